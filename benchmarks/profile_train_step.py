"""Time and profile training steps of the shipped recipe (warm start from the shipped drafter, 32
anchors, dense depth-1 term, 8k draft vocabulary) on a teacher cache, in fp32 or with autocast:

    jetflow cache-teacher --dtype bfloat16 --data data/regenerated/smollm2-mix2 --max-sequences 64 \\
        --part-size 64 --out runs/tc-bf16
    python benchmarks/profile_train_step.py --cache runs/tc-bf16 [--amp bfloat16]

Prints the wall time of --steps steps (after one warm-up step) and the torch profiler's top ops.
"""
import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from jetflow.models.checkpoint import load_drafter
from jetflow.models.loading import load_target
from jetflow.training.trainer import Trainer, TrainConfig, load_sequences

ap = argparse.ArgumentParser()
ap.add_argument("--cache", required=True, help="a teacher cache of the first N sequences of --data")
ap.add_argument("--data", default="data/regenerated/smollm2-mix2")
ap.add_argument("--sequences", type=int, default=64)
ap.add_argument("--amp", default="", choices=["", "bfloat16"])
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()

torch.set_num_threads(args.threads)
target = load_target("smollm2-135m-instruct", backend="torch")
sequences = load_sequences([args.data], target, args.sequences)
config = TrainConfig(draft_vocab=8192, anchors_per_seq=32, lr=1e-3, warmup_steps=50, gamma=4, feed_last_feature=True,
                     depth_embedding=True, dense_depth1=1.0, amp=args.amp)
head = load_drafter("jetflow/drafters/smollm2-135m-instruct", target=target, dtype=torch.float32)
trainer = Trainer(target, sequences, tempfile.mkdtemp(), config, head=head, teacher_cache=args.cache)
trainer.train_step()  # warm-up
t0 = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(args.steps):
        trainer.train_step()
print(f"{args.steps} steps ({args.amp or 'fp32'}): {time.perf_counter() - t0:.2f} s")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
