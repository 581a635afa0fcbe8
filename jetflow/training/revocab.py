"""Grow a trained head's draft vocabulary without training.

A reduced-vocabulary head predicts only its draft ids, and a target token outside them can never be
drafted: every round whose continuation holds one stops there. The head's output rows are the
target's own LM-head rows, so the same weights can score more ids. The fifth drafter, trained on
8,192 ids (97.1% of GSM8K answer tokens), replays tau@64 +3.4% with 16,384 (99.0%) for 1.5 ms more
per draft on the CPU (docs/results.md, "A wider draft vocabulary"). The new ids are the most
frequent answer tokens of the training split the head was trained on (``jetflow train``'s split
for the same data and seed); the old ones all stay.
"""

from __future__ import annotations

from pathlib import Path

from jetflow.errors import JetFlowError
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_vocab import token_counts, widened_draft_vocab
from jetflow.training.trainer import EVAL_SEQUENCES, held_out_split, load_sequences


def widen_drafter_vocab(target, drafter: str | Path, data, size: int, out: str | Path, seed: int = 0,
                        max_sequences: int | None = None) -> dict:
    """Write ``drafter`` with a ``size``-id draft vocabulary (0: the whole vocabulary) to ``out``;
    ``seed`` and ``max_sequences``: the training run's (its split is drawn from that many sequences)."""
    head = load_drafter(drafter, target=target)
    sequences = load_sequences(data, target, max_sequences)
    _, train_split = held_out_split(len(sequences), seed, EVAL_SEQUENCES)
    counts = token_counts((sequences[i] for i in train_split), target.vocab_size)
    try:
        ids = widened_draft_vocab(head.draft_ids, counts, size)
    except ValueError as e:
        raise JetFlowError(f"{drafter}: {e}") from None
    head.with_draft_vocab(ids).save_pretrained(out)
    def covered(ids) -> float:  # share of the training answers' tokens inside a draft vocabulary
        return 1.0 if ids is None else float(counts[ids.numpy()].sum() / max(1, counts.sum()))

    return {"drafter": str(drafter), "out": str(out), "draft_vocab": [head.config.draft_vocab_size or target.vocab_size,
                                                                      size or target.vocab_size],
            "training_answer_tokens_covered": [covered(head.draft_ids), covered(ids)]}
