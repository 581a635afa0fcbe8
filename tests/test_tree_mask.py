import random

import pytest
import torch

from jetflow.tree.mask import (ancestor_matrix, check_parents, is_chain, path_to_root, tree_attention_mask,
                               tree_depths)


def random_parents(n, rng, forest=False):
    return [(-1 if (i == 0 or (forest and rng.random() < 0.1)) else rng.randrange(-1 if forest else 0, i))
            for i in range(n)]


def brute_force_depth(parents, i):
    depth = 0
    while parents[i] >= 0:
        i, depth = parents[i], depth + 1
    return depth


def brute_force_allowed(parents, past_len, window=None):
    """Walk each node's ancestry explicitly (its depth too: the mask module's own tree_depths is
    not the reference)."""
    n = len(parents)
    depth = [brute_force_depth(parents, i) for i in range(n)]
    allowed = torch.zeros(n, past_len + n, dtype=torch.bool)
    for i in range(n):
        q_pos = past_len + depth[i]
        for k in range(past_len):
            allowed[i, k] = window is None or q_pos - k < window
        j = i
        while j >= 0:
            allowed[i, past_len + j] = window is None or q_pos - (past_len + depth[j]) < window
            j = parents[j]
    return allowed


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("window", [None, 3])
def test_tree_mask_matches_brute_force(seed, window):
    rng = random.Random(seed)
    n, past = rng.randint(1, 40), rng.randint(0, 12)
    parents = random_parents(n, rng, forest=seed % 2 == 1)
    mask = tree_attention_mask(parents, past, torch.float32, sliding_window=window)
    assert mask.shape == (1, 1, n, past + n)
    expected = brute_force_allowed(parents, past, window)
    assert torch.equal(mask[0, 0] == 0, expected)
    assert tree_depths(parents) == [brute_force_depth(parents, i) for i in range(n)]
    assert torch.all(mask[0, 0][~expected] == torch.finfo(torch.float32).min)


def test_depths_paths_and_chain():
    parents = [-1, 0, 0, 1, 3, -1]
    assert tree_depths(parents) == [0, 1, 1, 2, 3, 0]
    assert path_to_root(parents, 4) == [0, 1, 3, 4]
    assert path_to_root(parents, 5) == [5]
    assert is_chain([-1, 0, 1, 2]) and not is_chain(parents)
    m = ancestor_matrix(parents)
    assert m[4].nonzero().flatten().tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 0, 5], [-2]])
def test_check_parents_rejects_bad_trees(bad):
    with pytest.raises(ValueError, match="parent"):
        check_parents(bad)
