"""Server configurations side by side in one run: for each, start `jetflow serve`, run
benchmarks/load_server.py windows against it, stop it (SIGTERM), and collect the results.

    python benchmarks/serve_matrix.py --configs llamacpp-batch,torch-batch,torch-serial \
        --clients 1,8,32 --seconds 120 --out docs/results/server_matrix.json

A config is BACKEND-MODE[@FORM][/WEIGHTS]: BACKEND torch|llamacpp, MODE batch (--max-batch 32) or
serial (--max-batch 1, one request at a time); FORM sets the torch server's JETFLOW_CPU_LINEAR
(auto|paired|transposed|standard: how its CPU linear layers multiply a few rows), e.g.
``torch-batch@standard``; WEIGHTS is the server's --draft-weights (auto|float|int8), e.g.
``torch-batch@paired/float``; ``CONFIG:CLIENTS`` restricts its client counts, joined with '+', e.g.
``torch-serial:1`` or ``torch-batch:8+32``. Every server uses the shipped drafter
and --budget auto, starting from nothing (--auto-state none). Resumable: windows already in --out are not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jetflow.models.few_row_linear import FORMS

HERE = Path(__file__).resolve().parent


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server at {url} was not ready after {timeout:.0f} s")


def run_config(name: str, clients: str, args) -> dict:
    spec, _, weights = name.partition("/")
    base, _, form = spec.partition("@")
    backend, _, mode = base.partition("-")
    if weights not in ("", "auto", "float", "int8"):
        raise SystemExit(f"config {name!r}: /WEIGHTS is auto|float|int8")
    if backend not in ("torch", "llamacpp") or mode not in ("batch", "serial"):
        raise SystemExit(f"config {name!r}: expected BACKEND-MODE with BACKEND torch|llamacpp and MODE batch|serial")
    if form and (backend != "torch" or form not in FORMS):
        raise SystemExit(f"config {name!r}: @FORM is {'|'.join(FORMS)}, for the torch backend")
    env = dict(os.environ, **({"JETFLOW_CPU_LINEAR": form} if form else {}))
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "jetflow.cli", "serve", "--backend", backend, "--port", str(args.port),
           "--max-batch", str(args.max_batch if mode == "batch" else 1), "--max-queue", "64",
           *(["--draft-weights", weights] if weights else []), "--auto-state", "none",  # every config from nothing
           *args.server_args.split()]
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_ready(url, server)
        out = Path(args.tmp) / f"{name.replace('/', '-')}.json"
        subprocess.run([sys.executable, str(HERE / "load_server.py"), "--url", url, "--clients", clients,
                        "--seconds", str(args.seconds), "--max-tokens", str(args.max_tokens), "--out", str(out)],
                       check=True)
        result = json.loads(out.read_text())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
    windows = result["windows"] if "windows" in result else [result]
    prefix = f"JETFLOW_CPU_LINEAR={form} " if form else ""
    return {"command": prefix + " ".join(["jetflow"] + cmd[3:]), "windows": windows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="llamacpp-batch,torch-batch,torch-serial:1")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--server-args", default="", help="more `jetflow serve` options for every server, e.g. "
                                                      "'--max-prefill-tokens 100000'")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}  # resumable: finished windows are kept
    for spec in args.configs.split(","):
        name, _, clients = spec.partition(":")
        wanted = [int(c) for c in (clients.replace("+", ",") or args.clients).split(",")]
        done = {w["clients"] for w in results.get(name, {}).get("windows", [])}
        todo = [c for c in wanted if c not in done]
        if not todo:
            print(f"== {name}: {wanted} clients already in {out}, skipped", flush=True)
            continue
        run = run_config(name, ",".join(map(str, todo)), args)
        if name in results:
            run["windows"] = sorted(results[name]["windows"] + run["windows"], key=lambda w: w["clients"])
        results[name] = run
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        os.replace(tmp, out)
    print("| config | clients | tokens/s | p50 latency s | p50 TTFT s | p99 TTFT s | mean batch | 5xx |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for w in r["windows"]:
            print(f"| {name} | {w['clients']} | {w['tokens_per_s']:.1f} | {w['latency_s']['p50']:.2f} | "
                  f"{w['ttft_s']['p50']:.2f} | {w['ttft_s']['p99']:.2f} | {w['mean_batch_size'] or 1:.1f} | "
                  f"{w['server_errors_5xx']} |")


if __name__ == "__main__":
    main()
