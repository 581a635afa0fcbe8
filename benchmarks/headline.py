"""The README's headline table from `jetflow bench` outputs: each method at its best budget per dataset.

    python benchmarks/headline.py runs/headline [runs/budget-sweep ...] --out docs/results/headline.md \
        --plots docs/results/headline

Reads ``summary.json`` of each bench output (runs of the same dataset and method from several outputs
are pooled, later outputs winning on equal budgets). For tree methods the budget with the highest
speed-up (ratio of totals, the bench's headline) is shown with its tau; chains and `ar`/`hf`/`pld`
have one run. Also prints, per dataset, every budget's tau and speed-up (the budget-scaling table).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jetflow.eval.report import ORDER  # the bench's own method order


def pooled_runs(dirs: list[Path]) -> dict:
    runs = {}
    for d in dirs:
        for run in json.loads((d / "summary.json").read_text())["runs"]:
            runs[(run["dataset"], run["method"], run["budget"])] = run["summary"]
    return runs


def best_table(runs: dict) -> str:
    datasets = list(dict.fromkeys(k[0] for k in runs))
    methods = [m for m in ORDER if any(k[1] == m for k in runs)]
    lines = ["| method | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    for m in methods:
        cells = []
        for ds in datasets:
            options = {b: s for (d, mm, b), s in runs.items() if d == ds and mm == m}
            if not options:
                cells.append("")
                continue
            budget, s = max(options.items(), key=lambda kv: kv[1].get("speedup", 1.0))
            where = "" if budget is None else f" @{budget}"
            bad = " MISMATCH" if s.get("mismatches") else ""
            cells.append(f"tau {s['tau']:.2f}, {s.get('speedup', 1.0):.2f}x{where}{bad}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def scaling_table(runs: dict) -> str:
    out = []
    for ds in dict.fromkeys(k[0] for k in runs):
        budgets = sorted({b for (d, _, b) in runs if d == ds and b is not None},
                         key=lambda b: (isinstance(b, str), b if isinstance(b, int) else 0))  # "auto" last
        methods = [m for m in ORDER if any(k[0] == ds and k[1] == m and k[2] is not None for k in runs)]
        if not budgets:
            continue
        out.append(f"\n{ds}: tau / speed-up by budget\n")
        out.append("| method | " + " | ".join(str(b) for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for m in methods:
            cells = [f"{runs[(ds, m, b)]['tau']:.2f} / {runs[(ds, m, b)].get('speedup', 1):.2f}x"
                     if (ds, m, b) in runs else "" for b in budgets]
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="`jetflow bench --out` directories")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plots", type=Path, default=None,
                    help="write tau_vs_budget.png and speedup_vs_budget.png of the pooled runs here")
    args = ap.parse_args()
    runs = pooled_runs(args.dirs)
    if args.plots:
        from jetflow.eval.report import plots

        args.plots.mkdir(parents=True, exist_ok=True)
        pooled = [{"dataset": d, "method": m, "budget": b, "summary": s} for (d, m, b), s in runs.items()]
        for path in plots(pooled, args.plots):
            print(f"plot: {path}")
    text = best_table(runs) + scaling_table(runs)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
