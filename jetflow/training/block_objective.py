"""Training the block head: all blocks of a micro-batch of sequences through the head in one forward.

The training mask (training/blocks.py) keeps the blocks from seeing each other, so one forward
equals the decoder drafting from each anchor (tested to be exactly that); the loss compares every
slot's distribution with the teacher's at the slot's position. The sequences of a micro-batch are
packed end to end (each block sees only its own sequence's prefix), so the target and the head each
run once per micro-batch rather than once per sequence: on a GPU, per-sequence forwards of a small
head are bound by kernel launches, not by arithmetic.
"""

from __future__ import annotations

import torch

from jetflow.models.draft_head import DraftHead
from jetflow.training.blocks import (BlockBatch, answer_anchors, make_blocks, pack_blocks, sample_anchors,
                                     training_mask)
from jetflow.training.losses import depth_weights, slot_losses
from jetflow.training.teacher import top1_agreement


def block_context(head: DraftHead, features: torch.Tensor,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """Fused features [T, H] of a sequence (or of sequences packed end to end, with each one's own
    rotary ``positions``) and the head's context keys/values over them."""
    fused = head.fuse(features)
    if positions is None:
        positions = torch.arange(features.shape[0])
    return fused, head.context_kv(fused, positions.to(features.device))


def blocks_forward(head: DraftHead, embed, features: torch.Tensor, blocks: BlockBatch,
                   context: tuple[torch.Tensor, list] | None = None,
                   starts: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states [K*B, H] of all blocks in one head forward: the training-time equivalent of the
    decoder drafting from each anchor (tested to be exactly that). ``context``: :func:`block_context`
    of ``features``, when several calls share it; ``starts``: each block's context start when the
    features are several packed sequences (:func:`pack_blocks`)."""
    device, size = features.device, blocks.block_size  # size: the blocks' own (2 for depth-1 blocks)
    fused, ctx = context or block_context(head, features)
    mask = training_mask(blocks.anchors, features.shape[0], size, head.config.attention == "causal",
                         starts).to(device)
    with torch.no_grad():
        embeds = embed(blocks.block_ids.to(device))
    last = fused[(blocks.anchors - 1).repeat_interleave(size).to(device)]  # before each anchor
    return head(embeds, blocks.positions.to(device), ctx, mask, last, block_size=size)


def segment_mean(values: torch.Tensor, weights: torch.Tensor, segment: torch.Tensor, count: int) -> torch.Tensor:
    """Weighted mean of ``values`` within each of ``count`` segments [count] (0 where a segment is empty)."""
    num = values.new_zeros(count).index_add(0, segment, values * weights)
    den = weights.new_zeros(count).index_add(0, segment, weights)
    return torch.where(den > 0, num / den.clamp(min=1e-12), num)


class _SequencePlan:
    """One sequence's blocks, the slots that learn, and (while training with --dense-depth1) its
    2-slot depth-1 blocks, all drawn from the sequence's own generator in a fixed order."""

    def __init__(self, trainer, index: int, generator: torch.Generator):
        c, head = trainer.config, trainer.head
        self.index, self.seq = index, trainer.sequences[index]
        tokens = torch.tensor(self.seq.token_ids)
        anchors = sample_anchors(self.seq.prompt_len, len(tokens), c.anchors_per_seq, generator)
        revealed = None
        if c.reveal > 0 and head.training:  # held-out evaluation keeps plain blocks, comparable across arms
            k = anchors.shape[0]
            shown = torch.rand(k, generator=generator) < c.reveal
            revealed = torch.where(shown, torch.randint(1, c.block_size - 1, (k,), generator=generator), 0)
        self.blocks = make_blocks(tokens, anchors, c.block_size, head.config.mask_token_id, revealed,
                                  supervise_revealed=head.config.shift_tokens)
        self.labels = self._draft_labels(trainer, self.blocks)
        # Every supervised slot, also (with sft) one whose data token the reduced vocabulary lacks:
        # its loss weight is 0, but its agreement counts as with the KL losses (the head can never
        # propose that token: a miss wherever it is the target's top-1).
        self.sel = self.blocks.loss_mask.nonzero().flatten()
        self.dense = None
        if c.dense_depth1 > 0 and head.training:  # held-out evaluation keeps the plain objective
            if c.dense_depth1_anchors:
                dense_anchors = sample_anchors(self.seq.prompt_len, len(tokens), c.dense_depth1_anchors, generator)
            else:
                dense_anchors = answer_anchors(self.seq.prompt_len, len(tokens))
            self.dense = make_blocks(tokens, dense_anchors, 2, head.config.mask_token_id)
            self.dense_labels = self._draft_labels(trainer, self.dense)
            self.dense_sel = self.dense.loss_mask.nonzero().flatten()  # every slot 1 (anchors end at len-2)

    @staticmethod
    def _draft_labels(trainer, blocks: BlockBatch) -> torch.Tensor:
        return blocks.labels if trainer.label_index is None else trainer.label_index[blocks.labels]

    def teacher_positions(self) -> torch.Tensor:
        own = self.blocks.teacher_index[self.sel]
        return own if self.dense is None else torch.cat([own, self.dense.teacher_index[self.dense_sel]])


def _packed_selection(plans, blocks_of, sel_of) -> torch.Tensor:
    """Indices into the packed blocks of every plan's selected slots, plan after plan."""
    starts = torch.tensor([0, *[len(blocks_of(p).anchors) * blocks_of(p).block_size for p in plans[:-1]]]).cumsum(0)
    return torch.cat([sel_of(p) + int(s) for p, s in zip(plans, starts)])


def block_batch_loss(trainer, items: list[tuple[int, torch.Generator]]) -> tuple[torch.Tensor, dict]:
    """Loss of each sequence [S] of a micro-batch ``items`` (sequence index, its generator), from one
    target forward and one head forward (two with --dense-depth1), and the per-depth agreement of
    the slots that learn. Sequence i's loss is the weighted mean over its own slots, plus
    ``dense_depth1`` x its mean depth-1 loss over the dense anchors, exactly as if it were alone."""
    c, head, device = trainer.config, trainer.head, trainer.target.device
    plans = [_SequencePlan(trainer, index, g) for index, g in items]
    positions = [p.teacher_positions() for p in plans]
    features, teacher, target_top1 = trainer.teacher.fetch_many([(p.index, p.seq, pos)
                                                                 for p, pos in zip(plans, positions)])
    lengths = [f.shape[0] for f in features]
    packed_features = torch.cat(features)
    context = block_context(head, packed_features, torch.cat([torch.arange(n) for n in lengths]))
    # Teacher rows are per sequence [main slots, dense slots]; split them into the two groups.
    sizes = [len(pos) for pos in positions]
    main_rows = torch.cat([torch.arange(len(p.sel)) + int(o) for p, o in
                           zip(plans, torch.tensor([0, *sizes[:-1]]).cumsum(0))]).to(device)
    segment = torch.cat([torch.full((len(p.sel),), i) for i, p in enumerate(plans)]).to(device)

    blocks, starts = pack_blocks([p.blocks for p in plans], lengths)
    hidden = blocks_forward(head, trainer.embed, packed_features, blocks, context, starts)
    sel = _packed_selection(plans, lambda p: p.blocks, lambda p: p.sel).to(device)
    logits = hidden[sel].to(trainer.lm_weight.dtype) @ trainer.lm_weight.T
    labels = torch.cat([p.labels[p.sel] for p in plans]).to(device)
    depth = torch.cat([p.blocks.depth[p.sel] for p in plans]).to(device)
    main_teacher = teacher[main_rows]
    losses = slot_losses(logits, main_teacher, labels.clamp(min=0), c.loss, c.kl_temperature)
    weights = depth_weights(depth, c.gamma)
    if c.loss == "sft":  # no label to learn where the data token is outside the draft vocabulary
        weights = weights * (labels >= 0)
    loss = segment_mean(losses, weights, segment, len(plans))
    if plans[0].dense is not None:
        loss = loss + c.dense_depth1 * _dense_depth1_loss(trainer, plans, packed_features, lengths, context,
                                                           teacher, sizes)
    agree = top1_agreement(logits.detach(), head.draft_ids, target_top1[main_rows])
    return loss, {"depth": depth.cpu(), "agree": agree.cpu(), "sequence": segment.cpu()}


def _dense_depth1_loss(trainer, plans, features, lengths, context, teacher, sizes) -> torch.Tensor:
    """Each sequence's mean depth-1 loss over its dense anchors: blocks of 2 slots [anchor, MASK] (the
    first two slots of a full block; a causal head's slot 1 sees only them and the context, so it
    equals slot 1 of a full block), one extra head forward sharing the context keys/values."""
    c, device = trainer.config, trainer.target.device
    offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    rows = torch.cat([torch.arange(len(p.sel), sizes[i]) + int(offsets[i]) for i, p in enumerate(plans)]).to(device)
    segment = torch.cat([torch.full((len(p.dense_sel),), i) for i, p in enumerate(plans)]).to(device)
    blocks, starts = pack_blocks([p.dense for p in plans], lengths)
    hidden = blocks_forward(trainer.head, trainer.embed, features, blocks, context, starts)
    sel = _packed_selection(plans, lambda p: p.dense, lambda p: p.dense_sel).to(device)
    logits = hidden[sel].to(trainer.lm_weight.dtype) @ trainer.lm_weight.T
    labels = torch.cat([p.dense_labels[p.dense_sel] for p in plans]).to(device)
    losses = slot_losses(logits, teacher[rows], labels.clamp(min=0), c.loss, c.kl_temperature)
    weights = (labels >= 0).float() if c.loss == "sft" else torch.ones_like(losses)
    return segment_mean(losses, weights, segment, len(plans))
