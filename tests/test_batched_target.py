"""Many sequences in one batched cache: every verify row and the cache after many rounds against the
same sequence run alone (brute force), and batched decoding against solo decoding."""

import random

import pytest
import torch

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.batch import BatchDecoder, BatchRequest
from jetflow.models.batched_target import BatchedTarget
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from jetflow.tree.mask import path_to_root
from tiny import tiny_model, walk_prefix_cache


@pytest.fixture(scope="module")
def target(tokenizer):
    return TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])


@pytest.fixture(scope="module")
def solo(tokenizer):
    """A second target with the same weights, for the one-sequence reference runs (fresh prefills)."""
    t = TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])
    t.prefix_cache = False
    return t


def random_tree(rng, n, vocab):
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    return [rng.randrange(vocab) for _ in range(n)], parents


def test_rows_match_each_sequence_alone(target, solo):
    rng = random.Random(0)
    batch = BatchedTarget(target)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9)]
    rows = []
    for p in prompts[:2]:
        rid, out = batch.join(p)
        ref = solo.prefill(p)
        torch.testing.assert_close(out.logits, ref.logits)
        rows.append(rid)
    for round_ in range(8):
        if round_ == 3:  # a sequence joins mid-way
            rows.append(batch.join(prompts[2])[0])
        if round_ == 6:  # and one leaves
            batch.leave(rows.pop(0))
        trees = {rid: random_tree(rng, rng.randrange(1, 12), 200) for rid in rows}
        outs = batch.verify(trees)
        paths = {}
        for rid in rows:
            tokens, parents = trees[rid]
            solo.prefill(batch.token_ids(rid))
            ref = solo.verify(tokens, parents)
            torch.testing.assert_close(outs[rid].logits, ref.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(outs[rid].hidden, ref.hidden, atol=1e-4, rtol=1e-4)
            paths[rid] = path_to_root(parents, rng.randrange(len(parents)))
        batch.commit(paths)
        for rid in rows:  # each row's committed cells equal a fresh prefill of its tokens
            ids = batch.token_ids(rid)
            assert batch.length(rid) == len(ids)
            solo.prefill(ids)
            b = [r.id for r in batch.rows].index(rid)
            for mine, ref in zip(batch.cache.layers, solo.cache.layers):
                torch.testing.assert_close(mine.keys[b, :, :len(ids)], ref.keys[0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(mine.values[b, :, :len(ids)], ref.values[0], atol=1e-4, rtol=1e-4)
        assert batch.width == max(batch.length(r) for r in rows)
    with pytest.raises(ValueError, match="a tree for every sequence"):
        batch.verify({rows[0]: ([1], [-1])})


def test_bad_paths_and_order(target):
    batch = BatchedTarget(target)
    rid, _ = batch.join([5, 6, 7])
    with pytest.raises(RuntimeError, match="without a verify"):
        batch.commit({rid: [0]})
    batch.verify({rid: ([1, 2, 3], [-1, 0, 0])})
    with pytest.raises(ValueError, match="not a root-to-node path"):
        batch.commit({rid: [0, 2, 1]})
    with pytest.raises(RuntimeError, match="between verify"):
        batch.join([1, 2])


def request(target, prompt, budget, **kw):
    ids, params, output = prepare_request(target, prompt, **kw)
    return BatchRequest(ids, params, output, budget=budget, width=3)


@pytest.mark.parametrize("lookup, kind", [(False, "block"), (True, "block"), (True, "eagle3")])
def test_batched_decoding_equals_solo(target, lookup, kind):
    """Requests of different lengths and budgets, joining at different rounds, greedy and seeded
    sampling: each output equals the same request decoded alone (with either kind of head: each
    request drafts from its own sequence)."""
    from jetflow.models.eagle_head import EagleHead

    torch.manual_seed(0)
    config = DraftHeadConfig.for_target(target, block_size=6, kind=kind)
    head = DraftHead(config) if kind == "block" else EagleHead(config)
    specs = [([10, 20, 30, 40], 8, dict(max_new_tokens=30)),
             ([7] * 3 + [11, 12, 13] * 4, 4, dict(max_new_tokens=25)),
             ([99, 98], 0, dict(max_new_tokens=12)),
             ([50, 60, 70, 80, 90, 100], 16, dict(max_new_tokens=20, temperature=0.8, seed=3)),
             ([3, 4], 8, dict(max_new_tokens=40))]
    decoder = BatchDecoder(target, head, lookup=lookup)
    pending = [request(target, p, b, **kw) for p, b, kw in specs]
    finished, sizes = [], []
    joins = {0: 2, 2: 1, 5: 2}  # round -> how many join before it
    step = 0
    while pending or decoder.active:
        for _ in range(joins.get(step, 0)):
            r = decoder.add(pending.pop(0))
            if r.finished:
                finished.append(r)
        finished += decoder.step()
        sizes.append(decoder.last_step["batch"])
        step += 1
    assert max(sizes) >= 3 and len(finished) == len(specs)
    jf = jetflow.JetFlow(target, head, lookup=lookup)
    for r, (prompt, budget, kw) in zip(sorted(finished, key=lambda r: r.id), specs):
        alone = jf.generate(prompt, budget=budget, width=3, **kw) if budget else jetflow.generate(target, prompt, **kw)
        assert r.result.token_ids == alone.token_ids, (prompt, budget)
        assert r.result.finish_reason == alone.finish_reason
    assert decoder.batch.rows == [] and decoder.batch.width == 0


def test_load_budget_shrinks_trees_as_the_batch_grows():
    """With a CPU-like cost curve (a forward's cost grows with its tokens) the chosen cap falls as
    the batch grows, and reaches plain steps when even one node per request does not pay."""
    from jetflow.decoding.costs import CostCurve
    from jetflow.decoding.load_budget import LoadBudget
    from jetflow.tree.build import build_tree

    ms = {n: 10.0 + 2.5 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # c(k) = 7.5 + 2.5 k
    policy = LoadBudget(CostCurve({"c1_ms": 10.0, "verify_ms": ms, "draft_ms": {}}), max_budget=32)
    torch.manual_seed(0)
    lp = (torch.randn(15, 50) * 3).log_softmax(-1)
    lp[:, 0] = 0.0  # a confident head: top token at every depth near-certain
    lp = lp.log_softmax(-1)
    tree = build_tree(lp, 1, 32, 3)
    caps = [policy.choose([tree] * b, draft_ms=0.0) for b in (1, 4, 16, 64)]
    assert caps[0] > 0 and caps == sorted(caps, reverse=True) and caps[0] > caps[-1]
    weak = build_tree(torch.full((15, 50), -50.0).log_softmax(-1), 1, 32, 3)  # uniform: nothing pays
    assert policy.choose([weak] * 8, draft_ms=0.0) == 0
    assert not policy.should_draft([True] * 8) and not policy.should_draft([True] * 7)  # the next steps at this size stay plain ...
    assert sum(policy.should_draft([True] * 8) for _ in range(policy.explore_every)) == 1  # ... but explore now and then,
    policy.choose([weak] * 8, draft_ms=0.0)  # and, while that finds nothing, less and less often
    assert sum(policy.should_draft([True] * 6) for _ in range(2 * policy.explore_every - 1)) == 1
    assert [LoadBudget.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_batched_decoding_with_the_load_budget_is_lossless(target, tmp_path):
    from jetflow.decoding.costs import CostCurve, cached_costs
    from jetflow.decoding.load_budget import LoadBudget

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    jf = jetflow.JetFlow(target, head, cost_cache=tmp_path)
    policy = LoadBudget(jf.adaptive_budget().costs, max_budget=16)
    decoder = BatchDecoder(target, head, load_budget=policy)
    prompts = [[10, 20, 30, 40], [5, 6, 7, 5, 6, 7, 5, 6], [200, 201], [33] * 7]
    reqs = [decoder.add(request(target, p, None, max_new_tokens=24)) for p in prompts]
    while decoder.active:
        decoder.step()
    for r, p in zip(reqs, prompts):
        assert r.result.token_ids == jetflow.generate(target, p, max_new_tokens=24).token_ids
        assert r.result.stats["budget"] == "auto"


def test_a_lone_request_takes_lookup_only_rounds_like_a_single_stream(target, monkeypatch):
    """A head priced far above a verify: the lone request of a batch verifies its lookup chain
    without a head forward, as the single-stream loop does, and its output stays the target's."""
    from jetflow.decoding.budget import AdaptiveBudget
    from jetflow.decoding.costs import CostCurve
    from jetflow.decoding.load_budget import LoadBudget

    monkeypatch.setattr(AdaptiveBudget, "_observe_verify", lambda *a: None)  # price by this curve only
    monkeypatch.setattr(AdaptiveBudget, "_observe_draft", lambda *a: None)
    monkeypatch.setattr(AdaptiveBudget, "_observe_overhead", lambda *a, **k: None)  # (a tiny model's Python)

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=8))
    sizes = [1, 4, 16, 64]
    costs = CostCurve({"c1_ms": 10.0, "verify_ms": {n: 10.0 + 0.1 * n for n in sizes},
                       "draft_ms": {n: 50.0 for n in sizes}})
    decoder = BatchDecoder(target, head, lookup=True, load_budget=LoadBudget(costs))
    prompt = [11, 12, 13, 14] * 5
    r = decoder.add(request(target, prompt, None, max_new_tokens=48))
    while decoder.active:
        decoder.step()
    assert r.result.token_ids == jetflow.generate(target, prompt, max_new_tokens=48).token_ids
    kinds = r.result.stats["round_kinds"]
    # (as its single-stream twin: a random model seldom follows a chain, and the request's counts price them out)
    assert kinds["lookup"] >= 3 and sum(kinds.values()) == r.result.stats["rounds"]


def test_a_lone_request_times_only_drafts_that_follow_a_drafted_round(target, monkeypatch):
    """As in the single-stream loop: the lone request's draft time (head forward + tree build) goes
    to the single-stream budget only when its previous round drafted too, with its node count."""
    import itertools

    from jetflow.decoding.budget import AdaptiveBudget
    from jetflow.decoding.costs import CostCurve
    from jetflow.decoding.load_budget import LoadBudget

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=8))
    sizes = [1, 4, 16, 64]
    load = LoadBudget(CostCurve({"c1_ms": 10.0, "verify_ms": {n: 10.0 + n for n in sizes},
                                 "draft_ms": {n: 2.0 for n in sizes}}))
    pattern = itertools.cycle([True, True, True, False, True, False, True, True])
    monkeypatch.setattr(AdaptiveBudget, "should_draft", lambda self, chain=None, greedy=None: next(pattern))
    seen, real = [], AdaptiveBudget.observe

    def observe(self, tree, path, other_ms=None, verify_ms=None, draft_ms=None, drafted_nodes=None, drafted=True,
                greedy=True):
        seen.append((draft_ms, drafted_nodes, other_ms))
        return real(self, tree, path, other_ms, verify_ms, draft_ms, drafted_nodes, drafted, greedy)

    # A tree build of at least 20 ms: priced with the draft, not again in the round's other time.
    import time

    from jetflow.decoding.block_drafter import BlockProposal

    real_tree = BlockProposal.tree
    monkeypatch.setattr(BlockProposal, "tree", lambda self, n: (time.sleep(0.02), real_tree(self, n))[1])

    monkeypatch.setattr(AdaptiveBudget, "observe", observe)
    decoder = BatchDecoder(target, head, lookup=False, load_budget=load)
    prompt = [11, 12, 13, 14] * 5
    r = decoder.add(request(target, prompt, None, max_new_tokens=40))
    drafted = []
    while decoder.active:
        before = r.stats.round_kinds["drafted"]
        decoder.step()
        drafted.append(r.stats.round_kinds["drafted"] > before)
    assert r.result.token_ids == jetflow.generate(target, prompt, max_new_tokens=40).token_ids
    assert len(seen) == len(drafted) and not drafted[0]  # the first round re-times a plain step, as a lone stream's
    assert load.single._since_plain is not None
    for i, (draft_ms, nodes, other_ms) in enumerate(seen):
        if drafted[i]:
            assert other_ms < 20.0  # the build is not in it
        if drafted[i] and i and drafted[i - 1]:
            assert draft_ms >= 20.0 and nodes >= 8  # (a round drafts at least 8 nodes)
        else:
            assert draft_ms is None and nodes is None
    assert sum(d is not None for d, *_ in seen) >= 3 and not all(drafted)


@pytest.mark.real
def test_batched_decoding_equals_solo_on_smollm2(smollm2):
    """The shipped drafter, three GSM8K-style requests of different lengths, one joining late."""
    from jetflow.models.checkpoint import load_drafter

    head = load_drafter("jetflow/drafters/smollm2-135m-instruct", target=smollm2)
    questions = ["What is 12 times 7?", "Natalia sold 48 clips in April and half as many in May. How many in all?",
                 "Name three colors."]
    decoder = BatchDecoder(smollm2, head)
    reqs = [decoder.add(request(smollm2, [{"role": "user", "content": q}], 8, max_new_tokens=n))
            for q, n in zip(questions[:2], (40, 24))]
    decoder.step()
    reqs.append(decoder.add(request(smollm2, [{"role": "user", "content": questions[2]}], 8, max_new_tokens=32)))
    while decoder.active:
        decoder.step()
    for r, q, n in zip(reqs, questions, (40, 24, 32)):
        alone = jetflow.generate(smollm2, [{"role": "user", "content": q}], max_new_tokens=n)
        assert r.result.token_ids == alone.token_ids
        assert r.result.stats["tau"] > 1.0


@pytest.mark.parametrize("attention,int8", [("causal", False), ("bidirectional", False), ("causal", True)])
def test_batched_drafting_equals_one_by_one(target, solo, attention, int8):
    """One head forward for several requests' drafts (padded contexts, longest block) gives each
    request the distributions its own draft gives, and propose_many the same trees."""
    from jetflow.decoding.block_drafter import BlockDrafter, head_logprobs_many
    from jetflow.decoding.drafter import make_drafter, propose_many

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6, attention=attention,
                                                feed_last_feature=True, depth_embedding=True))
    rng = random.Random(1)
    drafters, anchors, positions = [], [], []
    for n in (5, 17, 9):
        out = solo.prefill([rng.randrange(3, 200) for _ in range(n)])
        d = BlockDrafter(head, solo, int8=int8)
        d.extend(out.hidden)
        drafters.append(d)
        anchors.append(rng.randrange(3, 200))
        positions.append(n)
    depths = [2, None, 4]
    if not int8:  # int8 drafters are not batched (see propose_many); the trees below still agree
        together = head_logprobs_many(drafters, anchors, positions, depths)
        for d, a, p, depth, lp in zip(drafters, anchors, positions, depths, together):
            torch.testing.assert_close(lp, d.head_logprobs(a, p, depth), atol=1e-4, rtol=1e-4)
    mixed = [make_drafter(head, solo, lookup=True, int8=int8) for _ in range(2)]
    for d, n in zip(mixed, (7, 11)):
        d.primary.extend(solo.prefill([rng.randrange(3, 200) for _ in range(n)]).hidden)
    trees = [p.tree(8) for p in propose_many(mixed, [5, 6], [7, 11], [20, 20], [3, 3], [8, 8])]
    alone = [d.propose(a, p, 20, 3, 8).tree(8) for d, a, p in zip(mixed, [5, 6], [7, 11])]
    assert [t.tokens for t in trees] == [t.tokens for t in alone]


@pytest.mark.parametrize("shift", [True, False])
def test_batched_path_passes_equal_one_by_one(solo, shift):
    """A head trained for the path-conditioned pass: propose_many runs every request's path pass in one
    head forward too (chains padded to the longest, heads that shift tokens; the q-slot layout of
    other heads runs one by one), and each request gets the rows and the tree it gets alone, with and
    without lookup merged in, with one pass and with three."""
    from jetflow.decoding.drafter import make_drafter, propose_many

    torch.manual_seed(1)
    config = DraftHeadConfig.for_target(solo, block_size=6, feed_last_feature=True, depth_embedding=True,
                                        shift_tokens=shift, path_projection=shift)
    config.path_refine = True
    head = DraftHead(config)
    with torch.no_grad():  # weights large enough that the path's tokens move the rows
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    rng = random.Random(2)
    contexts = [solo.prefill([rng.randrange(3, 200) for _ in range(n)]).hidden for n in (5, 13, 9)]
    for passes, lookup in ((1, False), (1, True), (3, False)):
        drafters = [make_drafter(head, solo, lookup=lookup, refine=passes) for _ in contexts]
        for d, hidden in zip(drafters, contexts):
            d.extend(hidden)
        anchors, positions = [5, 6, 7], [len(h) for h in contexts]
        rooms, nodes = [20, 3, 20], [12, 12, 2]  # depths 5, 3 and 2
        calls = []
        hook = head.register_forward_hook(lambda *_: calls.append(1))
        together = propose_many(drafters, anchors, positions, rooms, [3] * 3, nodes)
        hook.remove()
        # one forward for the first passes, then one per path pass (or per request's pass without shift)
        assert len(calls) <= 1 + passes if shift else len(calls) >= 1 + len(contexts)
        alone = [d.propose(a, p, r, 3, n) for d, a, p, r, n in zip(drafters, anchors, positions, rooms, nodes)]
        for t, a, n, depth in zip(together, alone, nodes, (5, 3, 2)):
            ht, ha = (t.primary, a.primary) if lookup else (t, a)
            assert ht.rows.shape[0] == ha.rows.shape[0] == 2 * depth - 1  # first pass + depths 2..D after the path
            torch.testing.assert_close(ht.rows, ha.rows, atol=1e-4, rtol=1e-4)
            assert t.tree(n).tokens == a.tree(n).tokens


def test_a_lone_request_gets_the_single_stream_budget():
    """With one request in the batch the load budget is the single-stream policy: same draft size,
    same choice, and the same plain/drafted decisions once drafting stops paying."""
    from jetflow.decoding.budget import AdaptiveBudget
    from jetflow.decoding.costs import CostCurve
    from jetflow.decoding.load_budget import LoadBudget
    from jetflow.tree.build import build_tree

    ms = {n: 10.0 + 2.5 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    costs = CostCurve({"c1_ms": 10.0, "verify_ms": ms, "draft_ms": {}})
    load, single = LoadBudget(costs, max_budget=16), AdaptiveBudget(costs)
    torch.manual_seed(0)
    for confidence in (3.0, 0.1):
        lp = (torch.randn(15, 50) * confidence).log_softmax(-1)
        tree = build_tree(lp, 1, 256, 3)
        for _ in range(12):
            assert load.draft_nodes(1) == single.draft_nodes()
            assert load.should_draft([True]) == single.should_draft()
            assert load.choose([tree], 0.0) == single.choose(tree)
            path = [0, tree.children[0][tree.tokens[1]]] if confidence > 1 else [0]
            load.observe(tree, path, 1.0)
            single.observe(tree, path, 1.0)
    assert load.draft_nodes(8) <= 16  # a batch stays within the load budget's cap


def test_load_budget_trusts_measured_steps_over_the_cost_curve():
    """The cost curve says drafting pays at this batch size, but the steps measured say the opposite
    (a batched forward dearer than the single-sequence curve): once both ways are measured, steps are
    plain, with a drafted one now and then; when drafted steps measure faster again, drafting resumes."""
    from jetflow.decoding.costs import CostCurve
    from jetflow.decoding.load_budget import LoadBudget
    from jetflow.tree.build import build_tree

    ms = {n: 10.0 + 0.1 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # nearly flat: drafting looks free
    policy = LoadBudget(CostCurve({"c1_ms": 10.0, "verify_ms": ms, "draft_ms": {}}), max_budget=32)
    lp = torch.full((15, 50), -9.0)
    lp[:, 0] = 0.0
    tree = build_tree(lp.log_softmax(-1), 1, 32, 3)
    assert policy.choose([tree] * 8, draft_ms=1.0) > 0 and policy.should_draft([True] * 8)  # predicted: draft
    policy.observe_step([True] * 8, drafted=True, tokens=10, ms=100.0)  # measured: 0.1 token/ms drafted ...
    assert policy.should_draft([True] * 8)  # (plain steps not measured yet: the prediction still rules)
    policy.observe_step([True] * 8, drafted=False, tokens=8, ms=20.0)  # ... 0.4 token/ms plain
    choices = [policy.should_draft([True] * 8) for _ in range(4 * policy.explore_every)]
    assert choices.count(True) in (1, 2) and not choices[0]  # plain, exploring drafts now and then
    for _ in range(5):
        policy.observe_step([True] * 8, drafted=True, tokens=40, ms=50.0)  # drafted steps now measure 0.8 token/ms
    assert sum(policy.should_draft([True] * 8) for _ in range(policy.explore_every)) == policy.explore_every - 1
    policy.observe_step([True] * 1, drafted=True, tokens=1, ms=1.0)  # a lone request is the single-stream policy's
    assert all(bucket > 1 for bucket, _ in policy.ways)


def test_load_budget_remembers_drafting_per_mix_of_modes():
    """Sampled requests accept fewer nodes: a batch of them that measured drafting as losing stays
    plain, while a greedy batch of the same size, and a mixed one, still draft by their own."""
    from jetflow.decoding.costs import CostCurve
    from jetflow.decoding.load_budget import LoadBudget
    from jetflow.tree.build import build_tree

    ms = {n: 10.0 + 0.1 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    policy = LoadBudget(CostCurve({"c1_ms": 10.0, "verify_ms": ms, "draft_ms": {}}), max_budget=32)
    lp = torch.full((15, 50), -9.0)
    lp[:, 0] = 0.0
    tree = build_tree(lp.log_softmax(-1), 1, 32, 3)
    sampled, greedy, mixed = [False] * 4, [True] * 4, [True, False, False, True]
    assert [LoadBudget.key(m) for m in (sampled, greedy, mixed)] == [(4, "sampled"), (4, "greedy"), (4, "mixed")]
    for modes in (sampled, greedy):
        assert policy.choose([tree] * 4, draft_ms=1.0, greedy=modes) > 0  # predicted: drafting pays
    policy.observe_step(sampled, drafted=True, tokens=4, ms=100.0)  # measured for the sampled batch: it loses
    policy.observe_step(sampled, drafted=False, tokens=4, ms=10.0)
    assert not any(policy.should_draft(sampled) for _ in range(3))
    assert all(policy.should_draft(greedy) for _ in range(3)) and policy.should_draft(mixed)
    policy.observe_step(greedy, drafted=True, tokens=20, ms=20.0)  # the greedy batch measures drafting ahead
    policy.observe_step(greedy, drafted=False, tokens=4, ms=10.0)
    assert all(policy.should_draft(greedy) for _ in range(3)) and not policy.should_draft(sampled)
    # two requests at `auto` in a step with two more at budgets of their own: the step is priced and
    # remembered as the batch of four it is, the others' trees included
    assert policy.choose([tree] * 2, draft_ms=1.0, greedy=[True, True], others=[(False, 0), (False, 0)]) > 0
    assert (4, "mixed") in policy.draft_rate and (2, "greedy") not in policy.draft_rate
    steep = LoadBudget(CostCurve({"c1_ms": 10.0, "verify_ms": {n: 10.0 + 2.5 * n for n in ms}, "draft_ms": {}}),
                       max_budget=32)
    torch.manual_seed(0)
    lp = (torch.randn(15, 50) * 3).log_softmax(-1)
    lp[:, 0] = 0.0
    confident = build_tree(lp.log_softmax(-1), 1, 32, 3)
    alone = steep.choose([confident] * 2, 0.0, [True] * 2, others=[(False, 0)] * 2)
    # beside two trees of 24 nodes every cap up to 24 costs the same padded forward: it is taken
    padded = steep.choose([confident] * 2, 0.0, [True] * 2, others=[(False, 24)] * 2)
    assert alone < padded and padded >= 24


QUESTIONS = ["What is the capital of France? Answer briefly.", "Name two prime numbers above ten.",
             "Write one sentence about the sea."]


def test_prefix_cache_keeps_finished_conversations(target, solo):
    """Finished sequences (prompt and answer) go into the prefix cache, least recently used out:
    every entry's keys, values and features equal a fresh prefill of its tokens, and a next turn
    that starts with a cached conversation prefills only its new tokens, with the rows it gets alone."""
    from jetflow.decoding.prompt import encode_prompt

    rng = random.Random(3)
    system = {"role": "system", "content": "You are a helpful assistant."}  # a shared system block
    prompts = [encode_prompt(target.tokenizer, [system, {"role": "user", "content": q}]) for q in QUESTIONS]
    batch = BatchedTarget(target, prefix_slots=2)

    def converse(prompt, steps):  # join, verify and commit random trees, remember, leave
        rid, _ = batch.join(prompt)
        for _ in range(steps):
            tokens, parents = random_tree(rng, rng.randrange(1, 6), 200)
            batch.verify({rid: (tokens, parents)})
            batch.commit({rid: path_to_root(parents, rng.randrange(len(parents)))})
        tokens = list(batch.token_ids(rid))
        batch.remember(rid)
        batch.leave(rid)
        return tokens

    def check_next_turn(follow_up, out):  # up to float rounding
        ref = solo.prefill(follow_up)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden, ref.hidden, atol=1e-4, rtol=1e-4)

    walk_prefix_cache(batch, converse, prompts, lambda: rng.randrange(3, 200), check_next_turn)
    for entry in batch._cached.entries:  # brute force: each entry holds a fresh prefill's keys, values and features
        ref = solo.prefill(entry.token_ids)
        torch.testing.assert_close(entry.features, ref.hidden, atol=1e-4, rtol=1e-4)
        for (k, v), layer in zip(entry.kv, solo.cache.layers):
            torch.testing.assert_close(k, layer.keys[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, layer.values[0], atol=1e-4, rtol=1e-4)
    assert batch.rows == []


def test_without_a_cache_nothing_is_kept(target):
    """No slots, or the target's own cache off: no entries, no features kept per row; of prompts
    joining together only the first goes into the cache (a burst must not push out conversations)."""
    from jetflow.decoding.prompt import encode_prompt

    prompts = [encode_prompt(target.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    for slots, on in ((0, True), (2, False)):
        target.prefix_cache = on
        try:
            batch = BatchedTarget(target, prefix_slots=slots)
            for p in prompts:
                rid, _ = batch.join(p)
                batch.remember(rid)
                assert batch.cached_prompt_tokens(rid) == 0
            assert batch._cached.entries == [] and all(r.features is None for r in batch.rows)
            assert batch.prefix_tokens_reused == 0
        finally:
            target.prefix_cache = True
    batch = BatchedTarget(target, prefix_slots=4)
    target.prefix_cache = False
    rid, _ = batch.join(prompts[0])  # joined while the cache was off: no features kept for it
    target.prefix_cache = True
    batch.remember(rid)  # its keys and values still go in
    assert [e.token_ids for e in batch._cached.entries] == [prompts[0]] and batch._cached.entries[0].features is None
    batch.leave(rid)
    batch = BatchedTarget(target, prefix_slots=4)
    for rid, _ in batch.join_many(prompts):
        batch.leave(rid)
    assert [e.token_ids for e in batch._cached.entries] == [prompts[0]]
    with pytest.raises(ValueError, match="prefix_slots must be >= 0"):
        BatchedTarget(target, prefix_slots=-1)


def test_a_chats_next_turn_through_the_batch_decoder(target):
    """A second turn joins the batch from the cached first turn (prompt and answer) and decodes as
    the same conversation alone with a fresh prefill."""
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    decoder = BatchDecoder(target, head)
    jf = jetflow.JetFlow(target, head)

    def turn(messages):
        r = decoder.add(request(target, messages, 8, max_new_tokens=20))
        while not r.finished:
            decoder.step()
        return r.result

    turn1 = [rng for rng in random.Random(5).choices(range(3, 200), k=40)]  # token ids: the answer goes back as it came
    first = turn(turn1)
    turn2 = turn1 + first.token_ids + [11, 12, 13]
    second = turn(turn2)
    # all but the last answer token (the bonus of the last round, never committed) came from the cache
    assert second.cached_prompt_tokens >= len(turn1) + len(first.token_ids) - 1
    target.prefix_cache = False
    try:
        alone = jf.generate(turn2, max_new_tokens=20, budget=8, width=3)
    finally:
        target.prefix_cache = True
    assert second.token_ids == alone.token_ids


def test_trees_are_cut_to_fit_one_llamacpp_decode():
    """Many requests with long lookup chains at once: more tokens than one llama.cpp decode takes
    would fail the step for every request; the longest trees are cut to prefixes instead."""
    from jetflow.decoding.batch import _fit_batch
    from jetflow.tree.build import DraftTree

    def chain(n):
        return DraftTree(list(range(n)), list(range(-1, n - 1)), list(range(n)), [-0.1 * i for i in range(n)])

    trees = {i: chain(n) for i, n in enumerate([33, 30, 5, 1])}
    _fit_batch(trees, 40)
    sizes = [len(trees[i]) for i in range(4)]
    assert sum(sizes) == 40 and sizes[2:] == [5, 1] and abs(sizes[0] - sizes[1]) <= 1
    assert all(trees[i].parents == list(range(-1, sizes[i] - 1)) for i in range(4))  # prefixes: still chains
    small = {i: chain(1) for i in range(3)}
    _fit_batch(small, 2)  # roots alone cannot be cut (the decode refuses them by name)
    assert [len(t) for t in small.values()] == [1, 1, 1]



def test_batched_rounds_that_accept_whole_paths_stop_where_decoding_alone_does(target):
    """Drafts the target agrees with (an oracle drafter), so rounds accept several tokens, and requests
    that end inside an accepted path (at a stop string, EOS or the length limit) while their
    batch-mates go on: each output and finish reason equals the request decoded alone."""
    from tiny import OracleDrafter

    prompts = [[10, 20, 30], [7, 8], [3, 4, 5, 6], [50, 60]]
    eos = target.model.generation_config.eos_token_id
    try:
        free = {i: jetflow.generate(target, p, max_new_tokens=40) for i, p in enumerate(prompts)}
        # EOS: a token the second answer emits mid-way; a stop string from inside the third answer
        target.model.generation_config.eos_token_id = free[1].token_ids[9]
        stop = free[2].text[12:15]
        specs = [dict(max_new_tokens=23), dict(max_new_tokens=40), dict(max_new_tokens=40, stop=[stop]),
                 dict(max_new_tokens=17)]
        alone = [jetflow.generate(target, p, **kw) for p, kw in zip(prompts, specs)]
        assert [a.finish_reason for a in alone] == ["length", "stop", "stop", "length"]
        torch.manual_seed(0)
        decoder = BatchDecoder(target, DraftHead(DraftHeadConfig.for_target(target, block_size=6)), lookup=False)
        decoder._new_drafter = lambda view: OracleDrafter(view, block_size=6, sharpen=20.0)
        finished = []
        for p, kw in zip(prompts, specs):
            finished.append(decoder.add(request(target, p, 5, **kw)))
        while decoder.active:
            decoder.step()
        for r, want in zip(finished, alone):
            assert r.result.token_ids == want.token_ids and r.result.text == want.text
            assert r.result.finish_reason == want.finish_reason
        accepted = [n for r in finished for n in r.result.stats["accept_lengths"]]
        assert max(accepted) == 6 and sum(accepted) / len(accepted) > 3  # whole paths taken
    finally:
        target.model.generation_config.eos_token_id = eos


def test_a_batch_decoder_taps_its_heads_layers_from_the_start(target):
    """A decoder made while the target tapped another head's layers (another JetFlow set them last):
    its batch keeps its own head's, and decodes, instead of refusing its own head at the first step."""
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))  # taps [0, 2]
    target.set_tapped_layers([1, 3])
    try:
        decoder = BatchDecoder(target, head, lookup=False)
        r = decoder.add(request(target, [10, 20, 30], 4, max_new_tokens=12))
        while decoder.active:
            decoder.step()
        assert r.result.token_ids == jetflow.generate(target, [10, 20, 30], max_new_tokens=12).token_ids
    finally:
        target.set_tapped_layers([0, 2])
