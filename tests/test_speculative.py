"""Speculative decoding must reproduce the target exactly: greedy token for token, sampling in
distribution (and, with a seed, token for token too)."""

import math
from collections import Counter

import pytest
import torch

import jetflow
from jetflow.decoding import speculative
from jetflow.decoding.api import prepare_request
from jetflow.decoding.autoregressive import autoregressive_stream
from jetflow.decoding.sampling import next_token
from jetflow.decoding.speculative import speculative_stream
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from tiny import OracleDrafter, tiny_model

PROMPT = [10, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def target(tokenizer):
    return TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])


def random_jetflow(target, attention="causal", block_size=8, **kw):
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, attention=attention, block_size=block_size))
    return jetflow.JetFlow(target, head, **kw)


def run(target, drafter, prompt, budget, width, **request):
    """Both loops on the same request: (autoregressive result, speculative result)."""
    ids, params, out = prepare_request(target, prompt, **request)
    *_, ar = autoregressive_stream(target, ids, params, out)
    ids, params, out = prepare_request(target, prompt, **request)
    *_, spec = speculative_stream(target, drafter, ids, params, out, budget, width)
    return ar, spec


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
@pytest.mark.parametrize("budget, width", [(1, 7), (8, 7), (64, 7), (256, 7), (16, 1), (0, 7)])
def test_greedy_random_head_equals_autoregressive(target, attention, budget, width):
    jf = random_jetflow(target, attention)
    ar = jetflow.generate(target, PROMPT, max_new_tokens=40)
    spec = jf.generate(PROMPT, max_new_tokens=40, budget=budget, width=width)
    assert spec.token_ids == ar.token_ids and spec.text == ar.text
    assert spec.stats["rounds"] >= 1 and sum(spec.stats["accept_lengths"]) + 1 >= len(spec.token_ids)


@pytest.mark.parametrize("good_depth", [99, 3])
@pytest.mark.parametrize("budget, width", [(1, 1), (8, 3), (64, 7), (256, 7)])
def test_greedy_long_accepted_runs(target, good_depth, budget, width):
    """An oracle drafter gets whole blocks accepted, so EOS and max_new_tokens land mid-round."""
    drafter = OracleDrafter(target, block_size=8, good_depth=good_depth, sharpen=4.0)
    ar, spec = run(target, drafter, PROMPT, budget, width, max_new_tokens=37)
    assert spec.token_ids == ar.token_ids and len(ar.token_ids) == 37 and spec.finish_reason == "length"
    if good_depth == 99 and budget >= 8:
        assert spec.stats["tau"] > (4 if budget >= 64 else 2)  # rounds really did accept long runs
    # A stop token that the target emits in the middle of a round.
    eos = ar.token_ids[13]
    first = ar.token_ids.index(eos)
    target.model.generation_config.eos_token_id = eos
    try:
        ar2, spec2 = run(target, drafter, PROMPT, budget, width, max_new_tokens=37)
    finally:
        target.model.generation_config.eos_token_id = None
    assert spec2.token_ids == ar2.token_ids == ar.token_ids[: first + 1]
    assert spec2.finish_reason == ar2.finish_reason == "stop"


def test_stop_string_and_context_end(target):
    drafter = OracleDrafter(target, block_size=8)
    ar, _ = run(target, drafter, PROMPT, 64, 7, max_new_tokens=30)
    stop = ar.text[8:10]
    ar2, spec2 = run(target, drafter, PROMPT, 64, 7, max_new_tokens=30, stop=[stop])
    assert spec2.text == ar2.text and spec2.finish_reason == "stop"
    saved = target.max_context
    target.max_context = 20
    try:
        ar3, spec3 = run(target, drafter, PROMPT, 64, 7, max_new_tokens=100)
    finally:
        target.max_context = saved
    assert spec3.token_ids == ar3.token_ids and spec3.finish_reason == "length"


def test_seeded_sampling_reproduces_autoregressive_sampling(target):
    drafter = OracleDrafter(target, block_size=8)
    for seed in range(3):
        ar, spec = run(target, drafter, PROMPT, 32, 4, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=seed)
        assert spec.token_ids == ar.token_ids


# ------------------------------------------------------------------ sampling losslessness (statistical)
V = 12  # small vocabulary so the joint law of two tokens has few outcomes
N = 2000
# A lossy acceptance rule is far off: chi2 641-785 against limits of 35-38 at 300 samples (measured
# for both parametrizations below), so catching it needs far fewer samples than the real check.
N_BROKEN = 300
SMALL_PROMPT = [1, 5, 3, 7]


@pytest.fixture(scope="module")
def small_target(tokenizer):
    model = tiny_model("llama", vocab_size=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.35)  # moderately peaked distributions
    return TargetModel(model, tokenizer, tapped_layers=[1])


def exact_joint(target, params):
    """P(first two tokens) by enumeration with plain forwards."""
    from jetflow.decoding.sampling import target_probs

    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([SMALL_PROMPT])).logits[0, -1], params)
        joint = {}
        for a in range(V):
            if p1[a] > 0:
                p2 = target_probs(target.model(torch.tensor([SMALL_PROMPT + [a]])).logits[0, -1], params)
                joint.update({(a, b): float(p1[a] * p2[b]) for b in range(V) if p2[b] > 0})
    return joint


def chi_square_passes(counts, probs, n):
    """Pearson chi-square against ``probs`` at the 0.999 level (cells with expected < 5 pooled)."""
    cells = sorted(probs, key=lambda c: -probs[c])
    big = [c for c in cells if probs[c] * n >= 5]
    small = [c for c in cells if probs[c] * n < 5]
    stat = sum((counts.get(c, 0) - probs[c] * n) ** 2 / (probs[c] * n) for c in big)
    if small:
        e = sum(probs[c] for c in small) * n
        o = sum(counts.get(c, 0) for c in small)
        stat += (o - e) ** 2 / e if e > 0 else 0
    k = len(big) + (1 if small else 0) - 1
    z = 3.09  # 0.999 quantile, Wilson-Hilferty approximation of the chi-square quantile
    limit = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return stat < limit, stat, limit


def sample_pairs(target, drafter, temperature, top_p, loop, n=N):
    counts = Counter()
    for seed in range(n):
        ids, params, out = prepare_request(target, SMALL_PROMPT, max_new_tokens=2, temperature=temperature,
                                           top_p=top_p, seed=10_000 + seed)
        if loop == "ar":
            *_, r = autoregressive_stream(target, ids, params, out)
        else:
            *_, r = speculative_stream(target, drafter, ids, params, out, 16, 3)
        counts[tuple(r.token_ids[:2])] += 1
    return counts


def broken_accept(tree, logits, params, generator):
    """Deliberately wrong: accept any drafted child the target finds plausible (p > 0.05)."""
    from jetflow.decoding.sampling import target_probs

    path, node = [0], 0
    while True:
        probs = target_probs(logits[node], params)
        ok = [c for t, c in tree.children[node].items() if probs[t] > 0.05]
        if not ok:
            return path, next_token(logits[node], params, generator)
        node = min(ok)
        path.append(node)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 0.9)])
def test_sampling_matches_target_distribution(small_target, temperature, top_p, monkeypatch):
    params = jetflow.SamplingParams(temperature, 0, top_p)
    probs = exact_joint(small_target, params)
    drafter = OracleDrafter(small_target, block_size=3, good_depth=1)  # depth 1 right, deeper random
    ok, stat, limit = chi_square_passes(sample_pairs(small_target, drafter, temperature, top_p, "spec"), probs, N)
    assert ok, f"speculative sampling is off the target's distribution: chi2={stat:.1f} > {limit:.1f}"
    # The test has teeth: a lossy acceptance rule is caught.
    monkeypatch.setattr(speculative, "accept_path", broken_accept)
    broken = sample_pairs(small_target, drafter, temperature, top_p, "spec", N_BROKEN)
    ok, stat, limit = chi_square_passes(broken, probs, N_BROKEN)
    assert not ok, f"broken acceptance rule went unnoticed: chi2={stat:.1f} <= {limit:.1f}"


def test_one_request_at_a_time_per_jetflow(target):
    """A newer request makes an older, unfinished stream refuse to go on (it would continue from the
    newer request's state); two threads never decode at once; each finished output is the target's."""
    import threading

    from jetflow.errors import RequestSupersededError

    jf = random_jetflow(target, budget=8)
    want = {p: jetflow.generate(target, list(p), max_new_tokens=12).token_ids for p in ((5, 6, 7), (8, 9, 10, 11))}
    old = jf.stream([5, 6, 7], max_new_tokens=12)
    next(old)
    assert jf.generate([8, 9, 10, 11], max_new_tokens=12).token_ids == want[(8, 9, 10, 11)]
    with pytest.raises(RequestSupersededError, match="a newer request started on the same JetFlow"):
        next(old)
    outcomes = []

    def request(prompt):
        try:
            outcomes.append(("ok", prompt, jf.generate(list(prompt), max_new_tokens=12).token_ids))
        except RequestSupersededError:
            outcomes.append(("superseded", prompt, None))

    threads = [threading.Thread(target=request, args=(p,)) for p in want for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 6 and any(kind == "ok" for kind, _, _ in outcomes)
    assert all(ids == want[p] for kind, p, ids in outcomes if kind == "ok")


def test_request_options_are_checked_by_name(target):
    from jetflow.errors import InvalidRequestError, RequestSupersededError

    jf = random_jetflow(target, budget=8)
    assert jf.generate(PROMPT, max_new_tokens=4, stop=None).new_tokens == 4  # None: no stop strings
    with pytest.raises(InvalidRequestError, match="unknown request option.s. max_tokens; the options are max_new_tokens"
                                                  ".*chat, budget, width, stream .generate.$"):
        jf.generate(PROMPT, max_tokens=4)
    assert jf.generate(PROMPT, max_new_tokens=4, budget=2, width=1).stats["budget"] == 2  # per-request overrides
    with pytest.raises(InvalidRequestError, match="unknown request option.s. budget; the options are .*, chat$"):
        jetflow.generate(target, PROMPT, budget=4)
    assert jetflow.RequestSupersededError is RequestSupersededError
    with pytest.raises(InvalidRequestError, match="expected a loaded target, got the name 'smollm2-135m-instruct'"):
        jetflow.generate("smollm2-135m-instruct", "hi")


def test_decoders_sharing_a_target_each_read_their_own_heads_layers(target):
    """Two decoders on one target, heads tapping different layers: each request taps its own head's
    (the later decoder's construction set the target's taps to its head's; the earlier one's head
    would get features of the wrong width)."""
    torch.manual_seed(0)
    a = jetflow.JetFlow(target, DraftHead(DraftHeadConfig.for_target(target, block_size=6)))
    target.set_tapped_layers([1, 2, 3])
    b = jetflow.JetFlow(target, DraftHead(DraftHeadConfig.for_target(target, block_size=6)))
    try:
        ar = jetflow.generate(target, PROMPT, max_new_tokens=20)
        for jf, taps in ((a, (0, 2)), (b, (1, 2, 3)), (a, (0, 2))):
            assert jf.generate(PROMPT, max_new_tokens=20, budget=8).token_ids == ar.token_ids
            assert target.tapped_layers == taps
    finally:
        target.set_tapped_layers([0, 2])


def test_drafters_that_read_no_features_are_given_none(target, monkeypatch):
    """Prompt lookup alone, and a budget of 0, never read the target's features: none are copied
    out (a cost the `lookup` baseline paid for nothing), and budget 0 takes plain greedy steps."""
    from jetflow.decoding.lookup_drafter import LookupDrafter

    asked, steps = [], []
    verify, prefill, greedy_step = target.verify, target.prefill, target.greedy_step
    monkeypatch.setattr(target, "verify", lambda *a, **k: asked.append(k["return_hidden"]) or verify(*a, **k))
    monkeypatch.setattr(target, "prefill", lambda *a, **k: asked.append(k["return_hidden"]) or prefill(*a, **k))
    monkeypatch.setattr(target, "greedy_step", lambda t: steps.append(t) or greedy_step(t))
    prompt = [5, 6, 7, 8] * 5
    ar = jetflow.generate(target, prompt, max_new_tokens=20)
    asked.clear()
    lookup = jetflow.JetFlow(target, drafter=LookupDrafter(target)).generate(prompt, max_new_tokens=20, budget=8)
    assert lookup.token_ids == ar.token_ids and len(asked) > 1 and not any(asked)
    asked.clear(), steps.clear()
    plain = random_jetflow(target).generate(prompt, max_new_tokens=20, budget=0)
    assert plain.token_ids == ar.token_ids and not any(asked) and len(steps) == len(ar.token_ids) - 1
    assert not lookup.stats["features"] and not plain.stats["features"]


def test_a_request_that_ends_at_its_first_token_has_no_tau(target):
    """No round ran: tau is None, not 0.0 (a server's tau metric would average it in as a round that
    accepted nothing, below the bonus token every round has)."""
    result = random_jetflow(target).generate(PROMPT, max_new_tokens=1, budget=8)
    assert len(result.token_ids) == 1 and result.stats["rounds"] == 0 and result.stats["tau"] is None
    assert random_jetflow(target).generate(PROMPT, max_new_tokens=3, budget=8).stats["tau"] >= 1
