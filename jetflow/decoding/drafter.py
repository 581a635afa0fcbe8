"""The interface the speculative loop drives a draft head through, and the runner each head kind gets.

A drafter keeps its own context in step with the target's committed tokens (``reset``, then
``extend`` with their tapped target features) and makes one proposal per round. A proposal builds a
tree of any budget, so one head pass prices every budget (see decoding/budget.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.decoding.eagle_drafter import EagleDrafter
from jetflow.decoding.mixed_drafter import MixedDrafter
from jetflow.models.backend import TargetBackend
from jetflow.models.draft_head import DraftHead
from jetflow.tree.build import DraftTree


class Proposal(Protocol):
    def tree(self, budget: int) -> DraftTree:
        """The best draft tree of ``budget`` nodes below the root (the anchor)."""


class Drafter(Protocol):
    head: DraftHead
    block_size: int  # deepest draft level + 1

    def reset(self) -> None:
        """Forget the context (a new prompt follows)."""

    def extend(self, features: torch.Tensor) -> None:
        """Append the tapped target features [n, taps*H] of newly committed tokens to the context."""

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None) -> Proposal:
        """The round's draft after ``anchor`` (at ``position``), at most ``room`` levels deep and
        ``width`` candidates per node; trees of at most ``max_nodes`` nodes will be taken from it
        (a drafter may skip work for deeper levels)."""

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """The verified tree and the accepted path (root first) of the round just proposed."""


DRAFTERS: dict[str, type[Drafter]] = {"block": BlockDrafter, "eagle3": EagleDrafter}  # head kind -> its runner


def make_drafter(head: DraftHead, target: TargetBackend, int8: bool = False, lookup: bool = False) -> Drafter:
    """The decoding-time runner of a head: one block forward per round, or EAGLE's D forwards.
    ``int8``: run a block head's matmuls with int8 weights (the lean CPU draft). ``lookup``: merge
    prompt-lookup candidates into its trees (decoding/mixed_drafter.py)."""
    options = {"int8": int8} if head.kind == "block" else {}  # EAGLE's sequential forwards stay float
    drafter = DRAFTERS[head.kind](head, target, **options)
    return MixedDrafter(drafter, target) if lookup else drafter
