"""95% intervals of the speed-ups in stored `jetflow bench` outputs (runs made before the bench
printed them): a paired bootstrap over prompts against each dataset's reference run.

    python benchmarks/speedup_intervals.py docs/results/headline_llamacpp_v7 docs/results/headline_llamacpp_v8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jetflow.eval.bootstrap import speedup_interval
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outs", nargs="+", type=Path, help="--out folders of `jetflow bench`")
    ap.add_argument("--json", type=Path, default=None, help="also write the intervals here")
    args = ap.parse_args()
    result = {}
    for out in args.outs:
        runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
        if not runs:
            ap.error(f"{out}: no runs/*.json (not a `jetflow bench` --out folder)")
        for run in runs:
            s = run["summary"]
            refs = [r for r in runs if r["dataset"] == run["dataset"] and r["method"] in ("llama-ar", "ar")]
            ref = next((r for r in refs if r["method"] == "llama-ar"), refs[0] if refs else None)
            if ref is None or ref is run or "speedup" not in s:
                continue
            ci = speedup_interval(run["records"], ref["records"])
            name = run["method"] + ("" if run["budget"] is None else f"@{run['budget']}")
            result.setdefault(str(out), {}).setdefault(run["dataset"], {})[name] = {
                "speedup": s["speedup"], "ci95": ci, "against": ref["method"]}
            print(f"{out.name:28s} {run['dataset']:10s} {name:20s} {s['speedup']:.3f}x  "
                  f"95% {ci[0]:.2f}-{ci[1]:.2f}x  (against {ref['method']})")
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
