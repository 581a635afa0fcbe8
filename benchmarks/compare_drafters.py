"""tau of several drafters side by side, from `jetflow bench` outputs (one output per drafter, or several
pooled under one label).

    python benchmarks/compare_drafters.py --run shipped:runs/a --run new:runs/b [--run new:runs/c] \
        --out docs/results/new_drafter/compare.json

Prints one markdown row per (dataset, budget): each drafter's tau (bonus token included) with its
rounds, and whether every output was identical to the bench's reference; writes the same as JSON.
Runs of one label that measured the same dataset and budget must agree on the prompt count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_label(dirs: list[Path]) -> dict:
    """(dataset, method, budget) -> {prompts, tau, rounds, identical}, pooled over the label's outputs."""
    rows = {}
    for d in dirs:
        for run in json.loads((d / "summary.json").read_text())["runs"]:
            if run["method"] in ("ar", "llama-ar"):
                continue
            s = run["summary"]
            key = (run["dataset"], run["method"], str(run["budget"]))
            row = {"prompts": s["prompts"], "tau": s["tau"], "rounds": s["rounds"],
                   "identical": not s.get("mismatches"), "source": str(d)}
            if key in rows and rows[key]["prompts"] != row["prompts"]:
                key = (f"{key[0]} (first {row['prompts']})", key[1], key[2])
            rows[key] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL:DIR",
                    help="a bench output under a label; repeat (a label may repeat to pool outputs)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dirs: dict[str, list[Path]] = {}
    for spec in args.run:
        label, sep, path = spec.partition(":")
        if not sep or not label or not Path(path, "summary.json").is_file():
            ap.error(f"--run {spec!r}: expected LABEL:DIR with DIR/summary.json")
        dirs.setdefault(label, []).append(Path(path))
    labels = {label: load_label(ds) for label, ds in dirs.items()}
    keys = sorted({k for rows in labels.values() for k in rows})
    print("| dataset | method | budget | prompts | " + " | ".join(f"{label} tau" for label in labels)
          + " | all identical |")
    print("|---|---|---|---|" + "---|" * len(labels) + "---|")
    table = []
    for key in keys:
        cells = [labels[label].get(key) for label in labels]
        prompts = next(c["prompts"] for c in cells if c)
        taus = [f"{c['tau']:.2f} ({c['rounds']} rounds)" if c else "" for c in cells]
        identical = all(c["identical"] for c in cells if c)
        same = "yes" if identical else "NO"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {prompts} | " + " | ".join(taus) + f" | {same} |")
        table.append({"dataset": key[0], "method": key[1], "budget": key[2],
                      **{label: labels[label].get(key) for label in labels}})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": {k: [str(p) for p in v] for k, v in dirs.items()},
                                        "table": table}, indent=1))


if __name__ == "__main__":
    main()
