"""Distillation losses of the draft head against the target, per block slot.

``fkl`` (default): KL(teacher || draft) at temperature T, scaled by T^2 as usual for distillation;
``sft``: cross-entropy on the regenerated tokens; ``rkl``: KL(draft || teacher). Optional depth
weights ``w_k = exp(-(k-1)/gamma)`` (gamma = 0: uniform) favour the first slots, which decide
acceptance most.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

LOSSES = ("fkl", "sft", "rkl")


def depth_weights(depth: torch.Tensor, gamma: float) -> torch.Tensor:
    if gamma <= 0:
        return torch.ones_like(depth, dtype=torch.float32)
    return torch.exp(-(depth.float() - 1) / gamma)


def slot_losses(draft_logits: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor,
                kind: str, temperature: float = 1.0) -> torch.Tensor:
    """Loss of every slot, [N], from draft logits [N, V] and the teacher's logits or log-probabilities
    [N, V] (the same thing after the softmax; unused by sft)."""
    if kind == "sft":
        return F.cross_entropy(draft_logits.float(), labels, reduction="none")
    if kind not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {kind!r}")
    t = temperature
    log_q = (draft_logits.float() / t).log_softmax(-1)
    log_p = (teacher.float() / t).log_softmax(-1)
    if kind == "fkl":
        p = log_p.exp()  # tokens the teacher rules out (-inf logits) add nothing, not 0 * -inf = NaN
        kl = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    else:
        kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    return kl * t * t


def block_loss(draft_logits, teacher, labels, loss_mask, depth, kind="fkl", temperature=1.0,
               gamma=0.0) -> torch.Tensor:
    """Weighted mean of the slot losses over the slots in ``loss_mask``."""
    sel = loss_mask.nonzero().flatten()
    if sel.numel() == 0:
        return draft_logits.sum() * 0.0
    losses = slot_losses(draft_logits[sel], teacher[sel] if teacher is not None else None, labels[sel], kind,
                         temperature)
    w = depth_weights(depth[sel], gamma)
    return (losses * w).sum() / w.sum()


