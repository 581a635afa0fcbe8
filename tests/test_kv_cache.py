"""PreallocatedCache against transformers' DynamicCache: the same operations give the same logits."""

import pytest
import torch
from transformers import DynamicCache

from jetflow.models.kv_cache import PreallocatedCache
from tiny import tiny_model


def _step(model, cache, ids, positions):
    return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits


def _truncate(cache, length):
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


@pytest.mark.parametrize("capacity", [0, 3, 64])
def test_matches_dynamic_cache_through_append_truncate_select_and_growth(capacity):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ours, ref = PreallocatedCache(capacity), DynamicCache()
    ids = torch.randint(0, 250, (3, 5), generator=g)
    pos = torch.arange(5).expand(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(_step(model, ours, ids, pos), _step(model, ref, ids, pos), rtol=0, atol=0)
        length = 5
        for step in range(12):  # appends past every capacity, truncations, a row selection
            n = 1 + step % 3
            ids = torch.randint(0, 250, (ours.layers[0].keys.shape[0], n), generator=g)
            pos = torch.arange(length, length + n).expand(ids.shape[0], n)
            torch.testing.assert_close(_step(model, ours, ids, pos), _step(model, ref, ids, pos), rtol=0, atol=0)
            length += n
            if step % 4 == 1:  # speculative rejection: drop the last token
                length -= 1
                _truncate(ours, length)
                _truncate(ref, length)
            if step == 6:
                rows = torch.tensor([0, 2])
                ours.select_rows(rows)
                for layer in ref.layers:
                    layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        assert ours.get_seq_length() == ref.get_seq_length() == length
        for a, b in zip(ours.layers, ref.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_appends_in_place_without_copying_the_prefix():
    model = tiny_model("llama")
    cache = PreallocatedCache(capacity=32)
    with torch.no_grad():
        _step(model, cache, torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
        ptr = cache.layers[0].keys.data_ptr()
        for t in range(3, 10):
            _step(model, cache, torch.tensor([[t]]), torch.tensor([[t]]))
    assert cache.layers[0].keys.data_ptr() == ptr and cache.get_seq_length() == 10
