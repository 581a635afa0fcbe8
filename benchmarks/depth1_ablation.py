"""Table of the depth-1 ablation (docs/results.md, "Closing the depth-1 gap"): per arm, training steps
and seconds (its train_log.jsonl), per-depth agreement and prefix agreement at every answer position
of the held-out sequences (`jetflow eval-agreement`), and greedy tau at budgets 16/64
(`jetflow eval-offline`, block heads only).

    python benchmarks/depth1_ablation.py --arm A:/tmp/abl/A --arm B:/tmp/abl/B ... \
        --agreement docs/results/depth1_ablation/agreement.json --tau docs/results/depth1_ablation/tau.json \
        --out docs/results/depth1_ablation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", action="append", required=True, help="NAME:RUN_DIR (drafter in RUN_DIR/drafter)")
    p.add_argument("--label", action="append", default=[], help="NAME:description")
    p.add_argument("--agreement", type=Path, required=True)
    p.add_argument("--tau", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    labels = dict(x.split(":", 1) for x in args.label)
    agreement = json.loads(args.agreement.read_text())
    # anchors: every arm is evaluated on the same sequences; depth 1 counts every answer anchor
    tau = json.loads(args.tau.read_text()) if args.tau else {"drafters": {}}
    rows, summary = [], {}
    for spec in args.arm:
        name, run = spec.split(":", 1)
        drafter = str(Path(run) / "drafter")
        log = [json.loads(line) for line in (Path(run) / "train_log.jsonl").read_text().splitlines()]
        evals = [r for r in log if "top1_agreement" in r]
        a = agreement["drafters"][drafter]
        t = tau["drafters"].get(drafter)
        summary[name] = {"run": run, "label": labels.get(name, ""), "steps": log[-1]["step"],
                         "train_seconds": round(log[-1]["seconds"], 1),
                         "train_eval_top1": evals[-1]["top1_agreement"][:4] if evals else None,
                         "agreement": a["agreement"], "prefix_agreement": a["prefix_agreement"],
                         "anchors": a["anchors"],
                         "tau": None if t is None else {b: t["tau"][b] for b in ("16", "64") if b in t["tau"]}}
        s = summary[name]
        tau_text = " | ".join(f"{s['tau'][b]:.3f}" if s["tau"] and b in s["tau"] else "--" for b in ("16", "64"))
        cells = lambda xs: " | ".join([f"{x:.3f}" for x in xs[:4]] + ["--"] * (4 - len(xs[:4])))  # noqa: E731
        rows.append(f"| {name} | {s['label']} | {s['steps']} | {s['train_seconds']:.0f} | "
                    + cells(s["agreement"]) + " | " + cells(s["prefix_agreement"]) + f" | {tau_text} |")
    seq = agreement["sequences"]
    head = ["| arm | change | steps | train s | agree d1 | d2 | d3 | d4 | prefix d1 | d2 | d3 | d4 | tau@16 | tau@64 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    anchors = next(iter(summary.values()))["anchors"]
    text = (f"Held-out sequences {seq[0]}:{seq[1]} (shard order), {anchors} answer anchors; agreement: draft top-1 = "
            "target top-1 at depth k over every anchor; prefix: depths 1..k all agree (a greedy chain accepts >= k); "
            "tau: `jetflow eval-offline`, rounds where greedy decoding puts them, width 7.\n\n"
            + "\n".join(head + rows) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
