"""Does skipping the head's target features pay? ``--budget auto`` with and without it, side by side.

Once the adaptive budget has found that the head's drafts lose (decoding/budget.py), requests skip
the layer features the head reads, all but the re-probes (every 8th request at first, every 64th
at most). This times, prompt by prompt in a rotating order so
that drift hits all alike, on the same target:

* ``ar``: JetFlow's plain loop (no drafter);
* ``auto_features``: the default decoder at ``auto`` that collects features on every request
  (re-probing on every request, the behaviour before);
* ``auto``: the default decoder at ``auto`` as shipped.

Greedy, first turns only; every output is checked against ``ar``'s.

    python benchmarks/auto_features_ab.py --backend llamacpp --datasets gsm8k,mtbench --limit 20 --out ab.json
"""

from __future__ import annotations

import argparse
import time

import jetflow
from jetflow.eval.datasets import load_eval_set
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="llamacpp", choices=["torch", "llamacpp"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--datasets", default="gsm8k,mtbench")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    shipped = jetflow.JetFlow.from_pretrained(backend=args.backend, n_threads=args.threads, drafter="auto")
    target = shipped.target
    target.prefix_cache = False  # every method prefills in full, as in jetflow bench
    always = jetflow.JetFlow.from_pretrained(target, drafter="auto")  # same target, its own budget state
    budget = always.adaptive_budget()
    budget.reprobe_every = budget.max_reprobe_every = 1  # every request collects features
    methods = {"ar": lambda p: jetflow.generate(target, p, max_new_tokens=args.max_new_tokens),
               "auto_features": lambda p: always.generate(p, budget="auto", max_new_tokens=args.max_new_tokens),
               "auto": lambda p: shipped.generate(p, budget="auto", max_new_tokens=args.max_new_tokens)}
    names = list(methods)
    report = {"backend": args.backend, "threads": args.threads, "max_new_tokens": args.max_new_tokens, "sets": {}}
    for dataset in args.datasets.split(","):
        prompts = load_eval_set(dataset, args.limit)
        tokens = dict.fromkeys(names, 0)
        seconds = dict.fromkeys(names, 0.0)
        featureless, mismatches = 0, []
        for i, prompt in enumerate(prompts):
            request = prompt.as_chat()
            outputs = {}
            for name in names[i % 3:] + names[:i % 3]:  # rotating order
                t0 = time.perf_counter()
                result = methods[name](request)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += result.new_tokens
                outputs[name] = result
            featureless += outputs["auto"].stats.get("features") is False
            mismatches += [f"{prompt.id}:{n}" for n in names[1:] if outputs[n].token_ids != outputs["ar"].token_ids]
        rates = {n: tokens[n] / seconds[n] for n in names}
        report["sets"][dataset] = {"prompts": len(prompts), "tokens_per_s": rates,
                                   "vs_ar": {n: rates[n] / rates["ar"] for n in names},
                                   "auto_requests_without_features": featureless, "mismatches": mismatches}
        print(dataset, " ".join(f"{n} {rates[n]:.1f} tok/s ({rates[n] / rates['ar']:.3f}x)" for n in names),
              f"| auto without features: {featureless}/{len(prompts)} requests | mismatches: {len(mismatches)}",
              flush=True)
    if args.out:
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
