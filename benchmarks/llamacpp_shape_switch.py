"""What a change of batch shape costs a llama.cpp decode: the graph rebuild a lookup chain pays.

llama.cpp reuses its previous compute graph when a decode has the same shape (tokens, outputs,
sequences) as the one before; any other shape builds and allocates the graph again. `auto` on
llama.cpp mostly runs one-token steps, so a lookup chain of n nodes between them pays its verify of
n + 1 tokens, a rebuild on the way in, and another one on the next one-token step. ``verify_ms`` of
the cost curve is measured with repeats of one shape, so it leaves both out.

Timed here, in JetFlow's own calls (``greedy_step``; ``verify`` + ``commit`` of a chain, no features),
after ``--context`` tokens, in rounds whose order rotates: a one-token step after a one-token step
and after a chain of n + 1 tokens; a chain after the same chain and after a one-token step.

    python benchmarks/llamacpp_shape_switch.py --threads 2 --out docs/results/llamacpp/shape_switch.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150, help="prompt tokens before the timed decodes")
    ap.add_argument("--chains", default="2,3,5,9", help="chain sizes in tokens (root included)")
    ap.add_argument("--pairs", type=int, default=20, help="timed pairs per case per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, backend="llamacpp", n_threads=args.threads)
    context = list(range(1000, 1000 + args.context))
    sizes = [int(s) for s in args.chains.split(",")]

    def step(i: int) -> float:
        t = time.perf_counter()
        target.greedy_step(1234 + i)
        return time.perf_counter() - t

    def chain(i: int, n: int) -> float:
        tokens = [1234 + i] + [500 + k for k in range(n - 1)]
        t = time.perf_counter()
        target.verify(tokens, list(range(-1, n - 1)), return_hidden=False)
        seconds = time.perf_counter() - t
        target.commit([])  # nothing kept: the context grows by the one-token steps alone, as in every case
        return seconds

    # case -> (untimed call before, timed call): a pair whose second call is timed
    cases = {"step after step": (step, step)}
    for n in sizes:
        cases[f"step after chain of {n}"] = (lambda i, n=n: chain(i, n), step)
        cases[f"chain of {n} after chain of {n}"] = (lambda i, n=n: chain(i, n), lambda i, n=n: chain(i, n))
        cases[f"chain of {n} after step"] = (step, lambda i, n=n: chain(i, n))
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before, timed = cases[name]
            target.prefill(context, return_hidden=False)
            for i in range(args.pairs):
                before(i)
                times[name].append(timed(i))
    out = {"command": ["benchmarks/llamacpp_shape_switch.py", *__import__("sys").argv[1:]],
           "threads": args.threads, "context": args.context,
           "ms": {name: {"median": 1e3 * statistics.median(v), "mean": 1e3 * statistics.fmean(v), "n": len(v)}
                  for name, v in times.items()}}
    base = out["ms"]["step after step"]["median"]
    out["switch_ms"] = {}
    for n in sizes:
        into = out["ms"][f"chain of {n} after step"]["median"] - out["ms"][f"chain of {n} after chain of {n}"]["median"]
        back = out["ms"][f"step after chain of {n}"]["median"] - base
        out["switch_ms"][str(n)] = {"into_chain": into, "back_to_step": back}
    for name, row in out["ms"].items():
        print(f"{name:28s} median {row['median']:6.2f} ms  mean {row['mean']:6.2f} ms  ({row['n']})")
    for n, row in out["switch_ms"].items():
        print(f"chain of {n}: switching in costs {row['into_chain']:.2f} ms, back to one-token steps {row['back_to_step']:.2f} ms")
    write_json_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
