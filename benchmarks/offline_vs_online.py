"""How close is `jetflow eval-offline` (uniform random anchors) to tau measured by decoding?

    python benchmarks/offline_vs_online.py --drafter jetflow/drafters/smollm2-135m-instruct \
        --data data/regenerated/smollm2-mix --sequences 1771:1779 --budgets 16,64 \
        --out docs/results/offline_vs_online.json

For each sequence in the range (target-regenerated, greedy) the prompt is decoded greedily with the
drafter for as many tokens as the stored answer holds; the output must be the stored answer (else the
sequence is reported and left out). tau of that decoding is compared with `eval-offline`'s replay of
decoding (rounds where decoding puts them; it should match up to the last round of each sequence,
which decoding may draft past the stored answer) and with uniform random anchors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jetflow  # noqa: E402
from jetflow.eval.offline_acceptance import offline_acceptance, parse_range  # noqa: E402
from jetflow.models.target import TargetModel  # noqa: E402
from jetflow.training.teacher import OnlineTeacher  # noqa: E402
from jetflow.training.trainer import load_sequences  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--sequences", required=True, help="START:END")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--anchors-per-seq", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    target = TargetModel.load(args.target)
    head = jetflow.DraftHead.from_pretrained(args.drafter, target=target, dtype=torch.float32)
    sequences = load_sequences(args.data, target)
    start, end = parse_range(args.sequences, len(sequences))
    teacher = OnlineTeacher(target, None)
    rows = {}
    for budget in budgets:
        jf = jetflow.JetFlow(target, head, budget=budget, width=args.width, lookup=False)  # what the replay models
        emitted, rounds, kept = 0, 0, []
        for index in range(start, end):
            seq = sequences[index]
            answer = seq.token_ids[seq.prompt_len:]
            out = jf.generate(seq.token_ids[:seq.prompt_len], max_new_tokens=len(answer))
            if out.token_ids != answer[:len(out.token_ids)]:
                print(f"sequence {index}: decoding differs from the stored answer; left out", file=sys.stderr)
                continue
            kept.append(index)
            lengths = out.stats["accept_lengths"]
            emitted, rounds = emitted + sum(lengths), rounds + len(lengths)
        replay = offline_acceptance(head, target, sequences, teacher, kept, [budget], args.width).summary()
        uniform = offline_acceptance(head, target, sequences, teacher, kept, [budget], args.width,
                                     args.anchors_per_seq).summary()
        rows[str(budget)] = {"sequences": len(kept), "online_rounds": rounds, "online_tau": emitted / max(1, rounds),
                             "replay_rounds": replay["rounds"][str(budget)],
                             "replay_tau": replay["tau"][str(budget)],
                             "uniform_anchors": uniform["rounds"][str(budget)],
                             "uniform_tau": uniform["tau"][str(budget)]}
        print(json.dumps({budget: rows[str(budget)]}))
    report = {"drafter": args.drafter, "data": args.data, "sequences": [start, end], "width": args.width,
              "budgets": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
