"""Per-depth agreement (jetflow/eval/depth_agreement.py) against brute-force per-anchor references,
and the dense depth-1 training blocks against drafting from each anchor."""

import dataclasses

import pytest
import torch

from jetflow.data.shards import Sequence
from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.eval.depth_agreement import (DepthAgreement, block_depth_predictions, depth_agreement,
                                         eagle_depth_predictions)
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.eagle_head import EagleHead
from jetflow.training.block_objective import block_context, blocks_forward
from jetflow.training.blocks import answer_anchors, make_blocks, sample_anchors
from jetflow.training.teacher import OnlineTeacher
from tiny import peaked_tiny_target


@pytest.fixture(scope="module")
def target(tokenizer):
    return peaked_tiny_target(tokenizer)


def peaked(head, seed=0):
    """Larger weights: distinct, peaked draft distributions, so argmaxes are not ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval()


def block_head(target, attention="causal", draft_ids=None, embed_norm=False):
    head = DraftHead(DraftHeadConfig.for_target(target, attention=attention, block_size=6, feed_last_feature=True,
                                                depth_embedding=True, embed_norm=embed_norm,
                                                draft_vocab_size=None if draft_ids is None else len(draft_ids)))
    if draft_ids is not None:
        head.set_draft_vocab(draft_ids)
    return peaked(head)


def eagle_head(target):
    return peaked(EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=6, kind="eagle3")))


def sequences_and_teacher(target):
    g = torch.Generator().manual_seed(3)
    seqs = [Sequence(f"s{i}", torch.randint(0, 256, (n,), generator=g).tolist(), p)
            for i, (n, p) in enumerate([(19, 5), (12, 4), (7, 5)])]  # the last: one answer anchor
    return seqs, OnlineTeacher(target, None)


def target_top1(target, seq):
    """The target's argmax at every position, by a fresh full forward."""
    _, logits = target.features_and_logits(seq.token_ids, torch.arange(len(seq.token_ids)))
    return logits.argmax(-1)


def reference_counts(seqs, target, draft_at, max_depth):
    """Brute force: per anchor, per depth, the draft ``draft_at(seq, anchor)`` ([D] target ids)
    against the target's argmax."""
    hits, counts, prefix = [0] * max_depth, [0] * max_depth, [0] * max_depth
    for seq in seqs:
        top1 = target_top1(target, seq)
        n = len(seq.token_ids)
        for a in range(seq.prompt_len, n - 1):
            draft = draft_at(seq, a)
            ok = True
            for k in range(1, max_depth + 1):
                if a + k > n - 1:
                    break
                agree = int(draft[k - 1]) == int(top1[a + k - 1])
                ok = ok and agree
                hits[k - 1] += agree
                counts[k - 1] += 1
                prefix[k - 1] += ok
    return hits, counts, prefix


@torch.no_grad()
@pytest.mark.parametrize("attention,reduced", [("causal", False), ("causal", True), ("bidirectional", False)])
def test_block_agreement_equals_per_anchor_drafting(target, attention, reduced):
    draft_ids = torch.arange(0, 272, 2) if reduced else None  # a reduced vocabulary: every other token
    head = block_head(target, attention, draft_ids)
    seqs, teacher = sequences_and_teacher(target)
    result = depth_agreement(head, target, seqs, teacher, [0, 1, 2], max_depth=4)

    def draft_at(seq, a):
        drafter = BlockDrafter(head, target)
        features = target.prefill(seq.token_ids).hidden
        drafter.extend(features[:a])
        lp = drafter.depth_logprobs(seq.token_ids[a], a)  # [B-1, V] over the target vocabulary
        return lp[:4].argmax(-1)

    hits, counts, prefix = reference_counts(seqs, target, draft_at, 4)
    assert result.counts == counts and result.hits == hits and result.prefix_hits == prefix
    assert sum(hits) > 0 or reduced  # the comparison is not vacuous
    assert result.counts[0] == sum(len(s.token_ids) - 1 - s.prompt_len for s in seqs)


@torch.no_grad()
def test_path_conditioned_block_agreement_equals_drafting_after_the_true_path(target):
    """--path-conditioned: depth k from a causal block [anchor, true tokens of depths 1..k-1, MASK]
    run by the decoder's drafter context (the second pass's layout), per anchor and depth."""
    head = block_head(target, "causal", None)
    seqs, teacher = sequences_and_teacher(target)
    result = depth_agreement(head, target, seqs, teacher, [0, 1, 2], max_depth=3, path_conditioned=True)

    def draft_at(seq, a):
        drafter = BlockDrafter(head, target)
        drafter.extend(target.prefill(seq.token_ids).hidden[:a])
        drafter.head_logprobs(seq.token_ids[a], a)  # projects the context
        out = []
        for k in range(1, 4):
            path = seq.token_ids[a + 1:a + k][:k - 1]
            path += [head.config.mask_token_id] * (k - 1 - len(path))  # past the sequence end: not scored
            block = torch.tensor([seq.token_ids[a]] + path + [head.config.mask_token_id])
            hidden = head(target.embed(block), torch.arange(a, a + k + 1), drafter.context_kv,
                          head.block_mask(a)[: k + 1, : a + k + 1], drafter.last_feature)
            out.append(int(drafter._output_logprobs(hidden[-1:]).argmax()))
        return torch.tensor(out)

    hits, counts, prefix = reference_counts(seqs, target, draft_at, 3)
    assert result.counts == counts and result.hits == hits and result.prefix_hits == prefix
    assert sum(hits) > 0
    seq, lm = seqs[0], head.output_weight(target.lm_head_weight())
    features, tokens = target.prefill(seq.token_ids).hidden, torch.tensor(seq.token_ids)
    plain, given = (block_depth_predictions(head, target.embed, lm, features, tokens, seq.prompt_len, 3,
                                            path_conditioned=pc) for pc in (False, True))
    assert torch.equal(plain[:, 0], given[:, 0]) and not torch.equal(plain[:, 1:], given[:, 1:])  # depth 1: no path


@torch.no_grad()
def test_eagle_agreement_equals_step_by_step_chains(target):
    head = eagle_head(target)
    seqs, teacher = sequences_and_teacher(target)
    result = depth_agreement(head, target, seqs, teacher, [0, 1, 2], max_depth=4)
    embed = target.model.get_input_embeddings()
    lm = target.lm_head_weight()

    def draft_at(seq, a):
        """The chain of anchor a, one fresh causal forward per depth: position t < a+1 reads the
        target feature of t-1, positions a+1.. read the head's own state of t-1."""
        tokens = torch.tensor(seq.token_ids)
        fused = head.fuse(target.prefill(seq.token_ids).hidden)
        states, out = [], []
        for t in range(0, min(a + 4, len(tokens))):
            prev = [torch.zeros(fused.shape[-1])] + [fused[s - 1] if s <= a else states[s - 1] for s in range(1, t + 1)]
            x = head.step_input(embed(tokens[:t + 1]), torch.stack(prev))
            h, _ = head(x, torch.arange(t + 1), None, torch.ones(t + 1, t + 1, dtype=torch.bool).tril())
            states.append(h[-1])
            if t >= a:
                out.append(int(head.logits(h[-1:], lm).argmax()))
        return out + [-1] * (4 - len(out))

    hits, counts, prefix = reference_counts(seqs, target, draft_at, 4)
    assert result.counts == counts and result.hits == hits and result.prefix_hits == prefix
    # Agreement of a random head is ~0, so also compare the drafted tokens themselves.
    seq = seqs[0]
    tokens = torch.tensor(seq.token_ids)
    features = target.prefill(seq.token_ids).hidden
    preds = eagle_depth_predictions(head, embed, lm, features, tokens, seq.prompt_len, 4)
    for i, a in enumerate(range(seq.prompt_len, len(tokens) - 1)):
        ref = draft_at(seq, a)
        n = min(4, len(tokens) - 1 - a)  # depths whose token exists
        assert preds[i, :n].tolist() == ref[:n]


def test_prefix_agreement_bookkeeping():
    r = DepthAgreement(3)
    agree = torch.tensor([[True, True, False], [True, False, True], [False, True, True], [True, True, True]])
    valid = torch.tensor([[True, True, True], [True, True, True], [True, True, True], [True, True, False]])
    r.add(agree, valid)
    s = r.summary()
    assert r.hits == [3, 3, 2] and r.counts == [4, 4, 3] and r.prefix_hits == [3, 2, 0]
    assert s["agreement"] == [0.75, 0.75, 2 / 3] and s["prefix_agreement"] == [0.75, 0.5, 0.0]


@torch.no_grad()
@pytest.mark.parametrize("embed_norm", [False, True])
def test_dense_depth1_blocks_equal_slot1_of_full_blocks_and_drafting(target, embed_norm):
    """A 2-slot block [anchor, MASK] at every answer anchor (the dense depth-1 objective) gives slot 1
    exactly as a full block does, and as the decoder drafting from that anchor."""
    head = block_head(target, embed_norm=embed_norm)
    seq = sequences_and_teacher(target)[0][0]
    tokens = torch.tensor(seq.token_ids)
    features = target.prefill(seq.token_ids).hidden
    embed = target.model.get_input_embeddings()
    anchors = answer_anchors(seq.prompt_len, len(tokens))
    assert anchors.tolist() == list(range(seq.prompt_len, len(tokens) - 1))
    context = block_context(head, features)
    pairs = make_blocks(tokens, anchors, 2, head.config.mask_token_id)
    assert pairs.block_size == 2 and pairs.loss_mask.sum() == len(anchors)
    dense = blocks_forward(head, embed, features, pairs, context).view(len(anchors), 2, -1)[:, 1]
    full = make_blocks(tokens, anchors, 6, head.config.mask_token_id)
    whole = blocks_forward(head, embed, features, full, context).view(len(anchors), 6, -1)[:, 1]
    torch.testing.assert_close(dense, whole, atol=1e-5, rtol=1e-5)
    lp = target.model.get_output_embeddings()(dense).log_softmax(-1)
    for i, a in enumerate(anchors.tolist()):
        drafter = BlockDrafter(head, target)
        drafter.extend(features[:a])
        torch.testing.assert_close(lp[i], drafter.depth_logprobs(int(tokens[a]), a)[0], atol=1e-4, rtol=0)


def test_dense_depth1_loss_is_the_mean_depth1_loss_at_every_anchor(target, tmp_path):
    """--dense-depth1 W adds W x the mean forward KL of slot 1 over every answer anchor (checked
    against drafting from each anchor and the target's own distribution); held-out evaluation keeps
    the plain objective; training runs and the option is refused where it means nothing."""
    from jetflow.errors import JetFlowError
    from jetflow.training.losses import slot_losses
    from jetflow.training.trainer import TrainConfig, Trainer

    seqs = sequences_and_teacher(target)[0][:2] * 3
    config = TrainConfig(block_size=5, anchors_per_seq=3, layers=1, batch_size=2, epochs=1, eval_sequences=0,
                         feed_last_feature=True, depth_embedding=True, dense_depth1=0.5, lr=1e-2, warmup_steps=0)
    trainer = Trainer(target, seqs, tmp_path / "run", config)
    seq = seqs[0]
    tokens = torch.tensor(seq.token_ids)
    features = target.prefill(seq.token_ids).hidden

    def dense_term(settings, seed):  # (training loss with the term - without it) / its weight
        g = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
        trainer.head.train()
        trainer.config = settings
        with_term = trainer.sequence_loss(0, g())[0]
        trainer.config = dataclasses.replace(settings, dense_depth1=0.0)
        without = trainer.sequence_loss(0, g())[0]
        trainer.config = config
        return (with_term - without) / settings.dense_depth1

    with torch.no_grad():
        dense = dense_term(config, 0)
        expected = []
        for a in range(seq.prompt_len, len(tokens) - 1):
            drafter = BlockDrafter(trainer.head, target)
            drafter.extend(features[:a])
            draft = drafter.depth_logprobs(int(tokens[a]), a)[0]
            _, teacher = target.features_and_logits(seq.token_ids, torch.tensor([a]))
            expected.append(slot_losses(draft[None], teacher.log_softmax(-1), tokens[a + 1:a + 2], "fkl"))
        torch.testing.assert_close(dense, torch.cat(expected).mean(), atol=1e-4, rtol=1e-4)
        # --dense-depth1-anchors N: the same losses at N answer positions drawn from the sequence's
        # generator after its block anchors
        g = torch.Generator().manual_seed(5)
        sample_anchors(seq.prompt_len, len(tokens), config.anchors_per_seq, g)
        sampled = sample_anchors(seq.prompt_len, len(tokens), 3, g) - seq.prompt_len
        assert len(sampled) == 3
        some = dense_term(dataclasses.replace(config, dense_depth1_anchors=3), 5)
        torch.testing.assert_close(some, torch.cat(expected)[sampled].mean(), atol=1e-4, rtol=1e-4)
        trainer.head.train().requires_grad_(True)  # the drafter switched it to inference
        train_loss, _ = trainer.sequence_loss(0, torch.Generator().manual_seed(7))
        trainer.head.eval()
        plain, _ = trainer.sequence_loss(0, torch.Generator().manual_seed(7))
        trainer.head.train()
    torch.testing.assert_close(train_loss, plain + 0.5 * dense_term(config, 7), atol=1e-5, rtol=1e-5)
    trainer.fit(log=lambda r: None)
    assert trainer.step == trainer.total_steps
    for bad in ({"attention": "bidirectional"}, {"head": "eagle3"}, {"dense_depth1": -1.0},
                {"dense_depth1_anchors": -1}):
        with pytest.raises(JetFlowError):
            TrainConfig(**{"dense_depth1": 1.0, **bad})


def test_train_cli_makes_dense_depth1_the_default_for_causal_block_heads():
    from jetflow.cli import _dense_depth1, build_parser

    parser = build_parser()
    base = ["train", "--data", "d", "--out", "o"]
    assert _dense_depth1(parser.parse_args(base)) == 1.0
    assert _dense_depth1(parser.parse_args(base + ["--attention", "bidirectional"])) == 0.0
    assert _dense_depth1(parser.parse_args(base + ["--head", "eagle3"])) == 0.0
    assert _dense_depth1(parser.parse_args(base + ["--dense-depth1", "0"])) == 0.0  # the old objective
    assert _dense_depth1(parser.parse_args(base + ["--dense-depth1", "0.5"])) == 0.5
    assert parser.parse_args(base).dense_depth1_anchors == 0  # every answer position
    assert parser.parse_args(base + ["--dense-depth1-anchors", "64"]).dense_depth1_anchors == 64
