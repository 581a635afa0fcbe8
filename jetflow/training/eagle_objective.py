"""Training the EAGLE-3-style head with "training-time test": the head is unrolled on its own states.

Step 0 is teacher-forced on the target: position t gets (token t, target feature of t-1) and predicts
token t+1. At unroll step j >= 1, position t gets (token t, the head's own step-(j-1) state at t-1):
it is the j-th draft token of a chain anchored at position t-j, exactly as in decoding. Its keys
are the step-0 keys of positions <= t-j (the context the target had verified) and, on its chain,
the step-i key of position t-(j-i) for i = 1..j (its draft ancestors and itself) -- one diagonal
per step, so all anchors of a sequence train in ``steps`` forwards. Tokens stay the regenerated
ones (accepted draft tokens are the target's tokens). Step j's loss has depth j+1; the depth
weights exp(-(k-1)/gamma) with gamma = -1/ln(0.8) ~ 4.48 give EAGLE-3's 0.8^j.
"""

from __future__ import annotations

import torch

from jetflow.models.eagle_head import EagleHead


def ttt_mask(length: int, step: int, device=None) -> torch.Tensor:
    """Boolean [L, (step+1)*L] over [step-0 keys, step-1 keys, ..., step-``step`` keys]."""
    t = torch.arange(length, device=device)
    cols = [t[None, :] <= (t[:, None] - step)]
    cols += [t[None, :] == (t[:, None] - (step - i)) for i in range(1, step + 1)]
    return torch.cat(cols, dim=1)


def ttt_states(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Output states [L, H] of every unroll step 0..steps-1 for one sequence."""
    fused = head.fuse(features)
    length = embeds.shape[0]
    positions = torch.arange(length, device=embeds.device)
    prev = torch.cat([fused.new_zeros(1, fused.shape[-1]), fused[:-1]])
    caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    outs = []
    for step in range(steps):
        past = None
        if caches:
            past = [(torch.cat([c[layer][0] for c in caches], -2), torch.cat([c[layer][1] for c in caches], -2))
                    for layer in range(len(head.layers))]
        out, new = head(head.step_input(embeds, prev), positions, past, ttt_mask(length, step, embeds.device))
        caches.append(new)
        outs.append(out)
        prev = torch.cat([out.new_zeros(1, out.shape[-1]), out[:-1]])
    return outs


def eagle_sequence_loss(trainer, index: int, steps: int) -> tuple[torch.Tensor, dict]:
    """Loss and per-step agreement of one sequence (the EAGLE counterpart of the block loss)."""
    from jetflow.training.losses import block_loss

    c, head, device = trainer.config, trainer.head, trainer.target.device
    seq = trainer.sequences[index]
    tokens = torch.tensor(seq.token_ids)
    length, start = len(tokens), seq.prompt_len
    if length - 1 <= start:
        raise ValueError(f"sequence {seq.prompt_id} has no answer position to learn")
    teach_pos = torch.arange(start, length - 1)  # position t predicts token t+1, taught by the target at t
    features, teacher = trainer.teacher.fetch(index, seq, teach_pos)
    with torch.no_grad():
        embeds = trainer.embed(tokens.to(device))
    states = ttt_states(head, embeds, features, steps)
    rows, depth = [], []
    for step, out in enumerate(states):
        pos = teach_pos[teach_pos - step >= start]  # chains anchored inside the answer
        rows.append((step, pos))
        depth.append(torch.full((len(pos),), step + 1))
    sel_states = torch.cat([states[s][p.to(device)] for s, p in rows])
    logits = head.logits(sel_states, trainer.lm_weight)
    t_rows = torch.cat([p - start for _, p in rows])
    labels = tokens[torch.cat([p for _, p in rows]) + 1]
    if trainer.label_index is not None:
        labels = trainer.label_index[labels]
    depth = torch.cat(depth)
    usable = labels >= 0 if c.loss == "sft" else torch.ones(len(labels), dtype=torch.bool)
    teacher = teacher[t_rows.to(teacher.device)]
    loss = block_loss(logits, teacher, labels.clamp(min=0).to(device), usable.to(device), depth.to(device),
                      c.loss, c.kl_temperature, c.gamma)
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float()
    return loss, {"depth": depth, "agree": agree.detach().cpu()}
