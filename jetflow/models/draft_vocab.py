"""Reduced draft vocabulary: the head predicts only the target tokens that actually occur.

On a small target the draft head's cost is dominated by its LM head (15 slots x 49k vocabulary for
SmolLM2). Restricting the head to the most frequent tokens of the regenerated answers (EAGLE-3 /
vLLM's ``draft_vocab_size``) cuts that cost by the same factor. Decoding stays lossless: the target
still checks every token; the head just never proposes a token outside its vocabulary.

The mapping is stored EAGLE-3 style: ``d2t[i]`` is the offset from draft id i to its target id
(``target = i + d2t[i]``) and ``t2d`` marks the target ids that have a draft id.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def token_counts(sequences: Iterable, vocab_size: int) -> np.ndarray:
    """How often each target token occurs in the answers of ``sequences`` (regenerated data)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        np.add.at(counts, np.asarray(seq.token_ids[seq.prompt_len:], dtype=np.int64), 1)
    return counts


def select_draft_vocab(counts: np.ndarray, size: int, required: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent target ids (ties by lower id), ``required`` ones always included;
    sorted ascending so ``d2t`` offsets are non-negative."""
    vocab_size = len(counts)
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    required = sorted({int(t) for t in required if 0 <= int(t) < vocab_size})
    if len(required) > size:
        raise ValueError(f"{len(required)} required tokens do not fit a draft vocabulary of {size}")
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    chosen = list(required)
    taken = set(required)
    for t in order:
        if len(chosen) == size:
            break
        if int(t) not in taken:
            chosen.append(int(t))
            taken.add(int(t))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def widened_draft_vocab(current: torch.Tensor | None, counts: np.ndarray, size: int) -> torch.Tensor | None:
    """A head's draft ids grown to ``size`` (0 or the vocabulary size: all of it): every current id
    kept, the most frequent others of ``counts`` added. None for the whole vocabulary."""
    vocab_size = len(counts)
    check_widening(None if current is None else current.numel(), size, vocab_size)
    if size == 0 or size >= vocab_size:
        return None
    return select_draft_vocab(counts, size, current.tolist())


def check_widening(current: int | None, size: int, vocab_size: int) -> None:
    """ValueError unless a draft vocabulary of ``current`` ids (None: the whole vocabulary) can grow
    to ``size`` (0 or ``vocab_size`` and above: the whole vocabulary)."""
    if size == 0 or size >= vocab_size:
        return
    if current is None:
        raise ValueError("the head already predicts the whole vocabulary; a draft vocabulary cannot grow from there")
    if size < current:
        raise ValueError(f"a draft vocabulary only grows: the head has {current} ids, asked for {size}")


def mapping_tensors(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets [Vd] int64, t2d mask [V] bool) for sorted, distinct ``draft_ids``."""
    ids = draft_ids.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size or not bool((ids[1:] > ids[:-1]).all())):
        raise ValueError("draft ids must be distinct, sorted and inside the target vocabulary")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def target_to_draft_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: the draft id of each target id, -1 where the target token has none."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    index[draft_ids] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return index
