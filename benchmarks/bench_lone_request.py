"""One request at a time through the batch decoder (llama.cpp) against the single-stream loop, with a
profile of the batched run: python benchmarks/bench_lone_request.py"""
import time, cProfile, pstats
import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.batch import BatchDecoder, BatchRequest
from jetflow.decoding.load_budget import LoadBudget
from jetflow.eval.datasets import load_eval_set
jf = jetflow.JetFlow.from_pretrained("smollm2-135m-instruct", "auto", backend="llamacpp", budget="auto", n_threads=2)
t = jf.target
qs = [p.request() for p in load_eval_set("gsm8k", 2)]
dec = BatchDecoder(t, jf.drafter.head, lookup=True, int8=jf.int8_draft, load_budget=LoadBudget(jf.adaptive_budget().costs), max_batch=32)
t0 = time.perf_counter(); n = 0
prof = cProfile.Profile(); prof.enable()
for q in qs:
    ids, params, out = prepare_request(t, q, max_new_tokens=64)
    r = dec.add(BatchRequest(ids, params, out, budget=None, width=7))
    while dec.active: dec.step()
    n += r.result.new_tokens
prof.disable()
print("batched lone", n / (time.perf_counter() - t0), "tok/s")
t0 = time.perf_counter(); n = 0
for q in qs:
    r = jf.generate(q, max_new_tokens=64)
    n += r.new_tokens
print("serial", n / (time.perf_counter() - t0), "tok/s")
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
