"""Long prompts on the llama.cpp backend: prefill seconds and one-token step time at a few context
lengths, JetFlow's target next to llama-cpp-python's ``Llama`` on the same GGUF in the same process.

For each length: random token ids (the same for both), a full prefill (JetFlow's prefix cache off,
llama-cpp-python's cleared) that ends with the first token, then ``--steps`` greedy one-token steps
(JetFlow's ``greedy_step``; llama-cpp-python's ``Llama.generate``). The two runtimes alternate,
the first one rotating from length to length and repeat to repeat.

    python benchmarks/llamacpp_long_context.py --lengths 500,2000,3500 --repeats 2 \\
        --out docs/results/llamacpp/long_context.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from jetflow.eval.llama_reference import open_llama
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="500,2000,3500")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=args.threads)
    target.prefix_cache = False
    llm = open_llama(target.gguf, n_ctx=target.max_context, n_threads=args.threads, flash_attn=target.flash_attn)

    def jetflow_run(ids):
        target.reset()
        t0 = time.perf_counter()
        token = int(target.prefill(ids, return_hidden=False).logits[-1].argmax())
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            token = target.greedy_step(token)
        return prefill, (time.perf_counter() - t0) / args.steps

    def llama_run(ids):  # its own greedy loop, as `llama-ar` runs it: the prefill ends at the first token
        llm.reset()
        t0 = time.perf_counter()
        tokens = llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
        next(tokens)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(tokens)
        step = (time.perf_counter() - t0) / args.steps
        tokens.close()
        return prefill, step

    runtimes = {"jetflow": jetflow_run, "llama-cpp-python": llama_run}
    rng, rows, k = random.Random(0), [], 0
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = [rng.randrange(100, 20000) for _ in range(n)]
        got = {name: [] for name in runtimes}
        for _ in range(args.repeats):
            order = list(runtimes)[k % 2:] + list(runtimes)[:k % 2]
            k += 1
            for name in order:
                got[name].append(runtimes[name](ids))
        row = {"context": n}
        for name, runs in got.items():
            row[name] = {"prefill_s": statistics.median(p for p, _ in runs),
                         "step_ms": statistics.median(s for _, s in runs) * 1e3}
        rows.append(row)
        print(f"{n:5d} tokens: prefill JetFlow {row['jetflow']['prefill_s']:.2f} s, llama-cpp-python "
              f"{row['llama-cpp-python']['prefill_s']:.2f} s; step {row['jetflow']['step_ms']:.1f} ms vs "
              f"{row['llama-cpp-python']['step_ms']:.1f} ms", flush=True)
    write_json_atomic(args.out, {"command": sys.argv, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
