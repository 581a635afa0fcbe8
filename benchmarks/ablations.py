"""Tables and plots of the training ablations from one `jetflow eval-offline` report.

    jetflow eval-offline --data data/regenerated/smollm2-mix --teacher-cache runs/cache \
        --sequences 1643:1771 --drafter runs/arms/causal-fkl-g0/drafter --drafter ... \
        --out docs/results/ablations/offline_tau.json
    python benchmarks/ablations.py docs/results/ablations/offline_tau*.json \
        --log-dir runs/arms --out docs/results/ablations --group NAME,NAME --group ...

Each drafter is named by its run directory (``runs/arms/NAME/drafter`` -> NAME). Writes ``table.md``
(rounds, chain tau, tree tau per budget, held-out loss and depth-1 agreement from the run's train_log.jsonl
when --log-dir has it) and ``tau_vs_budget.png`` (one line per drafter; groups share a panel).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def arm_name(drafter_path: str) -> str:
    p = Path(drafter_path)
    return p.parent.name if p.name == "drafter" else p.name


def last_eval(log_file: Path) -> dict:
    """The last record of a training log that holds held-out numbers."""
    if not log_file.is_file():
        return {}
    records = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval_loss" in r]
    return evals[-1] if evals else {}


def table(report: dict, log_dir: Path | None) -> str:
    budgets = [str(b) for b in report["budgets"]]
    head = ["head", "rounds@16", "chain tau"] + [f"tau@{b}" for b in budgets] + ["steps", "held-out loss",
                                                                               "top-1 depth 1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path, row in report["drafters"].items():
        name = arm_name(path)
        ev = last_eval(log_dir / name / "train_log.jsonl") if log_dir else {}
        cells = [name, str(row["rounds"][budgets[0]]), f"{row['chain_tau']:.2f}"] + [f"{row['tau'][b]:.2f}" for b in budgets]
        cells += [str(ev.get("step", "")), f"{ev['eval_loss']:.3f}" if ev else "",
                  f"{ev['top1_agreement'][0]:.3f}" if ev else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, groups: list[list[str]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {arm_name(p): row for p, row in report["drafters"].items()}
    groups = groups or [sorted(by_name)]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    budgets = report["budgets"]
    for ax, names in zip(axes[0], groups):
        for name in names:
            if name in by_name:
                ax.plot(budgets, [by_name[name]["tau"][str(b)] for b in budgets], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("tree budget (draft nodes)")
        ax.set_ylabel("tau (decoding replayed offline, bonus incl.)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "tau_vs_budget.png"
    fig.savefig(path, dpi=120)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", type=Path, nargs="+", help="`jetflow eval-offline --out` JSONs (same data, "
                                                          "range and budgets; their drafters are pooled)")
    ap.add_argument("--log-dir", type=Path, default=None, help="directory holding NAME/train_log.jsonl per arm")
    ap.add_argument("--group", action="append", default=[], help="comma list of arm names sharing a plot panel")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    reports = [json.loads(p.read_text()) for p in args.reports]
    report = reports[0]
    for other in reports[1:]:
        if (other["sequences"], other["budgets"]) != (report["sequences"], report["budgets"]):
            raise SystemExit("reports cover different sequences or budgets")
        report["drafters"].update(other["drafters"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table(report, args.log_dir))
    path = plot(report, [g.split(",") for g in args.group], args.out)
    print((args.out / "table.md").read_text() + f"plot: {path}")


if __name__ == "__main__":
    main()
