"""Markdown table of a fitted tree calibration: the acceptance rate it assigns to a node at each
depth, by kind of parent, for a few draft probabilities.

    python benchmarks/calibration_table.py docs/results/calibration/v5_fit.json
"""

from __future__ import annotations

import argparse
import json
import math

from jetflow.tree.calibration import TreeCalibration

PROBS = (0.1, 0.3, 0.6, 0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="a `jetflow calibrate --report` JSON file")
    args = p.parse_args()
    cal = TreeCalibration.from_json(json.load(open(args.report))["calibration"])
    print("| depth | parent | " + " | ".join(f"draft p = {q}" for q in PROBS) + " |")
    print("|---|---|" + "---|" * len(PROBS))
    for d in range(1, len(cal.main) + 1):
        for main in (True, False):
            if d == 1 and not main:
                continue  # depth-1 nodes hang from the root, which is on the chain
            cells = " | ".join(f"{math.exp(cal.score(d, main, math.log(q))):.2f}" for q in PROBS)
            print(f"| {d} | {'top-1 chain' if main else 'other'} | {cells} |")


if __name__ == "__main__":
    main()
