"""A round's draft cost (benchmarks/bench_lean_draft.py) with this checkout's code against an earlier
commit's, in alternating fresh processes on the same machine.

    python benchmarks/lean_draft_ab.py --base 28738ca --rounds 3 --out docs/results/lean_draft/ab.json

The earlier commit is checked out into a temporary git worktree, and this checkout's
bench_lean_draft.py runs against each tree's package (the script only calls the public drafter API).
Prints and writes, per variant, each side's median over rounds and the ratio new / base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from worktree import ROOT, checkout, resolve, this_checkout


def run_bench(tree: Path, extra: list[str]) -> dict:
    script = tree / "benchmarks" / "bench_lean_draft.py"
    if tree != ROOT:
        shutil.copy(ROOT / "benchmarks" / "bench_lean_draft.py", script)
    out = subprocess.run([sys.executable, str(script), *extra], cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("bench_args", nargs="*", help="passed to bench_lean_draft.py (after --)")
    args = ap.parse_args()
    commit = resolve(args.base)
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    with checkout(commit) as base_tree:
        for r in range(args.rounds):
            for side, tree in (("base", base_tree), ("new", ROOT)):
                runs[side].append(run_bench(tree, args.bench_args))
                print(f"round {r + 1}/{args.rounds} {side}: step {runs[side][-1]['llama_step_ms']:.2f} ms",
                      file=sys.stderr)
    table = {}
    for name in runs["new"][0]["draft_ms"]:
        base = statistics.median(run["draft_ms"][name]["ms"] for run in runs["base"])
        new = statistics.median(run["draft_ms"][name]["ms"] for run in runs["new"])
        table[name] = {"base_ms": base, "new_ms": new, "ratio": new / base}
    steps = {side: statistics.median(run["llama_step_ms"] for run in runs[side]) for side in runs}
    result = {"base": commit, "new": this_checkout(), "rounds": args.rounds,
              "llama_step_ms": steps, "draft_ms": table, "runs": runs}
    for name, row in table.items():
        print(f"{name:20s} base {row['base_ms']:6.2f} ms  new {row['new_ms']:6.2f} ms  x{row['ratio']:.2f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
