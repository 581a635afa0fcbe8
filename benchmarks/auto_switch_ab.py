"""Does charging the way back to plain steps pay? ``--budget auto`` with and without it, side by side.

On llama.cpp the one-token step after a round that verified nodes rebuilds the compute graph for the
one-token shape (0.6-0.9 ms on a 2-core CPU, `benchmarks/llamacpp_shape_switch.py`). `auto` times
the step after each lookup chain against the step after that one and charges the mean difference to
every chain and tree it prices (decoding/budget.py, ``switch_cost``). This times, prompt by prompt in a rotating order so that drift hits all alike,
on the same target:

* ``ar``: JetFlow's plain loop (no drafter);
* ``auto_no_switch``: the default decoder at ``auto`` with that charge held at 0 (the behaviour before);
* ``auto``: the default decoder at ``auto`` as shipped.

Each `auto` decoder first decodes ``--settle`` prompts of the set that are not timed (those after the
timed ones), so both are past their first exploring of the head. Greedy, first turns only; every
output is checked against ``ar``'s.

    python benchmarks/auto_switch_ab.py --datasets gsm8k,mtbench,humaneval --limit 20 --out ab.json
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import jetflow
from jetflow.eval.bootstrap import speedup_interval
from jetflow.eval.datasets import load_eval_set
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="llamacpp", choices=["torch", "llamacpp"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--datasets", default="gsm8k,mtbench,humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--settle", type=int, default=3, help="untimed prompts each `auto` decodes first")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    shipped = jetflow.JetFlow.from_pretrained(backend=args.backend, n_threads=args.threads, drafter="auto")
    target = shipped.target
    target.prefix_cache = False  # every method prefills in full, as in jetflow bench
    before = jetflow.JetFlow.from_pretrained(target, drafter="auto")  # same target, its own budget state
    before.adaptive_budget().switch_cost = lambda: 0.0
    decoders = {"auto_no_switch": before, "auto": shipped}
    methods = {"ar": lambda p: jetflow.generate(target, p, max_new_tokens=args.max_new_tokens),
               **{name: (lambda p, d=d: d.generate(p, budget="auto", max_new_tokens=args.max_new_tokens))
                  for name, d in decoders.items()}}
    names = list(methods)
    report = {"backend": args.backend, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "settle": args.settle, "sets": {}}
    for dataset in args.datasets.split(","):
        everything = load_eval_set(dataset, args.limit + args.settle)
        prompts, settle = everything[:args.limit], everything[args.limit:]
        for prompt in settle:
            for name in decoders:
                methods[name](prompt.as_chat())
        tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
        kinds = {name: Counter() for name in decoders}
        records = {name: [] for name in names}  # per prompt, for paired intervals
        mismatches = []
        for i, prompt in enumerate(prompts):
            request = prompt.as_chat()
            outputs = {}
            for name in names[i % 3:] + names[:i % 3]:  # rotating order
                t0 = time.perf_counter()
                result = methods[name](request)
                spent = time.perf_counter() - t0
                seconds[name] += spent
                tokens[name] += result.new_tokens
                records[name].append({"id": prompt.id, "turn": 0, "new_tokens": result.new_tokens, "seconds": spent})
                outputs[name] = result
            for name in decoders:
                kinds[name].update(outputs[name].stats["round_kinds"])
            mismatches += [f"{prompt.id}:{n}" for n in names[1:] if outputs[n].token_ids != outputs["ar"].token_ids]
        rates = {n: tokens[n] / seconds[n] for n in names}
        interval = speedup_interval(records["auto"], records["auto_no_switch"])
        report["sets"][dataset] = {"prompts": len(prompts), "tokens_per_s": rates,
                                   "vs_ar": {n: rates[n] / rates["ar"] for n in names},
                                   "auto_vs_auto_no_switch": rates["auto"] / rates["auto_no_switch"],
                                   "auto_vs_auto_no_switch_ci95": interval, "records": records,
                                   "round_kinds": {n: dict(k) for n, k in kinds.items()},
                                   "switch_ms": shipped.adaptive_budget().switch_ms, "mismatches": mismatches}
        print(dataset, " ".join(f"{n} {rates[n]:.1f} tok/s ({rates[n] / rates['ar']:.3f}x)" for n in names),
              "| rounds", {n: dict(k) for n, k in kinds.items()},
              f"| switch {shipped.adaptive_budget().switch_ms:.2f} ms | auto / auto_no_switch "
              f"{rates['auto'] / rates['auto_no_switch']:.3f} [{interval[0]:.3f}-{interval[1]:.3f}] "
              f"| mismatches: {len(mismatches)}", flush=True)
    if args.out:
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
