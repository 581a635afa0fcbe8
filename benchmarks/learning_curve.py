"""Learning curve over training-data size: tau at one budget for drafters trained on growing data.

    python benchmarks/learning_curve.py --point 512:runs/lc/quarter --point 1138:runs/lc/v1 \
        --point 1771:runs/lc/full --budget 64 --first 20 --out docs/results/learning_curve.json

Each --point is SEQUENCES:BENCH_OUT (a `jetflow bench` output directory with a gsm8k jetflow run at the
budget). tau is recomputed from the per-prompt records over the first --first prompts, so runs over
different prompt counts compare on the same questions. Also writes a PNG next to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def tau_of(run_file: Path, first: int) -> tuple[float, int, bool]:
    run = json.loads(run_file.read_text())
    recs = run["records"][:first]
    lengths = [a for r in recs for a in r["accept_lengths"]]
    identical = not run["summary"].get("mismatches")
    return sum(lengths) / len(lengths), len(recs), identical


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", action="append", required=True, help="SEQUENCES:BENCH_OUT_DIR")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--first", type=int, default=20)
    ap.add_argument("--answer-tokens", default=None, help="optional SEQUENCES:TOKENS,... for the x axis labels")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for spec in args.point:
        count, out_dir = spec.split(":", 1)
        tau, prompts, identical = tau_of(Path(out_dir) / "runs" / f"{args.dataset}__jetflow__b{args.budget}.json",
                                         args.first)
        rows.append({"sequences": int(count), "bench": out_dir, "tau": tau, "prompts": prompts,
                     "identical_to_ar": identical})
        print(f"{int(count):6d} sequences: tau@{args.budget} {tau:.2f} over {prompts} prompts"
              + ("" if identical else "  OUTPUT MISMATCH"))
    rows.sort(key=lambda r: r["sequences"])
    out = Path(args.out)
    out.write_text(json.dumps({"budget": args.budget, "dataset": args.dataset, "first": args.first,
                               "points": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["sequences"] for r in rows], [r["tau"] for r in rows], "o-")
    ax.set(xlabel="training sequences (regenerated answers)", ylabel=f"tau at budget {args.budget}",
           title=f"{args.dataset}, first {args.first} questions")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
