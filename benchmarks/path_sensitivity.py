"""How much a causal block head's depth-k draft depends on the tokens in the slots before it.

At every answer anchor of held-out regenerated sequences, the depth-k distribution (k = 2..D) is
computed twice: from the first-pass block [anchor, MASK x k] and from a block whose slots 1..k-1 hold
the sequence's true next tokens (the layout of the path-conditioned second pass). Printed per head
and depth: the mean KL(revealed || masked) in nats, the share of anchors whose top-1 changes, and
the top-1 agreement with the target both ways (the target's top-1 from the teacher cache). A head
that ignores the path shows KL ~ 0 and equal agreement.

    python benchmarks/path_sensitivity.py --drafter /tmp/abl/B/drafter --drafter /tmp/abl/S/drafter \\
        --data data/regenerated/smollm2-mix --teacher-cache /tmp/abl/cache --sequences 512:576 \\
        --max-depth 4 --out docs/results/refine/path_sensitivity.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from jetflow.decoding.block_drafter import draft_logprobs
from jetflow.eval.depth_agreement import depth_hidden, teacher_top1
from jetflow.eval.offline_acceptance import eval_teacher, parse_range
from jetflow.models.checkpoint import load_drafter
from jetflow.models.loading import load_target
from jetflow.training.block_objective import block_context
from jetflow.training.blocks import answer_anchors
from jetflow.training.trainer import load_sequences


@torch.no_grad()
def depth_rows(head, embed, lm_weight, features, context, tokens, anchors, k: int, revealed: bool) -> torch.Tensor:
    """Log-probabilities [anchors, Vd] of depth k, slots 1..k-1 MASK or the true tokens."""
    hidden = depth_hidden(head, embed, features, context, tokens, anchors, k, revealed)
    return draft_logprobs(hidden, lm_weight)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", required=True)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--teacher-cache", required=True, type=Path)
    p.add_argument("--sequences", default="512:576", help="START:END in shard order")
    p.add_argument("--max-depth", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    target = load_target(None, backend="torch")
    sequences = load_sequences(args.data, target)
    start, end = parse_range(args.sequences, len(sequences))
    depths = range(2, args.max_depth + 1)
    results = {}
    for path in args.drafter:
        head = load_drafter(path, target=target, device=target.device, dtype=torch.float32).eval()
        if head.config.kind != "block" or head.config.attention != "causal":
            raise SystemExit(f"{path}: a causal block head is needed")
        target.set_tapped_layers(head.config.target_layer_ids)
        teacher = eval_teacher(target, sequences, end, args.teacher_cache, head.config.target_layer_ids)
        lm_weight = head.output_weight(target.lm_head_weight())
        ids = head.draft_ids
        sums = {k: torch.zeros(5, dtype=torch.float64) for k in depths}  # kl, changed, agree masked, revealed, count
        t0 = time.perf_counter()
        for index in range(start, end):
            seq = sequences[index]
            features, top1 = teacher_top1(teacher, index, seq)
            tokens = torch.tensor(seq.token_ids)
            context = block_context(head, features)
            for k in depths:
                anchors = answer_anchors(seq.prompt_len, len(tokens))
                anchors = anchors[anchors + k <= len(tokens) - 1]  # the depth-k token exists
                if not len(anchors):
                    continue
                masked = depth_rows(head, target.embed, lm_weight, features, context, tokens, anchors, k, False)
                shown = depth_rows(head, target.embed, lm_weight, features, context, tokens, anchors, k, True)
                kl = (shown.exp() * (shown - masked)).sum(-1)
                a, b = masked.argmax(-1), shown.argmax(-1)
                to_target = (lambda x: x) if ids is None else (lambda x: ids[x])  # noqa: E731
                truth = top1[anchors + k - 1 - seq.prompt_len]
                sums[k] += torch.tensor([kl.sum().item(), (a != b).sum().item(), (to_target(a) == truth).sum().item(),
                                         (to_target(b) == truth).sum().item(), len(anchors)], dtype=torch.float64)
        rows = {}
        for k, s in sums.items():
            n = max(1.0, s[4].item())
            rows[str(k)] = {"kl": s[0].item() / n, "top1_changed": s[1].item() / n, "agree_masked": s[2].item() / n,
                            "agree_revealed": s[3].item() / n, "anchors": int(s[4].item())}
            r = rows[str(k)]
            print(f"{path} depth {k}: KL {r['kl']:.4f} nats, top-1 changed {r['top1_changed']:.3f}, agreement "
                  f"masked {r['agree_masked']:.3f} -> revealed {r['agree_revealed']:.3f} ({r['anchors']} anchors)",
                  flush=True)
        results[path] = {"depths": rows, "seconds": round(time.perf_counter() - t0, 1)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"sequences": [start, end], "drafters": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
