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
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.harness import BenchSettings, compare_rows, run_side_by_side
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
        rows = run_side_by_side(runner, runs, load_eval_set(dataset, args.limit), settings, dataset)
        for budget in budgets:  # the two forms against each other, method for method
            c = rows[f"transposed_vs_standard@{budget}"] = compare_rows(rows[f"jetflow-lookup/transposed@{budget}"],
                                                                        rows[f"jetflow-lookup/standard@{budget}"])
            print(f"{dataset:8s} @{budget}: transposed / standard {c['ratio']:.2f}x [{c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}]")
        c = compare_rows(rows["ar/transposed"], rows["ar/standard"])
        print(f"{dataset:8s} ar: transposed / standard {c['ratio']:.2f}x [{c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}]")
        result["datasets"][dataset] = rows
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
