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
# How far back a match is measured, at most (the n-gram that found it included): the longer the context that
# matched, the further the target tends to follow the copy (SmolLM2 on the five headline sets: 0.85
# tokens followed on average after a 1-token match, 2.9 after 3, 4.9 after 6, 15.5 after 20 or more;
# docs/results.md, "Lookup chains priced by how much context matched").
MAX_MATCH = 20


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


def matched_length(tokens, end: int, last: int, n: int, max_length: int = MAX_MATCH) -> int:
    """How many tokens up to ``tokens[end]`` equal those up to ``tokens[last]`` (``end < last``),
    given that the last ``n`` do, at most ``max_length``."""
    length = n
    while length < max_length and end - length >= 0 and tokens[end - length] == tokens[last - length]:
        length += 1
    return length


def lookup_match(history: np.ndarray, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT) -> tuple[int, list[int]]:
    """(match length, the tokens that followed the match): the latest earlier occurrence of the
    longest suffix n-gram (n <= ``max_ngram``) is the match, and its length is how far back it agrees
    with the suffix (:func:`matched_length`, at least n); (0, []) without a match. Runs every round
    of a drafter with lookup, so it narrows the earlier occurrences of the last token down instead
    of comparing every window."""
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
    end = int(ends[-1])  # the latest occurrence; what followed it
    return matched_length(history, end, n_hist - 1, n), history[end + 1:end + 1 + max_draft].tolist()


class LookupIndex:
    """``lookup_match`` for a growing context, by dict lookups: the latest end position of every
    n-gram (n <= max_ngram) of the committed tokens, updated as they grow. A drafter with lookup
    asks every round, and scanning the whole context each time costs a plain llama.cpp step ~1%
    at a few hundred tokens (tests check it against ``lookup_match``)."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]

    def sync(self, token_ids: list[int]) -> None:
        """Follow the target's committed tokens: append what is new, or start again when they are
        another sequence (shorter, or different where they overlap at the last synced token)."""
        n = len(self.tokens)
        if len(token_ids) < n or (n and token_ids[n - 1] != self.tokens[-1]):
            self._clear()
            n = 0
        tokens, latest = self.tokens, self._latest
        for t in token_ids[n:]:
            tokens.append(int(t))
            end = len(tokens) - 1
            for k in range(1, min(self.max_ngram, end + 1) + 1):
                latest[k][tuple(tokens[end - k + 1:])] = end

    def match(self, anchor: int, max_draft: int = MAX_DRAFT) -> tuple[int, list[int]]:
        """``lookup_match(tokens + [anchor], max_ngram, max_draft)``."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            end = self._latest[n].get((*tokens[len(tokens) - n + 1:], anchor))
            if end is not None:
                draft = tokens[end + 1:end + 1 + max_draft]
                if 0 < max_draft and end + 1 + max_draft > len(tokens):
                    draft.append(anchor)  # the continuation reaches the anchor itself
                # tokens[end] == anchor: compare backwards from tokens[end - 1] and tokens[-1]
                length = 1 + matched_length(tokens, end - 1, len(tokens) - 1, n - 1, MAX_MATCH - 1) if end else 1
                return length, draft
        return 0, []


class LookupDrafter:
    """The :class:`jetflow.decoding.drafter.Drafter` interface over the target's committed tokens."""

    head = None

    def __init__(self, target, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT):
        self.target, self.max_ngram, self.max_draft = target, max_ngram, max_draft
        self.block_size = max_draft + 1
        self.index = LookupIndex(max_ngram)

    def reset(self) -> None:
        self.index = LookupIndex(self.max_ngram)

    def extend(self, features: torch.Tensor | None) -> None:
        pass  # reads the target's committed tokens directly

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        pass

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None) -> ChainProposal:
        self.index.sync(self.target.token_ids)
        return ChainProposal(int(anchor), self.index.match(int(anchor), min(self.max_draft, room))[1])
