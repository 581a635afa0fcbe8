"""Chat clients of the batching server (`jetflow serve --max-batch N`, llama.cpp or ``--backend torch``)
with and without its prefix cache: how much sooner a conversation's next turn starts when the server
kept the turn before.

One server on the same target per arm (``--prefix-cache-slots`` values, e.g. 4 and 0; 0 keeps no
cache at all; ``--before DIR`` adds a server run from another checkout of JetFlow with its own
defaults, e.g. ``git worktree add /tmp/before <commit>``; ``--stock-lib DIR`` one of this checkout on
another llama.cpp build, its ``llama_cpp/lib`` directory loaded through ``LLAMA_CPP_LIB_PATH``, with
the first ``--slots`` value), all started before the first request.
Conversations (MT-Bench: a question, then its second turn after the server's own first answer;
``--turns 1``: the question alone) run in waves of ``--clients`` concurrent clients, each client one
conversation per wave, streaming, greedy. Every wave runs on each arm, in an order that rotates
from wave to wave, so drift in the machine's speed falls on all alike.

Prints, per arm and turn: the mean time to first token, the mean time of a turn, the prompt tokens
in all, the prompt tokens taken from the cache (the server's ``/metrics``), and whether every answer
is identical across arms.

    git worktree add /tmp/before <commit>   # optional: the server as it was
    python benchmarks/serve_multiturn.py --slots 4,0 --before /tmp/before --clients 4 --limit 16 \\
        --out docs/results/llamacpp/serve_multiturn.json
    python benchmarks/serve_multiturn.py --slots 4,0 --before /tmp/before --turns 1 --clients 8 --limit 32 \\
        --out docs/results/llamacpp/serve_oneshot.json      # what the cache costs where no turn follows
    python benchmarks/serve_multiturn.py --slots 4 --stock-lib <a stock build's llama_cpp/lib> --clients 4 \
        --limit 16 --out docs/results/llamacpp/serve_multiturn_two_column.json   # the two-column kernels
    python benchmarks/serve_multiturn.py --backend torch --slots 4,0 --clients 4 --limit 16 \
        --out docs/results/prefix_cache/serve_multiturn_torch.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import httpx

from serve_matrix import wait_ready  # (benchmarks/: the script's own directory)

from jetflow.eval.datasets import load_eval_set
from jetflow.utils.fs import write_json_atomic


def start(args, arm: str) -> tuple[subprocess.Popen, str]:
    """A server for ``arm``: "slots=N" (this checkout, --prefix-cache-slots N), "before" (--before) or
    "stock" (--stock-lib)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jetflow.cli", "serve", "--backend", args.backend, "--threads", str(args.threads),
           "--max-batch", str(args.max_batch), "--port", str(port)]
    env, cwd = dict(os.environ), None
    if arm == "before":
        env["PYTHONPATH"], cwd = args.before, args.before
    elif arm == "stock":
        env["LLAMA_CPP_LIB_PATH"] = args.stock_lib
        cmd += ["--prefix-cache-slots", args.slots.split(",")[0]]
    else:
        cmd += ["--prefix-cache-slots", arm.removeprefix("slots=")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
    except SystemExit:
        proc.kill()
        raise
    return proc, base


async def turn(http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, [], None
    import json

    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "seconds": end - t0, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"] if usage else None}


async def conversation(base: str, prompt, max_tokens: int, max_turns: int | None) -> list[dict]:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(900.0)) as http:
        answers, turns = [], []
        for _ in prompt.turns[:max_turns]:
            turns.append(await turn(http, prompt.request(answers), max_tokens))
            answers.append(turns[-1]["text"])
        return turns


def cached_tokens(base: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("jetflow_prompt_tokens_cached_total"):
            return float(line.split()[1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--slots", default="4,0", help="--prefix-cache-slots of each arm, comma-separated")
    ap.add_argument("--before", default=None, help="one more arm: a server from this checkout of JetFlow")
    ap.add_argument("--stock-lib", default=None,
                    help="one more arm: this checkout's server on the llama.cpp build in this llama_cpp/lib directory")
    ap.add_argument("--clients", type=int, default=4, help="concurrent conversations per wave")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--limit", type=int, default=12, help="MT-Bench conversations")
    ap.add_argument("--turns", type=int, default=None,
                    help="turns per conversation (default: all; 1: one-shot requests, which only pay for the cache)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prompts = load_eval_set("mtbench", limit=args.limit)
    slots = ([f"slots={int(s)}" for s in args.slots.split(",")] + (["before"] if args.before else [])
             + (["stock"] if args.stock_lib else []))
    servers = {s: start(args, s) for s in slots}
    runs = {s: [] for s in slots}  # per arm: one list of turns per conversation
    wave_s = {s: [] for s in slots}  # per arm: each wave's wall time (all its conversations, both turns)
    try:
        waves = [prompts[i:i + args.clients] for i in range(0, len(prompts), args.clients)]
        for w, wave in enumerate(waves):
            for s in slots[w % len(slots):] + slots[:w % len(slots)]:
                base = servers[s][1]
                t = time.perf_counter()
                runs[s] += asyncio.run(_gather(base, wave, args.max_new_tokens, args.turns))
                wave_s[s].append(time.perf_counter() - t)
                print(f"wave {w + 1}/{len(waves)} {s}: {time.perf_counter() - t:.1f} s", flush=True)
        cached = {s: cached_tokens(servers[s][1]) for s in slots}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=120)
    reference = [[t["text"] for t in conv] for conv in runs[slots[0]]]
    identical = all([[t["text"] for t in conv] for conv in runs[s]] == reference for s in slots)
    arms = {}
    for s in slots:
        per_turn = {}
        for k in range(max(len(conv) for conv in runs[s])):
            turns = [conv[k] for conv in runs[s] if len(conv) > k]
            per_turn[f"turn {k + 1}"] = {"turns": len(turns),
                                         "mean_ttft_s": statistics.mean(t["ttft_s"] for t in turns),
                                         "mean_seconds": statistics.mean(t["seconds"] for t in turns),
                                         "prompt_tokens": sum(t["prompt_tokens"] or 0 for t in turns)}
        arms[s] = {"per_turn": per_turn, "prompt_tokens_cached": cached[s],
                   "wave_seconds": wave_s[s], "seconds": sum(wave_s[s])}
        print(f"{s}: {sum(wave_s[s]):.1f} s in all, cached {cached[s]:.0f} prompt tokens; " + "; ".join(
            f"{k}: ttft {v['mean_ttft_s']:.3f} s, {v['mean_seconds']:.2f} s per turn, {v['prompt_tokens']} prompt tokens"
            for k, v in per_turn.items()))
    print(f"answers identical across arms: {identical}")
    write_json_atomic(args.out, {"command": sys.argv, "args": vars(args), "identical": identical, "arms": arms,
                                 "conversations": runs})
    return 0


async def _gather(base, wave, max_tokens, max_turns):
    return await asyncio.gather(*[conversation(base, p, max_tokens, max_turns) for p in wave])


if __name__ == "__main__":
    sys.exit(main())
