"""Reduced draft vocabulary: selection, EAGLE-3 mapping, checkpoints and lossless decoding."""

import numpy as np
import pytest
import torch

import jetflow
from jetflow.data.shards import Sequence
from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.draft_vocab import (mapping_tensors, select_draft_vocab, target_to_draft_index, token_counts,
                                       widened_draft_vocab)
from jetflow.models.target import TargetModel
from tiny import tiny_model


def test_token_counts_only_count_answers():
    seqs = [Sequence("a", [5, 5, 1, 2, 2], 2), Sequence("b", [1, 2, 3], 1)]
    counts = token_counts(seqs, 8)
    assert counts.tolist() == [0, 1, 3, 1, 0, 0, 0, 0]


def test_selection_is_most_frequent_with_required_tokens():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=200)
    ids = select_draft_vocab(counts, 20, required=[199, 3])
    assert ids.tolist() == sorted(ids.tolist()) and len(set(ids.tolist())) == 20
    assert {199, 3} <= set(ids.tolist())
    # brute force: the other 18 are the 18 best (count desc, id asc) among the rest
    rest = sorted((i for i in range(200) if i not in (199, 3)), key=lambda i: (-counts[i], i))[:18]
    assert set(ids.tolist()) == set(rest) | {199, 3}
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 0)
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 1, required=[1, 2])


def test_mapping_round_trip():
    ids = torch.tensor([0, 4, 5, 9])
    d2t, t2d = mapping_tensors(ids, 12)
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()  # EAGLE-3: target = draft + d2t[draft]
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    index = target_to_draft_index(ids, 12)
    assert [int(index[t]) for t in range(12)] == [0, -1, -1, -1, 1, 2, -1, -1, -1, 3, -1, -1]
    with pytest.raises(ValueError):
        mapping_tensors(torch.tensor([3, 1]), 12)


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return TargetModel(model, tokenizer, name="tiny", tapped_layers=[1, 2])


def reduced_head(target, ids, attention="causal"):
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=6, attention=attention,
                                                draft_vocab_size=len(ids)))
    head.set_draft_vocab(torch.tensor(ids))
    return head


def test_checkpoint_keeps_the_mapping_exact_in_bf16(target, tmp_path):
    ids = list(range(0, 272, 3))
    head = reduced_head(target, ids)
    head.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    loaded = DraftHead.from_pretrained(tmp_path / "d", target=target)
    assert loaded.config.draft_vocab_size == len(ids) and loaded.draft_ids.tolist() == ids
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
    assert loaded.fc.weight.dtype == torch.bfloat16
    w = torch.randn(272, 64)
    assert torch.equal(loaded.output_weight(w), w[ids])


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_reduced_head_proposes_only_its_tokens_and_stays_lossless(target, attention):
    ids = list(range(0, 272, 2))  # half the vocabulary: the target often wants a token the head lacks
    head = reduced_head(target, ids, attention)
    drafter = BlockDrafter(head, target)
    out = target.prefill([5, 6, 7, 8])
    drafter.extend(out.hidden)
    lp = drafter.depth_logprobs(9, 4)
    assert lp.shape == (5, 272)
    allowed = torch.zeros(272, dtype=torch.bool)
    allowed[ids] = True
    assert torch.isinf(lp[:, ~allowed]).all() and torch.isfinite(lp[:, allowed]).all()
    torch.testing.assert_close(lp[:, allowed].exp().sum(-1), torch.ones(5))
    jf = jetflow.JetFlow(target, head, budget=16, width=3)
    for prompt in ([1, 2, 3], [40, 41, 42, 43, 44]):
        assert jf.generate(prompt, max_new_tokens=25).token_ids == \
            jetflow.generate(target, prompt, max_new_tokens=25).token_ids


def test_widened_vocabulary_keeps_every_id_and_adds_the_most_frequent():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 50, size=100)
    current = torch.tensor([2, 50, 97])
    ids = widened_draft_vocab(current, counts, 10)
    rest = sorted((i for i in range(100) if i not in (2, 50, 97)), key=lambda i: (-counts[i], i))[:7]
    assert ids.tolist() == sorted([2, 50, 97] + rest)
    assert widened_draft_vocab(current, counts, 0) is None and widened_draft_vocab(current, counts, 100) is None
    with pytest.raises(ValueError, match="only grows"):
        widened_draft_vocab(current, counts, 2)
    with pytest.raises(ValueError, match="whole vocabulary"):
        widened_draft_vocab(None, counts, 10)


@pytest.mark.parametrize("wider", [200, None])
def test_widened_head_scores_its_old_ids_exactly_as_before(target, wider):
    """Same weights, more output rows: every old id's logit is unchanged (brute force over the full
    LM head), the new ids get the logits of the same hidden states, and the calibration is dropped."""
    ids = list(range(0, 272, 3))
    head = reduced_head(target, ids)
    identity = [[[-5.0, 0.0], [-5.0, 0.0]]] * 5  # one curve per depth (only its removal is checked)
    head.config.tree_calibration = {"main": identity, "off_main": identity}
    counts = np.arange(272)[::-1].copy()
    new_ids = widened_draft_vocab(head.draft_ids, counts, wider or 0)
    wide = head.with_draft_vocab(new_ids)
    assert wide.config.tree_calibration is None and wide.config.draft_vocab_size == wider
    assert wide.draft_ids is None if wider is None else set(ids) < set(wide.draft_ids.tolist())
    drafter_old, drafter_new = BlockDrafter(head, target), BlockDrafter(wide, target)
    out = target.prefill([5, 6, 7, 8])
    drafter_old.extend(out.hidden)
    drafter_new.extend(out.hidden)
    hidden = torch.randn(3, head.config.hidden_size)
    full = hidden @ target.lm_head_weight().T
    torch.testing.assert_close(hidden @ head.output_weight(target.lm_head_weight()).T, full[:, ids])
    torch.testing.assert_close(hidden @ wide.output_weight(target.lm_head_weight()).T,
                               full if wider is None else full[:, new_ids])
    old, new = drafter_old.depth_logprobs(9, 4), drafter_new.depth_logprobs(9, 4)
    # log-softmax over more ids: the old ids keep their order and differences
    diff = new[:, ids] - old[:, ids]
    torch.testing.assert_close(diff, diff[:, :1].expand_as(diff))
    assert torch.isfinite(new[:, new_ids if wider else slice(None)]).all()
