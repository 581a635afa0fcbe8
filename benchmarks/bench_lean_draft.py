"""Draft cost of the shipped causal head against one llama.cpp decoding step, per draft variant:
fp32 or int8 weights, and the block cut to the depths a tree of n nodes can reach.

    python benchmarks/bench_lean_draft.py --context 256 --threads 2

Prints one JSON object: the one-token llama.cpp step (ms) and, per variant and node count, the
median ms of one ``propose(...).tree(n)`` and its share of the step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    import torch

    from jetflow.decoding.costs import median_ms
    from jetflow.decoding.drafter import make_drafter
    from jetflow.models.checkpoint import load_drafter
    from jetflow.models.loading import load_target
    from jetflow.models.shipped import shipped_drafter

    torch.set_num_threads(args.threads)
    target = load_target(args.target, backend="llamacpp", n_threads=args.threads)
    head = load_drafter(shipped_drafter(target.name), target=target).float()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, target.vocab_size, (args.context,), generator=g).tolist()
    pre = target.prefill(prompt)
    step_ms = median_ms(lambda: (target.verify([prompt[-1]], [-1], return_hidden=False), target.commit([])), args.reps)
    out = {"context": args.context, "threads": args.threads, "llama_step_ms": step_ms, "draft_ms": {}}
    for int8 in (False, True):
        drafter = make_drafter(head, target, int8=int8)
        drafter.extend(pre.hidden)
        for nodes in (2, 4, 8, 16):
            ms = median_ms(lambda: drafter.propose(prompt[-1], target.past_len, target.max_context, 7,
                                                   max_nodes=nodes).tree(nodes), args.reps)
            out["draft_ms"][f"{'int8' if int8 else 'fp32'}@{nodes}"] = {"ms": ms, "of_step": ms / step_ms}
        full = median_ms(lambda: drafter.propose(prompt[-1], target.past_len, target.max_context, 7).tree(16), args.reps)
        out["draft_ms"][f"{'int8' if int8 else 'fp32'}@full-block"] = {"ms": full, "of_step": full / step_ms}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
