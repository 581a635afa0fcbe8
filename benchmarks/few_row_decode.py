"""Decoding with few-row products as W @ x^T, and with one row computed as two (the forms of
models/few_row_linear.py), against plain x @ W^T, side by side in one run on the torch backend:
one copy of the target per form, each with its own
copy of the drafter and its own cost curve; every prompt goes through every (method, form) pair in
rotating order, so a drift in the machine's speed falls on every form alike. Speed-ups are against
`ar` with plain products, with 95% intervals from a paired bootstrap over prompts; every output
must equal that `ar`'s. Each form is also compared with the plain one, method for method.

    python benchmarks/few_row_decode.py --datasets gsm8k --limit 10 --budgets 16,auto \
        --forms standard,transposed --out docs/results/few_row_linear/decode_gsm8k10.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from jetflow.models.shipped import shipped_drafter
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.harness import BenchSettings, print_comparison, run_side_by_side
from jetflow.eval.machine import machine
from jetflow.eval.methods import METHODS, MethodRunner
from jetflow.models.checkpoint import load_drafter
from jetflow.models.few_row_linear import ENV, LAYERS
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic


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
    ap.add_argument("--forms", default="standard,transposed,paired",
                    help="linear forms to compare; the first is the reference (default: all three)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in LAYERS]
    if unknown or len(forms) < 2 or len(set(forms)) != len(forms):
        ap.error(f"--forms {args.forms!r}: two or more distinct forms of {', '.join(LAYERS)}")
    base = forms[0]
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    runners = {}
    for form in forms:
        os.environ[ENV] = form
        target = load_target(args.target, backend="torch")
        assert target.linear_form == form, f"asked for {form}, got {target.linear_form}"
        head = load_drafter(shipped_drafter(target.name), target=target, device=target.device)  # one copy per form
        runners[form] = MethodRunner(target, {"causal": head})
    runs = [(dataclasses.replace(METHODS["ar"], name=f"ar/{form}"), None) for form in forms]
    runs += [(dataclasses.replace(METHODS["jetflow-lookup"], name=f"jetflow-lookup/{form}"), b)
             for b in budgets for form in forms]
    settings = BenchSettings(target=args.target, drafters={}, max_new_tokens=args.max_new_tokens)
    runner = FormRunner(runners)
    result = {"machine": machine(), "settings": vars(args), "datasets": {}}
    for dataset in args.datasets.split(","):
        rows = run_side_by_side(runner, runs, load_eval_set(dataset, args.limit), settings, dataset)
        for form in forms[1:]:  # each form against the reference form, method for method
            for budget in budgets:
                rows[f"{form}_vs_{base}@{budget}"] = print_comparison(
                    f"{dataset:8s} @{budget}: {form} / {base}", rows[f"jetflow-lookup/{form}@{budget}"],
                    rows[f"jetflow-lookup/{base}@{budget}"])
            rows[f"{form}_vs_{base}@ar"] = print_comparison(f"{dataset:8s} ar: {form} / {base}", rows[f"ar/{form}"],
                                                            rows[f"ar/{base}"])
        result["datasets"][dataset] = rows
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
