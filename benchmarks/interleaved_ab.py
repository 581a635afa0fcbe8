"""Two or more `jetflow bench` methods timed prompt by prompt, interleaved, on a machine whose speed drifts.

`jetflow bench` runs each method over all prompts before the next method starts, so a slow spell
of a shared machine lands on one method only. Here every prompt is run by every method back to
back, the order rotating from prompt to prompt, so drift hits all methods alike. Greedy outputs
are checked to be identical across methods. Prints per-category and overall tokens/s and tau, and
writes them as JSON.

    python benchmarks/interleaved_ab.py --backend torch --datasets benchmarks/prompts/copy_heavy.jsonl \
        --limit 20 --methods lookup,jetflow-lookup --budget auto --max-new-tokens 128 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from jetflow.eval.datasets import load_eval_set
from jetflow.eval.methods import METHODS, MethodRunner
from jetflow.models.checkpoint import load_drafter
from jetflow.models.loading import load_target
from jetflow.models.shipped import shipped_drafter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--datasets", required=True, help="comma list of bench datasets or JSONL files")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--methods", required=True, help="comma list of `jetflow bench` methods")
    ap.add_argument("--budget", default="auto", help="node budget of the tree methods, or auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or len(names) < 2:
        ap.error(f"--methods needs at least two of {', '.join(METHODS)}; unknown: {', '.join(unknown) or '-'}")
    budget = args.budget if args.budget == "auto" else int(args.budget)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(None, backend=args.backend, n_threads=args.threads)
    specs = [METHODS[m] for m in names]
    heads = {}
    if any(s.head == "causal" for s in specs):
        path = shipped_drafter(target.name) if args.drafter == "auto" else args.drafter
        heads["causal"] = load_drafter(path, target=target, device=target.device)
    runner = MethodRunner(target, heads)
    for spec in specs:
        runner.check(spec)
    prompts = [p for name in args.datasets.split(",") for p in load_eval_set(name.strip(), args.limit)]
    rows, mismatches = [], 0
    for i, prompt in enumerate(prompts):
        order = specs[i % len(specs):] + specs[:i % len(specs)]  # rotate who goes first
        results = {}
        for spec in order:
            result = runner.run(spec, prompt.as_chat(), budget=None if spec.name == "lookup" else budget,
                                max_new_tokens=args.max_new_tokens, chat=prompt.chat)
            results[spec.name] = result
        first = results[names[0]].token_ids
        same = all(r.token_ids == first for r in results.values())
        mismatches += not same
        rows.append({"id": prompt.id, "category": prompt.category or prompt.dataset, "same_output": same,
                     **{n: {"seconds": r.seconds, "new_tokens": r.new_tokens, "rounds": r.stats.get("rounds"),
                            "round_kinds": r.stats.get("round_kinds")} for n, r in results.items()}})
        print(f"{prompt.id}: " + "  ".join(f"{n} {r.new_tokens / r.seconds:.1f} tok/s" for n, r in results.items()),
              file=sys.stderr, flush=True)
    summary = {}
    groups = defaultdict(list)
    for row in rows:
        groups[row["category"]].append(row)
    groups["all"] = rows
    for group, members in groups.items():
        summary[group] = {}
        for n in names:
            tokens = sum(r[n]["new_tokens"] for r in members)
            seconds = sum(r[n]["seconds"] for r in members)
            rounds = sum(r[n]["rounds"] or r[n]["new_tokens"] for r in members)
            summary[group][n] = {"tokens_per_s": tokens / seconds, "tau": tokens / max(1, rounds)}
    print(f"{'category':12s} " + " ".join(f"{n + ' tok/s (tau)':>28s}" for n in names))
    for group, per in summary.items():
        print(f"{group:12s} " + " ".join(f"{per[n]['tokens_per_s']:18.2f} ({per[n]['tau']:.2f})" for n in names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": sys.argv, "methods": names, "budget": args.budget,
                                          "mismatches": mismatches, "summary": summary, "prompts": rows}, indent=1))
    print(f"outputs identical across methods: {len(rows) - mismatches}/{len(rows)}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
