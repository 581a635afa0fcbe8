"""Default-decoder variants side by side in one run on the torch backend: the shipped head with
prompt lookup merged in (`jetflow-lookup`), under several second-pass modes and tree widths, each
with its own copy of the head, all on one target; every prompt goes through `ar` and every variant
in rotating order, so a drift in the machine's speed falls on all alike. Speed-ups are against
`ar`, with 95% intervals from a paired bootstrap over prompts, and each variant against the first;
every output must equal `ar`'s; with several budgets, each budget against the first too.

    python benchmarks/decoder_variants.py --variants 1@7,tree@24,tree@7 --datasets gsm8k,mtbench \
        --limit 10 --budgets auto --out docs/results/decoder_variants/auto.json

A variant is REFINE@WIDTH[:WEIGHTS]: REFINE as `jetflow bench --refine` (N path passes, or tree /
tree:N), WIDTH the top-w tokens per depth (`--width`), WEIGHTS the head's weights in its forward,
`float` or `int8` (`--draft-weights`; left out: the decoder's default for the target). `1@7` is
the default decoder.
"""

from __future__ import annotations

import argparse
import dataclasses

from jetflow.cli import _refine_mode
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.harness import BenchSettings, print_comparison, run_side_by_side
from jetflow.eval.machine import machine
from jetflow.eval.methods import METHODS, MethodRunner
from jetflow.models.checkpoint import load_drafter
from jetflow.models.loading import load_target
from jetflow.models.shipped import shipped_drafter
from jetflow.utils.fs import write_json_atomic


class VariantRunner:
    """Runs method "<name>/<variant>" with that variant's runner ("ar" with the first)."""

    def __init__(self, runners: dict[str, MethodRunner]):
        self.runners = runners

    def run(self, spec, request, **kw):
        name, _, variant = spec.name.partition("/")
        return self.runners[variant or next(iter(self.runners))].run(METHODS[name], request, **kw)


def parse_variant(text: str) -> tuple[int | str, int, bool | None]:
    refine, sep, rest = text.partition("@")
    width, _, weights = rest.partition(":")
    if not sep or not width.isdigit() or int(width) < 1 or weights not in ("", "float", "int8"):
        raise SystemExit(f"variant {text!r}: expected REFINE@WIDTH[:float|:int8], e.g. 1@7, tree@24 or 1@7:int8")
    return _refine_mode(refine), int(width), {"": None, "float": False, "int8": True}[weights]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--variants", default="1@7,tree@24")
    ap.add_argument("--datasets", default="gsm8k")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--budgets", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    variants = args.variants.split(",")
    modes = {v: parse_variant(v) for v in variants}  # refused before the model loads
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    target = load_target(args.target, backend="torch")
    runners = {}
    for variant, (refine, width, int8) in modes.items():
        head = load_drafter(shipped_drafter(target.name), target=target, device=target.device)  # one copy each
        runners[variant] = MethodRunner(target, {"causal": head}, width=width, refine=refine, int8_draft=int8)
    runs = [(METHODS["ar"], None)]
    runs += [(dataclasses.replace(METHODS["jetflow-lookup"], name=f"jetflow-lookup/{v}"), b)
             for b in budgets for v in variants]
    settings = BenchSettings(target=args.target, drafters={}, max_new_tokens=args.max_new_tokens)
    runner = VariantRunner(runners)
    result = {"machine": machine(), "settings": {**vars(args), "linear_form": target.linear_form}, "datasets": {}}
    for dataset in args.datasets.split(","):
        rows = run_side_by_side(runner, runs, load_eval_set(dataset, args.limit), settings, dataset)
        def run(v: str, budget) -> dict:
            return rows[f"jetflow-lookup/{v}@{budget}"]

        first = variants[0]
        for budget in budgets:  # each variant against the first, method for method
            for v in variants[1:]:
                rows[f"{v}_vs_{first}@{budget}"] = print_comparison(
                    f"{dataset:8s} @{budget}: {v} / {first}", run(v, budget), run(first, budget))
        for v in variants:  # each budget against the first, variant for variant
            for budget in budgets[1:]:
                rows[f"{v}@{budget}_vs_@{budgets[0]}"] = print_comparison(
                    f"{dataset:8s} {v}: @{budget} / @{budgets[0]}", run(v, budget), run(v, budgets[0]))
        result["datasets"][dataset] = rows
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
