"""Seconds per training step of the shipped recipe with the online teacher: a micro-batch packed into
one target forward and one head forward, against the same sequences one per forward (batch 1 with
gradient accumulation: the same gradient).

    python benchmarks/bench_train_step.py --device cuda --amp bfloat16 --batch 16
    python benchmarks/bench_train_step.py --device cpu --batch 4 --threads 2

Warm start from the shipped drafter, block 8, 32 anchors, dense depth-1 term over 64 anchors.
Prints one JSON object (seconds per step and per sequence for each layout).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from jetflow.eval.machine import machine
from jetflow.models.loading import load_target
from jetflow.training.run import warm_start_head
from jetflow.training.trainer import TrainConfig, Trainer, load_sequences

DATA = ["data/regenerated/smollm2-mix", "data/regenerated/smollm2-mix2"]
DRAFTER = "jetflow/drafters/smollm2-135m-instruct"


def seconds_per_step(trainer: Trainer, steps: int) -> float:
    trainer.train_step()  # warm-up
    sync = torch.cuda.synchronize if trainer.target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--amp", default="", choices=["", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sequences", type=int, default=400, help="the first N training sequences")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(None, backend="torch", device=args.device)
    sequences = load_sequences(DATA, target, args.sequences)
    report = {"machine": machine(), "device": args.device, "amp": args.amp or "fp32", "batch": args.batch}
    for name, layout in (("packed", dict(batch_size=args.batch)),
                         ("per_sequence", dict(batch_size=1, grad_accum=args.batch))):
        config = TrainConfig(block_size=8, draft_vocab=16384, anchors_per_seq=32, lr=5e-4, warmup_steps=50, gamma=4,
                             feed_last_feature=True, depth_embedding=True, dense_depth1=1.0,
                             dense_depth1_anchors=64, layers=2, amp=args.amp, epochs=10, **layout)
        head = warm_start_head(DRAFTER, target, config)
        trainer = Trainer(target, sequences, tempfile.mkdtemp(), config, head=head)
        step = seconds_per_step(trainer, args.steps)
        report[name] = {"seconds_per_step": round(step, 4), "seconds_per_sequence": round(step / args.batch, 5)}
        print(name, report[name], flush=True)
    report["speedup"] = round(report["per_sequence"]["seconds_per_step"] / report["packed"]["seconds_per_step"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
