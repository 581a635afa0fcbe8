"""The single-stream prefix cache of the torch runtime: a prefill keeps the cache of the prefix it
shares with the committed tokens and hands back the features kept for them, checked against
brute-force references (fresh prefills, cache-free forwards) and against the features the verifies
that committed those tokens returned."""

import random

import numpy as np
import pytest
import torch

import jetflow
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.prefix_cache import CommittedFeatures, shared_prefix_length
from jetflow.models.target import TargetModel
from jetflow.tree.mask import path_to_root
from tiny import ARCHS, tiny_model

ATOL = 1e-4


@pytest.mark.parametrize("seed", range(20))
def test_shared_prefix_length_against_brute_force(seed):
    rng = random.Random(seed)
    held = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
    ids = np.asarray([rng.randrange(3) for _ in range(rng.randint(1, 12))], dtype=np.int32)
    limit = rng.randint(-1, 14)
    want = 0
    while want < min(limit, len(held), ids.size) and held[want] == ids[want]:
        want += 1
    assert shared_prefix_length(held, ids, limit) == want


@pytest.mark.parametrize("seed", range(10))
def test_committed_features_against_brute_force(seed):
    """Rows of contiguous commits are kept; a commit without features ends them until they are cut
    back to where the committed tokens and the rows agree."""
    rng = random.Random(seed)
    kept, reference, committed = CommittedFeatures(), [], 0  # reference: the rows that follow on
    for _ in range(60):
        op = rng.random()
        if op < 0.5:  # a commit of n tokens, with or without their features
            n = rng.randint(1, 4)
            rows = torch.randn(n, 3) if rng.random() < 0.8 else None
            kept.add(committed, rows)
            if rows is not None and committed == len(reference):
                reference += list(rows)
            committed += n
        elif op < 0.65 and kept.length:  # the last k tokens' rows computed again (a side branch's)
            k = rng.randint(1, min(kept.length, 5))
            rows = torch.randn(k, 3)
            kept.replace_tail(rows)
            reference[-k:] = list(rows)
        else:  # a prefill keeping the first n committed tokens
            n = rng.randint(0, committed)
            kept.truncate(n)
            reference, committed = reference[:n], n
        assert kept.length == len(reference)
        n = rng.randint(0, kept.length)
        if n:
            assert torch.equal(kept.rows(n), torch.stack(reference[:n]))
        else:
            assert kept.rows(0).shape[0] == 0
    with pytest.raises(ValueError, match="held for"):
        kept.rows(kept.length + 1)
    with pytest.raises(ValueError, match="cannot replace the last"):
        kept.replace_tail(torch.randn(kept.length + 1, 3))


def reference_forward(model, ids, taps):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[t + 1][0] for t in taps], -1)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def runtime(request, tokenizer):
    model = tiny_model(request.param)
    return model, TargetModel(model, tokenizer, name=f"tiny-{request.param}", tapped_layers=[0, 2])


def speculative_rounds(target, seed: int) -> tuple[list[int], torch.Tensor]:
    """A prompt and three verify/commit rounds of random trees, as the speculative loop runs them:
    (the committed tokens, the features the prefill and the verifies returned for them)."""
    rng = random.Random(seed)
    seq = [rng.randrange(256) for _ in range(rng.randint(4, 10))]
    features = [target.prefill(seq).hidden]
    for _ in range(3):
        n = rng.randint(1, 12)
        tokens, parents = [rng.randrange(256) for _ in range(n)], [-1] + [rng.randrange(0, i) for i in range(1, n)]
        out = target.verify(tokens, parents)
        path = path_to_root(parents, rng.randrange(n))
        target.commit(path)
        seq += [tokens[j] for j in path]
        features.append(out.hidden[path])
    assert target.token_ids == seq
    return seq, torch.cat(features)


@pytest.mark.parametrize("seed", range(3))
def test_a_prefill_takes_a_shared_prefix_and_its_features_from_the_cache(runtime, seed):
    model, target = runtime
    target.prefix_cache = True
    held, _ = speculative_rounds(target, seed)
    for shared in (len(held), len(held) - 3, 2, 0):
        follow = held[:shared] + [7, 8, 9]
        _, features = speculative_rounds(target, seed)  # the same tokens committed again
        out = target.prefill(follow)
        assert target.reused_tokens == shared and target.token_ids == follow and target.past_len == len(follow)
        ref_logits, ref_hidden = reference_forward(model, follow, target.tapped_layers)
        torch.testing.assert_close(out.logits[-1], ref_logits[-1], atol=ATOL, rtol=0)
        assert out.hidden.shape == ref_hidden.shape
        assert torch.equal(out.hidden[:shared], features[:shared])  # handed back as the verifies returned them
        torch.testing.assert_close(out.hidden, ref_hidden, atol=ATOL, rtol=0)
        # and decoding goes on from there as from a fresh forward
        step = target.extend([11, 12])
        torch.testing.assert_close(step.logits, reference_forward(model, follow + [11, 12], [0])[0][-2:], atol=ATOL, rtol=0)
    whole = list(target.token_ids)
    target.prefill(whole)
    assert target.reused_tokens == len(follow)  # extend() read no features for the last two tokens
    target.prefill(whole, return_hidden=False)
    assert target.reused_tokens == len(whole) - 1  # the last prompt token runs again, for its logits


def test_features_end_at_a_commit_without_them(runtime):
    """A plain step that reads no features (``auto`` settled against drafting) ends the rows kept: a
    prefill wanting features reuses only the prefix they cover; one that wants none, all of it."""
    model, target = runtime
    target.prefix_cache = True
    prompt = [3, 4, 5, 6, 7]
    target.prefill(prompt)
    target.extend([8], return_hidden=False)
    target.extend([9, 10], return_hidden=True)  # (rows past a gap are not taken)
    follow = prompt + [8, 9, 10, 11]
    out = target.prefill(follow)
    assert target.reused_tokens == len(prompt) and target.features.length == len(follow)
    torch.testing.assert_close(out.hidden, reference_forward(model, follow, target.tapped_layers)[1], atol=ATOL, rtol=0)
    target.extend([12], return_hidden=False)
    target.prefill(follow + [12, 13], return_hidden=False)
    assert target.reused_tokens == len(follow) + 1
    assert target.features.length == len(follow)  # a prefill without features adds none


def test_no_reuse_when_off_or_after_the_taps_change(runtime):
    model, target = runtime
    target.prefix_cache = False
    target.prefill([1, 2, 3, 4])
    target.prefill([1, 2, 3, 4, 5])
    target.extend([6])
    assert target.reused_tokens == 0 and target.features.length == 0  # none kept without the cache
    target.prefix_cache = True
    target.prefill([1, 2, 3, 4, 5, 6, 7], return_hidden=False)
    assert target.reused_tokens == 0  # what a request made with the cache off committed is not reused
    target.extend([8], return_hidden=False)
    target.prefill([1, 2, 3, 4, 5, 6, 7, 8, 9], return_hidden=False)
    assert target.reused_tokens == 8
    target.prefill([1, 2, 3, 4, 5, 6])  # no features held for the cached part: computed again
    assert target.reused_tokens == 0 and target.features.length == 6
    target.set_tapped_layers([1])
    out = target.prefill([1, 2, 3, 4, 5, 6, 7])  # the features held are of other layers
    assert target.reused_tokens == 0
    torch.testing.assert_close(out.hidden, reference_forward(model, [1, 2, 3, 4, 5, 6, 7], [1])[1], atol=ATOL, rtol=0)
    target.prefill([1, 2, 3, 4, 5, 6, 7, 8], return_hidden=False)
    assert target.reused_tokens == 7
    target.set_tapped_layers([0, 2])


def test_a_chats_next_turn_decodes_the_same_from_the_cache(tokenizer):
    """Speculative decoding of a second turn from the cache (the drafter reads the features kept
    for the first turn and its answer) gives the output of a fresh prefill, and of plain decoding."""
    target = TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])
    torch.manual_seed(0)
    jf = jetflow.JetFlow(target, DraftHead(DraftHeadConfig.for_target(target, block_size=8)), budget=8)
    given = []  # the features the drafter gets at each request's start
    reset, extend = jf.drafter.reset, jf.drafter.extend
    jf.drafter.reset = lambda: (given.append(None), reset())[1]
    jf.drafter.extend = lambda f: (given.__setitem__(-1, f) if given[-1] is None else None, extend(f))[1]
    turn1 = [{"role": "user", "content": "Name three rivers."}]
    answer = jf.generate(turn1, max_new_tokens=24)
    turn2 = turn1 + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "Which is longest?"}]
    cached = jf.generate(turn2, max_new_tokens=24)
    assert cached.cached_prompt_tokens > len(jetflow.decoding.prompt.encode_prompt(target.tokenizer, turn1))
    target.prefix_cache = False
    fresh = jf.generate(turn2, max_new_tokens=24)
    # the drafter read every prompt position's features, the cached part's included, as a fresh prefill gives them
    assert given[1].shape == given[2].shape == (cached.prompt_tokens, given[2].shape[1])
    torch.testing.assert_close(given[1], given[2], atol=ATOL, rtol=0)
    plain = jetflow.generate(target, turn2, max_new_tokens=24)
    target.prefix_cache = True
    assert fresh.cached_prompt_tokens == 0
    assert cached.token_ids == fresh.token_ids == plain.token_ids


def test_a_conversation_keeps_the_models_own_tokens(tokenizer):
    """Each next prompt is the previous prompt, the answer's own tokens and the encoded rest of the
    template: it decodes to the conversation's rendered text, and extends what the target committed
    token for token even where the text would encode otherwise (here: answers whose bytes are not
    valid UTF-8, so their text does not encode back to them)."""
    from jetflow.decoding.conversation import Conversation

    target = TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])
    jf = jetflow.JetFlow(target, None)
    conversation = Conversation(tokenizer, system="Be brief.")
    plain_differs = False
    for turn in ("Name three rivers.", "Which is longest?", "And the shortest?"):
        ids = conversation.prompt(turn)
        rendered = tokenizer.apply_chat_template(conversation.messages + [{"role": "user", "content": turn}],
                                                 tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(ids) == rendered
        plain = jetflow.decoding.prompt.encode_prompt(tokenizer, conversation.messages + [{"role": "user", "content": turn}])
        plain_differs |= ids != plain
        held = list(target.token_ids)
        result = jf.generate(ids, max_new_tokens=12)
        if held:  # all the target committed last turn is the start of this prompt
            assert ids[:len(held)] == held and result.cached_prompt_tokens == len(held)
        conversation.add_answer(result)
    assert plain_differs  # the case the class is for did occur
    conversation.reset()
    assert conversation.messages == [{"role": "system", "content": "Be brief."}]
    assert conversation.prompt("hi") == jetflow.decoding.prompt.encode_prompt(tokenizer, conversation.messages + [
        {"role": "user", "content": "hi"}])
    with pytest.raises(RuntimeError, match="without a prompt"):
        Conversation(tokenizer).add_answer(result)


def test_a_conversation_encodes_again_where_tokens_and_text_disagree(tokenizer):
    """An answer whose tokens do not decode to its text (a stop string cut it inside its tokens)
    leaves the next prompt to the plain encoding of the messages; a stop token at its end is dropped
    (the template writes its own end of turn)."""
    from types import SimpleNamespace

    from jetflow.decoding.conversation import Conversation
    from jetflow.decoding.prompt import encode_prompt

    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for token_ids, text, spliced in ((ids("abcd"), "ab", False), (ids("ab") + [257], "ab", True), (ids("ab"), "ab", True)):
        conversation = Conversation(tokenizer)
        first = conversation.prompt("hi")
        conversation.add_answer(SimpleNamespace(token_ids=token_ids, text=text))
        nxt = conversation.prompt("more")
        assert nxt == encode_prompt(tokenizer, conversation.messages + [{"role": "user", "content": "more"}])
        assert (conversation._last is not None) == spliced  # spliced from the answer's tokens, or encoded whole
        if spliced:
            assert nxt[:len(first) + 2] == first + ids("ab")
