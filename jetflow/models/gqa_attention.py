"""SDPA for grouped-query attention under a custom mask, without copying the keys and values.

transformers' ``sdpa`` attention, given a mask on a CPU (every tree verify, every batched step with
more than one token per row), expands each key/value head to its query heads (``repeat_kv``): a copy
of the whole cache per layer. For 32 rows of ~200 cached tokens and 3 tokens each, that copy took
a third of a batched verify step (benchmarks/bench_batch_decoder.py --budget 2 --profile). For one query token
transformers already avoids it by folding a key/value head's query heads into the query length
(``pack_gqa``); this does the same for n query tokens: the G query heads of a key/value head become
G*n query rows (row g*n + i is query i of head g), the mask's n rows repeated G times.

Each query row still attends to exactly the same keys with the same scores, so the result is the
one ``sdpa`` gives up to float rounding: bit-identical on an AVX-512 CPU, the last bit of some
outputs moved on an AVX2 one, where the kernel tiles the longer packed query differently
(tests/test_gqa_attention.py checks both against a brute-force reference). Every other case
(no mask, one query token, no key/value groups, position bias, dropout) goes to ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from jetflow.models.layers import grouped_query_sdpa

NAME = "jetflow_sdpa"


def packed_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs):
    """query [B, H, n, d], key/value [B, KV, W, d], mask [B or 1, 1, n or 1, W] -> ([B, n, H, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    n = query.shape[2]
    plain = kwargs.get("position_bias") is None and not kwargs.get("softcap") and not kwargs.get("output_attentions")
    if groups > 1 and n > 1 and plain and dropout == 0.0 and attention_mask is not None \
            and attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
        out = grouped_query_sdpa(query, key, value, attention_mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def register() -> str:
    """Make ``NAME`` an attention implementation (masks built as for ``sdpa``); returns the name."""
    AttentionInterface.register(NAME, packed_gqa_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_packed_gqa(model) -> None:
    """Switch a model that runs ``sdpa`` to the packed variant (same numbers, no key/value copies)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(register())
