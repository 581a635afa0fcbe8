"""Draft trees: the plain structure and the best-first builder over per-depth candidates.

A block head gives one distribution per depth, the same for every path (the draft is parallel), so
each depth offers its top-w tokens as candidates and a node's score is the cumulative draft
log-probability of its path. Best-first search pops the highest-scoring frontier node; popping a
node offers (a) its next-ranked sibling and (b) its first-ranked child. Because candidates are
sorted and log-probabilities are <= 0, this lazy frontier yields nodes in exactly descending score
order, and every node's parent is already in the tree.

``budget`` counts draft nodes; the root (the anchor token, already decided by the target) is node 0
and is not counted, so the verify forward processes ``budget + 1`` tokens.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from jetflow.tree.calibration import TreeCalibration


@dataclass
class DraftTree:
    tokens: list[int]  # tokens[0] is the root (anchor)
    parents: list[int]  # parents[0] == -1
    depths: list[int]
    scores: list[float]  # cumulative draft log-probability (root: 0)
    children: list[dict[int, int]] = field(default_factory=list)  # token -> child node, per node

    def __post_init__(self):
        if not self.children:
            self.children = [{} for _ in self.tokens]
            for node, parent in enumerate(self.parents):
                if parent >= 0:
                    self.children[parent][self.tokens[node]] = node

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add(self, token: int, parent: int, score: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.children.append({})
        self.children[parent][token] = node
        return node

    def prefix(self, size: int) -> "DraftTree":
        """The first ``size`` nodes: for a best-first tree, the tree of budget ``size - 1``."""
        return DraftTree(self.tokens[:size], self.parents[:size], self.depths[:size], self.scores[:size])

    def main_chain(self) -> "DraftTree":
        """The chain root -> first child -> first child ...: in a best-first tree, the most likely
        path (what a verifier that takes chains only checks)."""
        nodes = main_chain_nodes(self.parents)
        return DraftTree([self.tokens[i] for i in nodes], list(range(-1, len(nodes) - 1)),
                         list(range(len(nodes))), [self.scores[i] for i in nodes])

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls([int(token)], [-1], [0], [0.0])


def main_chain_nodes(parents) -> list[int]:
    """Nodes of the chain root -> first child -> first child ... (children in node order)."""
    first_child: dict[int, int] = {}
    for node, parent in enumerate(parents):
        first_child.setdefault(int(parent), node)
    chain = [0]
    while chain[-1] in first_child:
        chain.append(first_child[chain[-1]])
    return chain


def build_tree(depth_logprobs: torch.Tensor, root_token: int, budget: int, width: int,
               vocab_ids: torch.Tensor | None = None, calibration: TreeCalibration | None = None) -> DraftTree:
    """Best-first tree over per-depth log-probabilities [D, V] (row d-1 = depth d); column j is
    token ``vocab_ids[j]`` when given (a reduced draft vocabulary), else token j.

    Adds at most ``budget`` draft nodes with depth <= D, each depth offering its top-``width`` tokens.
    ``width=1`` gives a chain (DFlash's draft). With ``calibration``, a node's score adds its
    calibrated log-probability of acceptance (tree/calibration.py) instead of its draft log-prob.
    """
    depth = depth_logprobs.shape[0]
    return build_tree_rows(depth_logprobs, lambda row, token: row + 1 if row + 1 < depth else None,
                           root_token, budget, width, vocab_ids, calibration)


def build_tree_rows(logprobs: torch.Tensor, next_row, root_token: int, budget: int, width: int,
                    vocab_ids: torch.Tensor | None = None, calibration: TreeCalibration | None = None) -> DraftTree:
    """Best-first tree where each node's children come from a row of ``logprobs`` [R, V]: the root's
    from row 0, and the children of a node that came from row r with token t from row
    ``next_row(r, t)`` (None: a leaf). Per-depth rows (:func:`build_tree`) are the case
    next_row(r, t) = r + 1; a path-conditioned pass gives the nodes of one path rows of their own
    (decoding/refine.py). ``calibration`` maps a child's draft log-prob, by its depth and whether
    its parent is on the all-top-1 chain, to the log-prob the score adds."""
    if budget < 0 or width < 1:
        raise ValueError(f"budget must be >= 0 and width >= 1 (got {budget}, {width})")
    tree = DraftTree.root_only(root_token)
    if budget == 0 or logprobs.shape[0] == 0:
        return tree
    w = min(width, logprobs.shape[1])
    top_lp, top_ids = logprobs.float().topk(w, dim=-1)
    if vocab_ids is not None:
        top_ids = vocab_ids.to(top_ids.device)[top_ids]
    lp, ids = top_lp.tolist(), top_ids.tolist()  # one transfer; the search itself is pure Python
    on_main = [True]  # per node: on the all-top-1 chain (the root is); read only when calibrated

    # What a child of ``node`` (its row's ``rank``-th token) adds to its parent's score.
    def draft_gain(node: int, row: int, rank: int) -> float:
        return lp[row][rank]

    def calibrated_gain(node: int, row: int, rank: int) -> float:
        value = lp[row][rank]
        return value if value == float("-inf") else calibration.score(tree.depths[node] + 1, on_main[node], value)

    gain = draft_gain if calibration is None else calibrated_gain

    # Frontier entries: (-score, tie-breaker, parent node, row, rank).
    frontier = [(-gain(0, 0, 0), 0, 0, 0, 0)]
    counter = 1
    while frontier and len(tree) - 1 < budget:
        neg, _, parent, row, rank = heapq.heappop(frontier)
        score = -neg
        if score == float("-inf"):  # only impossible tokens left (outside a reduced draft vocabulary)
            break
        node = tree.add(ids[row][rank], parent, score)
        if calibration is not None:
            on_main.append(on_main[parent] and rank == 0)
        if rank + 1 < w:  # next-best sibling under the same parent
            sib = tree.scores[parent] + gain(parent, row, rank + 1)
            heapq.heappush(frontier, (-sib, counter, parent, row, rank + 1))
            counter += 1
        child_row = next_row(row, ids[row][rank])
        if child_row is not None:  # best child
            heapq.heappush(frontier, (-(score + gain(node, child_row, 0)), counter, node, child_row, 0))
            counter += 1
    return tree
