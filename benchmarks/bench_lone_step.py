"""One-token decode steps of a lone sequence: in the batched llama.cpp context (1 and 32 streams) and
in the single-sequence target: python benchmarks/bench_lone_step.py"""
import time, torch, numpy as np
from jetflow.models.loading import load_target
from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget
t = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=2)
prompt = list(range(1000, 1090))
for max_seqs in (1, 32):
    b = LlamaCppBatchedTarget(t, max_seqs=max_seqs)
    sid, out = b.join(prompt)
    tok = int(out.logits[-1].argmax())
    ts = []
    for i in range(60):
        t0 = time.perf_counter(); o = b.verify({sid: ([tok], [-1])}); b.commit({sid: [0]}); ts.append(time.perf_counter() - t0)
        tok = int(o[sid].logits[-1].argmax())
    print("batched max_seqs", max_seqs, "ms/step", np.median(ts) * 1e3)
    b.close()
t.prefill(prompt); tok = 5; ts = []
for i in range(60):
    t0 = time.perf_counter(); o = t.verify([tok], [-1]); t.commit([0]); ts.append(time.perf_counter() - t0)
    tok = int(o.logits[-1].argmax())
print("solo ms/step", np.median(ts) * 1e3)
