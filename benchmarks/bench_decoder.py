"""Speculative decoder benchmark: tau and tokens/s per budget against the autoregressive loop.

    python benchmarks/bench_decoder.py --drafter DIR --budgets 16,64
    python benchmarks/bench_decoder.py --drafter DIR --prompts gsm8k-test --limit 50 --new-tokens 256 --budgets 64
    python benchmarks/bench_decoder.py --random-head 2 --budgets 16,64   # untrained head: tau ~ 1,
                                                                          # measures the loop's overhead
Greedy; every speculative output is checked against the autoregressive one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import jetflow
from bench_target import PROMPTS
from jetflow.eval.machine import machine
from jetflow.eval.datasets import load_eval_set
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--random-head", type=int, default=None, metavar="LAYERS",
                    help="use an untrained head with this many layers instead of --drafter")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompts", default=None, help="an evaluation set (gsm8k-test); default: 3 fixed prompts")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of --prompts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ar-cache", default=None,
                    help="JSON of the autoregressive outputs: reused when it matches the prompts and settings, "
                         "written otherwise (saves the AR pass when comparing several drafters)")
    args = ap.parse_args()
    if (args.drafter is None) == (args.random_head is None):
        ap.error("give exactly one of --drafter and --random-head")

    prompts = PROMPTS if args.prompts is None else [
        p.as_chat() for p in load_eval_set(args.prompts, args.limit)]
    target = TargetModel.load(args.target)
    target.prefix_cache = False  # every arm prefills every prompt in full, as `jetflow bench` does
    if args.drafter:
        head = load_drafter(args.drafter, target=target)  # a block or an EAGLE head
    else:
        torch.manual_seed(0)
        head = DraftHead(DraftHeadConfig.for_target(target, num_hidden_layers=args.random_head))
    jf = jetflow.JetFlow(target, head.to(dtype=target.dtype), width=args.width, lookup=False)
    jetflow.generate(target, prompts[0], max_new_tokens=8)  # warm-up
    jf.generate(prompts[0], max_new_tokens=8)

    key = {"target": target.name, "prompts": prompts, "new_tokens": args.new_tokens}
    cached = json.loads(Path(args.ar_cache).read_text()) if args.ar_cache and Path(args.ar_cache).is_file() else None
    if cached and cached["key"] == key:
        ar_ids, ar_tps = cached["token_ids"], cached["tokens_per_s"]
        print(f"ar: {ar_tps:.1f} tok/s (from {args.ar_cache})")
    else:
        ar = [jetflow.generate(target, p, max_new_tokens=args.new_tokens) for p in prompts]
        ar_ids, ar_tps = [r.token_ids for r in ar], sum(r.new_tokens for r in ar) / sum(r.seconds for r in ar)
        print(f"ar: {ar_tps:.1f} tok/s")
        if args.ar_cache:
            Path(args.ar_cache).write_text(json.dumps({"key": key, "token_ids": ar_ids, "tokens_per_s": ar_tps}))
    rows = [{"method": "ar", "tokens_per_s": ar_tps}]
    if head.draft_ids is not None:  # how often the target says a token the reduced head cannot propose
        vocab = set(head.draft_ids.tolist())
        produced = [t for ids in ar_ids for t in ids]
        coverage = sum(t in vocab for t in produced) / max(1, len(produced))
        rows[0]["draft_vocab_coverage"] = coverage
        print(f"draft vocabulary ({len(vocab)} tokens) covers {coverage:.2%} of the AR output tokens")
    for budget in [int(b) for b in args.budgets.split(",")]:
        runs = [jf.generate(p, max_new_tokens=args.new_tokens, budget=budget) for p in prompts]
        for r, ref in zip(runs, ar_ids):
            if r.token_ids != ref:
                sys.exit(f"LOSSLESSNESS VIOLATION at budget {budget}: speculative output differs from AR")
        tokens = sum(r.new_tokens for r in runs)
        seconds = sum(r.seconds for r in runs)
        rounds = sum(r.stats["rounds"] for r in runs)
        split = {k: sum(r.stats["time_split"][k] for r in runs) / rounds * 1e3 for k in runs[0].stats["time_split"]}
        row = {"method": "jetflow", "budget": budget, "width": args.width,
               "tau": sum(sum(r.stats["accept_lengths"]) for r in runs) / rounds,
               "tokens_per_s": tokens / seconds, "speedup": tokens / seconds / ar_tps, "ms_per_round": split,
               "prompts": len(prompts), "new_tokens": tokens,
               "per_prompt_tau": [round(sum(r.stats["accept_lengths"]) / r.stats["rounds"], 3) for r in runs]}
        rows.append(row)
        print(f"jetflow budget {budget:4d}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tok/s, "
              f"speed-up {row['speedup']:.2f}x, per round ms: " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
