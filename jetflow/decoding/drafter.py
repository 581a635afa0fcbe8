"""The interface the speculative loop drives a draft head through, and the runner each head kind gets.

A drafter keeps its own context in step with the target's committed tokens (``reset``, then
``extend`` with their tapped target features) and makes one proposal per round. A proposal builds a
tree of any budget, so one head pass prices every budget (see decoding/budget.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from jetflow.decoding.block_drafter import BlockDrafter, head_logprobs_many
from jetflow.decoding.refine import refined_proposals
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


def make_drafter(head: DraftHead, target: TargetBackend, int8: bool = False, lookup: bool = False,
                 refine: bool | int | str | None = None) -> Drafter:
    """The decoding-time runner of a head: one block forward per round, or EAGLE's D forwards.
    ``int8``: run a block head's matmuls with int8 weights (the lean CPU draft). ``lookup``: merge
    prompt-lookup candidates into its trees (decoding/mixed_drafter.py). ``refine``: a block head's
    path-conditioned second pass (decoding/refine.py; None: when the head was trained for it)."""
    # EAGLE's sequential forwards stay float
    options = {"int8": int8, "refine": refine} if head.kind == "block" else {}
    drafter = DRAFTERS[head.kind](head, target, **options)
    return MixedDrafter(drafter, target) if lookup else drafter


def propose_many(drafters: list[Drafter], anchors: list[int], positions: list[int], rooms: list[int],
                 widths: list[int], max_nodes: list[int | None]) -> list[Proposal]:
    """Each drafter's :meth:`Drafter.propose`, with the float block-head drafters of one head (one
    per request of a batch) sharing ONE head forward; other drafters propose one by one."""
    proposals: list[Proposal | None] = [None] * len(drafters)
    base = [d.primary if isinstance(d, MixedDrafter) else d for d in drafters]
    groups: dict[tuple[int, int], list[int]] = {}  # (head, path passes) -> requests
    for i, d in enumerate(base):
        # int8 drafts quantize each call's activations with one scale: batched, a request's draft
        # would depend on its batch-mates, so they run one by one.
        # The tree-conditioned pass (one tree of slots per request) runs one by one; path passes batch.
        if isinstance(d, BlockDrafter) and not d.int8 and not d.refine_tree:
            groups.setdefault((id(d.head), d.refine), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        depths = [min(rooms[i], max_nodes[i]) if max_nodes[i] is not None else rooms[i] for i in members]
        logprobs = head_logprobs_many([base[i] for i in members], [anchors[i] for i in members],
                                      [positions[i] for i in members], depths)
        heads = {i: base[i].proposal(lp[:rooms[i]], anchors[i], widths[i]) for i, lp in zip(members, logprobs)}
        refined = [i for i in members if base[i].refine and heads[i].depth_logprobs.shape[0] >= 2]
        if refined:  # as BlockDrafter.propose: the path-conditioned passes, batched too
            heads.update(zip(refined, refined_proposals(
                [base[i] for i in refined], [anchors[i] for i in refined], [positions[i] for i in refined],
                [heads[i].depth_logprobs for i in refined], [widths[i] for i in refined], base[refined[0]].refine)))
        for i, head in heads.items():
            d = drafters[i]
            proposals[i] = (d.propose(anchors[i], positions[i], rooms[i], widths[i], max_nodes[i], primary=head)
                            if isinstance(d, MixedDrafter) else head)
    for i, d in enumerate(drafters):
        if proposals[i] is None:
            proposals[i] = d.propose(anchors[i], positions[i], rooms[i], widths[i], max_nodes[i])
    return proposals
