"""95% intervals of the speed-ups in stored `jetflow bench` outputs (runs made before the bench
printed them): a paired bootstrap over prompts against each dataset's reference run.

    python benchmarks/speedup_intervals.py docs/results/headline_llamacpp_v7 docs/results/headline_llamacpp_v8

``--against lookup`` compares with another method of the same run instead (tokens/s ratio of the
paired prompts' totals, and its interval).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jetflow.eval.bootstrap import speedup_interval
from jetflow.utils.fs import write_json_atomic


def total_ratio(records: list[dict], reference: list[dict]) -> float:
    """tokens/s of ``records`` over tokens/s of ``reference``, on the (id, turn) pairs both have."""
    ref = {(r["id"], r["turn"]): r for r in reference}
    pairs = [(r, ref[(r["id"], r["turn"])]) for r in records if (r["id"], r["turn"]) in ref]
    tokens, seconds = sum(r["new_tokens"] for r, _ in pairs), sum(r["seconds"] for r, _ in pairs)
    ref_tokens, ref_seconds = sum(q["new_tokens"] for _, q in pairs), sum(q["seconds"] for _, q in pairs)
    return tokens * ref_seconds / (seconds * ref_tokens)


def same_temperature(a: dict, b: dict) -> bool:
    """Whether two stored runs decoded at the same temperature (a sampled run's reference is ar)."""
    return a.get("key", {}).get("temperature") == b.get("key", {}).get("temperature")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outs", nargs="+", type=Path, help="--out folders of `jetflow bench`")
    ap.add_argument("--json", type=Path, default=None, help="also write the intervals here")
    ap.add_argument("--against", default=None, help="reference method (default: llama-ar, else ar)")
    args = ap.parse_args()
    result = {}
    for out in args.outs:
        runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
        if not runs:
            ap.error(f"{out}: no runs/*.json (not a `jetflow bench` --out folder)")
        for run in runs:
            s = run["summary"]
            wanted = (args.against,) if args.against else ("llama-ar", "ar")
            refs = [r for r in runs if r["dataset"] == run["dataset"] and r["method"] in wanted
                    and same_temperature(r, run)]  # (a greedy llama-ar left beside a sampled run is not its reference)
            ref = next((r for r in refs if r["method"] == "llama-ar"), refs[0] if refs else None)
            if ref is None or ref is run or "speedup" not in s:
                continue
            ci = speedup_interval(run["records"], ref["records"])
            speedup = s["speedup"] if not args.against else total_ratio(run["records"], ref["records"])
            name = run["method"] + ("" if run["budget"] is None else f"@{run['budget']}")
            result.setdefault(str(out), {}).setdefault(run["dataset"], {})[name] = {
                "speedup": speedup, "ci95": ci, "against": ref["method"]}
            interval = "no interval (one prompt)" if ci is None else f"95% {ci[0]:.2f}-{ci[1]:.2f}x"
            print(f"{out.name:28s} {run['dataset']:10s} {name:20s} {speedup:.3f}x  {interval}  (against {ref['method']})")
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
