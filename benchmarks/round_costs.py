"""What a round costs and yields in stored `jetflow bench` outputs, side by side: per method and
budget, tau, tokens/s, speed-up against the run's own reference with its 95% interval, and the
milliseconds of a round spent drafting, verifying and elsewhere, the round's time in the reference's
own steps (``steps``: comparable across runs when the machine's speed drifts between them), and the
mean verified tree size.
Two drafting modes timed in separate runs compare by speed-up (each against the reference timed in
its own run) and at equal time per round (tau against ms per round).

    python benchmarks/round_costs.py docs/results/tree_pass_decoded/path_pass_w7 \
        docs/results/tree_pass_decoded/tree_pass_w24 --json docs/results/tree_pass_decoded/round_costs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedup_intervals import same_temperature  # noqa: E402

from jetflow.eval.bootstrap import speedup_interval  # noqa: E402
from jetflow.utils.fs import write_json_atomic  # noqa: E402


def run_rows(out: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    if not runs:
        raise SystemExit(f"{out}: no runs/*.json (not a `jetflow bench` --out folder)")
    rows = []
    ref_ms = {}
    for run in runs:
        refs = [r for r in runs if r["dataset"] == run["dataset"] and r["method"] in ("llama-ar", "ar")
                and same_temperature(r, run)]
        ref = next((r for r in refs if r["method"] == "llama-ar"), refs[0] if refs else None)
        s = run["summary"]
        split = s.get("ms_per_round", {})
        rounds_ms = sum(split.values()) if split else 1000 * s["seconds"] / max(1, s["rounds"])
        rows.append({
            "out": out.name, "dataset": run["dataset"], "method": run["method"], "budget": run["budget"],
            "tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": s.get("speedup", 1.0),
            "ci95": speedup_interval(run["records"], ref["records"]) if ref is not None and ref is not run else [1.0, 1.0],
            "ms_per_round": rounds_ms, "draft_ms": split.get("draft", 0.0), "verify_ms": split.get("verify", rounds_ms),
            "mean_tree_size": s.get("mean_tree_size", 1.0), "mismatches": len(s.get("mismatches", [])),
        })
        if ref is run:
            ref_ms[run["dataset"]] = rounds_ms
    for row in rows:  # a round's time in plain steps of the same run: comparable across runs on a drifting machine
        row["round_in_ref_steps"] = row["ms_per_round"] / ref_ms[row["dataset"]] if row["dataset"] in ref_ms else None
    order = {"ar": 0, "llama-ar": 0}
    rows.sort(key=lambda r: (r["dataset"], order.get(r["method"], 1), r["method"],
                             -1 if r["budget"] is None else 10**9 if r["budget"] == "auto" else int(r["budget"])))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outs", nargs="+", type=Path, help="--out folders of `jetflow bench`")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = [row for out in args.outs for row in run_rows(out)]
    print(f"{'run':22s} {'set':8s} {'method@budget':22s} {'tau':>5s} {'tok/s':>6s} {'speed-up [95%]':>20s} "
          f"{'ms/round':>9s} {'draft':>7s} {'verify':>7s} {'steps':>6s} {'tree':>6s} {'diff':>4s}")
    for r in rows:
        name = r["method"] + ("" if r["budget"] is None else f"@{r['budget']}")
        lo, hi = r["ci95"]
        print(f"{r['out']:22s} {r['dataset']:8s} {name:22s} {r['tau']:5.2f} {r['tokens_per_s']:6.2f} "
              f"{r['speedup']:6.2f}x [{lo:.2f}-{hi:.2f}] {r['ms_per_round']:9.1f} {r['draft_ms']:7.1f} "
              f"{r['verify_ms']:7.1f} {r['round_in_ref_steps'] or float('nan'):6.2f} {r['mean_tree_size']:6.1f} "
              f"{r['mismatches']:4d}")
    if args.json:
        write_json_atomic(args.json, {"outs": [str(o) for o in args.outs], "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
