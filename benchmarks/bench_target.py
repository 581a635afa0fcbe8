"""Target runtime benchmark: single-stream autoregressive tokens/s and the verify cost curve.

    python benchmarks/bench_target.py [--target smollm2-135m-instruct] [--out docs/results/target_bench.json]

The verify curve c(n)/c(1) is the cost of one target forward over a tree of n nodes relative to a
1-token decode step, at the same prefix length. Every speculative speed-up is bounded by
tau * c(1) / (c_draft + c(n)), so this curve says how large a tree can still pay off here.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import jetflow
from jetflow.eval.machine import machine
from jetflow.decoding.prompt import encode_prompt
from jetflow.models.target import TargetModel

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a short story about a robot who learns to paint.",
    "Explain the difference between a list and a tuple in Python.",
]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_ar(target: TargetModel, new_tokens: int, repeats: int) -> dict:
    jetflow.generate(target, PROMPTS[0], max_new_tokens=8)  # warm-up
    runs = []
    for r in range(repeats):
        for prompt in PROMPTS:
            res = jetflow.generate(target, prompt, max_new_tokens=new_tokens, stop=())
            decode_s = res.seconds - res.prefill_seconds
            runs.append({"prompt": prompt[:40], "new_tokens": res.new_tokens, "seconds": res.seconds,
                         "decode_tokens_per_s": (res.new_tokens - 1) / decode_s, "tokens_per_s": res.tokens_per_s})
    total_tokens = sum(r["new_tokens"] for r in runs)
    total_s = sum(r["seconds"] for r in runs)
    return {"runs": runs, "tokens_per_s": total_tokens / total_s,
            "median_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs)}


def bench_verify(target: TargetModel, sizes: list[int], prefix_len: int, repeats: int) -> dict:
    rng = random.Random(0)
    ids = encode_prompt(target.tokenizer, PROMPTS[1])
    prefix = (ids * (prefix_len // len(ids) + 1))[:prefix_len]
    target.prefill(prefix)
    times = {}
    for n in sizes:
        parents = [-1] + [rng.randrange(max(0, i - 8), i) for i in range(1, n)]  # bushy, depth-limited tree
        tokens = [rng.randrange(target.vocab_size) for _ in range(n)]
        samples = []
        for _ in range(repeats + 1):  # first is warm-up
            sync(target.device)
            t = time.perf_counter()
            target.verify(tokens, parents)
            sync(target.device)
            samples.append(time.perf_counter() - t)
            target.commit([])
        times[n] = statistics.median(samples[1:])
    return {"prefix_len": prefix_len, "seconds": {str(n): t for n, t in times.items()},
            "relative": {str(n): t / times[sizes[0]] for n, t in times.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", default="1,4,16,64,256")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--out", default="docs/results/target_bench.json")
    args = ap.parse_args()

    target = TargetModel.load(args.target, device=args.device)
    target.prefix_cache = False  # every repeat prefills its prompt in full
    ar = bench_ar(target, args.new_tokens, args.repeats)
    print(f"autoregressive: {ar['tokens_per_s']:.1f} tok/s overall (prefill included), "
          f"median decode-only {ar['median_decode_tokens_per_s']:.1f} tok/s")
    sizes = [int(s) for s in args.sizes.split(",")]
    verify = bench_verify(target, sizes, args.prefix_len, max(5, args.repeats * 5))
    print(f"verify cost at prefix {args.prefix_len} tokens:")
    print("| nodes | ms | c(n)/c(1) |\n|---:|---:|---:|")
    for n in sizes:
        print(f"| {n} | {verify['seconds'][str(n)] * 1e3:.1f} | {verify['relative'][str(n)]:.2f} |")
    result = {"target": target.name, "machine": machine(), "autoregressive": ar, "verify": verify,
              "command": "python benchmarks/bench_target.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
