"""Where a plain decoding step's time goes on the llama.cpp backend, against llama-cpp-python's own.

Both run the same GGUF with the same threads and batch settings. Measured in rounds, the variants'
order rotating each round so that drift and what ran just before hit all alike, with a few untimed
steps after each switch (the first decode after another shape rebuilds llama.cpp's graph):

* ``llama_eval``: one ``Llama.eval([token])`` step (llama-cpp-python's decode and its bookkeeping);
* ``jetflow_decode``: the ``llama_decode`` call inside JetFlow's ``verify`` of one token;
* ``jetflow_python``: the rest of ``verify`` + ``commit`` (batch filling, copying logits and taps out);
* ``jetflow_step_no_taps``: the same step asking for no features, so llama.cpp's layer-input taps are
  off (what JetFlow's autoregressive loop ran until ``greedy_step``);
* ``jetflow_greedy_step``: ``greedy_step(token)``, the plain greedy step the autoregressive loop and
  ``auto``'s featureless plain rounds run now: decode, then the argmax read in place (no logits
  copied out, no tree bookkeeping), the argmax included;
* the prefill of the same prompts on both;
* greedy argmax of one full-vocabulary row with torch and with numpy.

    python benchmarks/llamacpp_step_overhead.py --threads 2 --out step_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from jetflow.decoding.prompt import encode_prompt
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.llama_reference import open_llama
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150, help="tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after each switch of variant")
    ap.add_argument("--prompts", default="mtbench", help="bench dataset whose first 8 prompts are prefilled")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, backend="llamacpp", n_threads=args.threads)
    llm = open_llama(target.gguf, n_ctx=target.max_context, n_threads=args.threads, flash_attn=target.flash_attn)
    context = list(range(1000, 1000 + args.context))

    decode_s: list[float] = []
    raw_decode = target._decode

    def timed_decode(what):
        t = time.perf_counter()
        raw_decode(what)
        decode_s.append(time.perf_counter() - t)

    target._decode = timed_decode
    times = {"llama_eval": [], "jetflow_step": [], "jetflow_decode": [], "jetflow_python": [],
             "jetflow_step_no_taps": [], "jetflow_greedy_step": []}

    def llama_eval(i):
        t = time.perf_counter()
        llm.eval([1234 + i])
        return {"llama_eval": time.perf_counter() - t}

    def jetflow_step(i):
        decode_s.clear()
        t = time.perf_counter()
        target.verify([1234 + i], [-1])
        target.commit([0])
        total = time.perf_counter() - t
        return {"jetflow_step": total, "jetflow_decode": decode_s[0], "jetflow_python": total - decode_s[0]}

    def jetflow_step_no_taps(i):
        t = time.perf_counter()
        target.verify([1234 + i], [-1], return_hidden=False)
        target.commit([0])
        return {"jetflow_step_no_taps": time.perf_counter() - t}

    def jetflow_greedy_step(i):
        t = time.perf_counter()
        target.greedy_step(1234 + i)
        return {"jetflow_greedy_step": time.perf_counter() - t}

    def start(variant):  # back to the same context; the warm-up steps absorb llama.cpp's graph rebuild
        if variant is llama_eval:
            llm.reset()
            llm.eval(context)
        else:
            target.prefill(context, return_hidden=variant is jetflow_step)

    variants = [llama_eval, jetflow_step, jetflow_step_no_taps, jetflow_greedy_step]
    for r in range(args.rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotating order
            start(variant)
            for i in range(args.warmup):
                variant(i)
            for i in range(args.warmup, args.warmup + args.steps):
                for name, seconds in variant(i).items():
                    times[name].append(seconds)
    report = {"command": ["benchmarks/llamacpp_step_overhead.py", *__import__("sys").argv[1:]],
              "threads": args.threads, "context": args.context,
              "step_ms": {k: {"median": 1e3 * statistics.median(v), "mean": 1e3 * statistics.fmean(v), "n": len(v)}
                          for k, v in times.items()}}

    prompts = [encode_prompt(target.tokenizer, p.as_chat(), p.chat) for p in load_eval_set(args.prompts, 8)]
    prefill = {"jetflow": 0.0, "llama": 0.0}
    for ids in prompts:
        t = time.perf_counter()
        target.prefill(ids)
        prefill["jetflow"] += time.perf_counter() - t
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        prefill["llama"] += time.perf_counter() - t
    report["prefill_s"] = {**prefill, "prompts": len(prompts), "tokens": sum(map(len, prompts))}

    row = torch.randn(target.vocab_size)
    argmax = {}
    for name, fn in (("torch", lambda: int(row.argmax())), ("numpy", lambda: int(row.numpy().argmax()))):
        fn()
        t = time.perf_counter()
        for _ in range(1000):
            fn()
        argmax[name] = (time.perf_counter() - t) / 1000 * 1e6
    report["argmax_us"] = argmax

    for k, v in report["step_ms"].items():
        print(f"{k:16s} median {v['median']:.2f} ms  mean {v['mean']:.2f} ms  ({v['n']} steps)")
    print(f"prefill of {len(prompts)} prompts ({report['prefill_s']['tokens']} tokens): "
          f"jetflow {prefill['jetflow']:.2f} s, llama-cpp-python {prefill['llama']:.2f} s")
    print(f"argmax of a {target.vocab_size}-row: torch {argmax['torch']:.0f} us, numpy {argmax['numpy']:.0f} us")
    if args.out:
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
