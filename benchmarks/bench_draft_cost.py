"""Draft cost per round against tree depth: one block-head forward vs D sequential EAGLE-style forwards.

    python benchmarks/bench_draft_cost.py --out docs/results/draft_cost.json

Heads of the shipped shape (random weights: the cost does not depend on training) on the default
target, after a 256-token context: the block head drafts every depth up to block_size - 1 in one
forward; the EAGLE-3-style head needs one forward per depth (EAGLE-2 expansion, --width nodes per
depth), so its draft time grows with the depth it is allowed (``room`` caps it here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.decoding.costs import median_ms
from jetflow.decoding.eagle_drafter import EagleDrafter
from jetflow.eval.machine import machine
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.eagle_head import EagleHead
from jetflow.models.target import TargetModel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--max-depth", type=int, default=15)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = TargetModel.load(args.target)
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.context,)).tolist()
    vocab = args.draft_vocab if args.draft_vocab < target.vocab_size else None
    block = DraftHead(DraftHeadConfig.for_target(target, num_hidden_layers=2, block_size=args.max_depth + 1,
                                                 draft_vocab_size=vocab, feed_last_feature=True, depth_embedding=True))
    eagle = EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=args.max_depth + 1,
                                                 draft_vocab_size=vocab, kind="eagle3"))
    for head in (block, eagle):
        if vocab:
            head.set_draft_vocab(torch.arange(vocab))
    rows = []
    for name, head, runner in (("block (2 layers)", block, BlockDrafter), ("eagle3 (1 layer)", eagle, EagleDrafter)):
        drafter = runner(head, target)
        pre = target.prefill(ids)
        drafter.reset()
        drafter.extend(pre.hidden)
        for depth in range(1, args.max_depth + 1):
            ms = median_ms(lambda: drafter.propose(ids[-1], target.past_len, depth, args.width).tree(64), args.reps)
            rows.append({"head": name, "depth": depth, "draft_ms": ms})
            print(f"{name:18s} depth {depth:2d}: {ms:7.1f} ms")
    c1 = median_ms(lambda: target.verify([ids[-1]], [-1], return_hidden=False), args.reps)
    print(f"target one-token step: {c1:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "target_step_ms": c1,
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
