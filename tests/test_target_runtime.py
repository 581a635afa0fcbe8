"""The target runtime against brute-force references: every tree node's logits and tapped hidden
states equal a plain causal forward over its root path; commit leaves the cache as a fresh forward
over the accepted tokens would."""

import random

import pytest
import torch

from jetflow.errors import InvalidRequestError
from jetflow.models.target import TargetModel, default_tapped_layers
from jetflow.tree.mask import path_to_root
from tiny import ARCHS, tiny_model

ATOL = 1e-4


def reference(model, ids, taps):
    """Logits and tapped hidden states of a plain, cache-free causal forward over ``ids``."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hidden = torch.cat([out.hidden_states[t + 1][0] for t in taps], -1)
    return out.logits[0], hidden


def random_tree(rng, n, vocab):
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tokens, parents


@pytest.fixture(scope="module", params=sorted(ARCHS))
def runtime(request, tokenizer):
    model = tiny_model(request.param)
    return model, TargetModel(model, tokenizer, name=f"tiny-{request.param}", tapped_layers=[0, 2])  # not the last: HF reports it after the final norm


@pytest.mark.parametrize("seed", range(4))
def test_verify_matches_per_path_forward(runtime, seed):
    model, target = runtime
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(rng.randint(3, 12))]
    tokens, parents = random_tree(rng, rng.randint(2, 24), 256)
    pre = target.prefill(prefix)
    ref_logits, ref_hidden = reference(model, prefix, target.tapped_layers)
    torch.testing.assert_close(pre.logits[-1], ref_logits[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(pre.hidden, ref_hidden, atol=ATOL, rtol=0)
    out = target.verify(tokens, parents)
    assert out.logits.shape == (len(tokens), model.config.vocab_size)
    for node in range(len(tokens)):
        path = prefix + [tokens[j] for j in path_to_root(parents, node)]
        logits, hidden = reference(model, path, target.tapped_layers)
        torch.testing.assert_close(out.logits[node], logits[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[node], hidden[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_commit_then_continue_equals_fresh_forward(runtime, seed):
    model, target = runtime
    rng = random.Random(100 + seed)
    seq = [rng.randrange(256) for _ in range(rng.randint(2, 8))]
    target.prefill(seq)
    for _round in range(3):  # several verify/commit rounds, as the speculative loop does
        tokens, parents = random_tree(rng, rng.randint(1, 16), 256)
        target.verify(tokens, parents)
        accepted = path_to_root(parents, rng.randrange(len(tokens)))
        target.commit(accepted)
        seq += [tokens[j] for j in accepted]
        assert target.past_len == len(seq) and target.token_ids == seq
    nxt = [rng.randrange(256) for _ in range(3)]
    out = target.extend(nxt)
    ref_logits, _ = reference(model, seq + nxt, target.tapped_layers)
    torch.testing.assert_close(out.logits, ref_logits[-3:], atol=ATOL, rtol=0)
    # The cache itself equals a fresh prefill of the same tokens.
    fresh = TargetModel(model, target.tokenizer, tapped_layers=[0])
    fresh.prefill(seq + nxt)
    for a, b in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=ATOL, rtol=0)


def test_commit_empty_path_and_reverify(runtime):
    model, target = runtime
    target.prefill([5, 6, 7])
    target.verify([1, 2, 3], [-1, 0, 0])
    target.verify([9], [-1])  # a new verify drops the uncommitted tree
    target.commit([])
    assert target.past_len == 3
    out = target.extend([4])
    torch.testing.assert_close(out.logits[-1], reference(model, [5, 6, 7, 4], [0])[0][-1], atol=ATOL, rtol=0)


def test_a_verify_that_fails_midway_leaves_no_keys_behind(runtime):
    """A forward that raises in a late layer (out of memory) after the earlier layers appended their
    keys and values: the next chain step must not attend to those leftovers."""
    model, target = runtime
    target.prefill([5, 6, 7])
    layer = model.model.layers[-1]

    def fail(*_):
        raise RuntimeError("out of memory")

    handle = layer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            target.verify([1, 2, 3], [-1, 0, 0])
    finally:
        handle.remove()
    assert target.past_len == 3
    out = target.extend([4])
    torch.testing.assert_close(out.logits[-1], reference(model, [5, 6, 7, 4], [0])[0][-1], atol=ATOL, rtol=0)


def test_chunked_prefill_equals_one_shot(tokenizer):
    model = tiny_model("llama")
    ids = list(range(1, 40))
    one = TargetModel(model, tokenizer, tapped_layers=[1])
    chunked = TargetModel(model, tokenizer, tapped_layers=[1], prefill_chunk=7)
    a, b = one.prefill(ids), chunked.prefill(ids)
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(a.hidden, b.hidden, atol=ATOL, rtol=0)


def test_bad_calls_raise_clear_errors(tokenizer):
    target = TargetModel(tiny_model("llama"), tokenizer, tapped_layers=[0])
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        target.prefill([])
    with pytest.raises(InvalidRequestError, match="context"):
        target.prefill([1] * 600)
    target.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="parent"):
        target.verify([1, 2], [-1, 5])
    with pytest.raises(ValueError, match="one parent per token"):
        target.verify([1, 2], [-1])
    target.verify([1, 2, 3], [-1, 0, 0])
    with pytest.raises(ValueError, match="root-to-node path"):
        target.commit([0, 2, 1])
    with pytest.raises(ValueError, match="not a pending tree node"):
        target.commit([7])
    with pytest.raises(ValueError, match="tapped layers"):
        TargetModel(tiny_model("llama"), tokenizer, tapped_layers=[4])


def test_default_tapped_layers():
    assert default_tapped_layers(30) == [1, 8, 14, 20, 27]
    assert default_tapped_layers(36) == [1, 9, 17, 25, 33]  # DFlash's choice for Qwen3-8B
    assert default_tapped_layers(4) == [0, 1, 2, 3]


@pytest.mark.parametrize("model_type, scaling", [("granite", {"logits_scaling": 8.0}), ("cohere", {"logit_scale": 0.25}),
                                                 ("gemma2", {"final_logit_softcapping": 3.0, "head_dim": 16})])
def test_teacher_logits_are_the_models_own(tokenizer, model_type, scaling):
    """What a teacher reads (features and logits from one forward) equals the model's own logits,
    with its output scaling: Granite divides them by logits_scaling, Cohere multiplies them by
    logit_scale, Gemma 2 soft-caps them; without it a Granite teacher's distribution would be
    that of logits 8x too large."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=True, **scaling)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    target = TargetModel(model, tokenizer, name="tiny", tapped_layers=[0])
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    _, logits = target.features_and_logits(ids, torch.arange(6))
    with torch.no_grad():
        want = model(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
