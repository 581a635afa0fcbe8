"""What a second compute thread costs torch on the CPU: the same small ops (a 32-row linear layer of
the target's MLP width and a SiLU, as in a batched decode step) timed in a thread that is the only
one running torch, and in a thread started after the main thread has run torch ops too.

    python benchmarks/bench_second_thread.py

Each thread that runs a parallel op keeps its own OpenMP team; with two teams there are more
OpenMP threads than cores and libgomp stops spin-waiting, so small ops wait for sleeping workers.
This is why ``jetflow serve`` runs the model only in its engine thread (jetflow/serve/server.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import torch


def time_ops(rows: int, reps: int) -> float:
    x, w = torch.randn(rows, 576), torch.randn(1536, 576)
    for _ in range(50):
        torch.nn.functional.silu(torch.nn.functional.linear(x, w))
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.silu(torch.nn.functional.linear(x, w))
    return (time.perf_counter() - t0) / reps * 1e6


def in_thread(rows: int, reps: int) -> float:
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("us", time_ops(rows, reps)))
    thread.start()
    thread.join()
    return out["us"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--case", choices=["alone", "after-main"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case == "alone":
        print(in_thread(args.rows, args.reps))
        return
    if args.case == "after-main":
        time_ops(args.rows, 100)  # the main thread now has an OpenMP team of its own
        print(in_thread(args.rows, args.reps))
        return
    result = {"threads": torch.get_num_threads(), "rows": args.rows}
    for case in ("alone", "after-main"):  # each in a fresh process: a team lives as long as its thread
        out = subprocess.run([sys.executable, __file__, "--case", case, "--rows", str(args.rows),
                              "--reps", str(args.reps)], check=True, capture_output=True, text=True).stdout
        result[f"us_per_op_pair_{case.replace('-', '_')}"] = round(float(out.split()[-1]), 1)
    result["slowdown"] = round(result["us_per_op_pair_after_main"] / result["us_per_op_pair_alone"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
