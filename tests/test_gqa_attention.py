"""Packed grouped-query SDPA against transformers' sdpa (bit for bit) and a brute-force softmax
attention (the definition), for tree masks, batches, bool and additive masks, broadcast shapes."""

import random
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from jetflow.models.gqa_attention import NAME, packed_gqa_sdpa
from jetflow.models.target import TargetModel
from jetflow.tree.mask import ancestor_matrix
from tiny import tiny_model


def brute_force(query, key, value, allowed, scale):
    """softmax(q k^T * scale) v over the allowed keys, each query head on its key/value head."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).double()
    v = value.repeat_interleave(groups, dim=1).double()
    scores = (query.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def tree_allowed(rng, batch, n, past):
    """[batch, 1, n, past + n]: each row a random prefix length and a random tree after it."""
    allowed = torch.zeros(batch, 1, n, past + n, dtype=torch.bool)
    for b in range(batch):
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        allowed[b, 0, :, :rng.randint(1, past)] = True
        allowed[b, 0, :, past:] = ancestor_matrix(parents)
    return allowed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_packed_equals_sdpa_and_the_definition(seed, mask_kind):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch, kv, groups, d = rng.choice([1, 3, 8]), rng.choice([1, 2, 3]), rng.choice([2, 3, 4]), 16
    n, past = rng.choice([2, 5, 17, 40]), rng.randint(1, 600)
    module = SimpleNamespace(num_key_value_groups=groups)
    query = torch.randn(batch, n, kv * groups, d).transpose(1, 2)  # a transposed view, as the model gives it
    cache = torch.randn(2, batch + 2, kv, past + n + 7, d)  # keys/values: views into larger buffers
    key, value = cache[0, :batch, :, :past + n], cache[1, :batch, :, :past + n]
    allowed = tree_allowed(rng, batch, n, past)
    mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    scale = d ** -0.5
    packed, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=scale)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scale)
    assert packed.shape == (batch, n, kv * groups, d)
    # Same keys, scores and mask per query row; the CPU kernel tiles the longer packed query differently,
    # which on AVX2 moves the last bit of some outputs (on AVX-512 they were bit-identical).
    torch.testing.assert_close(packed, stock, atol=1e-6, rtol=0)
    torch.testing.assert_close(packed.double(), brute_force(query, key, value, allowed, scale), atol=1e-5, rtol=0)


def test_broadcast_masks():
    """A mask shared by the batch (batch dim 1) and a mask with one row for every query."""
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3)
    query, key, value = torch.randn(4, 6, 5, 8), torch.randn(4, 2, 20, 8), torch.randn(4, 2, 20, 8)
    allowed = torch.rand(1, 1, 5, 20) > 0.3
    allowed[..., 0] = True
    for mask in (allowed, allowed[:, :, :1].expand(1, 1, 1, 20).clone()):
        packed, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=0.3)
        stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        assert torch.equal(packed, stock)
        full = mask.expand(4, 1, 5, 20)
        torch.testing.assert_close(packed.double(), brute_force(query, key, value, full, 0.3), atol=1e-5, rtol=0)


def test_target_uses_it_and_verifies_exactly_as_sdpa(tokenizer):
    """A tree verify through the packed implementation gives sdpa's logits bit for bit."""
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(9)]
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6]
    tokens = [rng.randrange(256) for _ in parents]
    outs = []
    for packed in (False, True):
        model = tiny_model("llama")
        target = TargetModel(model, tokenizer, name="tiny", tapped_layers=[0, 2])
        assert model.config._attn_implementation == NAME
        if not packed:
            model.set_attn_implementation("sdpa")
        target.prefill(prefix)
        outs.append(target.verify(tokens, parents))
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert torch.equal(outs[0].hidden, outs[1].hidden)


@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_query_sdpa_equals_the_definition(lead, groups):
    """The draft heads' attention (queries [..., H, n, d], a mask [..., 1, n, W] shared by the heads),
    with and without a batch dimension, with and without key/value groups."""
    from jetflow.models.layers import grouped_query_sdpa

    torch.manual_seed(groups)
    kv, n, w, d = 2, 5, 23, 8
    query = torch.randn(*lead, kv * groups, n, d)
    key, value = torch.randn(*lead, kv, w, d), torch.randn(*lead, kv, w, d)
    allowed = torch.rand(*lead, 1, n, w) > 0.4
    allowed[..., 0] = True
    out = grouped_query_sdpa(query, key, value, allowed)
    assert out.shape == query.shape
    batched = lambda t: t if lead else t.unsqueeze(0)  # noqa: E731  brute_force takes a batch dimension
    ref = brute_force(batched(query), batched(key), batched(value), batched(allowed), d ** -0.5).transpose(1, 2)
    torch.testing.assert_close(batched(out).double(), ref, atol=1e-5, rtol=0)
