"""One request at a time through the batch decoder against the single-stream loop (what `jetflow
serve` runs for one client with --max-batch 32 and with --max-batch 1), both with `--budget auto`,
interleaved prompt by prompt so that machine drift hits both alike:

    python benchmarks/bench_lone_request.py --backend torch --prompts 20 [--profile]
"""
import argparse
import cProfile
import json
import pstats
import sys
import time

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.batch import BatchDecoder, BatchRequest
from jetflow.decoding.load_budget import LoadBudget
from jetflow.eval.datasets import load_eval_set

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="torch", choices=["torch", "llamacpp"])
ap.add_argument("--dataset", default="gsm8k")
ap.add_argument("--prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=64)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--profile", action="store_true", help="cProfile the batched runs")
ap.add_argument("--out", default=None)
args = ap.parse_args()

jf = jetflow.JetFlow.from_pretrained("smollm2-135m-instruct", "auto", backend=args.backend, budget="auto",
                                     n_threads=args.threads)
t = jf.target
t.prefix_cache = False  # every method prefills in full, as in jetflow bench
dec = BatchDecoder(t, jf.drafter.head, lookup=jf.lookup, int8=jf.int8_draft,
                   load_budget=LoadBudget(jf.adaptive_budget().costs), max_batch=32)
prof = cProfile.Profile()
qs = [p.request() for p in load_eval_set(args.dataset, args.prompts)]
jf.generate(qs[0], max_new_tokens=8)  # warm-up of both paths
totals = {"batched": [0, 0.0], "single": [0, 0.0]}
split = {"batched": {}, "single": {}}  # rounds, tree nodes, round kinds and seconds per phase, summed


def add_split(kind, stats):
    acc = split[kind]
    acc["rounds"] = acc.get("rounds", 0) + stats["rounds"]
    acc["tree_nodes"] = acc.get("tree_nodes", 0) + stats["mean_tree_size"] * stats["rounds"]
    for key in ("time_split", "round_kinds"):
        sums = acc.setdefault(key, {})
        for k, v in stats[key].items():
            sums[k] = sums.get(k, 0) + v

same = 0
for q in qs:
    ids, params, out = prepare_request(t, q, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    if args.profile:
        prof.enable()
    r = dec.add(BatchRequest(ids, params, out, budget=None, width=jf.width))
    while dec.active:
        dec.step()
    if args.profile:
        prof.disable()
    totals["batched"][0] += r.result.new_tokens
    totals["batched"][1] += time.perf_counter() - t0
    add_split("batched", r.result.stats)
    t0 = time.perf_counter()
    s = jf.generate(q, max_new_tokens=args.max_new_tokens)
    totals["single"][0] += s.new_tokens
    totals["single"][1] += time.perf_counter() - t0
    add_split("single", s.stats)
    same += r.result.token_ids == s.token_ids
report = {k: {"tokens": n, "seconds": round(sec, 2), "tokens_per_s": round(n / sec, 2)} for k, (n, sec) in totals.items()}
for k, acc in split.items():
    acc["time_split"] = {p: round(v, 2) for p, v in acc["time_split"].items()}
    acc["tree_nodes"] = round(acc["tree_nodes"])
    report[k].update(acc)
report["batched_over_single"] = round(report["batched"]["tokens_per_s"] / report["single"]["tokens_per_s"], 4)
report["identical_outputs"] = f"{same}/{len(qs)}"
report["command"] = " ".join(["python", *sys.argv])
print(json.dumps(report, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
if args.profile:
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
