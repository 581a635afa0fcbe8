"""Adaptive budget: tree prefixes, expected tokens, the choice, the statistics, and losslessness."""

import itertools
import json
import math
import random
import time
from pathlib import Path

import pytest
import torch

import jetflow
from jetflow.decoding import costs as costs_mod
from jetflow.decoding.api import prepare_request
from jetflow.decoding.batch import BatchDecoder, BatchRequest
from jetflow.decoding.budget import ACCEPTANCE_WINDOW, AdaptiveBudget, ChainOffer
from jetflow.decoding.costs import CostCurve
from jetflow.decoding.drafter import make_drafter
from jetflow.decoding.load_budget import LoadBudget
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from jetflow.tree.build import DraftTree, build_tree


def curve(per_node_ms=1.0, base_ms=10.0, draft_ms=2.0):
    sizes = [1, 4, 16, 64, 256]
    return CostCurve({"c1_ms": base_ms, "verify_ms": {n: base_ms + per_node_ms * n for n in sizes},
                      "draft_ms": {n: draft_ms for n in sizes}})


@pytest.mark.parametrize("seed", range(5))
def test_best_first_prefix_is_the_smaller_budget_tree(seed):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(8, 50, generator=g).log_softmax(-1)
    big = build_tree(lp, 7, 64, 4)
    for n in (0, 1, 3, 10, 33, 64):
        small = build_tree(lp, 7, n, 4)
        p = big.prefix(n + 1)
        assert (p.tokens, p.parents, p.depths, p.scores) == (small.tokens, small.parents, small.depths, small.scores)


def test_cost_curve_interpolates_and_extrapolates():
    c = curve()
    assert c.verify_ms(16) == pytest.approx(26.0) and c.verify_ms(10) == pytest.approx(20.0)
    assert c.verify_ms(300) == pytest.approx(310.0)  # linear past the last point
    assert c.round_ms(40) == pytest.approx(52.0)


def test_cost_curve_takes_the_least_time_measured_at_a_size_or_above():
    bumpy = CostCurve({"c1_ms": 10.0, "verify_ms": {1: 12.0, 2: 30.0, 4: 16.0, 8: 15.0, 16: 20.0},
                       "draft_ms": {1: 3.0, 8: 2.0, 16: 4.0}})
    assert [bumpy.verify_ms(n) for n in (1, 2, 4, 8, 16)] == [12.0, 15.0, 15.0, 15.0, 20.0]
    assert bumpy.verify_ms(3) == pytest.approx(15.0) and bumpy.draft_ms(1) == 2.0
    assert bumpy.costs["verify_ms"][2] == 30.0  # the measurement itself is kept as it was


def hand_tree():
    # root -> a (q .8) -> c (q .5); root -> b (q .2)
    t = DraftTree.root_only(0)
    a = t.add(1, 0, math.log(0.8))
    t.add(2, 0, math.log(0.2))
    t.add(3, a, math.log(0.8) + math.log(0.5))
    return t


def test_expected_tokens_brute_force_and_observe():
    ab = AdaptiveBudget(curve(), bins=10)
    t = hand_tree()
    # prior: acceptance = bin mid of q -> .85, .25, .55
    a, b, c = 0.85, 0.25, 0.55
    assert ab.expected_tokens(t) == pytest.approx([1, 1 + a, 1 + a + b, 1 + a + b + a * c])
    # brute force over outcomes: a accepted (then c or not), b accepted, or neither
    outcomes = {("a", "c"): a * c, ("a",): a * (1 - c), ("b",): b, (): 1 - a - b}
    assert sum(p * (1 + len(o)) for o, p in outcomes.items()) == pytest.approx(ab.expected_tokens(t)[-1])
    ab.observe(t, [0, 1], other_ms=3.0)  # a accepted, c rejected; b rejected
    d1_bin8, d1_bin2, d2_bin5 = (ab.hits[1][8], ab.trials[1][8]), (ab.hits[2 - 1][2], ab.trials[1][2]), \
        (ab.hits[2][5], ab.trials[2][5])
    assert d1_bin8 == pytest.approx((4 * 0.85 + 1, 5)) and d1_bin2 == pytest.approx((4 * 0.25, 5))
    assert d2_bin5 == pytest.approx((4 * 0.55, 5)) and ab.overhead_ms == pytest.approx(3.0)


def test_acceptance_counts_follow_a_workload_change_within_their_window():
    """A long server life of accepted nodes (math), then a workload whose nodes are rejected (chat):
    the cell's rate follows within a window's trials, where counts summed since the start would
    still price the nodes as accepted."""
    ab = AdaptiveBudget(curve())
    t = hand_tree().prefix(2)  # root -> a: depth 1, q .8
    for _ in range(4 * ACCEPTANCE_WINDOW):
        ab.observe(t, [0, 1])
    assert ab.acceptance(1, 0.8) > 0.99 and ab.trials[1][8] == ACCEPTANCE_WINDOW
    for _ in range(ACCEPTANCE_WINDOW):
        ab.observe(t, [0])
    assert ab.acceptance(1, 0.8) == pytest.approx((1 - 1 / (ACCEPTANCE_WINDOW + 1)) ** ACCEPTANCE_WINDOW, rel=0.01)
    assert ab.acceptance(1, 0.8) < 0.4 and ab.trials[1][8] == ACCEPTANCE_WINDOW
    assert ab.acceptance(1, 0.2) == pytest.approx(0.25)  # a cell below the window keeps its prior


def test_sampled_requests_have_acceptance_counts_of_their_own():
    """Speculative sampling accepts a node with P = min(1, p/q), not when it is the target's argmax:
    sampled rounds do not move the greedy prices, nor greedy rounds the sampled ones."""
    ab = AdaptiveBudget(curve())
    t = hand_tree()
    greedy = ab.expected_tokens(t)
    for _ in range(50):
        ab.observe(t, [0], greedy=False)  # every node rejected
    assert ab.expected_tokens(t) == greedy and ab.expected_tokens(t, greedy=True) == greedy
    sampled = ab.expected_tokens(t, greedy=False)
    assert sampled[-1] < 1.2 and ab.acceptance(1, 0.8, greedy=False) < 0.1 < ab.acceptance(1, 0.8)
    for _ in range(50):
        ab.observe(t, [0, 1, 3])
    assert ab.expected_tokens(t, greedy=False) == sampled and ab.expected_tokens(t)[-1] > greedy[-1]
    # a small tree pays for greedy requests and not for sampled ones: each is sized by its own counts
    dear = AdaptiveBudget(curve(per_node_ms=2.0, draft_ms=0.0))
    for _ in range(50):
        dear.observe(t, [0, 1, 3])
        dear.observe(t, [0], greedy=False)
    assert dear.choose(t) == 3 and dear.choose(t, greedy=False) == 1 == dear.min_budget
    # the batched decoder's budget prices each request's tree by its mode, and counts it so
    load = LoadBudget(curve(draft_ms=0.0), max_budget=16)
    for _ in range(50):
        load.observe(t, [0], greedy=False)
    assert load.choose([t] * 4, 0.0, [True] * 4) > 0 and load.choose([t] * 4, 0.0, [False] * 4) == 0
    assert load.choose([t], 0.0, [False]) == load.single.choose(t, greedy=False)


def test_the_decoding_loop_counts_a_request_in_its_own_modes_table(tiny_dir, tmp_path):
    """The single-stream loop and the batched decoder count a sampled request's nodes in the sampled
    table, a greedy one's in the greedy table (``ab``: the budget whose tables are compared)."""
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    jf = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path)
    jf._adaptive = ab = AdaptiveBudget(curve(per_node_ms=0.0, draft_ms=0.0))  # (no measured curve: drafts pay)

    def tables(greedy):
        return json.dumps(ab._counts(greedy))

    greedy, sampled = tables(True), tables(False)
    jf.generate("hello", max_new_tokens=16, temperature=0.9, seed=1)
    assert tables(True) == greedy and tables(False) != sampled
    sampled = tables(False)
    jf.generate("hello", max_new_tokens=16)
    assert tables(True) != greedy and tables(False) == sampled

    # the batched decoder: two sampled requests share steps (then one is left alone), a greedy one follows
    load = LoadBudget(curve(per_node_ms=0.0, draft_ms=0.0), max_budget=16)
    decoder, ab = BatchDecoder(target, head, lookup=False, load_budget=load), load.single
    greedy, sampled = tables(True), tables(False)
    for seed, n in ((1, 12), (2, 6)):
        decoder.add(BatchRequest(*prepare_request(target, "hello", max_new_tokens=n, temperature=0.9, seed=seed),
                                 budget=None, width=3))
    while decoder.active:
        decoder.step()
    assert tables(True) == greedy and tables(False) != sampled
    sampled = tables(False)
    decoder.add(BatchRequest(*prepare_request(target, "hello", max_new_tokens=12), budget=None, width=3))
    while decoder.active:
        decoder.step()
    assert tables(True) != greedy and tables(False) == sampled


def test_a_state_with_one_table_of_counts_loads_as_the_greedy_table():
    """A state saved before sampled requests had counts of their own, and without a window: its one
    table prices greedy requests (cut to the window, rates kept), sampled ones start from the prior."""
    ab = AdaptiveBudget(curve())
    t = hand_tree()
    for _ in range(20):
        ab.observe(t, [0, 1])
    state = json.loads(json.dumps(ab.state()))
    old = json.loads(json.dumps({k: v for k, v in state.items() if k not in ("sampled_hits", "sampled_trials")}))
    old["hits"][1][8], old["trials"][1][8] = 9000.0, 10000.0  # a long life's summed counts
    fresh = AdaptiveBudget(curve())
    prior = fresh.expected_tokens(t, greedy=False)
    for _ in range(5):
        fresh.observe(t, [0], greedy=False)  # what the loading process had learned is replaced
    fresh.load_state(old)
    assert fresh.expected_tokens(t, greedy=False) == prior
    assert fresh.trials[1][8] == ACCEPTANCE_WINDOW and fresh.acceptance(1, 0.8) == pytest.approx(0.9)
    assert fresh.hits[2] == ab.hits[2] and fresh.trials[2] == ab.trials[2]
    fresh.load_state(state)  # a new state round-trips, both tables
    assert fresh.state() == ab.state()
    before = fresh.state()
    for broken in ({**state, "sampled_trials": state["sampled_trials"][:3]},
                   {**state, "sampled_hits": [[-1.0] * fresh.bins] * (fresh.max_depth + 1)},
                   {k: v for k, v in state.items() if k != "sampled_trials"}):
        with pytest.raises(ValueError, match="sampled_"):
            fresh.load_state(broken)
        assert fresh.state() == before


def test_greedy_and_sampled_requests_decide_to_draft_by_their_own_drafted_rate():
    """Sampled requests accept fewer nodes than greedy ones: in a mix of modes each mode's drafted
    rounds update its own rate, and each request decides by its own (given to should_draft, or told
    to collects_features at the request's start); an old state's one rate loads as the greedy one."""
    t = hand_tree()
    ab = AdaptiveBudget(curve(per_node_ms=2.0, draft_ms=0.0))
    for _ in range(50):
        ab.observe(t, [0, 1, 3])
        ab.observe(t, [0], greedy=False)
    ab.choose(t)
    for _ in range(5):  # sampled rounds that lose do not drag the greedy rate below a plain step
        ab.choose(t, greedy=False)
    assert ab.modes[False].draft_rate < ab.plain_rate() < ab.modes[True].draft_rate
    assert all(ab.should_draft() for _ in range(10))
    assert not any(ab.should_draft(greedy=False) for _ in range(3))  # (an exploring draft comes after 7)
    assert ab.collects_features(greedy=False) and not any(ab.should_draft() for _ in range(3))
    assert ab.collects_features() and all(ab.should_draft() for _ in range(5))
    for _ in range(5):  # nor do greedy rounds that pay lift the sampled rate above it
        ab.choose(t)
    assert ab.modes[False].draft_rate < ab.plain_rate() and not ab.should_draft(greedy=False)
    # the batched decoder's lone request decides by its mode too
    load = LoadBudget(curve(per_node_ms=2.0, draft_ms=0.0), max_budget=16)
    for greedy in (True, False):
        load.single.modes[greedy].draft_rate = ab.modes[greedy].draft_rate
    assert load.should_draft([True]) and not load.should_draft([False])
    # saved states keep both modes' rates
    state = json.loads(json.dumps(ab.state()))
    fresh = AdaptiveBudget(curve(per_node_ms=2.0, draft_ms=0.0))
    fresh.load_state(state)
    assert (fresh.modes[True].draft_rate, fresh.modes[False].draft_rate) == (ab.modes[True].draft_rate,
                                                                             ab.modes[False].draft_rate)
    with pytest.raises(ValueError, match="modes.sampled.draft_rate"):
        fresh.load_state({**state, "modes": {**state["modes"], "sampled": {**state["modes"]["sampled"], "draft_rate": "x"}}})
    # a state saved when both modes shared one policy: it becomes the greedy mode's (with or without
    # a sampled drafted-round rate of its own), and sampled requests start exploring afresh
    greedy = state["modes"]["greedy"]
    shared = {**{k: v for k, v in state.items() if k != "modes"}, "draft_rate": greedy["draft_rate"],
              "head_gain": 1.5, "_gains": 3, "_explore_gap": 16, "_featureless": 2, "_reprobe_doublings": 1,
              "_reprobing": True, "chain_explorer": {**greedy["chain_explorer"], "decisions": 5,
                                                     "rates": {"true": 0.3, "false": 0.2}}}
    for sampled_rate in (None, 0.25):
        old = shared if sampled_rate is None else {**shared, "sampled_draft_rate": sampled_rate}
        fresh.load_state(old)
        g, sampled = fresh.modes[True], fresh.modes[False]
        assert (g.draft_rate, g.head_gain, g.gains, g.explore_gap, g.featureless, g.reprobe_doublings,
                g.reprobing) == (greedy["draft_rate"], 1.5, 3, 16, 2, 1, True)
        assert sampled.draft_rate == sampled_rate and sampled.head_gain is None
        assert sampled.explore_gap == fresh.explore_every and sampled.chain_explorer.decisions == 0
        assert g.chain_explorer.decisions == 5 and g.chain_explorer.rates == {True: 0.3, False: 0.2}
    missing = {k: v for k, v in shared.items() if k != "head_gain"}
    with pytest.raises(ValueError, match="head_gain"):  # an old state missing a field is refused, as before
        fresh.load_state(missing)


def test_the_decoding_loops_decide_to_draft_by_the_requests_mode(tiny_dir, tmp_path):
    """The single-stream loop and the batched decoder's lone request ask about drafting for the
    request's own mode: drafting pays for greedy requests and not for sampled ones."""
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    jf = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path, lookup=False)
    jf._adaptive = AdaptiveBudget(curve(per_node_ms=0.0, draft_ms=0.0))
    load = LoadBudget(curve(per_node_ms=0.0, draft_ms=0.0), max_budget=16)
    decoder = BatchDecoder(target, head, lookup=False, load_budget=load)
    for ab in (jf._adaptive, load.single):
        ab.modes[True].draft_rate, ab.modes[False].draft_rate = 1e3, 1e-6
        # no exploring draft within these short requests, and not settled (so both collect features)
        ab.max_explore_every = 128
        for mode in ab.modes.values():
            mode.explore_gap = 64
    sampled = jf.generate("hello", max_new_tokens=12, temperature=0.9, seed=1).stats
    greedy = jf.generate("hello", max_new_tokens=12).stats
    assert sampled["features"] and greedy["features"]  # both could draft: their own rates decided
    assert sampled["round_kinds"].get("drafted", 0) == 0 and greedy["round_kinds"].get("drafted", 0) > 0
    for temperature, drafts in ((0.9, False), (0.0, True)):
        request = BatchRequest(*prepare_request(target, "hello", max_new_tokens=12, temperature=temperature, seed=1),
                               budget=None, width=3)
        decoder.add(request)
        while decoder.active:
            decoder.step()
        assert (request.stats.round_kinds["drafted"] > 0) == drafts


def test_a_tree_rounds_overhead_is_not_diluted_by_plain_steps_nor_drafted_rounds():
    """Plain steps have almost no time outside their verify, drafted rounds much more than a lookup
    chain verified alone: a chain round's acceptance and commit are priced from chain rounds alone,
    so where most rounds are plain a chain whose gain is less than its own overhead is not taken,
    and one whose gain is more is not refused for a drafted round's overhead."""
    ab = AdaptiveBudget(curve(per_node_ms=0.0, base_ms=10.0, draft_ms=5.0))
    t = hand_tree()
    for _ in range(9):
        ab.observe_plain(10.0)
    ab.observe(t.prefix(2), [0], other_ms=2.0, drafted=False)
    ab.observe(t.prefix(3), [0], other_ms=6.0)  # a drafted round: its choice, prefix and the head's bookkeeping
    assert ab.chain_overhead_ms == pytest.approx(2.0) and ab.plain_overhead_ms == pytest.approx(0.0)
    assert ab.overhead_ms == pytest.approx(6.0)
    assert ab.plain_rate() == pytest.approx(1 / 10.0)
    # a one-node chain accepted 15% of the time: 1.15 tokens for 10 + 2 ms loses to 1 token in 10 ms
    # (with one mean over all eleven rounds, 0.7 ms, it would have looked like a 7% gain)
    assert ab.chain_offer(chain_tree([0.15])) is None
    # 1.25 / 12 > 1 / 10 (priced with the drafted round's 6 ms, 1.25 / 16, it would have been refused)
    assert ab.chain_offer(chain_tree([0.25])) is not None


def test_a_round_is_charged_the_draft_it_ran_and_the_first_choice_sets_the_drafted_size():
    """choose() prices every size with the draft of the nodes actually drafted (a small tree's
    round is not cheaper for it: on llama.cpp a one-node draft is half the price of the eight the
    round ran); the first choice sets the size later rounds draft, plain steps before it or not;
    and drafts are priced at the machine's measured speed, as verifies are."""
    costs = CostCurve({"c1_ms": 10.0, "verify_ms": {1: 14.0, 8: 40.0, 256: 1000.0},
                       "draft_ms": {1: 5.0, 8: 10.0, 256: 10.0}})
    ab = AdaptiveBudget(costs)
    ab.observe_plain(10.0)  # the forced first plain step of every process
    assert ab.draft_nodes() == 256  # nothing chosen yet: the first draft may be as big as any
    t = hand_tree()
    best = ab.choose(t)
    expected = ab.expected_tokens(t)
    rates = [expected[n] / (10.0 + ab.verify_cost(n)) for n in range(1, 4)]  # the draft of 256 nodes: 10 ms
    assert best == 1 + rates.index(max(rates)) and ab.modes[True].draft_rate == pytest.approx(max(rates))
    assert best == 3 and expected[1] / (5.0 + 14.0) > max(rates)  # (priced at a one-node draft, 1 would win)
    assert ab._recent_choice == 3 and ab.draft_nodes() == 8  # not 0.8 * 256
    small = AdaptiveBudget(costs, max_budget=3)  # a first choice of the largest size is a choice too
    assert small.choose(t) == 3 and small._chosen
    assert small.choose(chain_tree([0.9, 0.01])) == 1 and small._recent_choice == 2  # shrinks by a fifth, no jump
    for _ in range(30):  # the machine got twice as fast: plain steps say so, drafts follow
        ab.observe_plain(5.0)
    assert ab.draft_cost(8) == pytest.approx(5.0, rel=0.05)


def test_a_learned_state_round_trips_through_json_and_bad_ones_are_refused():
    """What a budget learned, saved as JSON and loaded into a fresh one, prices and decides as the
    original does; a state of another shape or kind is refused and changes nothing."""
    ab = AdaptiveBudget(curve(per_node_ms=2.0, base_ms=10.0, draft_ms=4.0), max_explore_every=16)
    rng = random.Random(0)
    t = hand_tree()
    for i in range(60):  # plain steps, trees, chains with a paying offer: every part of the state moves
        if i % 3 == 0:
            ab.observe_plain(10.0 + rng.random())
        else:
            ab.should_draft(ab.chain_offer(chain_tree([0.9, 0.8])) if i % 3 == 1 else None)
            ab.choose(t)
            ab.observe(t, [0, 1] if rng.random() < 0.6 else [0], other_ms=rng.random(), verify_ms=14.0 + rng.random())
    state = json.loads(json.dumps(ab.state()))
    fresh = AdaptiveBudget(curve(per_node_ms=2.0, base_ms=10.0, draft_ms=4.0), max_explore_every=16)
    fresh.load_state(state)
    assert fresh.state() == ab.state()
    assert fresh.expected_tokens(t) == ab.expected_tokens(t) and fresh.plain_rate() == ab.plain_rate()
    assert fresh.head_settled_losing() == ab.head_settled_losing()
    assert [fresh.choose(t) for _ in range(3)] == [ab.choose(t) for _ in range(3)]
    offer = chain_tree([0.9, 0.8])
    assert fresh.should_draft(fresh.chain_offer(offer)) == ab.should_draft(ab.chain_offer(offer))

    before = fresh.state()
    other_shape = AdaptiveBudget(curve(), bins=5)
    bad = [{}, None, [], {**state, "hits": state["hits"][:3]}, {**state, "trials": [[0.0] * 10] * 33},
           {**state, "modes": None}, {**state, "modes": {"greedy": state["modes"]["greedy"]}},
           {**state, "_scale_count": 3}, {**state, "_chosen": 1}]
    for broken in bad:
        with pytest.raises(ValueError):
            fresh.load_state(broken)
        assert fresh.state() == before
    with pytest.raises(ValueError, match="rows"):
        other_shape.load_state(state)
    # a state saved before chain rounds had their own overhead, and drafts their scale relative to
    # the plain steps': read as it was meant
    old = {k: v for k, v in state.items() if k not in ("chain_overhead_ms", "_chain_rounds", "_chosen")}
    old.update(_plain_scale=2.0, _draft_scale=3.0, overhead_ms=1.5)
    fresh.load_state(old)
    assert fresh.chain_overhead_ms == 1.5 and fresh._chosen and fresh.draft_cost(4) == pytest.approx(3.0 * 4.0)


def test_choice_follows_the_cost_curve():
    lp = torch.full((15, 30), -10.0)
    lp[:, 0] = math.log(0.97)  # a confident chain plus weak side branches
    tree = build_tree(lp.log_softmax(-1), 5, 256, 7)
    cheap = AdaptiveBudget(curve(per_node_ms=0.0))
    steep = AdaptiveBudget(curve(per_node_ms=5.0))
    expected = cheap.expected_tokens(tree)
    assert cheap.choose(tree) >= 15  # free nodes: take the whole confident chain at least
    n = steep.choose(tree)
    assert n < cheap.choose(tree)
    best = max(range(1, len(tree)), key=lambda k: expected[k] / (steep.costs.round_ms(k)))
    assert n == best  # brute-force argmax of tokens per ms


def test_auto_budget_is_lossless_and_its_cost_curve_is_cached(tiny_dir, tmp_path, monkeypatch):
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    calls = []
    real = costs_mod.measure_costs
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: calls.append(1) or real(*a, **dict(k, reps=1)))
    jf = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path)
    ar = jetflow.generate(target, "hello", max_new_tokens=24)
    spec = jf.generate("hello", max_new_tokens=24)
    measured = len(calls)  # 1, or up to 3 when a tiny model's timings look disturbed (see cached_costs)
    assert 1 <= measured <= 3
    assert spec.token_ids == ar.token_ids and spec.stats["budget"] == "auto"
    sampled = [jf.generate("hi", max_new_tokens=16, temperature=0.9, seed=s).token_ids for s in (1, 1)]
    assert sampled[0] == sampled[1]
    again = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path)
    assert again.generate("hello", max_new_tokens=24).token_ids == ar.token_ids
    assert len(calls) == measured and len(list(tmp_path.glob("costs-*.json"))) == 1  # read, not measured
    with pytest.raises(Exception, match="or 'auto'"):
        jetflow.JetFlow(target, head, budget="fast")


def test_auto_on_a_small_context_or_batch_prices_the_trees_it_can_verify(tiny_dir, tmp_path, monkeypatch):
    """The cost curve's prefix, the tokens its timed drafts commit and its biggest tree must fit the
    target's context (and llama.cpp's batch): otherwise every `auto` request failed in the measurement."""
    from types import SimpleNamespace

    fit = costs_mod.fitting_costs
    assert fit(SimpleNamespace(max_context=4096), 256, 5, costs_mod.COST_BUDGETS) == (256, costs_mod.COST_BUDGETS)
    assert fit(SimpleNamespace(max_context=4096, n_batch=16), 256, 5, costs_mod.COST_BUDGETS) == (256, [1, 2, 3, 4, 5, 6, 7, 8, 12, 15])
    assert fit(SimpleNamespace(max_context=128), 256, 5, costs_mod.COST_BUDGETS) == (32, [1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 24, 32, 48, 64])
    with pytest.raises(ValueError, match="context is 16 tokens"):
        fit(SimpleNamespace(max_context=16), 256, 5, costs_mod.COST_BUDGETS)
    target = TargetModel.load(str(tiny_dir))
    target.max_context = 128
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    real = costs_mod.measure_costs
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: real(*a, **dict(k, reps=1)))
    jf = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path)
    ar = jetflow.generate(target, "hello", max_new_tokens=24)
    assert jf.generate("hello", max_new_tokens=24).token_ids == ar.token_ids
    assert jf.adaptive_budget().max_budget == 64


def test_prompt_lookup_alone_decodes_with_a_fixed_budget_and_refuses_auto(tiny_dir):
    """`auto` prices a head's drafts: a decoder whose drafter has no head (prompt lookup) defaults to
    the whole lookup chain, and an explicit 'auto' is refused by name instead of failing inside."""
    from jetflow.decoding.lookup_drafter import MAX_DRAFT, LookupDrafter
    from jetflow.errors import InvalidRequestError

    target = TargetModel.load(str(tiny_dir))
    jf = jetflow.JetFlow(target, drafter=LookupDrafter(target))
    assert jf.budget == MAX_DRAFT
    ar = jetflow.generate(target, "hello hello hello", max_new_tokens=24)
    assert jf.generate("hello hello hello", max_new_tokens=24).token_ids == ar.token_ids
    with pytest.raises(InvalidRequestError, match="budget 'auto' prices a draft head's trees"):
        jf.generate("hi", budget="auto")
    with pytest.raises(InvalidRequestError, match="LookupDrafter"):
        jetflow.JetFlow(target, drafter=LookupDrafter(target), budget="auto")


def test_auto_keeps_what_it_learned_between_decoders_when_asked(tiny_dir, tmp_path, capsys):
    """With ``auto_state`` a decoder saves what `auto` learned after each request and a new one for
    the same curve and head resumes it; another head starts fresh; a damaged file is ignored with a
    notice and replaced; without ``auto_state`` nothing is written."""
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    costs, states = tmp_path / "costs", tmp_path / "states"

    def decoder(h, auto_state=states):
        return jetflow.JetFlow(target, h, budget="auto", cost_cache=costs, auto_state=auto_state)

    ar = jetflow.generate(target, "hello", max_new_tokens=24)
    jf = decoder(head)
    assert jf.generate("hello", max_new_tokens=24).token_ids == ar.token_ids
    (path,) = states.glob("auto-state-*.json")
    learned = json.loads(json.dumps(jf.adaptive_budget().state()))
    assert json.loads(path.read_text())["state"] == learned
    assert decoder(head).adaptive_budget().state() == learned  # resumed
    torch.manual_seed(1)
    other = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    assert decoder(other).adaptive_budget().state() == decoder(other, None).adaptive_budget().state()  # fresh
    assert decoder(other, None).adaptive_budget().state() != learned

    path.write_text("{not json")
    damaged = decoder(head)
    assert damaged.generate("hello", max_new_tokens=24).token_ids == ar.token_ids
    assert "ignoring the saved 'auto' state" in capsys.readouterr().err
    assert json.loads(path.read_text())["state"] == json.loads(json.dumps(damaged.adaptive_budget().state()))
    decoder(head, None).generate("hello", max_new_tokens=8)
    assert len(list(states.glob("*.json"))) == 1


def test_a_disturbed_cost_curve_is_measured_again_and_merged(tiny_dir, monkeypatch, tmp_path):
    """A curve whose smaller tree costs far more than a bigger one, or whose one-token step moved
    between start and end, was measured on a busy machine: it is measured again (up to three times)
    and the attempts merged point by point at their least; an old cached file that fails the check
    is measured again, a checked one is read as is."""
    good = {"c1_ms": 10.0, "c1_after_ms": 10.5, "verify_ms": {1: 18.0, 2: 25.0, 8: 70.0},
            "verify_ratio": {}, "draft_ms": {1: 5.0, 8: 6.0}, "context": 8, "reps": 1}
    busy = {**good, "c1_ms": 73.0, "c1_after_ms": 12.0, "verify_ms": {1: 77.0, 2: 3556.0, 8: 415.0},
            "draft_ms": {1: 268.0, 8: 7.0}}
    assert costs_mod.disturbance(good) is None
    assert "start" in costs_mod.disturbance(busy)
    assert "verify_ms[2]" in costs_mod.disturbance({**busy, "c1_after_ms": 73.0})
    assert "draft_ms[1]" in costs_mod.disturbance({**good, "draft_ms": {1: 268.0, 8: 7.0}})
    merged = costs_mod.least_costs([busy, good])
    assert merged["c1_ms"] == 10.0 and merged["verify_ms"] == {1: 18.0, 2: 25.0, 8: 70.0}
    assert merged["draft_ms"] == {1: 5.0, 8: 6.0} and merged["attempts"] == 2 and merged["verify_ratio"][8] == 7.0

    runs = iter([busy, busy, good, busy])
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: dict(next(runs)))
    target = TargetModel.load(str(tiny_dir))
    drafter = make_drafter(DraftHead(DraftHeadConfig.for_target(target, block_size=6)), target)
    notes = []
    costs = costs_mod.cached_costs(target, drafter, tmp_path, log=notes.append)
    assert costs["attempts"] == 3 and costs["verify_ms"][2] == 25.0
    assert notes[0].startswith("measuring") and sum(n.startswith("cost curve looks disturbed") for n in notes) == 2
    assert costs_mod.cached_costs(target, drafter, tmp_path)["attempts"] == 3  # read back, not measured
    (path,) = tmp_path.glob("costs-*.json")
    stored = json.loads(path.read_text())
    stored["costs"] = {k: v for k, v in busy.items()}  # as written before the check existed
    path.write_text(json.dumps(stored))
    assert costs_mod.cached_costs(target, drafter, tmp_path, attempts=1)["c1_ms"] == 12.0  # measured again


def test_a_cost_curve_cached_by_other_code_is_measured_again(tiny_dir, monkeypatch, tmp_path):
    """A change to the code that runs verifies or drafts (a kernel, the draft path) makes a cached
    curve stale: the key holds a digest of that code, which follows every module named in it."""
    runs = []
    monkeypatch.setattr(costs_mod, "measure_costs",
                        lambda *a, **k: runs.append(1) or {"c1_ms": 10.0, "c1_after_ms": 10.0, "verify_ms": {1: 18.0},
                                                           "verify_ratio": {1: 1.8}, "draft_ms": {1: 5.0}})
    target = TargetModel.load(str(tiny_dir))
    drafter = make_drafter(DraftHead(DraftHeadConfig.for_target(target, block_size=6)), target)
    costs_mod.cached_costs(target, drafter, tmp_path)
    costs_mod.cached_costs(target, drafter, tmp_path)
    assert len(runs) == 1  # read back
    monkeypatch.setattr(costs_mod, "cost_code_digest", lambda: "another-version")
    costs_mod.cached_costs(target, drafter, tmp_path)
    assert len(runs) == 2 and len(list(tmp_path.glob("costs-*.json"))) == 2

    package = Path(costs_mod.__file__).resolve().parents[1]
    assert all((package / name).is_file() for name in costs_mod.COST_CODE)  # no module renamed away
    copy = tmp_path / "pkg"
    for name in costs_mod.COST_CODE:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((package / name).read_bytes())
    monkeypatch.undo()
    real = costs_mod.cost_code_digest()
    for name in costs_mod.COST_CODE:  # each module's source is in the digest
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b"\n")
        assert costs_mod.cost_code_digest(copy) != real
        (copy / name).write_bytes(original)
    assert costs_mod.cost_code_digest(copy) == real


def test_a_plain_step_is_timed_first_and_whenever_none_was_for_a_while():
    """Every price is scaled by the plain steps' measured time, so a decoder times one at its first
    round and again after max_explore_every rounds without one, even where drafts or chains pay."""
    budget = AdaptiveBudget(curve(per_node_ms=0.1), max_explore_every=4)
    tree = build_tree(torch.full((3, 5), math.log(0.2)), 1, 2, 2)
    assert budget.plain_step_due()
    budget.observe(DraftTree.root_only(1), [0], other_ms=0.1, verify_ms=9.0)
    for _ in range(4):
        assert not budget.plain_step_due()
        budget.observe(tree, [0], other_ms=0.1, verify_ms=11.0)
    assert budget.plain_step_due()
    budget.observe(tree, [0])  # an untimed round (no verify time) counts for nothing
    assert budget.plain_step_due()
    budget.observe(DraftTree.root_only(1), [0], other_ms=0.1, verify_ms=9.0)
    assert not budget.plain_step_due()


def test_plain_steps_timed_slow_for_a_while_do_not_keep_trees_looking_cheap():
    """A few seconds of load slow the plain steps; rounds that explore then time trees at their usual
    cost, cheap next to the slow steps, so nearly every round verifies a chain. The plain step due
    every max_explore_every rounds stands for all the rounds since the last, so the scale recovers
    within a few of them (at the usual weight of 1/20 it took thousands of rounds; seen once on
    llama.cpp: the rest of a GSM8K set verifying a tree or a chain in all but one round a request)."""
    ab = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=0.0), max_explore_every=64)
    offer = chain_tree([0.3])  # 1.3 tokens for 15 ms: loses to a 10 ms step, pays against a 25 ms one
    for _ in range(40):
        ab.observe_plain(10.0)
    assert ab.chain_offer(offer) is None
    for _ in range(30):  # load: plain steps at 25 ms
        ab.observe_plain(25.0)
    for _ in range(20):  # the load is gone: rounds that explore verify chains at their usual cost
        ab.observe(offer, [0], other_ms=0.0, verify_ms=15.0, drafted=False)
    assert ab.chain_offer(offer) is not None
    rounds = 0
    while ab.chain_offer(offer) is not None:  # the loop verifies the chain unless a plain step is due
        if ab.plain_step_due():
            ab.observe_plain(10.5)  # (after a chain: llama.cpp rebuilds its graph for one token)
        else:
            ab.observe(offer, [0], other_ms=0.0, verify_ms=15.0, drafted=False)
        rounds += 1
        assert rounds < 20 * 64, "still verifying chains that lose"
    assert rounds < 6 * 64


def test_plain_steps_when_drafting_does_not_pay_with_periodic_exploration():
    lp = torch.full((15, 30), math.log(0.7 / 29))
    lp[:, 0] = math.log(0.3)  # an unsure head
    tree = build_tree(lp, 5, 64, 7)
    dear = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=8.0), explore_every=4)
    assert dear.should_draft()  # no estimate yet: draft
    dear.choose(tree)
    assert dear.modes[True].draft_rate < dear.plain_rate()
    pattern = [dear.should_draft() for _ in range(12)]
    # plain steps, one exploring draft after 3, then (it still does not pay) after 7
    assert pattern == [False] * 3 + [True] + [False] * 7 + [True]
    cheap = AdaptiveBudget(curve(per_node_ms=0.0, base_ms=10.0, draft_ms=0.5))
    cheap.choose(build_tree(torch.zeros(15, 30).index_fill_(1, torch.tensor([0]), 5.0).log_softmax(-1), 5, 64, 7))
    assert cheap.modes[True].draft_rate > cheap.plain_rate() and all(cheap.should_draft() for _ in range(10))


def settle_losing(ab: AdaptiveBudget) -> None:
    """Explore until drafting is tried only at the longest gap, losing against plain steps each time."""
    lp = torch.full((15, 30), math.log(0.7 / 29))
    lp[:, 0] = math.log(0.3)
    ab.choose(build_tree(lp, 5, 64, 7))
    while ab.modes[True].explore_gap < ab.max_explore_every:
        if ab.should_draft():
            ab.choose(build_tree(lp, 5, 64, 7))


def test_a_head_settled_as_losing_skips_features_but_reprobes_at_doubling_gaps():
    ab = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=8.0), explore_every=2, max_explore_every=8)
    assert not ab.head_settled_losing() and ab.collects_features()  # no evidence yet
    settle_losing(ab)
    assert ab.head_settled_losing()
    # re-probes after 8, 16, 32, 64 and then every 64 requests while each leaves the head losing
    pattern = [ab.collects_features() for _ in range(8 + 16 + 32 + 64 + 64)]
    assert [i + 1 for i, p in enumerate(pattern) if p] == [8, 24, 56, 120, 184]
    # a re-probe that finds the head paying starts over: features on, and the next settling
    # re-probes after 8 requests again
    draft_rate = ab.modes[True].draft_rate
    ab.modes[True].draft_rate = 10 * ab.plain_rate()
    assert not ab.head_settled_losing() and ab.collects_features()
    ab.modes[True].draft_rate = draft_rate
    assert ab.head_settled_losing() and [ab.collects_features() for _ in range(8)] == [False] * 7 + [True]
    # a paying lookup chain on offer: features stay on while drafting is preferred over the chain alone
    offered = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=8.0), explore_every=2, max_explore_every=8)
    settle_losing(offered)
    offer = offered.chain_offer(chain_tree([0.95] * 4))
    offered.modes[True].head_gain = 50.0  # the head was measured adding many tokens beyond the chain
    assert offered.should_draft(offer)
    assert not offered.head_settled_losing() and offered.collects_features()
    offered.modes[True].head_gain = 0.0  # ... or none: the chain alone is preferred, and the head has settled
    assert not offered.should_draft(offer)
    assert offered.head_settled_losing() and not offered.collects_features()
    # a head that pays never goes featureless
    paying = drafting_head()
    assert not paying.head_settled_losing() and all(paying.collects_features() for _ in range(10))


def test_a_reprobe_drafts_at_once_and_stops_collecting_features_while_the_head_still_loses():
    lp = torch.full((15, 30), math.log(0.7 / 29))
    lp[:, 0] = math.log(0.3)
    ab = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=8.0), explore_every=2, max_explore_every=8,
                        reprobe_every=3)
    settle_losing(ab)
    assert [ab.collects_features() for _ in range(3)] == [False, False, True]  # the third: a re-probe
    assert ab.keeps_features()  # nothing drafted yet in this request
    assert ab.should_draft()  # at once, although exploring stands at its longest gap
    ab.choose(build_tree(lp, 5, 64, 7))  # ... and the head still loses: no more features this request
    assert ab.head_settled_losing() and not ab.keeps_features()
    assert not any(ab.should_draft() for _ in range(ab.max_explore_every - 1))  # no second probe
    # a re-probe whose draft finds the head paying keeps features and starts exploring over
    assert [ab.collects_features() for _ in range(6)] == [False] * 5 + [True]
    assert ab.should_draft()
    ab.modes[True].draft_rate = 10 * ab.plain_rate()
    assert not ab.head_settled_losing() and ab.keeps_features()
    assert ab.should_draft() and ab.modes[True].explore_gap == ab.explore_every
    # a request that collects features because the head has not settled keeps them until it settles
    fresh = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=8.0), explore_every=2, max_explore_every=8)
    assert fresh.collects_features() and fresh.keeps_features()
    fresh.should_draft()
    fresh.choose(build_tree(lp, 5, 64, 7))
    while fresh.modes[True].explore_gap < fresh.max_explore_every:
        assert fresh.keeps_features()
        if fresh.should_draft():
            fresh.choose(build_tree(lp, 5, 64, 7))
    assert not fresh.keeps_features()
    # a head that pays keeps them
    paying = drafting_head()
    assert paying.collects_features() and paying.should_draft() and paying.keeps_features()


def test_each_mode_explores_settles_reprobes_and_measures_the_heads_gain_by_its_own_rounds():
    """Greedy requests settling the head as losing leave sampled ones collecting features and
    drafting; each mode's exploring gap, re-probe counters and measured head gain are its own."""
    lp = torch.full((15, 30), math.log(0.7 / 29))
    lp[:, 0] = math.log(0.3)
    ab = AdaptiveBudget(curve(per_node_ms=5.0, base_ms=10.0, draft_ms=8.0), explore_every=2, max_explore_every=8,
                        reprobe_every=3)
    settle_losing(ab)  # greedy rounds only
    greedy, sampled = ab.modes[True], ab.modes[False]
    assert greedy.explore_gap == ab.max_explore_every and sampled.explore_gap == ab.explore_every
    assert ab.head_settled_losing()
    assert ab.collects_features(greedy=False) and not ab.head_settled_losing()  # the sampled mode has no evidence
    assert all(ab.should_draft() for _ in range(3))  # ... so its requests draft
    ab.choose(build_tree(lp, 5, 64, 7))  # (this request's mode: sampled) and find it losing
    assert sampled.draft_rate < ab.plain_rate()
    greedy_before = greedy.state(), greedy.plain_rounds
    # sampled rounds explore at their own doubling gaps, leaving greedy's where they were
    assert [ab.should_draft() for _ in range(6)] == [False, True, False, False, False, True]
    assert sampled.explore_gap == ab.max_explore_every and (greedy.state(), greedy.plain_rounds) == greedy_before
    # now both modes have settled; each counts its own featureless requests and re-probes
    assert [ab.collects_features() for _ in range(3)] == [False, False, True]  # greedy: featureless, re-probe
    assert greedy.featureless == 0 and greedy.reprobing and sampled.featureless == 0 and not sampled.reprobing
    assert not ab.collects_features(greedy=False) and sampled.featureless == 1
    assert greedy.featureless == 0 and greedy.reprobing
    # a head gain measured in greedy rounds with a chain on offer is the greedy mode's alone
    paying = drafting_head()
    offer = paying.chain_offer(chain_tree([0.5] * 4))
    assert paying.should_draft(offer)
    paying.observe(*merged_round(offer, 8))
    assert paying.modes[True].head_gain == pytest.approx(8) and paying.modes[False].head_gain is None
    assert paying.should_draft(offer, greedy=False)
    paying.observe(*merged_round(offer, 0), greedy=False)
    assert paying.modes[False].head_gain == 0 and paying.modes[True].head_gain == pytest.approx(8)


def test_featureless_requests_are_lossless_and_read_no_features(tiny_dir, tmp_path):
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    jf = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path, lookup=True)
    ab = jf.adaptive_budget()
    # settled as losing by a wide margin: featureless requests measure plain rounds, whose timing on
    # this tiny model moves plain_rate, and must not move it past the head's rate
    ab.modes[True].draft_rate, ab.modes[True].explore_gap = 1e-6, ab.max_explore_every
    assert ab.head_settled_losing()
    asked = []
    verify, prefill = target.verify, target.prefill
    target.verify = lambda *a, **k: asked.append(k.get("return_hidden", True)) or verify(*a, **k)
    target.prefill = lambda *a, **k: asked.append(k.get("return_hidden", True)) or prefill(*a, **k)
    prompt = "one two three four five one two three four five one two three"
    ar = jetflow.generate(target, prompt, max_new_tokens=32)
    asked.clear()
    steps, greedy_step = [], target.greedy_step
    target.greedy_step = lambda token: steps.append(token) or greedy_step(token)
    quiet = jf.generate(prompt, max_new_tokens=32)
    assert quiet.token_ids == ar.token_ids and quiet.stats["features"] is False
    assert asked and not any(asked) and quiet.stats["round_kinds"].get("drafted", 0) == 0
    # plain rounds are the runtime's own greedy steps (this runtime's extends one token by a verify);
    # the other forwards: the prefill and one verify per lookup chain
    kinds = quiet.stats["round_kinds"]
    assert len(steps) == kinds["plain"] > 0 and len(asked) == 1 + kinds["plain"] + kinds.get("lookup", 0)
    target.greedy_step = greedy_step
    for _ in range(6):
        assert jf.generate(prompt, max_new_tokens=8).stats["features"] is False
    asked.clear()
    ab.plain_rate = lambda: 1e9  # whatever the tiny model's timings: the head keeps losing
    probe = jf.generate(prompt, max_new_tokens=32)  # the eighth: features on, the head drafts once ...
    assert probe.stats["features"] is True and probe.token_ids == ar.token_ids
    assert probe.stats["round_kinds"].get("drafted", 0) == 1 and probe.stats["features_dropped"] is True
    with_features = asked.index(False)  # ... and then the rest of the request reads no features
    assert with_features >= 2 and not any(asked[with_features:])


def _state(budget: AdaptiveBudget) -> dict:
    def plain(v):  # objects as their attributes, all the way down
        v = vars(v) if hasattr(v, "__dict__") else v
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v
    return plain(budget)


def test_observing_a_plain_round_alone_equals_observing_its_tree():
    """``observe_plain`` (the fast path of featureless greedy rounds) leaves the same state as
    ``observe`` of a root-only tree with nothing but its verify timed, among rounds of other kinds."""
    curve = CostCurve({"c1_ms": 10.0, "verify_ms": {1: 14.0, 8: 30.0, 64: 90.0}, "draft_ms": {1: 3.0, 64: 9.0}})
    fast, full = AdaptiveBudget(curve), AdaptiveBudget(curve)
    rng = random.Random(0)
    for r in range(300):
        if rng.random() < 0.8:
            ms = rng.uniform(8.0, 14.0)
            fast.observe_plain(ms)
            full.observe(DraftTree.root_only(5), [0], other_ms=0.0, verify_ms=ms)
        else:
            tree = chain_tree([0.9, 0.5, 0.3][:rng.randint(1, 3)])
            path = list(range(rng.randint(1, len(tree))))
            other, verify = rng.uniform(0.1, 1.0), rng.uniform(12.0, 20.0)
            for budget in (fast, full):
                budget.observe(tree, path, other_ms=other, verify_ms=verify)
        assert _state(fast) == _state(full), r
        assert fast.plain_step_due() == full.plain_step_due()


def chain_tree(rates):
    """A chain whose node d is accepted with P = prod(rates[:d]) (scores: cumulative log rates)."""
    scores = [0.0] + list(itertools.accumulate(math.log(r) for r in rates))
    n = len(scores)
    return DraftTree(list(range(5, 5 + n)), list(range(-1, n - 1)), list(range(n)), scores)


@pytest.mark.parametrize("per_node_ms", [0.0, 0.5, 3.0, 20.0])
def test_chain_offer_is_the_brute_force_argmax_of_tokens_per_ms(per_node_ms):
    ab = AdaptiveBudget(curve(per_node_ms=per_node_ms, base_ms=10.0, draft_ms=8.0))
    ab.chain_overhead_ms = ab.plain_overhead_ms = 1.5
    ab.overhead_ms = 4.0  # a drafted round's: not a chain's
    rates = [0.9, 0.8, 0.95, 0.3, 0.9, 0.9]
    chain = chain_tree(rates)
    offer = ab.chain_offer(chain)
    # brute force: E[tokens | n] = 1 + sum_d prod(rates[:d]); cost = verify(n) + overhead, no draft
    value = [(1 + sum(math.prod(rates[:d]) for d in range(1, k + 1)))
             / ((10.0 if k == 0 else 10.0 + per_node_ms * k) + 1.5) for k in range(len(rates) + 1)]
    best = max(range(len(value)), key=value.__getitem__)
    if per_node_ms >= 20.0:
        assert best == 0 and offer is None  # nothing pays: a plain step
    else:
        assert offer.tree.tokens == chain.tokens[:best + 1] and offer.rate == pytest.approx(value[best])


def drafting_head():
    ab = AdaptiveBudget(curve(per_node_ms=0.5, base_ms=10.0, draft_ms=2.0), explore_every=4)
    lp = torch.full((15, 30), math.log(0.3 / 29))
    lp[:, 0] = math.log(0.7)
    ab.choose(build_tree(lp, 5, 64, 7))  # drafting pays against a plain step
    assert ab.modes[True].draft_rate > ab.plain_rate() and ab.should_draft()
    return ab


def test_a_paying_lookup_chain_replaces_drafting_but_exploration_goes_on():
    ab = drafting_head()
    offer = ab.chain_offer(chain_tree([0.95] * 10))
    assert offer.rate > ab.modes[True].draft_rate  # a sure lookup chain without the draft pays more
    assert [ab.should_draft(offer) for _ in range(12)] == [False] * 3 + [True] + [False] * 7 + [True]
    weak = ChainOffer(chain_tree([0.5]), expected=0.5 * ab.modes[True].draft_rate * 10.0, cost_ms=10.0)
    assert ab.should_draft(weak)  # a weaker chain does not stop drafting


def merged_round(offer, head_nodes_after_chain: int):
    """A drafted round's tree: the offered chain, then a head chain under its last node; the target
    takes all of it."""
    chain = offer.tree
    tree = DraftTree(list(chain.tokens), list(chain.parents), list(chain.depths), list(chain.scores))
    node = len(tree) - 1
    for k in range(head_nodes_after_chain):
        node = tree.add(100 + k, node, tree.scores[node] - 1.0)
    return tree, list(range(len(tree)))


@pytest.mark.parametrize("gain", [0, 8])
def test_the_heads_measured_gain_over_a_paying_chain_decides(gain):
    """Once drafted rounds with a chain on offer have shown what the head adds beyond the chain
    (exactly: greedy acceptance is deterministic), that gain prices drafting against the chain."""
    ab = drafting_head()
    offer = ab.chain_offer(chain_tree([0.5] * 4))
    assert offer is not None and offer.rate < ab.modes[True].draft_rate  # the model would draft
    assert ab.should_draft(offer)  # the gain not measured yet: the model decides
    ab.observe(*merged_round(offer, gain))
    assert ab.modes[True].head_gain == pytest.approx(gain)  # what the merged tree emitted beyond the chain + bonus
    pattern = [ab.should_draft(offer) for _ in range(8)]
    if gain == 0:  # the head adds little: the chain alone, with an exploring draft now and then
        assert pattern == [False] * 3 + [True] + [False] * 4
    else:  # 8 more tokens a round are worth the draft and the bigger tree
        assert pattern[0] and sum(pattern) >= 6
    assert ab.modes[True].head_gain == pytest.approx(gain)
    ab.should_draft()  # a round without a chain on offer does not count as a drafted round with one
    ab.observe(*merged_round(offer, 3))
    assert ab.modes[True].head_gain == pytest.approx(gain)


def test_measured_verify_times_rescale_the_cached_curve():
    """The cached curve says a 4-node tree costs 1.4 plain steps; measured rounds say plain steps
    now take 2x as long (the machine slowed down): trees, not yet measured, are priced 2x too. Then
    trees measure 1.5x the curve: each size of tree is priced by the curve times that ratio (pooled
    over sizes), and one disturbed measurement moves it by 1/20."""
    ab = AdaptiveBudget(curve(per_node_ms=1.0, base_ms=10.0))
    assert (ab.verify_cost(0), ab.verify_cost(4), ab.verify_cost(8)) == (10.0, 14.0, 18.0)
    for _ in range(30):
        ab.observe(DraftTree.root_only(5), [0], verify_ms=20.0)
    assert ab.verify_cost(0) == pytest.approx(20.0) and ab.verify_cost(8) == pytest.approx(36.0)
    assert ab.plain_rate() == pytest.approx(1 / 20.0)
    chain = chain_tree([0.5] * 4)
    for ms in [21.0] * 30:
        ab.observe(chain, [0], verify_ms=ms)
    assert ab.verify_cost(4) == pytest.approx(21.0) and ab.verify_cost(8) == pytest.approx(27.0)
    assert ab.verify_cost(0) == pytest.approx(20.0)
    assert ab.verify_scales() == pytest.approx((2.0, 1.5))
    ab.observe(chain, [0], verify_ms=210.0)  # one disturbed measurement moves the ratio by 1/20 of it
    assert ab.verify_cost(4) == pytest.approx(21.0 + (210.0 - 21.0) / 20)


def test_unverified_tree_costs_follow_the_machine_speed_of_plain_steps():
    """Trees measured at 1.5x the curve while plain steps ran at 2x (a tree costs 0.75 of what the
    plain steps' slowdown predicts). Then the machine speeds up and only plain steps run (trees no
    longer pay, so none is verified): plain steps at 1x price the trees at 0.75x, not at the stale
    1.5x that would make them look twice as dear as they are."""
    ab = AdaptiveBudget(curve(per_node_ms=1.0, base_ms=10.0))
    chain = chain_tree([0.5] * 4)
    for _ in range(30):
        ab.observe(DraftTree.root_only(5), [0], verify_ms=20.0)
        ab.observe(chain, [0], verify_ms=21.0)
    assert ab.verify_cost(4) == pytest.approx(21.0)
    for _ in range(100):  # a running mean over 20: within 1% after 100
        ab.observe(DraftTree.root_only(5), [0], verify_ms=10.0)
    assert ab.verify_cost(0) == pytest.approx(10.0, rel=0.01)
    assert ab.verify_cost(4) == pytest.approx(14.0 * 0.75, rel=0.01)
    assert ab.verify_scales()[1] == pytest.approx(0.75, rel=0.01)


def test_cached_lookup_chain_prices_equal_pricing_every_chain_afresh(monkeypatch):
    """lookup_chain prices a chain once per (calibration state, match length, length) until costs
    move (a tree verified, or 16 plain steps). Here plain steps cost the same every time, so every
    offer must equal chain_offer on the chain's full tree, round after round."""
    from jetflow.decoding import mixed_drafter
    from jetflow.decoding.mixed_drafter import MixedDrafter

    # Each round below asks for its chain twice (the offer, then the reference): chains followed past
    # their verify between the two would change the rates the reference is priced with.
    monkeypatch.setattr(mixed_drafter, "FOLLOW_EVERY", 10**9)

    class History:
        token_ids: list[int] = []

    class Primary:
        head, block_size, int8 = None, 8, False

        def reset(self):
            pass

        def observe(self, tree, path):
            pass

    rng = __import__("random").Random(0)
    history = History()
    drafter = MixedDrafter(Primary(), history)
    ab = AdaptiveBudget(curve(per_node_ms=0.5), max_budget=64)
    fresh = AdaptiveBudget(curve(per_node_ms=0.5), max_budget=64)
    history.token_ids = [rng.randrange(6) for _ in range(40)]
    offers = 0
    for step in range(300):
        root = rng.randrange(6)
        offer = ab.lookup_chain(drafter, root, room=50)
        proposal = drafter.propose_lookup(root, 50)
        want = fresh.chain_offer(proposal.tree(drafter.max_draft)) if proposal is not None else None
        assert (offer is None) == (want is None), step
        if offer is not None:
            offers += 1
            assert offer.tree.tokens == want.tree.tokens and offer.expected == pytest.approx(want.expected)
            assert offer.cost_ms == pytest.approx(want.cost_ms)
        tree = offer.tree if offer is not None else DraftTree.root_only(root)
        path = list(range(min(len(tree), rng.randrange(1, 4))))
        drafter.observe(tree, path)  # the lookup's counts change only when a chain was verified
        ms = 10.0 + 0.5 * (len(tree) - 1) * rng.uniform(0.5, 2.0)
        for budget in (ab, fresh):
            budget.observe(tree, path, other_ms=0.3, verify_ms=ms)
        history.token_ids = history.token_ids + [root] + [tree.tokens[n] for n in path[1:]]  # what it took
    assert offers > 20  # chains both paid and did not


def test_a_llamacpp_cost_curve_is_measured_again_on_another_build(tiny_dir, monkeypatch, tmp_path):
    """Another llama.cpp CPU library (a rebuild with or without JetFlow's multi-token tiles) prices
    verifies differently: the cached curve is keyed by the library's digest."""
    import jetflow.models.llamacpp_target as llamacpp_target

    runs = []
    monkeypatch.setattr(costs_mod, "measure_costs",
                        lambda *a, **k: runs.append(1) or {"c1_ms": 10.0, "c1_after_ms": 10.0, "verify_ms": {1: 18.0},
                                                           "verify_ratio": {1: 1.8}, "draft_ms": {1: 5.0}})
    target = TargetModel.load(str(tiny_dir))
    monkeypatch.setattr(target, "backend", "llamacpp", raising=False)
    drafter = make_drafter(DraftHead(DraftHeadConfig.for_target(target, block_size=6)), target)
    build = {"cpu_library": "aaaa", "quant_dot_columns": 1}
    monkeypatch.setattr(llamacpp_target, "llama_build", lambda: build)
    costs_mod.cached_costs(target, drafter, tmp_path)
    costs_mod.cached_costs(target, drafter, tmp_path)
    assert len(runs) == 1
    build = {"cpu_library": "bbbb", "quant_dot_columns": 16}
    costs_mod.cached_costs(target, drafter, tmp_path)
    assert len(runs) == 2 and len(list(tmp_path.glob("costs-*.json"))) == 2


def test_measured_draft_times_rescale_the_cached_draft_curve():
    """Drafts timed at twice the cached curve price every size at twice the curve, so the choice and
    the rate of drafting follow the measured drafts; then one draft 22x the curve moves the ratio by
    1/20 of the difference (a running mean over 20, as for verifies)."""
    ab = AdaptiveBudget(curve(per_node_ms=1.0, base_ms=10.0, draft_ms=2.0))
    t = hand_tree()
    assert ab.draft_cost(4) == pytest.approx(2.0)
    ab.choose(t)
    cheap_rate = ab.modes[True].draft_rate
    for _ in range(40):  # rounds without nodes: only the draft's time moves
        ab.observe(DraftTree.root_only(5), [0], draft_ms=4.0, drafted_nodes=16)
    assert ab.draft_cost(1) == pytest.approx(4.0) and ab.draft_cost(256) == pytest.approx(4.0)
    expected = ab.expected_tokens(t)
    cost = [4.0 * (n > 0) + ab.verify_cost(n) + (ab.overhead_ms if n else ab.plain_overhead_ms) for n in range(4)]
    assert ab.choose(t) == max(range(1, 4), key=lambda n: expected[n] / cost[n])
    ab.modes[True].draft_rate = None
    ab.choose(t)
    assert ab.modes[True].draft_rate < cheap_rate
    state = json.loads(json.dumps(ab.state()))
    ab.observe(DraftTree.root_only(5), [0], draft_ms=44.0, drafted_nodes=4)
    assert ab.draft_cost(4) == pytest.approx(2.0 * (2.0 + (22.0 - 2.0) / 20))
    fresh = AdaptiveBudget(curve(per_node_ms=1.0, base_ms=10.0, draft_ms=2.0))
    fresh.load_state(state)
    assert fresh.draft_cost(4) == pytest.approx(4.0)
    before = fresh.state()
    for bad in ("fast", -1.0, 0, float("nan")):
        with pytest.raises(ValueError, match="_draft_scale"):
            fresh.load_state({**state, "_draft_scale": bad})
    for bad in (-1, 2.5, "3"):
        with pytest.raises(ValueError, match="_draft_count"):
            fresh.load_state({**state, "_draft_count": bad})
    with pytest.raises(ValueError, match="_scale_count"):
        fresh.load_state({**state, "_scale_count": [3, -2]})
    # Every other saved value is checked too: a damaged file would otherwise load, fail every
    # request, and never be replaced (it is saved only when a request completes).
    for field, bad in [("overhead_ms", None), ("plain_overhead_ms", -1.0), ("_recent_choice", None),
                       ("_rounds", 1.5), ("hits", [[float("nan")] * fresh.bins] * (fresh.max_depth + 1))]:
        with pytest.raises(ValueError, match=field):
            fresh.load_state({**state, field: bad})
    for name in ("greedy", "sampled"):  # each mode's policy
        mode = state["modes"][name]
        chains = mode["chain_explorer"]
        for field, bad in [("draft_rate", "x"), ("head_gain", float("inf")), ("explore_gap", 0), ("gains", -1),
                           ("featureless", -1), ("reprobe_doublings", 2.0), ("reprobing", 1),
                           ("chain_explorer", None), ("chain_explorer", {**chains, "_gap": 0}),
                           ("chain_explorer", {**chains, "_since": None}), ("chain_explorer", {**chains, "_prefer": "yes"}),
                           ("chain_explorer", {**chains, "decisions": -3}),
                           ("chain_explorer", {**chains, "rates": {"true": float("nan")}})]:
            with pytest.raises(ValueError, match=f"modes.{name}.{field}"):
                fresh.load_state({**state, "modes": {**state["modes"], name: {**mode, field: bad}}})
            assert fresh.state() == before
    with pytest.raises(ValueError, match="hits: counts must be numbers"):
        fresh.load_state({**state, "hits": [[None] * fresh.bins] * (fresh.max_depth + 1)})
    assert fresh.draft_cost(4) == pytest.approx(4.0)  # nothing of a refused state was taken


def test_the_loop_times_only_drafts_that_follow_a_drafted_round(tiny_dir, tmp_path, monkeypatch):
    """A request's first draft projects the prompt, and a draft after a plain round the rows of that
    round too: only a draft right after another one is timed for the draft curve, with the draft's
    node count, and every such draft is."""
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    real_measure = costs_mod.measure_costs
    monkeypatch.setattr(costs_mod, "measure_costs", lambda *a, **k: real_measure(*a, **dict(k, reps=1)))
    jf = jetflow.JetFlow(target, head, budget="auto", cost_cache=tmp_path)
    pattern = itertools.cycle([True, True, True, False, True, False, True, True])
    monkeypatch.setattr(AdaptiveBudget, "should_draft", lambda self, chain=None, greedy=None: next(pattern))
    events = []
    real_propose = type(jf.drafter).propose

    def propose(self, *a, max_nodes=None, **k):
        events.append(("draft", max_nodes))
        return real_propose(self, *a, max_nodes=max_nodes, **k)

    real_observe = AdaptiveBudget.observe

    def observe(self, tree, path, other_ms=None, verify_ms=None, draft_ms=None, drafted_nodes=None, drafted=True,
                **kw):
        events.append(("round", draft_ms, drafted_nodes, other_ms))
        return real_observe(self, tree, path, other_ms, verify_ms, draft_ms, drafted_nodes, drafted, **kw)

    monkeypatch.setattr(type(jf.drafter), "propose", propose)
    monkeypatch.setattr(AdaptiveBudget, "observe", observe)
    jf.generate("hi", max_new_tokens=2)  # measures the cost curve (its drafts are not rounds)
    events.clear()
    # A tree build of at least 20 ms: priced with the draft, not again in the round's other time.
    from jetflow.decoding.block_drafter import BlockProposal

    real_tree = BlockProposal.tree
    monkeypatch.setattr(BlockProposal, "tree", lambda self, n: (time.sleep(0.02), real_tree(self, n))[1])
    out = jf.generate("hello", max_new_tokens=40)
    assert out.token_ids == jetflow.generate(target, "hello", max_new_tokens=40).token_ids
    rounds, drafted = [], None
    for e in events:
        if e[0] == "draft":
            drafted = e[1]
        else:
            rounds.append((drafted, e[1], e[2], e[3]))
            drafted = None
    timed = 0
    for (before, *_), (nodes, draft_ms, drafted_nodes, other_ms) in zip([(None,)] + rounds, rounds):
        if nodes is not None:
            assert other_ms < 20.0  # the build is not in it
        if nodes is not None and before is not None:
            assert draft_ms >= 20.0 and drafted_nodes == nodes
            timed += 1
        else:
            assert draft_ms is None and drafted_nodes is None
    assert timed >= 3 and any(n is not None and d is None for n, d, *_ in rounds)


def test_the_cost_curve_keeps_its_ratios_when_the_machine_slows_down_midway(monkeypatch):
    """A verify of k tokens that takes k one-token steps measures k steps although the machine runs at
    half speed from the third size on: each size is timed against a one-token step of its own reps
    (a ratio to the step timed at the start would read 2k there), and verify_ms is that ratio times
    the start's step."""
    from types import SimpleNamespace

    clock = SimpleNamespace(now=0.0, slow=False)

    class SlowingTarget:
        vocab_size = 100

        def prefill(self, ids, return_hidden=False):
            pass

        def verify(self, tokens, parents, return_hidden=False):
            clock.slow = clock.slow or len(tokens) >= 5  # from the size of 4 draft nodes on, for good
            clock.now += len(tokens) * (2e-3 if clock.slow else 1e-3)

        def reset(self):
            pass

    monkeypatch.setattr(costs_mod.time, "perf_counter", lambda: clock.now)
    import jetflow.utils.timing as timing

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock.now)
    costs = costs_mod.measure_costs(SlowingTarget(), [1, 2, 4, 8], None, context=8, reps=3)
    assert costs["c1_ms"] == pytest.approx(1.0) and costs["c1_after_ms"] == pytest.approx(2.0)
    for n in (1, 2, 4, 8):
        assert costs["verify_ratio"][n] == pytest.approx(n + 1)
        assert costs["verify_ms"][n] == pytest.approx(n + 1)
