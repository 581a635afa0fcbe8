"""The EAGLE-3-style autoregressive draft head: the third corner of the paper's dilemma.

Built from the same pieces as the block head (fused target features via ``fc`` + ``hidden_norm``,
Qwen3-style decoder layers, the target's embedding and LM head, an optional reduced vocabulary) but
used autoregressively. The input at position t is

    input_proj([embed_norm(embedding of token t), prev_norm(s_{t-1})])

where s_{t-1} is the fused target feature of position t-1 when the target has run there, and the
head's own output hidden state at t-1 when it is drafting beyond what the target has seen. The
output at t predicts token t+1. Context positions form an ordinary causal sequence through the
layers (their keys/values are cached); draft nodes attend to the context and their tree ancestors.
A draft tree of depth D therefore costs D sequential head forwards -- the price EAGLE pays for
conditioning every branch on its own path.
"""

from __future__ import annotations

import torch
from torch import nn

from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.layers import RMSNorm


class EagleHead(DraftHead):
    kind = "eagle3"

    def __init__(self, config: DraftHeadConfig):
        super().__init__(config)
        h = config.hidden_size
        self.embed_norm = RMSNorm(h, config.rms_norm_eps)
        self.prev_norm = RMSNorm(h, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.reset_parameters()

    @property
    def max_depth(self) -> int:
        return self.config.block_size - 1

    def step_input(self, embeds: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[..., T, H] token embeddings and the previous position's state -> layer input [..., T, H]."""
        x = torch.cat([self.embed_norm(embeds.to(self.fc.weight.dtype)), self.prev_norm(prev.to(self.fc.weight.dtype))],
                      dim=-1)
        return self.input_proj(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past_kv: list | None, mask: torch.Tensor):
        """Layer stack over inputs ``x`` [Q, H] at ``positions`` [Q], after the cached keys/values
        ``past_kv`` (per layer (k, v) [kv_heads, P, d], or None) under the boolean ``mask`` [Q, P+Q].
        Returns the output states [Q, H] (before the final norm: they feed the next draft step) and
        the new keys/values of the Q positions, per layer."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        new_kv = []
        for i, layer in enumerate(self.layers):
            k, v = past_kv[i] if past_kv else (None, None)
            x, kv = layer(x, cos, sin, mask, k, v, return_kv=True)
            new_kv.append(kv)
        return x, new_kv

    def logits(self, states: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        return self.norm(states).to(lm_weight.dtype) @ lm_weight.T
