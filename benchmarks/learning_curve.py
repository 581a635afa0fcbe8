"""Learning curve over training-data size: tau at one budget for drafters trained on growing data.

    python benchmarks/learning_curve.py --point 512:runs/lc/quarter --point 1138:runs/lc/v1 \
        --point 1771:runs/lc/full --budget 64 --first 20 --out docs/results/learning_curve.json

Each --point is SEQUENCES:RESULT, where RESULT is either
* a `jetflow bench` output directory with a gsm8k jetflow run at the budget: tau is recomputed from
  the per-prompt records over the first --first prompts, so runs over different prompt counts compare
  on the same questions; or
* a `jetflow eval-offline` JSON file of one drafter (the replay reproduces decoding's rounds,
  tests/test_offline_acceptance.py). Its sequences are in the order regeneration finished them, not
  in question order, so --first does not apply: every such point must replay the same data and range.
Also writes a PNG next to --out.
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


def offline_tau_of(result_file: Path, budget: int, replayed: set) -> tuple[float, int, bool]:
    result = json.loads(result_file.read_text())
    start, end = result["sequences"]
    replayed.add((result["data"], start, end))
    if len(replayed) > 1:
        raise SystemExit(f"the offline points replay different sequences: {sorted(replayed)}")
    if len(result["drafters"]) != 1:
        raise SystemExit(f"{result_file} holds {len(result['drafters'])} drafters; a point needs one")
    (drafter,) = result["drafters"].values()
    if str(budget) not in drafter["tau"]:
        raise SystemExit(f"{result_file} has no budget {budget} (it has {sorted(drafter['tau'])})")
    return drafter["tau"][str(budget)], end - start, True  # a replay has no output to differ


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", action="append", required=True, help="SEQUENCES:BENCH_OUT_DIR or SEQUENCES:EVAL_OFFLINE.json")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--first", type=int, default=20)
    ap.add_argument("--answer-tokens", default=None, help="optional SEQUENCES:TOKENS,... for the x axis labels")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, replayed = [], set()
    for spec in args.point:
        count, out_dir = spec.split(":", 1)
        if not Path(out_dir).exists():
            raise SystemExit(f"--point {spec}: {out_dir} does not exist")
        offline = out_dir.endswith(".json")
        if offline:
            tau, prompts, identical = offline_tau_of(Path(out_dir), args.budget, replayed)
        else:
            tau, prompts, identical = tau_of(Path(out_dir) / "runs" / f"{args.dataset}__jetflow__b{args.budget}.json",
                                             args.first)
        rows.append({"sequences": int(count), "bench": out_dir, "tau": tau, "prompts": prompts,
                     "replayed_offline": offline, "identical_to_ar": identical})
        print(f"{int(count):6d} sequences: tau@{args.budget} {tau:.2f} over {prompts} prompts"
              + ("" if identical else "  OUTPUT MISMATCH"))
    rows.sort(key=lambda r: r["sequences"])
    out = Path(args.out)
    online = any(not r["replayed_offline"] for r in rows)
    out.write_text(json.dumps({"budget": args.budget, "dataset": args.dataset, "first": args.first if online else None,
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
           title=f"{args.dataset}, " + (f"first {args.first} questions" if online
                                        else f"{rows[0]['prompts']} questions, replayed offline"))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
