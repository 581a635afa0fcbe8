"""Decoding with few-row products as W @ x^T (models/few_row_linear.py) against plain x @ W^T, side
by side in one run on the torch backend: two copies of the target, one per form, each with its own
copy of the drafter and its own cost curve; every prompt goes through every (method, form) pair in
rotating order, so a drift in the machine's speed falls on both forms alike. Speed-ups are against
`ar` with plain products, with 95% intervals from a paired bootstrap over prompts; every output
must equal that `ar`'s.

    python benchmarks/few_row_decode.py --datasets gsm8k --limit 10 --budgets 16,auto \
        --out docs/results/few_row_linear/decode_gsm8k10.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from jetflow.models.shipped import shipped_drafter
from jetflow.eval.bootstrap import speedup_interval
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.harness import BenchSettings, run_interleaved, summarize
from jetflow.eval.machine import machine
from jetflow.eval.methods import METHODS, MethodRunner
from jetflow.models.checkpoint import load_drafter
from jetflow.models.few_row_linear import ENV
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic

FORMS = ("standard", "transposed")


class FormRunner:
    """Runs method "<name>/<form>" with the runner of that form."""

    def __init__(self, runners: dict[str, MethodRunner]):
        self.runners = runners

    def run(self, spec, request, **kw):
        name, form = spec.name.rsplit("/", 1)
        return self.runners[form].run(METHODS[name], request, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--datasets", default="gsm8k")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--budgets", default="16,auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    runners = {}
    for form in FORMS:
        os.environ[ENV] = form
        target = load_target(args.target, backend="torch")
        assert target.linear_form == form, f"asked for {form}, got {target.linear_form}"
        head = load_drafter(shipped_drafter(target.name), target=target, device=target.device)  # one copy per form
        runners[form] = MethodRunner(target, {"causal": head})
    runs = [(dataclasses.replace(METHODS["ar"], name=f"ar/{form}"), None) for form in FORMS]
    runs += [(dataclasses.replace(METHODS["jetflow-lookup"], name=f"jetflow-lookup/{form}"), b)
             for b in budgets for form in FORMS]
    settings = BenchSettings(target=args.target, drafters={}, max_new_tokens=args.max_new_tokens)
    runner = FormRunner(runners)
    result = {"machine": machine(), "settings": vars(args), "datasets": {}}
    for dataset in args.datasets.split(","):
        prompts = load_eval_set(dataset, args.limit)
        for spec, budget in runs:  # warm-up: one-time costs (allocations, the cost curve of `auto`)
            runner.run(spec, prompts[0].request([]), budget=budget, max_new_tokens=8, chat=prompts[0].chat)
        records = run_interleaved(runner, runs, prompts, settings)
        reference = records[0]
        rows = {}
        for (spec, budget), recs in zip(runs, records):
            name = spec.name + ("" if budget is None else f"@{budget}")
            s = summarize(recs, reference, greedy=True)
            s["ci95"] = s.get("speedup_ci95") or [1.0, 1.0]
            rows[name] = {"summary": s, "records": recs}
            print(f"{dataset:8s} {name:30s} tau {s['tau']:5.2f}  {s['tokens_per_s']:6.2f} tok/s  "
                  f"speed-up {s.get('speedup', 1.0):.2f}x [{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}]  "
                  f"outputs differing {len(s.get('mismatches', []))}")
        for budget in budgets:  # the two forms against each other, method for method
            a, b = rows[f"jetflow-lookup/transposed@{budget}"], rows[f"jetflow-lookup/standard@{budget}"]
            ci = speedup_interval(a["records"], b["records"])
            ratio = a["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"]
            rows[f"transposed_vs_standard@{budget}"] = {"ratio": ratio, "ci95": ci}
            print(f"{dataset:8s} @{budget}: transposed / standard {ratio:.2f}x [{ci[0]:.2f}-{ci[1]:.2f}]")
        ci = speedup_interval(rows["ar/transposed"]["records"], reference)
        print(f"{dataset:8s} ar: transposed / standard {rows['ar/transposed']['summary']['speedup']:.2f}x "
              f"[{ci[0]:.2f}-{ci[1]:.2f}]")
        result["datasets"][dataset] = rows
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
