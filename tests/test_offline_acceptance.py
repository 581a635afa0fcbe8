"""Offline acceptance must equal what the decoding loop accepts, round by round."""

import pytest
import torch

import jetflow
from jetflow.data.shards import Sequence
from jetflow.errors import JetFlowError
from jetflow.eval.offline_acceptance import accepted_depth, offline_acceptance, path_nodes
from jetflow.models.draft_head import DraftHead, DraftHeadConfig, head_class
from jetflow.models.target import TargetModel
from jetflow.training.teacher import OnlineTeacher
from jetflow.training.trainer import TrainConfig, Trainer
from jetflow.tree.build import DraftTree
from tiny import tiny_model

PROMPTS = [[10, 20, 30, 40, 50], [7, 7, 8, 9], [100, 3, 5, 200, 11, 12]]


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # peaked distributions: long accepted runs once trained
    return TargetModel(model, tokenizer, name="tiny", tapped_layers=[1, 2])


@pytest.fixture(scope="module")
def sequences(target):
    """The target's own greedy answers (what `jetflow regenerate` writes)."""
    return [Sequence(f"p{i}", p + jetflow.generate(target, p, max_new_tokens=60).token_ids, len(p))
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module", params=["causal", "bidirectional"])
def head(request, target, sequences, tmp_path_factory):
    """A head trained briefly on the sequences, so trees accept several tokens (a random head accepts ~0)."""
    config = TrainConfig(block_size=6, anchors_per_seq=16, layers=1, lr=1e-2, warmup_steps=5, epochs=40,
                         batch_size=3, eval_every=10_000, save_every=10_000, eval_sequences=0,
                         attention=request.param, draft_vocab=64)
    trainer = Trainer(target, sequences, tmp_path_factory.mktemp("run"), config)
    trainer.fit(log=lambda r: None)
    return trainer.head.eval()


def test_path_nodes_and_budget_prefixes():
    tree = DraftTree.root_only(1)
    a = tree.add(5, 0, -0.1)  # node 1
    tree.add(6, 0, -0.5)  # node 2
    b = tree.add(7, a, -0.7)  # node 3
    tree.add(8, b, -0.9)  # node 4
    nodes = path_nodes(tree, [5, 7, 8, 9])
    assert nodes == [1, 3, 4]
    assert [accepted_depth(nodes, n) for n in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert path_nodes(tree, [6, 7]) == [2] and path_nodes(tree, [9]) == []


@pytest.mark.parametrize("budget, width", [(1, 7), (4, 2), (16, 7), (64, 7), (5, 1)])
def test_matches_the_decoding_loop_round_by_round(target, sequences, head, budget, width):
    teacher = OnlineTeacher(target, None)
    jf = jetflow.JetFlow(target, head, budget=budget, width=width)
    rounds = 0
    for index, seq in enumerate(sequences):
        prompt = seq.token_ids[:seq.prompt_len]
        spec = jf.generate(prompt, max_new_tokens=40)
        assert spec.token_ids == seq.token_ids[seq.prompt_len:seq.prompt_len + 40]
        anchor = seq.prompt_len  # the prefill's token anchors the first round
        for emitted in spec.stats["accept_lengths"]:
            one = offline_acceptance(head, target, sequences, teacher, [index], [budget], width,
                                     anchors={index: torch.tensor([anchor])})
            accepted = one.tree_accepted[budget] if width > 1 else one.chain_accepted
            if width == 1:  # the chain arm drafts the whole block; the loop's chain is the budget
                accepted = min(accepted, budget)
            assert accepted == emitted - 1, (index, anchor)
            anchor += emitted
            rounds += 1
    assert rounds > 10


def test_larger_budgets_never_accept_less(target, sequences, head):
    result = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1, 2],
                                [1, 4, 16, 64], width=7, anchors_per_seq=20)
    tau = result.summary()["tau"]
    assert result.anchors == 60
    assert tau["1"] <= tau["4"] <= tau["16"] <= tau["64"]
    assert tau["64"] > 1.5  # the trained head gets whole runs accepted
    reached = result.summary()["depth_acceptance"]
    assert all(x >= y for x, y in zip(reached, reached[1:]))


def test_chain_is_the_width_one_tree_of_the_whole_block(target, sequences, head):
    result = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1],
                                [head.config.block_size - 1], width=1, anchors_per_seq=10)
    assert result.tree_accepted[head.config.block_size - 1] == result.chain_accepted


def test_refuses_eagle_heads_and_bad_budgets(target, sequences):
    cfg = DraftHeadConfig.for_target(target, block_size=4, kind="eagle3", num_hidden_layers=1)
    with pytest.raises(JetFlowError, match="block head"):
        offline_acceptance(head_class("eagle3")(cfg), target, sequences, OnlineTeacher(target, None), [0], [4])
    block = DraftHead(DraftHeadConfig.for_target(target, block_size=4))
    with pytest.raises(JetFlowError, match="budgets"):
        offline_acceptance(block, target, sequences, OnlineTeacher(target, None), [0], [0])
