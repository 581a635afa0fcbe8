"""How close is `jetflow eval-offline` (uniform random anchors) to tau measured by decoding?

    python benchmarks/offline_vs_online.py --drafter jetflow/drafters/smollm2-135m-instruct \
        --data data/regenerated/smollm2-mix --sequences 1771:1779 --budgets 16,64 \
        --out docs/results/offline_vs_online.json

For each sequence in the range (target-regenerated, greedy) the prompt is decoded greedily with the
drafter for as many tokens as the stored answer holds; the output must be the stored answer (else the
sequence is reported and left out). tau of that decoding is compared with the offline estimate on the
same sequences, both with random anchors and with the decoding's own round anchors (the latter must
match exactly: the same computation without the target).
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
        jf = jetflow.JetFlow(target, head, budget=budget, width=args.width)
        emitted, rounds, kept, anchors = 0, 0, [], {}
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
            pos = seq.prompt_len + torch.tensor([0] + lengths[:-1]).cumsum(0)
            anchors[index] = pos[pos <= len(seq.token_ids) - 2]
        at_rounds = offline_acceptance(head, target, sequences, teacher, kept, [budget], args.width,
                                       anchors=anchors).summary()
        uniform = offline_acceptance(head, target, sequences, teacher, kept, [budget], args.width,
                                     args.anchors_per_seq).summary()
        rows[str(budget)] = {"sequences": len(kept), "rounds": rounds, "online_tau": emitted / max(1, rounds),
                             "offline_tau_round_anchors": at_rounds["tau"][str(budget)],
                             "offline_tau_uniform_anchors": uniform["tau"][str(budget)],
                             "uniform_anchors": uniform["anchors"]}
        print(json.dumps({budget: rows[str(budget)]}))
    report = {"drafter": args.drafter, "data": args.data, "sequences": [start, end], "width": args.width,
              "budgets": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
