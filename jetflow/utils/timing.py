"""Wall-clock timing of a call, as every cost measurement in JetFlow takes it."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, reps: int) -> float:
    """Median wall milliseconds of ``fn()`` over ``reps`` calls, after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3
