import random

import pytest
import torch

from jetflow.tree.build import DraftTree, build_tree
from jetflow.tree.mask import path_to_root


def brute_force_best(logprobs, budget, width, calibration=None):
    """Enumerate every path of candidates (depth <= D, top-width per depth) and keep the best
    ``budget`` by cumulative log-probability (or calibrated score)."""
    depth = logprobs.shape[0]
    return brute_force_rows(logprobs, lambda row, token: row + 1 if row + 1 < depth else None, budget, width,
                            calibration)


def brute_force_rows(rows, next_row, budget, width, calibration=None):
    """Every candidate path (each node's children: the top-``width`` of its row), best ``budget``;
    with ``calibration``, each node's score is recomputed from scratch through it (the path's ranks
    say whether a parent is on the all-top-1 chain)."""
    top_lp, top_ids = rows.topk(width, dim=-1)
    paths, stack = [], [((), (), 0.0, 0)]
    while stack:
        tokens, ranks, score, row = stack.pop()
        if row is None:
            continue
        for r in range(width):
            lp = float(top_lp[row, r])
            if calibration is not None:
                lp = calibration.score(len(tokens) + 1, all(x == 0 for x in ranks), lp)
            tok, s = int(top_ids[row, r]), score + lp
            paths.append((s, tokens + (tok,)))
            stack.append((tokens + (tok,), ranks + (r,), s, next_row(row, tok)))
    paths.sort(key=lambda x: -x[0])
    return paths[:budget]


@pytest.mark.parametrize("seed", range(15))
def test_best_first_equals_brute_force(seed):
    rng = random.Random(seed)
    depth, vocab, width = rng.randint(1, 4), 12, rng.randint(1, 4)
    logprobs = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)).mul(2).log_softmax(-1)
    total = sum(width ** d for d in range(1, depth + 1))
    budget = rng.randint(0, total + 3)
    tree = build_tree(logprobs, root_token=99, budget=budget, width=width)
    expected = brute_force_best(logprobs, budget, width)
    got = []
    for node in range(1, len(tree)):
        path = path_to_root(tree.parents, node)
        assert path[0] == 0 and tree.depths[node] == len(path) - 1
        got.append((tree.scores[node], tuple(tree.tokens[j] for j in path[1:])))
    assert len(tree) - 1 == min(budget, total)
    assert sorted(p for _, p in got) == sorted(p for _, p in expected)
    for (s1, _), (s2, _) in zip(sorted(got, reverse=True), expected):
        assert s1 == pytest.approx(s2, abs=1e-5)
    # Nodes come out in descending score order, parents before children.
    assert all(tree.parents[i] < i for i in range(1, len(tree)))
    assert tree.scores[1:] == sorted(tree.scores[1:], reverse=True)


def test_chain_is_width_one_and_limits():
    lp = torch.randn(5, 20).log_softmax(-1)
    chain = build_tree(lp, 7, budget=100, width=1)
    assert chain.parents == [-1, 0, 1, 2, 3, 4]
    assert chain.tokens[1:] == lp.argmax(-1).tolist()
    assert len(build_tree(lp, 7, budget=3, width=1)) == 4
    assert len(build_tree(lp, 7, budget=0, width=7)) == 1
    assert build_tree(lp[:0], 7, budget=5, width=2).tokens == [7]
    with pytest.raises(ValueError):
        build_tree(lp, 7, budget=4, width=0)


def test_children_index():
    tree = DraftTree([5, 1, 2, 3], [-1, 0, 0, 1], [0, 1, 1, 2], [0, -1, -2, -3])
    assert tree.children == [{1: 1, 2: 2}, {3: 3}, {}, {}]
    assert tree.add(4, 2, -5.0) == 4 and tree.children[2] == {4: 4} and tree.depths[4] == 2
