"""Time prompt lookup's n-gram matching over random histories of several lengths: the stateless
scan (`lookup_match`, what the offline replay runs) and the incremental index a decoding drafter
runs every round (`LookupIndex`: one round's sync of a new token plus its match).

    python benchmarks/bench_lookup_match.py
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from jetflow.decoding.lookup_drafter import LookupIndex, lookup_match


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="200,600,1500", help="history lengths in tokens")
    ap.add_argument("--vocab", type=int, default=2000, help="distinct token ids in the random histories")
    ap.add_argument("--number", type=int, default=1000, help="calls timed per length")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for n in (int(x) for x in args.lengths.split(",")):
        history = rng.integers(0, args.vocab, size=n)
        scan_us = timeit.timeit(lambda: lookup_match(history), number=args.number) / args.number * 1e6
        # the index after n - 1 tokens; each timed call syncs one more (restarting it on a copy
        # would time the build), so the history grows by `number` tokens during the timing
        ids = history.tolist()
        index = LookupIndex()
        index.sync(ids[:-1])
        grown = iter(args.vocab + np.arange(args.number + 1))  # fresh ids: appended, never a restart
        tail = ids[:-1]

        def index_round():
            tail.append(int(next(grown)))
            index.sync(tail)
            index.match(ids[-1])

        index_us = timeit.timeit(index_round, number=args.number) / args.number * 1e6
        print(f"history {n:5d} tokens: lookup_match {scan_us:7.1f} us per call, "
              f"LookupIndex sync + match {index_us:6.1f} us per round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
