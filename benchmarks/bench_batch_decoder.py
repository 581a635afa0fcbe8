"""Batched decoding without HTTP: B GSM8K requests decoded together by one BatchDecoder.

    python benchmarks/bench_batch_decoder.py --requests 32 --budget auto [--backend llamacpp] [--profile]

Prints tokens/s over all requests, milliseconds per step, per-request tau and, with --profile, the
functions that took the time (cProfile, by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.batch import BatchDecoder, BatchRequest
from jetflow.decoding.load_budget import LoadBudget
from jetflow.eval.datasets import load_eval_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--budget", default="auto", help="'auto' (the load budget) or draft nodes per request")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--backend", default="torch", choices=["torch", "llamacpp"])
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    jf = jetflow.JetFlow.from_pretrained("smollm2-135m-instruct", "auto", backend=args.backend, budget="auto",
                                         n_threads=args.threads)
    target = jf.target
    load = LoadBudget(jf.adaptive_budget().costs) if args.budget == "auto" else None
    decoder = BatchDecoder(target, jf.drafter.head, lookup=True, load_budget=load, max_batch=args.requests,
                           prefix_slots=0)  # every request prefills in full
    requests = []
    for prompt in load_eval_set("gsm8k", args.requests):
        ids, params, output = prepare_request(target, prompt.request(), max_new_tokens=args.max_new_tokens)
        budget = None if args.budget == "auto" else int(args.budget)
        requests.append(BatchRequest(ids, params, output, budget=budget, width=jf.width))
    t_prefill = time.perf_counter()
    decoder.add_many(requests)  # all prompts prefilled together
    prefill_s = time.perf_counter() - t_prefill
    profiler = cProfile.Profile() if args.profile else None
    t0, steps = time.perf_counter(), 0
    if profiler:
        profiler.enable()
    while decoder.active:
        decoder.step()
        steps += 1
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - t0
    tokens = sum(r.result.new_tokens for r in requests)
    print(json.dumps({"requests": args.requests, "budget": args.budget, "steps": steps, "tokens": tokens,
                      "tokens_per_s": tokens / seconds, "prefill_s": prefill_s,
                      "prompt_tokens": sum(len(r.prompt_ids) for r in requests), "ms_per_step": seconds / max(1, steps) * 1e3,
                      "draft_ms_per_step": sum(r.result.stats["time_split"].get("draft", 0.0) for r in requests)
                      / max(1, steps) * 1e3,
                      "tau": [None if r.result.stats["tau"] is None else round(r.result.stats["tau"], 2)
                              for r in requests]}))
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
