"""A decoding round's draft cost with the shipped causal head next to a llama.cpp target, per draft
variant: float or int8 weights, with or without the path-conditioned second pass, for trees of n
nodes (a causal head runs only the slots such a tree can reach).

    python benchmarks/bench_lean_draft.py --context 256 --threads 2

A round's draft is what the decoding loop times as "draft": project the features of the tokens the
last verify committed (``--new-rows``, default 2) into the head's context, run the head, build the
tree. As in decoding, each timed draft follows an (untimed) llama.cpp step, which leaves the CPU's
caches holding the target's weights, not the head's. ``--warm`` times drafts back to back instead,
with nothing to project (how `auto`'s cost curve timed them until it timed them as here). Prints one
JSON object: the median one-token llama.cpp step (ms) and, per variant and node count, the median ms
of a round's draft and its share of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the first timed round")
    ap.add_argument("--new-rows", type=int, default=2, help="committed tokens projected per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--warm", action="store_true", help="drafts back to back, nothing to project")
    args = ap.parse_args()
    nodes_list = [int(n) for n in args.nodes.split(",")]

    import torch

    from jetflow.decoding.drafter import make_drafter
    from jetflow.models.checkpoint import load_drafter
    from jetflow.models.loading import load_target
    from jetflow.models.shipped import shipped_drafter

    torch.set_num_threads(args.threads)
    target = load_target(args.target, backend="llamacpp", n_threads=args.threads)
    head = load_drafter(shipped_drafter(target.name), target=target).float()
    target.set_tapped_layers(head.config.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    rounds = args.reps + 1  # one warm-up round
    total = args.context + args.new_rows * rounds
    tokens = torch.randint(100, target.vocab_size, (total,), generator=g).tolist()
    features = target.prefill(tokens, return_hidden=True).hidden  # every position's taps, from one prefill
    target.prefill(tokens[: args.context], return_hidden=False)  # the steps below then run after the prompt

    def step() -> None:
        target.verify([tokens[0]], [-1], return_hidden=False)
        target.commit([])

    times = []
    for _ in range(args.reps + 1):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    out = {"context": args.context, "new_rows": 0 if args.warm else args.new_rows, "warm": args.warm,
           "threads": args.threads,
           "llama_step_ms": statistics.median(times[1:]) * 1e3, "draft_ms": {}}
    for int8 in (False, True):
        for refine in (0, 1):
            drafter = make_drafter(head, target, int8=int8, refine=refine)
            for nodes in nodes_list:
                drafter.reset()
                drafter.extend(features[: args.context])
                drafter.propose(tokens[args.context - 1], args.context, target.max_context, 7,
                                max_nodes=nodes).tree(nodes)  # the prompt's projection, untimed
                times, end = [], args.context
                for _ in range(rounds):
                    if not args.warm:
                        step()
                    t = time.perf_counter()
                    if not args.warm:
                        drafter.extend(features[end: end + args.new_rows])
                        end += args.new_rows
                    drafter.propose(tokens[end - 1], end, target.max_context, 7, max_nodes=nodes).tree(nodes)
                    times.append(time.perf_counter() - t)
                ms = statistics.median(times[1:]) * 1e3
                name = f"{'int8' if int8 else 'float'}{'+refine' if refine else ''}@{nodes}"
                out["draft_ms"][name] = {"ms": ms, "of_step": ms / out["llama_step_ms"]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
