"""Acceptance (tau) of one `jetflow bench` command with this checkout's code against an earlier
commit's: a timing-free check that a change to the draft path left what the head proposes as good.

    python benchmarks/tau_ab.py --base 28738ca --out docs/results/lean_draft/tau_ab -- \\
        --backend llamacpp --threads 2 --datasets gsm8k,mtbench --limit 10 --max-new-tokens 128 \\
        --methods jetflow --budgets 4,16

At a fixed budget a greedy round's tree, and so tau, depends only on the drafts (not on timings).
The earlier commit runs from a temporary git worktree; the two runs go to OUT/base and OUT/new (a
side already finished for the same commit is kept), and each (dataset, method, budget) prints both
taus and how many requests emitted the same tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from worktree import ROOT, checkout, resolve, this_checkout
RUN_CLI = "import sys; from jetflow.cli import main; sys.exit(main(sys.argv[1:]))"


def bench(tree: Path, args: list[str], out: Path, commit: str) -> None:
    """One side's run, from the tree's root (so its own `jetflow` package is the one imported); kept
    when OUT/<side> already holds a finished run of this commit with these bench options. Otherwise
    its stored runs go first: the bench would reuse them (their keys name settings, not code), and
    the A/B would compare a side with itself. Uncommitted code is never kept (it may have changed)."""
    marker, made = out / "COMMIT", json.dumps({"commit": commit, "bench": args})
    kept = marker.is_file() and marker.read_text().strip() == made and (out / "summary.json").is_file()
    if kept and not commit.endswith("+uncommitted"):
        print(f"{out}: kept (a finished run of {commit[:12]} with the same options)", file=sys.stderr)
        return
    shutil.rmtree(out / "runs", ignore_errors=True)
    marker.unlink(missing_ok=True)
    # Exit status 1: some output differed from the reference (llama.cpp's near-ties, which the bench
    # reports); the taus still compare. Anything else is a failure.
    done = subprocess.run([sys.executable, "-c", RUN_CLI, "bench", *args, "--out", str(out), "--overwrite"], cwd=tree)
    if done.returncode not in (0, 1) or not (out / "summary.json").is_file():
        raise SystemExit(f"jetflow bench failed in {tree} (exit status {done.returncode})")
    marker.write_text(made + "\n")


def runs(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `jetflow bench` options, without --out")
    args = ap.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    out = args.out.resolve()
    commit = resolve(args.base)
    with checkout(commit) as base_tree:
        bench(base_tree, bench_args, out / "base", commit)
    bench(ROOT, bench_args, out / "new", this_checkout())
    base, new = runs(out / "base"), runs(out / "new")
    table = {}
    for name in sorted(set(base) & set(new)):
        b, n = base[name], new[name]
        same = sum(x["token_ids"] == y["token_ids"] for x, y in zip(b["records"], n["records"]))
        table[name] = {"tau_base": b["summary"]["tau"], "tau_new": n["summary"]["tau"], "requests": len(n["records"]),
                       "same_tokens": same}
        print(f"{name:40s} tau {b['summary']['tau']:.3f} -> {n['summary']['tau']:.3f}   "
              f"same tokens in {same} of {len(n['records'])} requests")
    new_commit = json.loads((out / "new" / "COMMIT").read_text())["commit"]
    (out / "tau_ab.json").write_text(json.dumps({"base": commit, "new": new_commit, "bench": bench_args,
                                                 "runs": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
