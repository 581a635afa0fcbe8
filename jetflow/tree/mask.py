"""Tree topology helpers and the tree attention mask used by one-pass verification.

A tree of N candidate nodes is given by ``parents``: ``parents[i]`` is the index of node i's parent,
or -1 when node i hangs directly off the committed prefix. Parents always come before children
(``parents[i] < i``), which is the order in which trees are built and verified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_parents(parents: Sequence[int]) -> None:
    """Raise ValueError unless ``parents`` describes a forest in topological order."""
    for i, p in enumerate(parents):
        if not (-1 <= p < i):
            raise ValueError(f"parents[{i}] = {p}: a parent must be -1 or an earlier node index (< {i})")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node; nodes attached to the prefix have depth 0."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def is_chain(parents: Sequence[int]) -> bool:
    """True when the tree is a single path 0 -> 1 -> ... -> N-1 starting at the prefix."""
    return all(p == i - 1 for i, p in enumerate(parents))


def ancestor_matrix(parents: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean [N, N] matrix, ``m[i, j]`` = node j is node i itself or one of its ancestors."""
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]  # ancestors of i = i + ancestors of its parent (parents precede children)
    return m.to(device) if device is not None else m


def path_to_root(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the top of the tree down to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_attention_mask(
    parents: Sequence[int],
    past_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Additive attention mask of shape [1, 1, N, past_len + N] for verifying a tree in one forward.

    Node i may attend to every prefix position and to its own ancestors and itself; everything else
    gets the dtype's most negative value. With ``sliding_window`` (local-attention layers, e.g.
    Gemma 3), a key is also masked when its position is ``sliding_window`` or more behind the
    query's position (positions are past_len + depth, prefix position k is k).
    """
    check_parents(parents)
    n = len(parents)
    allowed = torch.ones(n, past_len + n, dtype=torch.bool, device=device)
    allowed[:, past_len:] = ancestor_matrix(parents, device)
    if sliding_window is not None:
        depths = torch.tensor(tree_depths(parents), device=device)
        q_pos = past_len + depths
        k_pos = torch.cat([torch.arange(past_len, device=device), q_pos])
        allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    mask = torch.zeros(n, past_len + n, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
