"""What a single-stream target keeps between requests so that a prompt extending the previous one (a
chat's next turn, a shared system prompt) computes only its new tokens: the length of the prefix a
new prompt shares with the committed tokens, and the tapped features of those committed tokens, which a
drafter reads for the part of a prompt that is not computed again."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def shared_prefix_length(held: Sequence[int], ids: np.ndarray, limit: int) -> int:
    """How many leading tokens of ``ids`` equal those of ``held``, counting at most ``limit``."""
    n = min(limit, len(held), ids.size)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(held[:n], dtype=ids.dtype) != ids[:n])
    return int(differ[0]) if differ.size else n


class CommittedFeatures:
    """Tapped target features [n, taps*H] of the first ``length`` committed tokens.

    Rows are added as tokens are committed with their features (a prefill's chunks, a verify's accepted
    path). A commit without features (a plain step of ``auto`` that settled against drafting) ends the
    rows: later rows would leave a gap, so they are not taken until the rows are cut back to where the
    committed tokens and the rows agree again.
    """

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._chunks: list[torch.Tensor] = []
        self.length = 0

    def follows(self, start: int) -> bool:
        """Whether rows for the committed tokens from position ``start`` on would be kept (a commit
        checks before it gathers an accepted path's rows)."""
        return start == self.length

    def add(self, start: int, rows: torch.Tensor | None) -> None:
        """The features of the committed tokens from position ``start`` on (ignored unless they follow
        the rows held, and for None: a commit without features)."""
        if rows is not None and self.follows(start) and rows.shape[0]:
            self._chunks.append(rows)
            self.length += rows.shape[0]

    def replace_tail(self, rows: torch.Tensor) -> None:
        """New rows for the last ``len(rows)`` tokens held (recomputed as a fresh prefill computes them)."""
        k = rows.shape[0]
        if not 0 < k <= self.length:
            raise ValueError(f"features are held for {self.length} tokens: cannot replace the last {k}")
        self.truncate(self.length - k)
        self._chunks.append(rows)
        self.length += k

    def truncate(self, n: int) -> None:
        """Keep the rows of the first ``n`` tokens."""
        if n >= self.length:
            return
        rows = self.rows(n)
        self._chunks = [rows] if n else []
        self.length = n

    def rows(self, n: int) -> torch.Tensor:
        """The rows of the first ``n`` tokens (``n <= length``), as one tensor."""
        if n > self.length:
            raise ValueError(f"features are held for {self.length} tokens, not {n}")
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0][:n] if self._chunks else torch.empty(0)


MIN_SHARED = 16  # shortest shared prompt prefix a batching server starts a request from
DEFAULT_PREFIX_SLOTS = 4  # entries of a batching server's prefix cache (llama.cpp: each a KV stream)


class PrefixEntries:
    """The entries of a batching server's prefix cache (recent prompts and finished conversations,
    each anything with ``token_ids``), least recently used first, and the choices both backends make
    about them: which entry a joining prompt starts from, and which one a new entry replaces."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: list = []

    def best(self, prompt: np.ndarray) -> tuple[object | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and how many leading tokens that is,
        now the most recently used; (None, 0) when fewer than ``MIN_SHARED``. At least the last
        prompt token is left to compute: its logits are needed."""
        best, m = None, 0
        for entry in reversed(self.entries):  # on a tie the most recent, so the oldest stays the oldest
            k = shared_prefix_length(entry.token_ids, prompt, prompt.size - 1)
            if k > m:
                best, m = entry, k
        if m < MIN_SHARED:
            return None, 0
        self.touch(best)
        return best, m

    def touch(self, entry) -> None:
        self.entries.remove(entry)
        self.entries.append(entry)

    def make_room(self, tokens: list[int]) -> tuple[bool, object | None]:
        """Before keeping ``tokens``: (False, None) when not worth it, too short ever to be offered or
        already held by an entry (which is then the most recently used); else (True, the entry to
        replace, or None while there is room): an entry the new one extends (a chat's previous turn),
        else the least recently used once the cache is full. The replaced entry is taken out."""
        if self.capacity <= 0 or len(tokens) <= MIN_SHARED:
            return False, None
        for entry in self.entries:
            if entry.token_ids[:len(tokens)] == tokens:
                self.touch(entry)
                return False, None
        extended = [e for e in self.entries if tokens[:len(e.token_ids)] == e.token_ids]
        victim = extended[0] if extended else self.entries[0] if len(self.entries) >= self.capacity else None
        if victim is not None:
            self.entries.remove(victim)
        return True, victim

    def add(self, entry) -> None:
        self.entries.append(entry)
