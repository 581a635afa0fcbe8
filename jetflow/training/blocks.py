"""Turning a regenerated sequence into draft-head training blocks.

For an anchor at position a, the block is ``[token a, MASK x (B-1)]`` at positions a..a+B-1. It sees
the target features of positions < a (what the decoder would have committed), and inside the block
it is causal (JetFlow) or bidirectional (DFlash); blocks of the same sequence never see each other,
so all of them train in one forward. Slot k >= 1 learns the token at position a+k, whose teacher is
the target's next-token distribution at position a+k-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetflow.models.layers import BlockMask


@dataclass
class BlockBatch:
    anchors: torch.Tensor  # [K] anchor positions
    block_ids: torch.Tensor  # [K*B] input tokens (anchor, then MASK ids)
    positions: torch.Tensor  # [K*B] absolute positions a+j
    teacher_index: torch.Tensor  # [K*B] sequence position whose target distribution teaches the slot
    labels: torch.Tensor  # [K*B] the regenerated token at a+j (SFT label)
    loss_mask: torch.Tensor  # [K*B] bool: slot j >= 1 and a+j inside the answer
    depth: torch.Tensor  # [K*B] slot index j (0 = anchor)

    @property
    def block_size(self) -> int:
        """Slots per block, B."""
        return self.positions.shape[0] // max(1, self.anchors.shape[0])


def sample_anchors(prompt_len: int, seq_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` distinct anchor positions in [prompt_len, seq_len-2], sorted (every anchor has
    at least one answer token after it)."""
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    n = hi - lo + 1
    picks = torch.randperm(n, generator=generator)[: min(count, n)]
    return (picks + lo).sort().values


def make_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                revealed: torch.Tensor | None = None, supervise_revealed: bool = False) -> BlockBatch:
    """Blocks for one sequence ``tokens`` [T] (prompt + answer) and its ``anchors`` [K].

    ``revealed`` [K]: in block i, slots 1..revealed[i] hold the sequence's own next tokens instead
    of MASK and are not supervised (unless ``supervise_revealed``: a head that shifts tokens never
    reads a slot's own token, so a revealed slot can still learn it). Those blocks train the head's
    second, path-conditioned pass (decoding/refine.py), where the slots after a draft path's tokens
    predict what follows that path."""
    seq_len = tokens.shape[0]
    j = torch.arange(block_size)
    pos = (anchors[:, None] + j[None, :]).flatten()
    depth = j.repeat(anchors.shape[0])
    inside = pos < seq_len
    labels = torch.where(inside, tokens[pos.clamp(max=seq_len - 1)], torch.zeros_like(pos))
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[depth == 0] = tokens[anchors]
    supervised = inside & (depth > 0)
    if revealed is not None:
        shown = (depth >= 1) & (depth <= revealed.repeat_interleave(block_size)) & inside
        block_ids = torch.where(shown, labels, block_ids)
        if not supervise_revealed:
            supervised &= ~shown
    return BlockBatch(anchors, block_ids, pos, (pos - 1).clamp(min=0), labels, supervised, depth)


def answer_anchors(prompt_len: int, seq_len: int) -> torch.Tensor:
    """Every anchor with a token after it: positions prompt_len..seq_len-2."""
    return torch.arange(prompt_len, max(prompt_len, seq_len - 1))


def training_mask(anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool,
                  starts: torch.Tensor | None = None) -> BlockMask:
    """The mask of K blocks over [context positions 0..T-1, all K*B block slots]: each slot sees the
    prefix before its own anchor and the slots of its own block (causal: those up to itself).
    ``starts`` [K]: where each block's sequence begins in a context of several sequences packed one
    after another (:func:`pack_blocks`); a block then sees context positions starts..anchor-1."""
    col = torch.arange(seq_len)[None, :]
    ctx = col < anchors.repeat_interleave(block_size)[:, None]  # [K*B, T]
    if starts is not None:
        ctx &= col >= starts.repeat_interleave(block_size)[:, None]
    inner = torch.ones(block_size, block_size, dtype=torch.bool)
    return BlockMask(ctx, inner.tril() if causal else inner)


def pack_blocks(blocks: list[BlockBatch], lengths: list[int]) -> tuple[BlockBatch, torch.Tensor]:
    """The blocks of several sequences as one batch over their contexts laid end to end (sequence
    i's positions start at sum(lengths[:i])): anchors move to packed coordinates, positions (the
    rotary ones) stay each sequence's own. Returns the batch and each block's context start [K]."""
    offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    shift = torch.cat([torch.full((len(b.anchors),), int(o)) for b, o in zip(blocks, offsets)])
    cat = lambda name: torch.cat([getattr(b, name) for b in blocks])  # noqa: E731
    packed = BlockBatch(cat("anchors") + shift, cat("block_ids"), cat("positions"), cat("teacher_index"),
                        cat("labels"), cat("loss_mask"), cat("depth"))
    return packed, shift
