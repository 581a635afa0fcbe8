"""Is JetFlow's one-token llama.cpp step slower than llama-cpp-python's, or do loaded copies differ?

Loads the target twice on JetFlow's backend and twice as llama-cpp-python's ``Llama`` (same GGUF,
threads and batch), then times one-token greedy steps on all four: JetFlow's ``greedy_step`` and
``Llama.eval``, after the same ``--context`` tokens, in rounds whose order rotates, a few untimed
steps after each switch. If two copies of the same code differ by as much as the two runtimes do,
that difference is not the runtime's.

    python benchmarks/llamacpp_step_instances.py --threads 2 --out docs/results/llamacpp/step_instances.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jetflow.eval.llama_reference import open_llama
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per copy per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after each switch of copy")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    context = list(range(1000, 1000 + args.context))

    def jetflow_copy():
        target = load_target(args.target, backend="llamacpp", n_threads=args.threads)
        return target, (lambda: target.prefill(context, return_hidden=False)), (lambda i: target.greedy_step(1234 + i))

    def llama_copy(gguf, n_ctx):
        llm = open_llama(gguf, n_ctx=n_ctx, n_threads=args.threads)

        def start():
            llm.reset()
            llm.eval(context)
        return start, (lambda i: llm.eval([1234 + i]))

    first, start_a, step_a = jetflow_copy()
    _, start_b, step_b = jetflow_copy()
    copies = {"jetflow greedy_step, copy 1": (start_a, step_a), "jetflow greedy_step, copy 2": (start_b, step_b),
              "Llama.eval, copy 1": llama_copy(first.gguf, first.max_context),
              "Llama.eval, copy 2": llama_copy(first.gguf, first.max_context)}
    times: dict[str, list[float]] = {name: [] for name in copies}
    names = list(copies)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, step = copies[name]
            start()
            for i in range(args.warmup):
                step(i)
            for i in range(args.warmup, args.warmup + args.steps):
                t = time.perf_counter()
                step(i)
                times[name].append(time.perf_counter() - t)
    out = {"command": ["benchmarks/llamacpp_step_instances.py", *__import__("sys").argv[1:]],
           "threads": args.threads, "context": args.context,
           "step_ms": {name: {"median": 1e3 * statistics.median(v), "mean": 1e3 * statistics.fmean(v), "n": len(v)}
                       for name, v in times.items()}}
    for name, row in out["step_ms"].items():
        print(f"{name:28s} median {row['median']:.3f} ms  mean {row['mean']:.3f} ms  ({row['n']} steps)")
    write_json_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
