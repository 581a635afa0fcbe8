"""Training the block head: all K blocks of a sequence through the head in one forward.

The training mask (training/blocks.py) keeps the blocks from seeing each other, so one forward
equals the decoder drafting from each anchor (tested to be exactly that); the loss compares every
slot's distribution with the teacher's at the slot's position.
"""

from __future__ import annotations

import torch

from jetflow.models.draft_head import DraftHead
from jetflow.training.blocks import BlockBatch, answer_anchors, make_blocks, sample_anchors, training_mask
from jetflow.training.losses import block_loss, slot_losses


def block_context(head: DraftHead, features: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Fused features [T, H] of a sequence and the head's context keys/values over them."""
    fused = head.fuse(features)
    return fused, head.context_kv(fused, torch.arange(features.shape[0], device=features.device))


def blocks_forward(head: DraftHead, embed, features: torch.Tensor, blocks: BlockBatch,
                   context: tuple[torch.Tensor, list] | None = None) -> torch.Tensor:
    """Hidden states [K*B, H] of all blocks of one sequence in one head forward: the training-time
    equivalent of the decoder drafting from each anchor (tested to be exactly that). ``context``:
    :func:`block_context` of ``features``, when several calls share it."""
    device, size = features.device, blocks.block_size  # size: the blocks' own (2 for depth-1 blocks)
    fused, ctx = context or block_context(head, features)
    mask = training_mask(blocks.anchors, features.shape[0], size, head.config.attention == "causal").to(device)
    with torch.no_grad():
        embeds = embed(blocks.block_ids.to(device))
    last = fused[(blocks.anchors - 1).repeat_interleave(size).to(device)]  # before each anchor
    return head(embeds, blocks.positions.to(device), ctx, mask, last, block_size=size)


def dense_depth1_loss(trainer, index: int, seq, tokens: torch.Tensor, features: torch.Tensor, context,
                      generator: torch.Generator) -> torch.Tensor:
    """Mean depth-1 loss over every answer anchor of the sequence (or ``dense_depth1_anchors`` random
    ones): blocks of 2 slots [anchor, MASK] (the first two slots of a full block; a causal head's slot
    1 sees only them and the context, so it equals slot 1 of a full block), one extra head forward
    sharing the context keys/values."""
    c, head, device = trainer.config, trainer.head, trainer.target.device
    if c.dense_depth1_anchors:
        anchors = sample_anchors(seq.prompt_len, len(tokens), c.dense_depth1_anchors, generator)
    else:
        anchors = answer_anchors(seq.prompt_len, len(tokens))
    blocks = make_blocks(tokens, anchors, 2, head.config.mask_token_id)
    sel = blocks.loss_mask.nonzero().flatten()  # every slot 1 (anchors end at len-2)
    labels = blocks.labels if trainer.label_index is None else trainer.label_index[blocks.labels]
    _, teacher = trainer.teacher.fetch(index, seq, blocks.teacher_index[sel])
    hidden = blocks_forward(head, trainer.embed, features, blocks, context)
    logits = hidden[sel.to(device)].to(trainer.lm_weight.dtype) @ trainer.lm_weight.T
    labels = labels[sel].to(device)
    usable = labels >= 0
    if c.loss == "sft" and not usable.any():
        return logits.sum() * 0.0
    losses = slot_losses(logits, teacher, labels.clamp(min=0), c.loss, c.kl_temperature)
    return losses[usable].mean() if c.loss == "sft" else losses.mean()


def block_sequence_loss(trainer, index: int, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Loss and per-depth agreement of one sequence: the blocks of ``anchors_per_seq`` random answer
    anchors."""
    c, head, device = trainer.config, trainer.head, trainer.target.device
    seq = trainer.sequences[index]
    tokens = torch.tensor(seq.token_ids)
    anchors = sample_anchors(seq.prompt_len, len(tokens), c.anchors_per_seq, generator)
    revealed = None
    if c.reveal > 0 and head.training:  # held-out evaluation keeps plain blocks, comparable across arms
        k = anchors.shape[0]
        shown = torch.rand(k, generator=generator) < c.reveal
        revealed = torch.where(shown, torch.randint(1, c.block_size - 1, (k,), generator=generator), 0)
    blocks = make_blocks(tokens, anchors, c.block_size, head.config.mask_token_id, revealed,
                         supervise_revealed=head.config.shift_tokens)
    labels = blocks.labels if trainer.label_index is None else trainer.label_index[blocks.labels]
    usable = blocks.loss_mask & (labels >= 0) if c.loss == "sft" else blocks.loss_mask
    sel = usable.nonzero().flatten()
    features, teacher = trainer.teacher.fetch(index, seq, blocks.teacher_index[sel])
    context = block_context(head, features)
    hidden = blocks_forward(head, trainer.embed, features, blocks, context)
    logits = hidden[sel.to(device)].to(trainer.lm_weight.dtype) @ trainer.lm_weight.T
    ones = torch.ones(len(sel), dtype=torch.bool, device=device)
    loss = block_loss(logits, teacher, labels[sel].to(device), ones, blocks.depth[sel].to(device),
                      c.loss, c.kl_temperature, c.gamma)
    if c.dense_depth1 > 0 and head.training:  # held-out evaluation keeps the plain objective, comparable across arms
        loss = loss + c.dense_depth1 * dense_depth1_loss(trainer, index, seq, tokens, features, context, generator)
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float()
    return loss, {"depth": blocks.depth[sel], "agree": agree.detach().cpu()}
