"""Does a one-token llama.cpp decode get slower when the caller spends longer between decodes?

`auto`'s plain rounds run a little more Python between decodes than a plain loop, and their decodes
were measured 2-3% slower (docs/results.md). One suspect: llama.cpp's CPU threads (OpenMP here) spin
for a while after a decode and then sleep, and waking them costs time at the next decode. This times
``greedy_step`` (the plain step both loops run) with a busy wait of G microseconds after each step,
for several G, interleaved in rounds; each OpenMP setting (``--envs``) runs in its own child process,
since the library reads them when it loads.

    python benchmarks/llamacpp_idle_gap.py --gaps-us 0,50,100,200,400,800 \
        --envs "default;OMP_WAIT_POLICY=active;OMP_WAIT_POLICY=passive" --out gap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def child(gaps_us: list[int], threads: int, context: int, steps: int, rounds: int) -> dict:
    from jetflow.models.loading import load_target

    target = load_target(None, backend="llamacpp", n_threads=threads)
    prompt = list(range(1000, 1000 + context))
    decode_ms: dict[int, list[float]] = {g: [] for g in gaps_us}
    for r in range(rounds):
        for g in gaps_us[r % len(gaps_us):] + gaps_us[:r % len(gaps_us)]:  # rotating order
            token = int(target.prefill(prompt, return_hidden=False).logits[-1].argmax())
            for _ in range(steps):
                t = time.perf_counter()
                token = target.greedy_step(token)
                decode_ms[g].append((time.perf_counter() - t) * 1e3)
                until = time.perf_counter() + g * 1e-6
                while time.perf_counter() < until:  # the caller's own work between decodes
                    pass
    target.close()
    return {str(g): {"median_ms": statistics.median(v), "mean_ms": statistics.fmean(v), "n": len(v)}
            for g, v in decode_ms.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gaps-us", default="0,50,100,200,400,800")
    ap.add_argument("--envs", default="default", help="';'-separated settings, each 'default' or K=V[,K=V]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--steps", type=int, default=64, help="timed steps per gap and round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds inside each child")
    ap.add_argument("--repeats", type=int, default=2, help="children per setting, settings interleaved")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        gaps = [int(g) for g in args.gaps_us.split(",")]
    except ValueError:
        ap.error(f"--gaps-us: expected comma-separated integers, got {args.gaps_us!r}")
    if any(g < 0 for g in gaps):
        ap.error("--gaps-us: gaps must be >= 0")
    if args.child:
        print(json.dumps(child(gaps, args.threads, args.context, args.steps, args.rounds)))
        return 0
    settings = [s.strip() for s in args.envs.split(";") if s.strip()]
    envs = {}
    for s in settings:
        pairs = [] if s == "default" else [kv.split("=", 1) for kv in s.split(",")]
        if any(len(kv) != 2 or not kv[0] for kv in pairs):
            ap.error(f"--envs: {s!r} is not 'default' or K=V[,K=V]")
        envs[s] = dict(pairs)
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    cmd = [sys.executable, __file__, "--child", "--gaps-us", args.gaps_us, "--threads", str(args.threads),
           "--context", str(args.context), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    for rep in range(args.repeats):
        for s in settings[rep % len(settings):] + settings[:rep % len(settings)]:
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            env.update(envs[s])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[s].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{s} (run {rep + 1}): " + "  ".join(f"{g} us {runs[s][-1][str(g)]['median_ms']:.2f} ms"
                                                       for g in gaps), flush=True)
    summary = {s: {str(g): statistics.median(r[str(g)]["median_ms"] for r in rs) for g in gaps}
               for s, rs in runs.items()}
    print("median one-token decode (ms) by the caller's gap between decodes:")
    print("setting".ljust(36) + "".join(f"{g:>9} us" for g in gaps))
    for s, row in summary.items():
        print(s.ljust(36) + "".join(f"{row[str(g)]:>12.2f}" for g in gaps))
    if args.out:
        from jetflow.eval.machine import machine
        from jetflow.utils.fs import write_json_atomic

        write_json_atomic(args.out, {"settings": vars(args) | {"out": str(args.out)}, "machine": machine(),
                                     "summary_median_ms": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
