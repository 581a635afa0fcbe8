"""The EAGLE-3-style baseline head: its masks, its unrolled training forward and its decoding tree
against brute-force step-by-step references, losslessness, and a tiny overfit run."""

import pytest
import torch

import jetflow
from jetflow.decoding.eagle_drafter import EagleDrafter
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead, DraftHeadConfig, DrafterMismatchError
from jetflow.models.eagle_head import EagleHead
from jetflow.training.eagle_objective import ttt_states
from tiny import lossless_tau, peaked_tiny_target


@pytest.fixture(scope="module")
def target(tokenizer):
    return peaked_tiny_target(tokenizer)


def make_head(target, layers=2, depth=5, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=layers, block_size=depth + 1, kind="eagle3"))
    with torch.no_grad():  # larger weights: distinct, peaked draft distributions
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    return head.eval()


def reference_states(head, embed, fused, tokens, known):
    """Output state at every position of ``tokens`` by brute force: a fresh causal forward per
    position; position t's partner is the target feature of t-1 for t < ``known`` + 1 (zero at 0),
    else the head's own state at t-1."""
    states = []
    for n in range(1, len(tokens) + 1):
        prev = [torch.zeros(fused.shape[-1])] + [fused[t - 1] if t <= known else states[t - 1] for t in range(1, n)]
        x = head.step_input(embed(torch.tensor(tokens[:n])), torch.stack(prev))
        out, _ = head(x, torch.arange(n), None, torch.ones(n, n, dtype=torch.bool).tril())
        states.append(out[-1])
    return states


@torch.no_grad()
def test_unrolled_training_states_equal_step_by_step_drafting(target):
    head = make_head(target)
    tokens = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    features, _ = target.features_and_logits(tokens.tolist(), torch.arange(1))
    embed = target.model.get_input_embeddings()
    outs = ttt_states(head, embed(tokens), features, steps=4)  # every position anchors a chain
    fused = head.fuse(features)
    assert [o.shape[0] for o in outs] == [12, 11, 10, 9]
    for step in range(4):
        for anchor in range(12 - step):  # chain of ``anchor``: positions up to it use target features
            t = anchor + step
            ref = reference_states(head, embed, fused, tokens[:t + 1].tolist(), known=anchor)
            row = t if step == 0 else anchor
            torch.testing.assert_close(outs[step][row], ref[t], atol=1e-3, rtol=1e-3)  # fp32 reduction order
    picked = torch.tensor([1, 4, 5, 9, 10])  # a sample of chains gives the same states as all of them
    some = ttt_states(head, embed(tokens), features, steps=4, anchors=picked)
    assert [o.shape[0] for o in some] == [12, 5, 4, 3]
    torch.testing.assert_close(some[0], outs[0])
    for step in range(1, 4):
        alive = picked[picked + step < 12]
        torch.testing.assert_close(some[step], outs[step][alive], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_decoding_tree_matches_per_path_reference(target):
    head = make_head(target, depth=4)
    drafter = EagleDrafter(head, target)
    prompt = torch.randint(0, target.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    pre = target.prefill(prompt)
    drafter.extend(pre.hidden)
    root = 17
    tree = drafter.propose(root, target.past_len, 100, width=3).full
    assert tree.scores == sorted(tree.scores, reverse=True)
    assert all(p < i for i, p in enumerate(tree.parents) if i)  # parents first: prefixes are trees
    assert max(tree.depths) == 4 and len(tree) <= 1 + 3 + 3 * 3 * 3
    embed = target.model.get_input_embeddings()
    fused = head.fuse(pre.hidden)
    lm = head.output_weight(target.model.get_output_embeddings().weight)
    for node in range(len(tree)):
        kids = [c for c in range(len(tree)) if tree.parents[c] == node]
        if not kids:
            continue
        path, n = [], node
        while n > 0:
            path.append(tree.tokens[n])
            n = tree.parents[n]
        seq = prompt + [root] + path[::-1]
        state = reference_states(head, embed, fused, seq, known=len(prompt))[-1]
        lp = head.logits(state[None], lm).log_softmax(-1)[0]
        for c in kids:
            torch.testing.assert_close(tree.scores[c] - tree.scores[node], float(lp[tree.tokens[c]]), atol=1e-3,
                                       rtol=0)
        assert sorted(tree.tokens[c] for c in kids) == sorted(lp.topk(3).indices.tolist())
    target.reset()


def test_eagle_decoding_is_lossless_and_checkpoints_round_trip(target, tmp_path):
    head = make_head(target, layers=1, depth=6)
    path = head.save_pretrained(tmp_path / "eagle")
    loaded = load_drafter(path, target=target)
    assert isinstance(loaded, EagleHead) and loaded.config.kind == "eagle3"
    with pytest.raises(DrafterMismatchError, match="load_drafter"):  # the block class loads block heads only
        DraftHead.from_pretrained(path, target=target)
    for budget in (4, 32, "auto"):
        jf = jetflow.JetFlow(target, loaded, budget=budget, width=4, cost_cache=tmp_path / "costs")
        for prompt in ([5, 6, 7], [100, 3, 44, 9, 2]):
            ar = jetflow.generate(target, prompt, max_new_tokens=25)
            spec = jf.generate(prompt, max_new_tokens=25)
            assert spec.token_ids == ar.token_ids
            size = spec.stats["mean_tree_size"]  # auto may take plain steps (size 0) when drafting does not pay
            assert (0 <= size <= 256) if budget == "auto" else (1 <= size <= budget)
        a = jf.generate([5, 6, 7], max_new_tokens=20, temperature=0.8, seed=3).token_ids
        assert a == jf.generate([5, 6, 7], max_new_tokens=20, temperature=0.8, seed=3).token_ids


def test_eagle_head_overfits_a_tiny_set(target, tmp_path):
    from jetflow.data.prompts import Prompt
    from jetflow.data.regenerate import regenerate
    from jetflow.training.trainer import TrainConfig, Trainer, load_sequences

    prompts = [Prompt("toy", f"toy/{i}", (("user", "abc"[i % 3] * (i + 1)),)) for i in range(6)]
    regenerate(target, prompts, tmp_path / "data", max_new_tokens=40, batch_size=6, shard_size=6, progress=False)
    seqs = load_sequences(tmp_path / "data", target)
    cfg = TrainConfig(head="eagle3", block_size=5, layers=1, lr=1e-2, warmup_steps=5, epochs=80, batch_size=2,
                      eval_every=1000, save_every=1000, eval_sequences=1, gamma=4.48)
    trainer = Trainer(target, seqs, tmp_path / "run", cfg)
    first = trainer.evaluate()
    trainer.fit(log=lambda r: None)
    after = trainer.evaluate()
    held_out = seqs[trainer.eval_set[0]]  # one per unroll step (ttt_steps = depth 4) the answer allows
    assert len(after["top1_agreement"]) == min(4, held_out.answer_len - 1)
    assert after["eval_loss"] < first["eval_loss"] / 4, (first, after)
    head = load_drafter(tmp_path / "run" / "drafter", target=target)
    jf = jetflow.JetFlow(target, head, budget=16, width=3)
    assert lossless_tau(jf, seqs, trainer.train_set) > 2.5
