"""Default-decoder variants side by side in one run on the torch backend: the shipped head with
prompt lookup merged in (`jetflow-lookup`), under several second-pass modes and tree widths, each
with its own copy of the head, all on one target; every prompt goes through `ar` and every variant
in rotating order, so a drift in the machine's speed falls on all alike. Speed-ups are against
`ar`, with 95% intervals from a paired bootstrap over prompts, and each variant against the first;
every output must equal `ar`'s.

    python benchmarks/decoder_variants.py --variants 1@7,tree@24,tree@7 --datasets gsm8k,mtbench \
        --limit 10 --budgets auto --out docs/results/decoder_variants/auto.json

A variant is REFINE@WIDTH: REFINE as `jetflow bench --refine` (N path passes, or tree / tree:N),
WIDTH the top-w tokens per depth (`--width`). `1@7` is the default decoder.
"""

from __future__ import annotations

import argparse
import dataclasses

from jetflow.cli import _refine_mode
from jetflow.eval.bootstrap import speedup_interval
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.harness import BenchSettings, run_interleaved, summarize
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


def parse_variant(text: str) -> tuple[int | str, int]:
    refine, sep, width = text.partition("@")
    if not sep or not width.isdigit() or int(width) < 1:
        raise SystemExit(f"variant {text!r}: expected REFINE@WIDTH, e.g. 1@7 or tree@24")
    return _refine_mode(refine), int(width)


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
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    target = load_target(args.target, backend="torch")
    runners = {}
    for variant in variants:
        refine, width = parse_variant(variant)
        head = load_drafter(shipped_drafter(target.name), target=target, device=target.device)  # one copy each
        runners[variant] = MethodRunner(target, {"causal": head}, width=width, refine=refine)
    runs = [(METHODS["ar"], None)]
    runs += [(dataclasses.replace(METHODS["jetflow-lookup"], name=f"jetflow-lookup/{v}"), b)
             for b in budgets for v in variants]
    settings = BenchSettings(target=args.target, drafters={}, max_new_tokens=args.max_new_tokens)
    runner = VariantRunner(runners)
    result = {"machine": machine(), "settings": {**vars(args), "linear_form": target.linear_form}, "datasets": {}}
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
            print(f"{dataset:8s} {name:34s} tau {s['tau']:5.2f}  {s['tokens_per_s']:6.2f} tok/s  "
                  f"speed-up {s.get('speedup', 1.0):.2f}x [{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}]  "
                  f"outputs differing {len(s.get('mismatches', []))}")
        for budget in budgets:  # each variant against the first, method for method
            base = rows[f"jetflow-lookup/{variants[0]}@{budget}"]
            for v in variants[1:]:
                a = rows[f"jetflow-lookup/{v}@{budget}"]
                ci = speedup_interval(a["records"], base["records"])
                ratio = a["summary"]["tokens_per_s"] / base["summary"]["tokens_per_s"]
                rows[f"{v}_vs_{variants[0]}@{budget}"] = {"ratio": ratio, "ci95": ci}
                print(f"{dataset:8s} @{budget}: {v} / {variants[0]} {ratio:.2f}x [{ci[0]:.2f}-{ci[1]:.2f}]")
        result["datasets"][dataset] = rows
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
