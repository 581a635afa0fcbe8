"""Does the llama.cpp context JetFlow decodes in cost a one-token decode anything?

JetFlow's context holds 256 sequences in one unified KV buffer (a verified tree's paths share
cells); llama-cpp-python's holds one. Both are made here from one loaded model, with the same
threads and batch, and timed on the same one-token ``llama_decode`` calls after the same prompt,
interleaved in rounds so that drift falls on all alike. Only ``llama_decode`` is timed.

    python benchmarks/llamacpp_context_layout.py --out docs/results/llamacpp/context_layout.json
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

from jetflow.models.llamacpp_target import MAX_SEQ
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic

LAYOUTS = {  # name -> (sequences, unified KV buffer)
    "jetflow (256 sequences, unified)": (MAX_SEQ, True),
    "llama-cpp-python (1 sequence)": (1, False),
    "1 sequence, unified": (1, True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150, help="prompt tokens before the timed decodes")
    ap.add_argument("--steps", type=int, default=30, help="timed decodes per layout per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    target = load_target(args.target, backend="llamacpp", n_threads=args.threads)
    lib = target._lib
    contexts = {name: target.new_context(4096, target.n_batch, seqs, unified) for name, (seqs, unified) in LAYOUTS.items()}

    def decode(ctx, tokens: list[int]) -> float:
        array = (ctypes.c_int32 * len(tokens))(*tokens)
        batch = lib.llama_batch_get_one(array, len(tokens))
        t0 = time.perf_counter()
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - t0

    prompt = list(range(1000, 1000 + args.context))
    for ctx in contexts.values():
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        decode(ctx, prompt)
    times: dict[str, list[float]] = {name: [] for name in contexts}
    for r in range(args.rounds):
        names = list(contexts)[r % len(contexts):] + list(contexts)[:r % len(contexts)]  # rotating order
        for name in names:
            ctx = contexts[name]
            lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, args.context, -1)  # back to the prompt
            times[name] += [decode(ctx, [500 + s]) for s in range(args.steps)]
    out = {"threads": args.threads, "context": args.context,
           "decode_ms": {name: {"median": statistics.median(v) * 1e3, "mean": statistics.mean(v) * 1e3, "n": len(v)}
                         for name, v in times.items()}}
    for name, row in out["decode_ms"].items():
        print(f"{name:34s} median {row['median']:.3f} ms  mean {row['mean']:.3f} ms  ({row['n']} decodes)")
    write_json_atomic(args.out, out)
    for ctx in contexts.values():
        lib.llama_free(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
