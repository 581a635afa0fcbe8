"""Head + prompt lookup in one tree: the merge against brute force, the calibration, and lossless
decoding with it."""

import math
import random

import numpy as np
import pytest
import torch

import jetflow
from jetflow.decoding.budget import AdaptiveBudget
from jetflow.decoding.costs import CostCurve
from jetflow.decoding.lookup_drafter import MAX_MATCH, lookup_match
from jetflow.decoding.mixed_drafter import (MATCH_ROWS, LookupCalibration, MixedDrafter, MixedProposal,
                                             RequestCalibration, log_probs, match_row)
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.eagle_head import EagleHead
from jetflow.models.target import TargetModel
from jetflow.tree.build import build_tree
from tiny import tiny_model


class FixedProposal:
    def __init__(self, logprobs, root, width):
        self.logprobs, self.root, self.width = logprobs, root, width

    def tree(self, budget):
        return build_tree(self.logprobs, self.root, budget, self.width)


def paths(tree, upto=None):
    """The token path of every node (root excluded) among the first ``upto`` nodes."""
    out = []
    for node in range(1, len(tree) if upto is None else upto):
        p, n = [], node
        while n > 0:
            p.append(tree.tokens[n])
            n = tree.parents[n]
        out.append(tuple(reversed(p)))
    return out


def reference_merge(base, chain, logq, budget):
    """Brute force: repeatedly add the best available candidate (the next base node or the next
    chain token not yet in the tree), a candidate's value being its parent's value times its own
    conditional q, where a path both sources hold keeps the value of whichever added it first."""
    value = {(): 0.0}
    order = []
    i, j = 1, 0
    base_paths = paths(base)
    while len(order) < budget and (i < len(base) or j < len(chain)):
        while j < len(chain) and tuple(chain[:j + 1]) in value:  # the head took it already
            j += 1
        hv = cv = -math.inf
        if i < len(base):
            bp = base_paths[i - 1]
            hv = value[bp[:-1]] + base.scores[i] - base.scores[base.parents[i]]
        if j < len(chain):
            cv = value[tuple(chain[:j])] + logq[j]
        if hv == cv == -math.inf:
            break
        if hv >= cv:
            path, v, i = base_paths[i - 1], hv, i + 1
        else:
            path, v, j = tuple(chain[:j + 1]), cv, j + 1
        if path not in value:
            value[path] = v
            order.append(path)
    return order


@pytest.mark.parametrize("seed", range(40))
def test_merge_matches_brute_force(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    depth, vocab = rng.randint(1, 6), rng.randint(2, 8)
    logprobs = (torch.randn(depth, vocab) * rng.choice([0.5, 2.0, 5.0])).log_softmax(-1)
    width, budget = rng.randint(1, 4), rng.randint(0, 30)
    # chains that often follow the head's own tokens (where the two coincide), or random ones
    top = logprobs.topk(min(width, vocab), dim=-1).indices.tolist()
    chain = [rng.choice(top[d]) if d < depth and rng.random() < 0.7 else rng.randrange(vocab)
             for d in range(rng.randint(0, 8))]
    q = np.array([rng.choice([0.0, 0.05, 0.3, 0.7, 0.99, 1.0, rng.random()]) for _ in chain])
    proposal = MixedProposal(FixedProposal(logprobs, 99, width), 99, chain, log_probs(q))
    tree = proposal.tree(budget)
    base = build_tree(logprobs, 99, budget, width)
    assert paths(tree) == reference_merge(base, chain, proposal.chain_logq, budget)
    assert len(tree) - 1 <= budget and all(p < n for n, p in enumerate(tree.parents) if n)
    assert len(set(paths(tree))) == len(tree) - 1  # a token proposed twice is one node
    for size in range(1, len(tree) + 1):  # every prefix is a tree (what --budget auto verifies)
        assert all(tree.parents[n] < size for n in range(1, size))
    for n in range(budget):  # ... and the tree of that budget (what one build at the largest prices)
        small = proposal.tree(n)
        assert (small.tokens, small.parents, small.scores) == (tree.tokens[:n + 1], tree.parents[:n + 1],
                                                               tree.scores[:n + 1])
    if q.size and (q == 1.0).all() and budget >= len(chain):  # certain lookup tokens come first
        assert paths(tree)[:len(chain)] == [tuple(chain[:k + 1]) for k in range(len(chain))]


def _rows(*rows):
    """Per-depth log-probabilities over 6 tokens, from the first few tokens' probabilities."""
    return torch.tensor([row + [0.001] * (6 - len(row)) for row in rows]).log()


def test_a_chain_through_a_head_node_goes_on_at_that_nodes_value():
    """The chain's first token is the head's best (q .9, the chain's own .2): the chain's next token
    (q .8) is valued .9 x .8 and taken right after it, not once the head's nodes fell below .2."""
    head = FixedProposal(_rows([0.9, 0.05], [0.6, 0.3]), 99, 2)
    tree = MixedProposal(head, 99, [0, 5], log_probs([0.2, 0.8])).tree(5)
    assert paths(tree) == [(0,), (0, 5), (0, 0), (0, 1), (1,)]
    assert np.exp(tree.scores[1:]) == pytest.approx([0.9, 0.72, 0.54, 0.27, 0.05])


def test_head_nodes_below_a_chain_token_keep_the_heads_order():
    """The chain proposes the head's second token with q .9: that node is valued .9 and the chain's
    next token .81, but the head's child of it (.9 x .5 = .45) stays behind the head's earlier nodes
    (.3, .24) in the head's order, by design (docs/results.md, "How the lookup chain is merged")."""
    head = FixedProposal(_rows([0.6, 0.35], [0.01, 0.02, 0.5, 0.4]), 99, 2)
    tree = MixedProposal(head, 99, [1, 3], log_probs([0.9, 0.9])).tree(6)
    assert paths(tree) == [(1,), (1, 3), (0,), (0, 2), (0, 3), (1, 2)]
    assert np.exp(tree.scores[1:]) == pytest.approx([0.9, 0.81, 0.6, 0.3, 0.24, 0.45])


def test_lookup_match_reports_the_match_length():
    history = np.array([5, 6, 7, 8, 1, 2, 6, 7])
    assert lookup_match(history) == (2, [8, 1, 2, 6, 7])  # "6 7" occurred before, followed by 8 1 2 ...
    assert lookup_match(np.array([1, 2, 3])) == (0, [])
    assert lookup_match(np.array([4, 9, 4]), max_draft=1) == (1, [9])
    # found by its last 3 tokens, but it agrees 6 back: "1 2 3 4 5 6" occurred before, followed by 7
    assert lookup_match(np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4, 5, 6]), max_draft=2) == (6, [7, 9])
    long = np.array(list(range(30)) * 2)  # a passage repeated: the match is capped
    assert lookup_match(long, max_draft=1) == (MAX_MATCH, [0])


def test_match_rows():
    """One row per match length up to 7, then 8-11, 12-19 and 20 on; row 0 is no match."""
    assert [match_row(n) for n in range(0, 9)] == list(range(0, 9))
    assert {match_row(n) for n in range(8, 12)} == {8} and {match_row(n) for n in range(12, 20)} == {9}
    assert match_row(MAX_MATCH) == MATCH_ROWS - 1 == 10


def test_calibration_counts_like_brute_force():
    rng = random.Random(0)
    cal = LookupCalibration(rows=4, max_depth=10, prior=2.0)
    hits = np.zeros((4, 11))
    trials = np.zeros((4, 11))
    for _ in range(300):
        n, verified = rng.randint(1, 3), rng.randint(0, 10)
        accepted = rng.randint(0, verified)
        cal.observe(n, verified, accepted)
        for d in range(1, verified + 1):
            if d - 1 <= accepted:  # the token before it was accepted: a trial
                trials[n, d] += 1
                hits[n, d] += d <= accepted
    np.testing.assert_array_equal(cal.trials, trials)
    np.testing.assert_array_equal(cal.hits, hits)
    expected, previous = [], 0.5  # each depth's counts shrunk towards the depth above (2 pseudo-trials),
    for d in range(1, 11):        # less one standard error
        previous = (hits[2, d] + 2.0 * previous) / (trials[2, d] + 2.0)
        expected.append(previous - math.sqrt(previous * (1 - previous) / (trials[2, d] + 2.0)))
    np.testing.assert_allclose(cal.rates(2, 10), expected)
    no_evidence = 0.5 - math.sqrt(0.25 / 2)
    assert LookupCalibration().rates(1, 4) == pytest.approx([no_evidence] * 4)


@pytest.mark.parametrize("deepest", [0, 1, 3, 32])
def test_calibration_rates_at_untried_depths_equal_the_full_recurrence(deepest):
    """Rates are computed up to the deepest tried depth and carried below it: equal to running the
    recurrence over every depth, and log_rates equal to their clipped logs."""
    rng = random.Random(deepest)
    cal = LookupCalibration(rows=3, max_depth=32, prior=2.0, window=50)
    for _ in range(200 if deepest else 0):
        verified = rng.randint(1, deepest)
        cal.observe(1, verified, rng.randint(0, verified))
    expected, previous = [], 0.5
    for d in range(1, 33):
        n = cal.trials[1, d] + 2.0
        previous = (cal.hits[1, d] + 2.0 * previous) / n
        expected.append(max(0.0, previous - math.sqrt(previous * (1 - previous) / n)))
    np.testing.assert_allclose(cal.rates(1, 32), expected, rtol=1e-12)
    np.testing.assert_allclose(cal.log_rates(1, 32), np.log(np.clip(expected, 1e-9, 1.0)), rtol=1e-12)
    assert (cal.trials[1, deepest + 1:] == 0).all() and cal.trials[1, 1:].any() == (deepest > 0)


def _pooled_estimates(cal: LookupCalibration, row: int) -> tuple[list[float], list[float]]:
    """Brute force: each depth's point estimate (shrunk towards the depth above) and its trials."""
    points, ns, previous = [], [], 0.5
    for d in range(1, cal.trials.shape[1]):
        n = cal.trials[row, d] + cal.prior
        previous = (cal.hits[row, d] + cal.prior * previous) / n
        points.append(previous)
        ns.append(n)
    return points, ns


def test_request_calibration_shrinks_a_requests_counts_towards_the_pooled_rates():
    """Each depth: (own hits + k p) / (own trials + k), p the pooled point estimate, less one standard
    error of that mix; with no own counts, exactly the pooled rates. Counts go to both; a new request
    starts from the pooled counts alone."""
    rng = random.Random(1)
    pooled = LookupCalibration(rows=3, max_depth=6, prior=2.0)
    cal = RequestCalibration(pooled, strength=4.0)
    for _ in range(60):  # an earlier request
        verified = rng.randint(1, 6)
        cal.observe(rng.randint(1, 2), verified, rng.randint(0, verified))
    before = cal.row_version(2)
    cal.start_request()
    assert cal.row_version(2) != before and cal.own.trials.sum() == 0
    np.testing.assert_allclose(cal.rates(2, 6), pooled.rates(2, 6), rtol=1e-12)
    own_hits, own_trials = np.zeros((3, 7)), np.zeros((3, 7))
    for _ in range(25):  # this request: row 2's chains seldom followed
        verified = rng.randint(1, 6)
        accepted = 0 if rng.random() < 0.8 else verified
        cal.observe(2, verified, accepted)
        for d in range(1, min(verified, accepted + 1) + 1):
            own_trials[2, d] += 1
            own_hits[2, d] += d <= accepted
    np.testing.assert_array_equal(cal.own.trials, own_trials)
    assert pooled.trials[2].sum() > own_trials[2].sum()  # (the pooled counts hold both requests)
    points, ns = _pooled_estimates(pooled, 2)
    expected = []
    for d, (p, n_pooled) in enumerate(zip(points, ns), start=1):
        n, h = own_trials[2, d], own_hits[2, d]
        m = (h + 4.0 * p) / (n + 4.0)
        se = math.sqrt((n * m * (1 - m) + 16.0 * p * (1 - p) / n_pooled) / (n + 4.0) ** 2)
        expected.append(max(0.0, m - se))
    np.testing.assert_allclose(cal.rates(2, 6), expected, rtol=1e-12)
    np.testing.assert_allclose(cal.log_rates(2, 6), np.log(np.clip(expected, 1e-9, 1.0)), rtol=1e-12)
    assert cal.rates(2, 1)[0] < pooled.rates(2, 1)[0]  # this request's failures count for more
    np.testing.assert_allclose(cal.rates(1, 6), pooled.rates(1, 6), rtol=1e-12)  # row 1: no own counts
    with pytest.raises(ValueError, match="strength > 0"):
        RequestCalibration(pooled, strength=0)


def test_a_rows_rates_and_price_key_change_only_with_its_own_counts():
    """Counting one row's chains leaves another row's cached rates and price key as they were (they
    are priced every round of `auto`), and every row's rates stay those of a fresh calibration with
    the same counts."""
    rng = random.Random(2)
    pooled = LookupCalibration(rows=4, max_depth=6, prior=2.0)
    cal = RequestCalibration(pooled, strength=4.0)
    for _ in range(40):
        verified = rng.randint(1, 6)
        cal.observe(rng.randint(1, 3), verified, rng.randint(0, verified))
    keys = {row: cal.row_version(row) for row in (1, 2, 3)}
    rates = {row: cal.rates(row, 6) for row in (1, 2, 3)}
    cached = cal._rates[1]
    cal.observe(2, 4, 1)
    pooled.observe(3, 2, 2)  # another request's count (a batch's fork): in the pooled counts only
    assert cal.row_version(1) == keys[1] and cal.row_version(2) != keys[2] and cal.row_version(3) != keys[3]
    cal.rates(1, 6)
    assert cal._rates[1] is cached  # row 1 served from its cache, not computed again
    fresh_pooled = LookupCalibration(rows=4, max_depth=6, prior=2.0)
    fresh_pooled.load_counts(pooled.counts())
    fresh = RequestCalibration(fresh_pooled, strength=4.0)
    fresh.own.load_counts(cal.own.counts())
    for row in (1, 2, 3):
        np.testing.assert_array_equal(cal.rates(row, 6), fresh.rates(row, 6))
    np.testing.assert_array_equal(cal.rates(1, 6), rates[1])
    assert not np.array_equal(cal.rates(2, 6), rates[2])
    version = cal.row_version(1)
    pooled.load_counts(pooled.counts())  # counts replaced: every row may have changed
    assert cal.row_version(1) != version


def test_each_request_prices_chains_from_its_own_counts():
    """MixedDrafter: a new request (reset) starts from the pooled counts alone, and its price key
    changes; a fork (a batch's request) shares the pooled counts and keeps its own; request_prior=None
    prices by the pooled counts."""
    drafter = MixedDrafter(_Primary(), _History())
    assert isinstance(drafter.rates, RequestCalibration) and drafter.rates.pooled is drafter.calibration
    key = drafter.propose_lookup(3, 100).scores_key
    drafter.rates.observe(3, 5, 0)
    assert drafter.rates.own.trials.sum() == drafter.calibration.trials.sum() == 1
    drafter.reset()
    assert drafter.rates.own.trials.sum() == 0 and drafter.calibration.trials.sum() == 1
    assert drafter.propose_lookup(3, 100).scores_key != key
    fork = drafter.fork(_History())
    assert isinstance(fork.rates, RequestCalibration) and fork.calibration is drafter.calibration
    assert fork.rates is not drafter.rates
    fork.rates.observe(3, 2, 2)  # counted into the shared pool, and into the fork's own request only
    assert drafter.calibration.trials.sum() == 3 and drafter.rates.own.trials.sum() == 0
    pooled_only = MixedDrafter(_Primary(), _History(), request_prior=None)
    assert pooled_only.rates is pooled_only.calibration and pooled_only.fork(_History()).rates is pooled_only.calibration


def test_a_windowed_calibration_follows_a_change_of_text():
    """Chains that were always followed stop being followed: a windowed estimate falls with the
    last window's evidence, the plain sums only slowly."""
    windowed, summed = LookupCalibration(window=50), LookupCalibration()
    for cal in (windowed, summed):
        for _ in range(1000):
            cal.observe(2, 1, 1)  # followed
        for _ in range(100):
            cal.observe(2, 1, 0)  # not followed
    assert windowed.trials[2, 1] == pytest.approx(50)
    assert windowed.hits[2, 1] / windowed.trials[2, 1] == pytest.approx(50 * (1 - 1 / 51) ** 100 / 50, rel=1e-6)
    assert windowed.rates(2, 1)[0] < 0.2 < 0.85 < summed.rates(2, 1)[0]


@pytest.fixture(scope="module")
def target(tokenizer):
    return TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])


@pytest.mark.parametrize("budget", [1, 4, 16, 64, "auto"])
def test_greedy_with_lookup_equals_autoregressive(target, budget, tmp_path):
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=8))
    jf = jetflow.JetFlow(target, head, lookup=True, cost_cache=tmp_path)
    assert isinstance(jf.drafter, MixedDrafter)
    for prompt in ([11, 12, 13, 14] * 5, [7, 8, 9]):
        ar = jetflow.generate(target, prompt, max_new_tokens=48)
        assert jf.generate(prompt, max_new_tokens=48, budget=budget).token_ids == ar.token_ids


@pytest.mark.parametrize("budget", [4, 16])
def test_eagle_tree_with_lookup_equals_autoregressive(target, budget, tmp_path):
    """An EAGLE head's path-dependent tree takes the lookup chain too (bench method eagle3-lookup)."""
    torch.manual_seed(0)
    head = EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=4, kind="eagle3"))
    jf = jetflow.JetFlow(target, head, lookup=True, cost_cache=tmp_path)
    assert isinstance(jf.drafter, MixedDrafter)
    for prompt in ([11, 12, 13, 14] * 5, [7, 8, 9]):
        ar = jetflow.generate(target, prompt, max_new_tokens=32)
        assert jf.generate(prompt, max_new_tokens=32, budget=budget).token_ids == ar.token_ids


def test_auto_takes_lookup_only_rounds_when_the_head_is_dear_and_stays_lossless(target, monkeypatch):
    """A head forward priced far above a verify: after its first draft, rounds verify the lookup
    chain alone (no head forward) whenever one matches; outputs stay the target's own."""
    monkeypatch.setattr(AdaptiveBudget, "_observe_verify", lambda *a: None)  # price by this curve only
    monkeypatch.setattr(AdaptiveBudget, "_observe_draft", lambda *a: None)
    monkeypatch.setattr(AdaptiveBudget, "_observe_overhead", lambda *a, **k: None)  # (a tiny model's Python)
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=8))
    jf = jetflow.JetFlow(target, head, lookup=True, budget="auto")
    sizes = [1, 4, 16, 64]
    jf._adaptive = AdaptiveBudget(CostCurve({"c1_ms": 10.0, "verify_ms": {n: 10.0 + 0.1 * n for n in sizes},
                                             "draft_ms": {n: 50.0 for n in sizes}}))
    prompt = [11, 12, 13, 14] * 5
    spec = jf.generate(prompt, max_new_tokens=48)
    assert spec.token_ids == jetflow.generate(target, prompt, max_new_tokens=48).token_ids
    kinds = spec.stats["round_kinds"]
    # (a random model seldom follows a chain, and the request's own counts soon price its chains out)
    assert kinds["lookup"] >= 3 and sum(kinds.values()) == spec.stats["rounds"]
    sampled = jf.generate(prompt, max_new_tokens=32, temperature=0.8, seed=3)
    assert sampled.token_ids == jetflow.generate(target, prompt, max_new_tokens=32, temperature=0.8, seed=3).token_ids


class _Primary:
    head, block_size, int8 = None, 8, False

    def reset(self):
        pass

    def extend(self, features):
        pass

    def observe(self, tree, path):
        self.seen = (tree, path)

    def fork(self, target):
        return _Primary()

    def propose(self, anchor, position, room, width, max_nodes=None):
        return FixedProposal(torch.full((3, 20), -10.0).log_softmax(-1), anchor, 1)  # q = 1/20 everywhere


class _History:
    token_ids = [1, 2, 3, 4, 5, 1, 2]


def test_observe_counts_how_far_the_target_followed_the_chain():
    drafter = MixedDrafter(_Primary(), _History(), request_prior=None)  # priced by the pooled calibration alone
    drafter.calibration.log_rates = lambda row, depth: [math.log(0.5)] * depth  # (priced as if half were taken)
    proposal = drafter.propose(3, 7, 100, 1, max_nodes=8)  # "1 2 3" occurred before, followed by 4 5 1 2 3
    assert proposal.chain == [4, 5, 1, 2, 3]
    tree = proposal.tree(8)
    # the chain's value 0.5^d beats the head's 1/20 up to depth 4; then the head's first node comes
    assert paths(tree)[:6] == [(4,), (4, 5), (4, 5, 1), (4, 5, 1, 2), (12,), (4, 5, 1, 2, 3)]
    taken = [tree.children[0][4]]
    taken.append(tree.children[taken[-1]][5])  # the target took 4 and 5, then something else
    before = drafter.calibration.trials.copy(), drafter.calibration.hits.copy()
    drafter.observe(tree, [0] + taken)
    assert drafter.primary.seen[1] == [0] + taken
    trials, hits = drafter.calibration.trials - before[0], drafter.calibration.hits - before[1]
    assert trials[3].tolist()[:5] == [0, 1, 1, 1, 0]  # depths 1-3 were tried (3: after 2 accepted)
    assert hits[3].tolist()[:5] == [0, 1, 1, 0, 0]
    shrunk = [2 / 3, 7 / 9, 14 / 27]  # 1 of 1, 1 of 1, 0 of 1, each shrunk towards the depth above
    assert trials.sum() == 3 and LookupCalibration.rates(drafter.calibration, 3, 3) == pytest.approx(
        [r - math.sqrt(r * (1 - r) / 3) for r in shrunk])


def test_a_chain_taken_up_to_its_cut_is_followed_past_it():
    """A verify held the chain's first two tokens and took both: the chain's later tokens are counted
    against what the target produced next, as for a chain no verify held, so the depths past the cut
    get tried; a verified part not taken whole is counted at once, as before."""
    history = _History()
    drafter = MixedDrafter(_Primary(), history, request_prior=None)
    drafter.calibration.window = None
    drafter.calibration.log_rates = lambda row, depth: [math.log(0.5)] * depth
    proposal = drafter.propose(3, 7, 100, 1, max_nodes=2)
    assert proposal.chain == [4, 5, 1, 2, 3]
    tree = proposal.tree(2)
    assert paths(tree) == [(4,), (4, 5)]  # cut after two chain tokens
    taken = [tree.children[0][4]]
    taken.append(tree.children[taken[-1]][5])
    drafter.observe(tree, [0] + taken)
    assert drafter.calibration.trials.sum() == 0  # not decided yet: the target may go on with 1 2 3
    history.token_ids = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # it took 4 5 (verified), then 1 2 ...
    drafter.propose_lookup(7, 100)  # ... and 7, not 3 (a later round's anchor)
    drafter.reset()  # the request ends: pending chains are counted
    reference = LookupCalibration(MATCH_ROWS, drafter.max_draft)
    reference.observe(3, 5, 4)  # five chain tokens, four followed
    assert np.array_equal(drafter.calibration.trials, reference.trials)
    assert np.array_equal(drafter.calibration.hits, reference.hits)

    drafter = MixedDrafter(_Primary(), _History(), request_prior=None)  # the same verify, the target taking only 4
    drafter.calibration.window = None
    drafter.calibration.log_rates = lambda row, depth: [math.log(0.5)] * depth
    tree = drafter.propose(3, 7, 100, 1, max_nodes=2).tree(2)
    drafter.observe(tree, [0, tree.children[0][4]])
    reference = LookupCalibration(MATCH_ROWS, drafter.max_draft)
    reference.observe(3, 2, 1)
    assert np.array_equal(drafter.calibration.trials, reference.trials)


def test_a_chain_its_verified_tree_left_out_is_counted_against_what_the_target_produced():
    """A tree cut before its first chain node (the head's nodes priced higher, a small budget):
    the chain is decided later by the target's own tokens, as for a round that verified no tree,
    not dropped uncounted (chains priced too low would then never be tried again)."""
    history = _History()
    drafter = MixedDrafter(_Primary(), history, request_prior=None)
    drafter.calibration.window = None
    drafter.calibration.log_rates = lambda row, depth: [math.log(0.01)] * depth  # below the head's 1/20
    proposal = drafter.propose(3, 7, 100, 1, max_nodes=1)
    assert proposal.chain == [4, 5, 1, 2, 3]
    tree = proposal.tree(1)
    assert 4 not in tree.children[0]  # the head's node only
    drafter.observe(tree, [0])
    history.token_ids = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 9]  # the target went on with 4 5 1, then 9
    drafter.propose_lookup(7, 100)
    drafter.reset()
    reference = LookupCalibration(MATCH_ROWS, drafter.max_draft)
    reference.observe(3, 5, 3)  # five chain tokens, three followed
    assert np.array_equal(drafter.calibration.trials, reference.trials)
    assert np.array_equal(drafter.calibration.hits, reference.hits)


@pytest.mark.parametrize("seed", range(3))
def test_chains_no_verify_held_are_scored_against_what_the_target_produced(seed):
    """Plain rounds verify no chain. Each chain they were offered is counted (in batches, the last
    at the request's end) once the target's own tokens since have decided it (a token it missed, or
    all of it taken), as far as a verify would have taken it: brute force over a random text that
    repeats itself."""
    rng = random.Random(seed)
    text = [rng.randrange(5) for _ in range(400)]  # five token ids: n-gram matches most rounds
    history = _History()
    drafter = MixedDrafter(_Primary(), history)
    drafter.calibration.window = None  # plain sums: the order of observations does not matter
    offered = []
    for p in range(1, len(text)):  # one plain round per token: text[p] is the target's latest token
        history.token_ids = text[:p]
        proposal = drafter.propose_lookup(text[p], 100)
        length, chain = lookup_match(np.array(text[:p + 1]), drafter.max_ngram, drafter.max_draft)
        assert (proposal.chain if proposal is not None else []) == chain
        if chain:
            offered.append((match_row(length), chain, p + 1))
    reference = LookupCalibration(MATCH_ROWS, drafter.max_draft)
    decided = 0
    for row, chain, start in offered:
        seen = text[start:][:len(chain)]  # the target's tokens where the chain's went, as far as known
        followed = next((k for k, t in enumerate(seen) if t != chain[k]), len(seen))
        if followed < len(seen) or followed == len(chain):
            reference.observe(row, len(chain), followed)
            decided += 1
    assert decided > 200
    counted = drafter.calibration.trials.sum()
    drafter.reset()  # the request ends: the last batch is counted
    assert counted < drafter.calibration.trials.sum()  # (counted in batches: some were left)
    assert np.array_equal(drafter.calibration.trials, reference.trials)
    assert np.array_equal(drafter.calibration.hits, reference.hits)
    drafter.reset()  # a new request: nothing of the old one is scored against it
    history.token_ids = [9, 9, 9]
    drafter.propose_lookup(9, 100)
    assert np.array_equal(drafter.calibration.trials, reference.trials)


@pytest.mark.real
def test_lookup_lifts_tau_where_smollm2_copies(smollm2):
    """SmolLM2 asked to repeat a passage copies it; the head alone drafts little of it, the merged
    tree a lot, and the output stays the same."""
    from jetflow.models.checkpoint import load_drafter

    head = load_drafter("jetflow/drafters/smollm2-135m-instruct", target=smollm2)
    text = ("The committee met on Tuesday to review the budget for the new library, which will open in "
            "March with twelve reading rooms, a children's wing and a cafe run by local volunteers.")
    prompt = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]
    mixed = jetflow.JetFlow(smollm2, head, lookup=True).generate(prompt, max_new_tokens=48, budget=16)
    alone = jetflow.JetFlow(smollm2, head, lookup=False).generate(prompt, max_new_tokens=48, budget=16)
    assert mixed.token_ids == alone.token_ids == jetflow.generate(smollm2, prompt, max_new_tokens=48).token_ids
    assert mixed.stats["tau"] > alone.stats["tau"] + 0.5


def test_merged_chain_runs_past_plain_lookups_ten_tokens():
    """The merged chain may be MAX_CHAIN long (each token still has to earn its node); plain prompt
    lookup keeps transformers' 10; a request's room caps both."""
    from jetflow.decoding.lookup_drafter import MAX_DRAFT, LookupDrafter
    from jetflow.decoding.mixed_drafter import MAX_CHAIN

    history = _History()
    history.token_ids = list(range(100, 200)) + list(range(100, 130))  # the target repeats a passage
    drafter = MixedDrafter(_Primary(), history)
    assert drafter.propose(130, 130, 100, 1).chain == list(range(131, 131 + MAX_CHAIN))
    assert drafter.propose(130, 130, 5, 1).chain == list(range(131, 136))
    assert LookupDrafter(history).propose(130, 130, 100, 1).draft == list(range(131, 131 + MAX_DRAFT))
    assert MAX_CHAIN > MAX_DRAFT


def test_lookup_index_grown_token_by_token_equals_lookup_match():
    from jetflow.decoding.lookup_drafter import LookupIndex

    rng = np.random.default_rng(1)
    for _ in range(200):
        max_ngram, vocab = int(rng.integers(1, 5)), int(rng.integers(2, 6))
        index, committed = LookupIndex(max_ngram), []
        for _ in range(int(rng.integers(1, 40))):
            committed += rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()  # a round commits 1-3
            index.sync(committed)
            anchor, max_draft = int(rng.integers(0, vocab)), int(rng.integers(0, 8))
            want = lookup_match(np.array(committed + [anchor]), max_ngram, max_draft) if max_draft else \
                (lookup_match(np.array(committed + [anchor]), max_ngram, 1)[0], [])
            assert index.match(anchor, max_draft) == want, (committed, anchor, max_ngram, max_draft)
    passage = list(range(30)) * 2  # a repeated passage: the match length reaches its cap on both
    index = LookupIndex()
    for k in range(31, len(passage)):
        index.sync(passage[:k])
        assert index.match(passage[k], 4) == lookup_match(np.array(passage[:k + 1]), max_draft=4)
    assert index.match(passage[-1], 4)[0] == MAX_MATCH


def test_lookup_index_starts_again_on_another_sequence():
    from jetflow.decoding.lookup_drafter import LookupIndex

    index = LookupIndex()
    index.sync([5, 6, 7, 5, 6])
    assert index.match(7, 4) == (3, [5, 6, 7])
    index.sync([1, 2, 3])  # shorter: a new request
    assert index.tokens == [1, 2, 3] and index.match(7, 4) == (0, [])
    index.sync([9, 2, 8, 4])  # longer, but another token at the last one synced
    assert index.tokens == [9, 2, 8, 4] and index.match(2, 2) == (1, [8, 4])
