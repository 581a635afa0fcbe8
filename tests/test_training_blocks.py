import pytest
import torch

from jetflow.training.blocks import make_blocks, sample_anchors, training_mask
from jetflow.training.losses import block_loss, depth_weights, slot_losses


@pytest.mark.parametrize("causal", [True, False])
def test_training_mask_matches_brute_force(causal):
    anchors, T, B = torch.tensor([3, 5, 9]), 12, 4
    mask = training_mask(anchors, T, B, causal).dense()
    assert mask.shape == (3 * B, T + 3 * B)
    for q in range(3 * B):
        block, slot = divmod(q, B)
        for key in range(T + 3 * B):
            if key < T:
                expected = key < int(anchors[block])  # the prefix before its own anchor only
            else:
                kb, ks = divmod(key - T, B)
                expected = kb == block and (ks <= slot if causal else True)
            assert bool(mask[q, key]) == expected, (q, key)


def test_teacher_indexing_on_hand_built_sequence():
    # prompt = [100, 101, 102], answer = [7, 8, 9, 10]; anchor at position 4 (token 8), B = 4
    tokens = torch.tensor([100, 101, 102, 7, 8, 9, 10])
    b = make_blocks(tokens, torch.tensor([4]), block_size=4, mask_token_id=0)
    assert b.block_ids.tolist() == [8, 0, 0, 0]
    assert b.positions.tolist() == [4, 5, 6, 7]
    # slot k is the token at 4+k, taught by the target's distribution at 4+k-1
    assert b.teacher_index.tolist()[1:3] == [4, 5]
    assert b.labels.tolist()[1:3] == [9, 10]
    assert b.loss_mask.tolist() == [False, True, True, False]  # slot 3 would be position 7: past the end
    assert b.depth.tolist() == [0, 1, 2, 3]


def test_revealed_slots_hold_the_next_tokens_and_are_not_supervised():
    tokens = torch.tensor([100, 101, 102, 7, 8, 9, 10, 11, 12])
    b = make_blocks(tokens, torch.tensor([3, 4, 6]), block_size=5, mask_token_id=0, revealed=torch.tensor([2, 0, 3]))
    assert b.block_ids.view(3, 5).tolist() == [[7, 8, 9, 0, 0],  # slots 1..2 show positions 4, 5
                                               [8, 0, 0, 0, 0],  # nothing revealed: a plain block
                                               [10, 11, 12, 0, 0]]  # slot 3 would be position 9: past the end
    assert b.loss_mask.view(3, 5).tolist() == [[False, False, False, True, True],
                                               [False, True, True, True, True],
                                               [False, False, False, False, False]]
    plain = make_blocks(tokens, torch.tensor([3, 4, 6]), 5, 0)
    for name in ("positions", "teacher_index", "labels", "depth"):  # only inputs and supervision change
        assert torch.equal(getattr(b, name), getattr(plain, name))


def test_revealed_slots_stay_supervised_for_heads_that_shift_tokens():
    tokens = torch.tensor([100, 101, 102, 7, 8, 9, 10, 11, 12])
    anchors, shown = torch.tensor([3, 4, 6]), torch.tensor([2, 0, 3])
    b = make_blocks(tokens, anchors, 5, 0, revealed=shown, supervise_revealed=True)
    assert torch.equal(b.block_ids, make_blocks(tokens, anchors, 5, 0, revealed=shown).block_ids)
    assert torch.equal(b.loss_mask, make_blocks(tokens, anchors, 5, 0).loss_mask)


def test_anchor_sampling_stays_inside_the_answer():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = sample_anchors(5, 20, 6, g)
        assert len(a) == 6 and a.min() >= 5 and a.max() <= 18 and torch.equal(a, a.sort().values)
    assert len(sample_anchors(5, 6, 4, g)) == 0
    assert sample_anchors(5, 8, 10, g).tolist() == [5, 6]


def test_losses_match_direct_formulas():
    g = torch.Generator().manual_seed(0)
    d, t = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    labels = torch.tensor([1, 2, 3, 4, 5])
    T = 2.0
    p, q = (t / T).softmax(-1), (d / T).softmax(-1)
    fkl = (p * (p.log() - q.log())).sum(-1) * T * T
    rkl = (q * (q.log() - p.log())).sum(-1) * T * T
    sft = -d.log_softmax(-1)[torch.arange(5), labels]
    torch.testing.assert_close(slot_losses(d, t, labels, "fkl", T), fkl)
    torch.testing.assert_close(slot_losses(d, t, labels, "rkl", T), rkl)
    torch.testing.assert_close(slot_losses(d, None, labels, "sft"), sft)
    assert torch.all(slot_losses(t, t, labels, "fkl") < 1e-6)
    depth = torch.tensor([0, 1, 2, 3, 1])
    mask = torch.tensor([False, True, True, True, True])
    w = depth_weights(depth, 2.0)
    assert w[1] == 1 and torch.isclose(w[2], torch.exp(torch.tensor(-0.5)))
    expected = (fkl[1:] * w[1:]).sum() / w[1:].sum()
    torch.testing.assert_close(block_loss(d, t, labels, mask, depth, "fkl", T, gamma=2.0), expected)
    with pytest.raises(ValueError):
        slot_losses(d, t, labels, "l2")


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
@pytest.mark.parametrize("feed_last_feature", [False, True])
def test_training_forward_equals_inference_drafting(tokenizer, attention, feed_last_feature):
    """All blocks of a sequence trained in one forward see exactly what the decoder's drafter sees
    when it drafts from that anchor."""
    from jetflow.decoding.block_drafter import BlockDrafter
    from jetflow.models.draft_head import DraftHead, DraftHeadConfig
    from jetflow.models.target import TargetModel
    from jetflow.training.block_objective import blocks_forward
    from tiny import tiny_model

    target = TargetModel(tiny_model("llama"), tokenizer, tapped_layers=[0, 2])
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, attention=attention, block_size=5,
                                                feed_last_feature=feed_last_feature)).eval()
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    features = target.prefill(tokens.tolist()).hidden
    anchors = torch.tensor([4, 9, 15])
    blocks = make_blocks(tokens, anchors, 5, head.config.mask_token_id)
    with torch.no_grad():
        hidden = blocks_forward(head, target.model.get_input_embeddings(), features, blocks)
        train_lp = target.model.get_output_embeddings()(hidden).log_softmax(-1).view(3, 5, -1)[:, 1:]
    for i, a in enumerate(anchors.tolist()):
        drafter = BlockDrafter(head, target)
        drafter.extend(features[:a])
        torch.testing.assert_close(train_lp[i], drafter.depth_logprobs(int(tokens[a]), a), atol=1e-4, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_block_attention_equals_attention_under_the_dense_mask(causal, heads, kv_heads):
    import torch.nn.functional as F

    from jetflow.models.layers import block_attention

    g = torch.Generator().manual_seed(0)
    anchors, T, B, d = torch.tensor([2, 5, 6, 11]), 13, 4, 8
    mask = training_mask(anchors, T, B, causal)
    q = torch.randn(heads, 4 * B, d, generator=g, requires_grad=True)
    ctx_k, ctx_v, k, v = (torch.randn(kv_heads, n, d, generator=g, requires_grad=True)
                          for n in (T, T, 4 * B, 4 * B))
    out = block_attention(q, ctx_k, ctx_v, k, v, mask)
    ref = F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], -2), torch.cat([ctx_v, v], -2),
                                         attn_mask=mask.dense(), enable_gqa=heads != kv_heads)
    torch.testing.assert_close(out, ref)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, ctx_k, ctx_v, k, v))
    for got, want in zip(grads, torch.autograd.grad((ref * w).sum(), (q, ctx_k, ctx_v, k, v))):
        torch.testing.assert_close(got, want)


def test_block_attention_in_bfloat16_fills_masked_scores_and_matches_fp32():
    """Under autocast the scores are bf16: the fill value must be bf16's own minimum (fp32's overflows)."""
    from jetflow.models.layers import block_attention

    g = torch.Generator().manual_seed(1)
    anchors, T, B, d = torch.tensor([3, 7]), 10, 4, 8
    mask = training_mask(anchors, T, B, True)
    q, ctx_k, ctx_v, k, v = (torch.randn(h, n, d, generator=g) for h, n in ((4, 8), (2, T), (2, T), (2, 8), (2, 8)))
    ref = block_attention(q, ctx_k, ctx_v, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_attention(q, ctx_k, ctx_v, k, v, mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


def test_forward_kl_ignores_tokens_the_teacher_rules_out():
    """A teacher with -inf logits (a masked vocabulary, a top-k row): 0 * -inf must not make the loss NaN."""
    import torch

    from jetflow.training.losses import slot_losses

    teacher = torch.tensor([[2.0, 1.0, float("-inf")], [0.5, float("-inf"), float("-inf")]])
    draft = torch.tensor([[1.0, 1.0, 1.0], [0.0, 3.0, 1.0]])
    loss = slot_losses(draft, teacher, torch.tensor([0, 0]), "fkl")
    p = teacher.softmax(-1)
    want = [sum(p[r, i] * (p[r, i].log() - draft[r].log_softmax(-1)[i]) for i in range(3) if p[r, i] > 0)
            for r in range(2)]
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, torch.stack(want))
