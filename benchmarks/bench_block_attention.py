"""Training-time attention of the block head: the factored block mask against the same mask as one
dense tensor (what training used before).

    python benchmarks/bench_block_attention.py --context 900 --reps 5 --out docs/results/block_attention.json

Times one head forward + backward (context keys/values included, no LM head) for the two shapes a
training step runs per sequence: 32 blocks of 16 (the block loss) and blocks of 2 at many anchors
(the dense depth-1 term), each with the mask factored (:class:`jetflow.models.layers.BlockMask`) and
dense (``BlockMask.dense()``). Random inputs on the shipped drafter's shapes; prints one JSON object
with the best-of-``reps`` milliseconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from jetflow.eval.machine import machine
from jetflow.models.draft_head import DraftHead
from jetflow.training.blocks import training_mask

SHIPPED = Path(__file__).resolve().parents[1] / "jetflow" / "drafters" / "smollm2-135m-instruct"


def forward_backward_ms(head: DraftHead, fused, positions, x, last, mask, block_size: int, reps: int) -> float:
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        ctx = head.context_kv(fused, torch.arange(fused.shape[0]))
        head(x, positions, ctx, mask, last, block_size=block_size).pow(2).mean().backward()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=str(SHIPPED))
    ap.add_argument("--context", type=int, default=900, help="sequence length T")
    ap.add_argument("--answer", type=int, default=450, help="answer tokens (anchors of the depth-1 blocks)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not 2 < args.answer < args.context:
        ap.error("--answer must be in (2, --context)")
    torch.manual_seed(0)
    head = DraftHead.from_pretrained(args.drafter, dtype=torch.float32).train()
    hidden, start = head.config.hidden_size, args.context - args.answer
    fused = torch.randn(args.context, hidden)
    rows = []
    for name, count, size in [("block loss", 32, head.config.block_size), ("dense depth 1", args.answer - 1, 2)]:
        anchors = (torch.randperm(args.answer - 1)[:count] + start).sort().values
        mask = training_mask(anchors, args.context, size, head.config.attention == "causal")
        positions = (anchors[:, None] + torch.arange(size)).flatten()
        x, last = torch.randn(len(positions), hidden) * 0.1, torch.randn(len(positions), hidden)
        factored = forward_backward_ms(head, fused, positions, x, last, mask, size, args.reps)
        dense = forward_backward_ms(head, fused, positions, x, last, mask.dense(), size, args.reps)
        rows.append({"blocks": name, "anchors": count, "block_size": size, "slots": len(positions),
                     "factored_ms": round(factored, 1), "dense_ms": round(dense, 1),
                     "dense_over_factored": round(dense / factored, 2)})
    report = {"machine": machine(), "drafter": args.drafter, "context": args.context, "answer": args.answer,
              "rows": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
