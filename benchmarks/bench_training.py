"""Training throughput: the offline teacher cache against the online teacher, full against reduced
draft vocabulary.

    python benchmarks/bench_training.py --data data/regenerated/smollm2-mix --sequences 40

Builds a teacher cache for the first N sequences (tokens/s), then times training steps (seconds per
sequence) for: cached teacher + reduced vocabulary, cached teacher + full vocabulary, online teacher
+ reduced vocabulary. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from jetflow.eval.machine import machine
from jetflow.models.target import TargetModel
from jetflow.training.teacher_cache import build_teacher_cache
from jetflow.training.trainer import TrainConfig, Trainer, load_sequences


def seconds_per_sequence(trainer: Trainer, steps: int) -> float:
    trainer.train_step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - t0) / (steps * trainer.config.batch_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--sequences", type=int, default=40)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--anchors-per-seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = TargetModel.load(args.target)
    seqs = load_sequences(args.data, target)[: args.sequences]
    tokens = sum(len(s.token_ids) for s in seqs)
    result = {"machine": machine(), "threads": torch.get_num_threads(), "sequences": len(seqs), "tokens": tokens}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build_teacher_cache(target, seqs, Path(tmp) / "cache", top_k=32, progress=False)
        result["cache_tokens_per_s"] = tokens / (time.perf_counter() - t0)
        print(f"teacher cache: {result['cache_tokens_per_s']:.0f} tokens/s")
        for name, vocab, cache in (("cached_reduced_vocab", args.draft_vocab, True), ("cached_full_vocab", 0, True),
                                   ("online_reduced_vocab", args.draft_vocab, False)):
            cfg = TrainConfig(batch_size=4, anchors_per_seq=args.anchors_per_seq, draft_vocab=vocab, eval_sequences=1,
                              save_every=10**9, eval_every=10**9, epochs=100)
            trainer = Trainer(target, seqs, Path(tmp) / name, cfg, teacher_cache=Path(tmp) / "cache" if cache else None)
            result[f"{name}_s_per_seq"] = seconds_per_sequence(trainer, args.steps)
            print(f"{name}: {result[f'{name}_s_per_seq']:.3f} s per sequence")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
