"""Prompt lookup: a drafter without a model. The last n tokens (anchor included) are looked up in
everything committed so far (prompt and output); the tokens that followed their most recent earlier
occurrence are proposed as a chain. Longer n-grams are tried first. It runs on any target backend
through the same tree verifier, so it is the model-free baseline on llama.cpp too."""

from __future__ import annotations

import numpy as np
import torch

from jetflow.tree.build import DraftTree

MAX_NGRAM = 3
MAX_DRAFT = 10  # transformers' prompt_lookup_num_tokens default


class ChainProposal:
    def __init__(self, root: int, draft: list[int]):
        self.root, self.draft = root, draft

    def tree(self, budget: int) -> DraftTree:
        tokens = [self.root] + self.draft[:budget]
        n = len(tokens)
        return DraftTree(tokens, list(range(-1, n - 1)), list(range(n)), [0.0] * n)


def lookup_continuation(history: np.ndarray, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    return lookup_match(history, max_ngram, max_draft)[1]


def lookup_match(history: np.ndarray, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT) -> tuple[int, list[int]]:
    """(length of the longest suffix n-gram that occurred earlier, the tokens that followed its
    latest earlier occurrence); (0, []) without a match. Runs every round of a drafter with lookup,
    so it narrows the earlier occurrences of the last token down instead of comparing every window."""
    n_hist = history.size
    if n_hist < 2:
        return 0, []
    # ends: earlier positions e (e < n_hist - 1) where an occurrence of the suffix n-gram would end
    ends = np.flatnonzero(history[:-1] == history[-1])
    best = (1, ends) if ends.size else (0, ends)
    for k in range(1, min(max_ngram, n_hist - 1)):
        ends = ends[ends >= k]
        ends = ends[history[ends - k] == history[n_hist - 1 - k]]
        if not ends.size:
            break
        best = (k + 1, ends)
    n, ends = best
    if not n:
        return 0, []
    start = int(ends[-1]) + 1  # the latest occurrence; what followed it
    return n, history[start:start + max_draft].tolist()


class LookupDrafter:
    """The :class:`jetflow.decoding.drafter.Drafter` interface over the target's committed tokens."""

    head = None

    def __init__(self, target, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT):
        self.target, self.max_ngram, self.max_draft = target, max_ngram, max_draft
        self.block_size = max_draft + 1

    def reset(self) -> None:
        pass

    def extend(self, features: torch.Tensor | None) -> None:
        pass  # reads the target's committed tokens directly

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        pass

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None) -> ChainProposal:
        history = np.asarray(self.target.token_ids + [int(anchor)], dtype=np.int64)
        draft = lookup_continuation(history, self.max_ngram, min(self.max_draft, room))
        return ChainProposal(int(anchor), draft)
