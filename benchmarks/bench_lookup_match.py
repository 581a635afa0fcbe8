"""Time prompt lookup's n-gram matching (`lookup_match`), which a drafter with lookup runs every
round, over random histories of several lengths.

    python benchmarks/bench_lookup_match.py
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from jetflow.decoding.lookup_drafter import lookup_match


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="200,600,1500", help="history lengths in tokens")
    ap.add_argument("--vocab", type=int, default=2000, help="distinct token ids in the random histories")
    ap.add_argument("--number", type=int, default=1000, help="calls timed per length")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for n in (int(x) for x in args.lengths.split(",")):
        history = rng.integers(0, args.vocab, size=n)
        us = timeit.timeit(lambda: lookup_match(history), number=args.number) / args.number * 1e6
        print(f"history {n:5d} tokens: {us:7.1f} us per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
