"""Qwen3-style transformer building blocks shared by the draft heads: RMSNorm, RoPE, GQA attention
with q/k norms and an optional injected key/value context, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def grouped_query_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """SDPA of query [..., H, n, d] over key/value [..., KV, W, d] (H a multiple of KV) under a mask
    [..., 1, n or 1, W] shared by the heads, with each key/value head's G query heads packed into G*n
    query rows: no key/value copy per query head. Returns [..., H, n, d]."""
    *lead, heads, n, d = query.shape
    kv_heads = key.shape[-3]
    groups = heads // kv_heads
    if groups == 1:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    packed = query.reshape(*lead, kv_heads, groups * n, d)
    # Packed row g*n + i is query i of head g in its group: the mask's n rows, once per head.
    mask = mask.expand(*mask.shape[:-2], n, mask.shape[-1]).repeat(*([1] * (mask.dim() - 2)), groups, 1)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)
    return out.reshape(*lead, heads, n, d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (the rotate-half convention of Llama/Qwen)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # A plain attribute, not a buffer: ``head.to(torch.bfloat16)`` (a bf16 checkpoint loaded as is)
        # would round a buffer to 8 bits, which a later ``.float()`` does not undo (SmolLM2's head: its
        # fastest pair then drifts 1.4e-3 rad a token, 0.14 rad over 100 tokens). Always float32.
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, T, head_dim]; cos/sin: [..., T, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos.unsqueeze(-3) + rotated * sin.unsqueeze(-3)


@dataclass
class BlockMask:
    """A mask over [context, slots] whose slots form blocks of ``inner.shape[0]`` that see a context
    prefix and their own block only (the training blocks, training/blocks.py). Kept factored, the
    attention scores only the context and the own block: Q x (C + b) entries instead of Q x (C + Q),
    (32 blocks of 16 after 700 tokens: 716 keys per slot instead of 1,212)."""

    context: torch.Tensor  # [Q, C] bool: slot q may see context position c
    inner: torch.Tensor  # [b, b] bool: slot i of a block may see slot j of the same block

    def to(self, device) -> "BlockMask":
        return BlockMask(self.context.to(device), self.inner.to(device))

    def dense(self) -> torch.Tensor:
        """The same mask as one boolean [Q, C + Q] tensor."""
        b, q = self.inner.shape[0], self.context.shape[0]
        same = torch.block_diag(*[self.inner] * (q // b)) if q else self.inner[:0, :0]
        return torch.cat([self.context, same.to(self.context.device)], dim=1)


def block_attention(q, ctx_k, ctx_v, k, v, mask: BlockMask) -> torch.Tensor:
    """Attention of block slots q [..., H, Q, d] over context keys/values [..., Hkv, C, d] and the
    slots' own keys/values [..., Hkv, Q, d] under a :class:`BlockMask`; equals scaled dot-product
    attention with ``mask.dense()`` (tested)."""
    *lead, heads, n, d = q.shape
    kv_heads, b = k.shape[-3], mask.inner.shape[0]
    q = q.reshape(*lead, kv_heads, heads // kv_heads, n, d) * d ** -0.5  # grouped query heads
    ctx_k, ctx_v, k, v = (t.unsqueeze(-3) for t in (ctx_k, ctx_v, k, v))  # [..., Hkv, 1, *, d]
    blocks = lambda t: t.unflatten(-2, (n // b, b))  # noqa: E731  [..., n/b, b, d]
    s_ctx = q @ ctx_k.transpose(-1, -2)  # under autocast these scores are bf16/fp16: fill with their own min
    neg = torch.finfo(s_ctx.dtype).min
    s_ctx = s_ctx.masked_fill(~mask.context, neg)
    s_blk = (blocks(q) @ blocks(k).transpose(-1, -2)).masked_fill(~mask.inner, neg).flatten(-3, -2)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1, dtype=torch.float32).to(ctx_v.dtype)
    p_ctx, p_blk = p.split([s_ctx.shape[-1], b], dim=-1)
    out = p_ctx @ ctx_v + (p_blk.unflatten(-2, (n // b, b)) @ blocks(v)).flatten(-3, -2)
    return out.reshape(*lead, heads, n, d)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:  # [..., T, heads*d] -> [..., heads, T, d]
        return x.unflatten(-1, (heads, self.head_dim)).transpose(-2, -3)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values of ``x`` ([..., T, hidden]) -> [..., kv_heads, T, d] each."""
        k = Rotary.apply(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x, cos, sin, mask, ctx_k=None, ctx_v=None, return_kv: bool = False):
        """Queries from ``x``; keys/values from the injected context (if any) followed by ``x``.

        mask: boolean [..., T, C+T] (True = may attend) over [context, x], or a :class:`BlockMask`
        (with a context). With ``return_kv`` also returns the keys/values of ``x`` itself (for
        callers that cache them)."""
        q = Rotary.apply(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)
        k_new, v_new = k, v = self.key_value(x, cos, sin)
        if isinstance(mask, BlockMask):
            out = block_attention(q, ctx_k, ctx_v, k, v, mask)
        else:
            if ctx_k is not None:
                k, v = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
            out = grouped_query_sdpa(q, k, v, mask.unsqueeze(-3))
        out = self.o_proj(out.transpose(-2, -3).flatten(-2))
        return (out, (k_new, v_new)) if return_kv else out


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x, cos, sin, mask, ctx_k=None, ctx_v=None, return_kv: bool = False):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, ctx_k, ctx_v, return_kv)
        attn, kv = attn if return_kv else (attn, None)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, kv) if return_kv else x
