"""Early-training probe: held-out per-depth top-1 agreement of a fresh head after a few hundred
steps, for one variant of the training setup (used to compare depth weighting and head inputs).

    python benchmarks/probe_training.py --data DIR --teacher-cache CACHE --name lad-g4 \\
        --config '{"feed_last_feature": true, "depth_embedding": true, "gamma": 4.0}' --steps 200

The base setup is the shipped recipe's: batch 4, 32 anchors per sequence, 8k draft vocabulary,
lr 1e-3 with 50 warm-up steps (cosine over 8 epochs), 16 held-out sequences; --config overrides
TrainConfig fields.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from jetflow.models.target import TargetModel
from jetflow.training.trainer import TrainConfig, Trainer, load_sequences


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--teacher-cache", default=None)
    ap.add_argument("--name", required=True)
    ap.add_argument("--config", default="{}", help="JSON object of TrainConfig overrides")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    args = ap.parse_args()
    settings = {"batch_size": 4, "anchors_per_seq": 32, "draft_vocab": 8192, "eval_sequences": 16, "epochs": 8,
                "lr": 1e-3, "warmup_steps": 50, "save_every": 10**9, "eval_every": 10**9, **json.loads(args.config)}
    target = TargetModel.load(args.target)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(target, load_sequences(args.data, target), out, TrainConfig(**settings),
                          teacher_cache=args.teacher_cache)
        for step in range(1, args.steps + 1):
            trainer.train_step()
            if step % args.eval_every == 0:
                e = trainer.evaluate()
                print(json.dumps({"name": args.name, "step": step, "eval_loss": round(e["eval_loss"], 3),
                                  "top1_agreement": [round(x, 3) for x in e["top1_agreement"]]}), flush=True)


if __name__ == "__main__":
    main()
