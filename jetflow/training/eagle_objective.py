"""Training the EAGLE-3-style head with "training-time test": the head is unrolled on its own states.

Step 0 is teacher-forced on the target: position t gets (token t, target feature of t-1) and predicts
token t+1. At unroll step j >= 1, position t gets (token t, the head's own step-(j-1) state at t-1):
it is the j-th draft token of a chain anchored at position t-j, exactly as in decoding. Its keys
are the step-0 keys of positions <= t-j (the context the target had verified) and, on its chain,
the step-i key of position t-(j-i) for i = 1..j (its draft ancestors and itself), so all chains of
a sequence train in ``steps`` forwards. Like the block head, each sequence trains the chains of K
random anchors (``anchors_per_seq``); K = the whole answer is EAGLE-3's full unroll. Tokens stay the regenerated
ones (accepted draft tokens are the target's tokens). Step j's loss has depth j+1; the depth
weights exp(-(k-1)/gamma) with gamma = -1/ln(0.8) ~ 4.48 give EAGLE-3's 0.8^j.
"""

from __future__ import annotations

import torch

from jetflow.models.eagle_head import EagleHead
from jetflow.training.blocks import sample_anchors
from jetflow.training.losses import block_loss
from jetflow.training.teacher import top1_agreement


def ttt_states(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, steps: int,
               anchors: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Unroll steps 0..steps-1 for one sequence. Step 0 (teacher-forced) covers every position: its
    keys are the context every chain sees. Step j >= 1 covers the chains of ``anchors`` (sorted
    positions; default: every position) that still fit: row k is the chain of ``anchors[k]`` at
    position anchors[k] + j. Returns [L, H] for step 0 and [n_j, H] for step j (n_j: chains alive;
    they are always the first n_j anchors). Training the chains of K random anchors instead of all
    positions costs L + (steps-1)*K positions instead of steps*L, with the same rows in expectation."""
    length, device = embeds.shape[0], embeds.device
    anchors = torch.arange(length, device=device) if anchors is None else anchors.to(device)
    fused = head.fuse(features)
    prev = torch.cat([fused.new_zeros(1, fused.shape[-1]), fused[:-1]])
    positions = torch.arange(length, device=device)
    causal = positions[None, :] <= positions[:, None]
    out, new = head(head.step_input(embeds, prev), positions, None, causal)
    outs, caches = [out], [new]
    prev = out[anchors]  # the state each chain's first draft position reads
    for step in range(1, steps):
        alive = int((anchors + step < length).sum())
        if alive == 0:
            break
        query = anchors[:alive] + step
        past = [(torch.cat([c[layer][0] for c in caches], -2), torch.cat([c[layer][1] for c in caches], -2))
                for layer in range(len(head.layers))]
        # Context: step-0 keys up to the anchor; then the chain's own keys of steps 1..step (self included).
        mask = [positions[None, :] <= anchors[:alive, None]]
        mask += [torch.eye(alive, caches[i][0][0].shape[-2], dtype=torch.bool, device=device)
                 for i in range(1, step)]
        mask.append(torch.eye(alive, dtype=torch.bool, device=device))
        out, new = head(head.step_input(embeds[query], prev[:alive]), query, past, torch.cat(mask, dim=1))
        outs.append(out)
        caches.append(new)
        prev = out
    return outs


def _eagle_plan(trainer, index: int, generator: torch.Generator, steps: int):
    """One sequence's anchors and its (step, positions) rows, and the positions the teacher teaches."""
    seq = trainer.sequences[index]
    length = len(seq.token_ids)
    anchors = sample_anchors(seq.prompt_len, length, trainer.config.anchors_per_seq, generator)
    if anchors.numel() == 0:
        raise ValueError(f"sequence {seq.prompt_id} has no answer position to learn")
    # Step j of the chain at anchor a sits at a+j and predicts token a+j+1, taught by the target at a+j.
    rows = [(step, (anchors + step)[anchors + step <= length - 2]) for step in range(steps)]
    rows = [(step, pos) for step, pos in rows if len(pos)]
    return seq, anchors, rows, torch.cat([pos for _, pos in rows])


def eagle_batch_loss(trainer, items: list[tuple[int, torch.Generator]]) -> tuple[torch.Tensor, dict]:
    """Loss [S] and per-step agreement of the sequences of a micro-batch (the EAGLE counterpart of
    the block loss): for each, the chains of ``anchors_per_seq`` random answer positions, unrolled
    ``ttt_steps`` deep (default: the head's deepest level). The target runs once for all of them;
    the head's unrolled steps run per sequence."""
    c, head, device = trainer.config, trainer.head, trainer.target.device
    steps = c.ttt_steps or head.max_depth
    plans = [_eagle_plan(trainer, index, g, steps) for index, g in items]
    requests = [(index, seq, teach_pos) for (index, _), (seq, _, _, teach_pos) in zip(items, plans)]
    features, teacher, target_top1 = trainer.teacher.fetch_many(requests)
    losses, depths, agrees, segments, row = [], [], [], [], 0
    for i, ((seq, anchors, rows, teach_pos), feats) in enumerate(zip(plans, features)):
        tokens = torch.tensor(seq.token_ids)
        seq_teacher, seq_top1 = teacher[row:row + len(teach_pos)], target_top1[row:row + len(teach_pos)]
        row += len(teach_pos)
        with torch.no_grad():
            embeds = trainer.embed(tokens.to(device))
        states = ttt_states(head, embeds, feats, len(rows), anchors)
        sel_states = torch.cat([states[0][pos.to(device)] if step == 0 else states[step][:len(pos)]
                                for step, pos in rows])
        logits = head.logits(sel_states, trainer.lm_weight)
        labels = tokens[teach_pos + 1]
        if trainer.label_index is not None:
            labels = trainer.label_index[labels]
        depth = torch.cat([torch.full((len(pos),), step + 1) for step, pos in rows])
        usable = labels >= 0 if c.loss == "sft" else torch.ones(len(labels), dtype=torch.bool)
        losses.append(block_loss(logits, seq_teacher, labels.clamp(min=0).to(device), usable.to(device),
                                 depth.to(device), c.loss, c.kl_temperature, c.gamma))
        depths.append(depth)
        agrees.append(top1_agreement(logits.detach(), head.draft_ids, seq_top1).cpu())
        segments.append(torch.full((len(depth),), i))
    return torch.stack(losses), {"depth": torch.cat(depths), "agree": torch.cat(agrees),
                                 "sequence": torch.cat(segments)}
