"""Tree calibration: the fit against brute-force references, and calibrated best-first trees against
an enumeration of every candidate path scored from scratch."""

import json
import math
import random

import numpy as np
import pytest
import torch

from jetflow.models.draft_head import DrafterMismatchError, DraftHead, DraftHeadConfig, read_config
from jetflow.tree.build import build_tree
from jetflow.tree.calibration import (MIN_BIN, Curve, TreeCalibration, _isotonic, candidate_records,
                                      fit_calibration, fit_curve, reliability)
from jetflow.tree.mask import path_to_root
from test_tree_build import brute_force_best


def isotonic_reference(values, weights):
    """Weighted isotonic regression by its min-max formula: x_i = max_{j<=i} min_{k>=i} mean(j..k)."""
    n = len(values)

    def mean(j, k):
        w = sum(weights[j:k + 1])
        return sum(v * x for v, x in zip(values[j:k + 1], weights[j:k + 1])) / w
    return [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_isotonic_equals_min_max_formula(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    values = [rng.random() for _ in range(n)]
    weights = [rng.randint(1, 5) for _ in range(n)]
    got = _isotonic(values, weights)
    assert got == pytest.approx(isotonic_reference(values, weights))
    assert all(b >= a - 1e-12 for a, b in zip(got, got[1:]))


def test_fit_curve_bins_are_smoothed_rates():
    """Equal-count bins, each its (hits + 1/2) / (n + 1): here already increasing, so nothing pools."""
    rng = np.random.default_rng(0)
    lp = np.log(rng.uniform(0.01, 1.0, 6000))
    accepted = rng.uniform(size=lp.size) < np.exp(lp)  # a calibrated head: P(accept) = draft prob
    curve = fit_curve(lp, accepted)
    order = np.argsort(lp, kind="stable")
    parts = np.array_split(order, 6000 // MIN_BIN)
    want_x = [lp[p].mean() for p in parts]
    want_y = [(accepted[p].sum() + 0.5) / (len(p) + 1) for p in parts]
    want_y = isotonic_reference(want_y, [len(p) for p in parts])
    assert curve.log_probs == pytest.approx(want_x)
    assert curve.log_accept == pytest.approx(np.log(want_y).tolist())
    # The rates follow the true acceptance within sampling noise.
    assert np.abs(np.exp(curve.log_accept) - np.exp(curve.log_probs)).max() < 0.12


def test_curve_interpolates_and_extends():
    c = Curve([-2.0, -1.0, -0.1], [-3.0, -1.0, -0.2])
    tie = 1e-3
    assert c(-1.5) == pytest.approx(-2.0 + tie * -1.5)
    assert c(-5.0) == pytest.approx(-3.0 - 3.0 + tie * -5.0)  # slope 1 below the first knot
    assert c(0.0) == pytest.approx(-0.2)  # flat above the last
    assert c(-1.2) < c(-1.1)  # strictly increasing, flat stretches included
    assert c(float("-inf")) == float("-inf")


def enumerate_records(top_lp, top_ids, continuation):
    """Every candidate of the unbounded width-w tree whose parent path is the true prefix."""
    records = []
    D, w = top_ids.shape
    paths = [((), True)]  # (path of ranks, all rank 0)
    for d in range(D):
        nxt = []
        for ranks, main in paths:
            for r in range(w):
                nxt.append((ranks + (r,), main and r == 0))
        paths = nxt
    for ranks, _ in paths:
        for d in range(min(len(ranks), len(continuation))):
            parent_true = all(top_ids[k][ranks[k]] == continuation[k] for k in range(d))
            if parent_true:
                records.append((d + 1, all(r == 0 for r in ranks[:d]), float(top_lp[d][ranks[d]]),
                                bool(top_ids[d][ranks[d]] == continuation[d])))
    return sorted(set(records))


@pytest.mark.parametrize("seed", range(12))
def test_candidate_records_equal_enumeration(seed):
    rng = np.random.default_rng(seed)
    D, w, V = rng.integers(1, 4), rng.integers(1, 4), 6
    lp = torch.tensor(rng.normal(size=(D, V)) * 2).log_softmax(-1)
    top_lp, top_ids = [t.numpy() for t in lp.topk(w, dim=-1)]
    continuation = [int(top_ids[d][rng.integers(0, w)]) if rng.uniform() < 0.8 else V + 1 for d in range(D)]
    continuation = continuation[:rng.integers(1, D + 1)]
    got = candidate_records(top_lp, top_ids, continuation)
    assert sorted(set((d, bool(m), lp_, bool(a)) for d, m, lp_, a in got)) == enumerate_records(
        top_lp, top_ids, continuation)
    assert len(got) == len(set(got))


def skewed_calibration(depths: int, seed: int) -> TreeCalibration:
    """A calibration far from the identity: each depth and parent kind its own curve."""
    rng = random.Random(seed)

    def curve():
        xs = sorted(rng.uniform(-8, 0) for _ in range(3))
        ys = sorted(math.log(rng.uniform(0.01, 0.99)) for _ in range(3))
        return Curve(xs, ys)
    return TreeCalibration([curve() for _ in range(depths)], [curve() for _ in range(depths)])


@pytest.mark.parametrize("seed", range(15))
def test_calibrated_best_first_equals_brute_force(seed):
    rng = random.Random(seed)
    depth, vocab, width = rng.randint(1, 4), 12, rng.randint(1, 4)
    logprobs = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)).mul(2).log_softmax(-1)
    cal = skewed_calibration(rng.randint(1, depth), seed)  # fewer curves than depths: the deepest repeats
    total = sum(width ** d for d in range(1, depth + 1))
    budget = rng.randint(0, total + 3)
    tree = build_tree(logprobs, root_token=99, budget=budget, width=width, calibration=cal)
    expected = brute_force_best(logprobs, budget, width, calibration=cal)
    got = [(tree.scores[n], tuple(tree.tokens[j] for j in path_to_root(tree.parents, n)[1:]))
           for n in range(1, len(tree))]
    assert len(tree) - 1 == min(budget, total)
    assert sorted(p for _, p in got) == sorted(p for _, p in expected)
    for (s1, _), (s2, _) in zip(sorted(got, reverse=True), expected):
        assert s1 == pytest.approx(s2, abs=1e-9)
    assert all(tree.parents[i] < i for i in range(1, len(tree)))


def test_calibration_changes_the_tree_shape():
    """A calibration that trusts the top-1 chain and distrusts every other branch turns a bushy
    tree into a deep one: the node count stays, the depth grows."""
    probs = torch.full((6, 30), 0.3 / 26)
    probs[:, 0], probs[:, 1:4] = 0.4, 0.1  # each depth: one likely token, three runners-up
    lp = probs.log()
    main = [Curve([-3.0, -1.0, 0.0], [-6.0, -0.01, -0.001])] * 6  # top-1 ~ sure, runners-up ~ hopeless
    off = [Curve([-10.0, 0.0], [-12.0, -6.0])] * 6
    plain = build_tree(lp, 1, budget=12, width=4)
    deep = build_tree(lp, 1, budget=12, width=4, calibration=TreeCalibration(main, off))
    assert len(plain) == len(deep) == 13
    assert deep.max_depth == 6 > plain.max_depth


def test_fit_calibration_fallbacks_and_refusal():
    rng = np.random.default_rng(1)
    records = [(1, True, float(np.log(p)), bool(rng.uniform() < p)) for p in rng.uniform(0.05, 1, 700)]
    records += [(2, False, float(np.log(p)), bool(rng.uniform() < p / 2)) for p in rng.uniform(0.05, 1, 500)]
    cal = fit_calibration(records, depths=3)
    assert cal.samples == 1200 and len(cal.main) == len(cal.off_main) == 3
    assert cal.off_main[0] == cal.main[0]  # depth 1: the root's children only (borrowed for the other kind)
    assert cal.main[1] == cal.main[0]  # too few main records at depth 2: the depth above
    assert cal.off_main[2] == cal.off_main[1]
    assert cal.score(2, False, -0.1) < cal.score(2, True, -0.1)  # off-main depth 2 was fitted at half the rate
    with pytest.raises(ValueError, match="depth 1"):
        fit_calibration(records[:100], depths=2)
    with pytest.raises(ValueError, match="no calibration records"):
        fit_calibration([], depths=2)


def test_json_roundtrip_and_validation(tmp_path):
    cal = skewed_calibration(3, 0)
    again = TreeCalibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert again == cal
    for bad in ({"main": [[[-1.0, -2.0], [-1.0, -0.5]]], "off_main": [[[-1.0], [-1.0]]]},  # knots decrease
                {"main": [[[-1.0], [0.5]]], "off_main": [[[-1.0], [-1.0]]]},  # above 0
                {"main": [[[-1.0], [-1.0]]], "off_main": []},  # depths differ
                {"main": "x", "off_main": []}):
        with pytest.raises(ValueError, match="calibration"):
            TreeCalibration.from_json(bad)
    # A checkpoint whose config carries a malformed calibration is refused with the file named.
    config = DraftHeadConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, vocab_size=32, mask_token_id=0, target_layer_ids=[0],
                             tree_calibration=cal.to_json())
    head = DraftHead(config)
    head.save_pretrained(tmp_path / "d")
    assert read_config(tmp_path / "d").calibration == cal
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    raw["tree_calibration"]["main"][0][1] = [0.5, 0.6, 0.7]
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterMismatchError, match="config.json.*calibration"):
        read_config(tmp_path / "d")


def test_reliability_table_counts_each_cell():
    records = [(1, True, math.log(0.5), True), (1, True, math.log(0.3), False),
               (2, False, math.log(0.2), True), (2, True, math.log(0.9), True)]
    rows = reliability(records, depths=3)
    assert rows == [
        {"depth": 1, "parent_on_main": True, "candidates": 2, "mean_draft_prob": pytest.approx(0.4), "accept_rate": 0.5},
        {"depth": 2, "parent_on_main": True, "candidates": 1, "mean_draft_prob": pytest.approx(0.9), "accept_rate": 1.0},
        {"depth": 2, "parent_on_main": False, "candidates": 1, "mean_draft_prob": pytest.approx(0.2), "accept_rate": 1.0},
    ]
