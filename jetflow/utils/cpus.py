"""How many CPUs this process may use (the default thread count of llama.cpp)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not the
    host's count; llama.cpp threads beyond it spin-wait on each other."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # (no affinity masks on macOS and Windows)
        return os.cpu_count() or 1
