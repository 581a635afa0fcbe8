"""The path-conditioned second pass of a causal block head (the paper's Eq. 5-7 ideal, approximated).

A block head's first pass gives one distribution per depth, the same for every path. The second
pass puts the first pass's most likely path t1..t(D-1) into the slots, as tokens, and adds below
each path token t_j a MASK slot q_j at depth j+1; with a tree-causal mask, q_j sees the context, the
anchor and t1..tj only. A head trained with revealed blocks (``jetflow train --reveal``: the first m
slots hold the true next tokens, the rest stay MASK) reads q_j as "what follows this path", so its
output is the depth-(j+1) distribution conditioned on the path. The tree is then built best-first
over both passes' rows: a node on the path takes its children from its path-conditioned row, every
other node from the first pass's row of its depth (tree/build.py, build_tree_rows).

Layout of the pass, 2D-1 slots for D draft depths: [anchor, t1..t(D-1), q1..q(D-1)]. A head that
shifts tokens (``config.shift_tokens``: each slot reads its parent's token) needs no q slots: in the
plain causal block [anchor, t1..t(D-1), MASK] the slot after t_j reads t_j and sees t1..tj, so D+1
slots give the same rows.

More passes (``refine=N``) iterate the path to a fixed point, Jacobi-style: pass n+1 runs on the path
that pass n's rows choose greedily (t1 from the first pass, t(j+1) the top token after t1..tj), so the
main chain of the tree is conditioned on its own tokens one depth further per pass.

``refine="tree"`` conditions the whole first-pass tree instead, in one pass, for a head that shifts
tokens: one slot per tree node, reading the node's token under its parent's slot (tree-causal mask),
so its output is the distribution of that node's children after the node's own path, the paper's
Eq. 5-7 for every node of the first tree. The tree is then built again over both passes' rows.
``refine="tree:N"``: N such passes, each over the tree the one before built.
"""

from __future__ import annotations

import torch

from jetflow.tree.build import DraftTree, build_tree_rows
from jetflow.tree.mask import ancestor_matrix


def tree_passes(refine) -> int:
    """Tree-conditioned passes a ``refine`` setting asks for: "tree" 1, "tree:N" N, anything else 0."""
    if not isinstance(refine, str):
        return 0
    kind, _, count = refine.partition(":")
    if kind != "tree" or (count and not count.isdigit()) or count == "0":
        raise ValueError(f"refine must be a number of passes, 'tree' or 'tree:N' (N >= 1), got {refine!r}")
    return int(count or 1)


def refine_layout(depth: int) -> tuple[list[int], list[int]]:
    """Parents and depths of the pass's slots for ``depth`` draft depths (D >= 2)."""
    m = depth - 1
    parents = [-1] + list(range(m)) + list(range(1, m + 1))  # t_j under t_(j-1) (t_0: anchor); q_j under t_j
    depths = [0] + list(range(1, m + 1)) + list(range(2, m + 2))
    return parents, depths


def path_rows(depth: int, path_tokens: list[int]):
    """``next_row`` for build_tree_rows over rows [first pass, depths 1..D] + [path rows q1..q(D-1)]:
    row r < D is depth r+1 of the first pass; row D+j-1 is depth j+1 after the path t1..tj."""
    d = depth

    def next_row(row: int, token: int) -> int | None:
        if row < d:  # a first-pass node: on the path only if it is t1 under the root
            if row == 0 and d >= 2 and token == path_tokens[0]:
                return d
            return row + 1 if row + 1 < d else None
        j = row - d + 1  # the node is a child of t_j, at depth j+1
        if j + 1 <= d - 1 and token == path_tokens[j]:  # it is t_(j+1): still on the path
            return row + 1
        return j + 1 if j + 1 < d else None  # off the path: the first pass's row for depth j+2

    return next_row


def repath(path: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The next pass's path [..., D] from this pass's ``path`` and its rows ``after`` [..., D-1, V]
    (row j-1: depth j+1 after t1..tj): t1 stays, t(j+1) is the top token of row j-1."""
    return torch.cat([path[..., :1], after.argmax(-1)], dim=-1)


def tree_pass_layout(tree: DraftTree, depth: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Parents, depths and read tokens of the tree-conditioned pass over a first-pass ``tree`` of at
    most ``depth`` levels, and the tree node of each slot from slot 2 on: slot 0 is the anchor; slot 1
    reads it at depth 1 (the first pass's slot 1); each node n above the last level gets a slot that
    reads its token at depth(n)+1 under its parent's slot (nodes at the last level can have no
    children). Along one path this is the causal block [anchor, t1..tk, MASK] of a head that shifts
    tokens, slot for slot."""
    parents, depths, reads, nodes = [-1, 0], [0, 1], [tree.tokens[0]] * 2, []
    slot = {0: 1}
    for n in range(1, len(tree)):
        if tree.depths[n] >= depth:
            continue
        slot[n] = len(parents)
        parents.append(slot[tree.parents[n]])
        depths.append(tree.depths[n] + 1)
        reads.append(tree.tokens[n])
        nodes.append(n)
    return parents, depths, reads, nodes


def tree_rows(first: DraftTree, depth: int):
    """``next_row`` for build_tree_rows over rows [first pass, depths 1..D] + [node rows]: row D+n-1
    holds the children of first-tree node n after its path. A node of the first tree takes its
    children from its own row, any other node from the first pass's row of their depth."""
    d = depth

    def next_row(row: int, token: int) -> int | None:
        owner = 0 if row == 0 else row - d + 1 if row >= d else None  # first-tree node whose children the row holds
        level = row + 1 if row < d else first.depths[owner] + 1  # depth of the new node
        if level >= d:
            return None
        child = first.children[owner].get(token) if owner is not None else None
        return d + child - 1 if child is not None else level

    return next_row


class RefinedProposal:
    """Both passes' rows; a tree of any budget is built from them (``next_row``: whose row holds which
    node's children)."""

    def __init__(self, rows: torch.Tensor, next_row, root: int, width: int, vocab_ids: torch.Tensor | None = None,
                 path_tokens: list[int] | None = None):
        self.rows, self.next_row, self.path_tokens = rows, next_row, path_tokens
        self.root, self.width, self.vocab_ids = root, width, vocab_ids

    def tree(self, budget: int) -> DraftTree:
        return build_tree_rows(self.rows, self.next_row, self.root, budget, self.width, self.vocab_ids)


def path_hidden(drafter, anchor: int, position: int, path: list[int], d: int) -> torch.Tensor:
    """Head states [D-1, H] of depths 2..D after the path t1..tj (row j-1: after t1..tj), for a head
    that does not shift tokens: its q slots (:func:`refine_layout`). Heads that shift tokens run the
    plain causal chain instead (:func:`paths_hidden`)."""
    parents, depths = refine_layout(d)
    return slots_hidden(drafter, [anchor] + path[: d - 1] + [drafter.head.config.mask_token_id] * (d - 1), parents,
                        depths, position)[d:]


def slots_hidden(drafter, tokens: list[int], parents: list[int], depths: list[int], position: int) -> torch.Tensor:
    """Head states of one tree of slots after the drafter's context: slot i holds ``tokens[i]`` at
    depth ``depths[i]`` below the anchor (slot 0, at ``position``) and sees its ancestors and itself."""
    device = drafter.head.fc.weight.device
    depth_t = torch.tensor(depths, device=device)
    mask = torch.cat([torch.ones(len(parents), drafter.context_len, dtype=torch.bool, device=device),
                      ancestor_matrix(parents).to(device)], 1)
    return drafter.run_head(drafter.embed(torch.tensor(tokens, device=device)), position + depth_t,
                            drafter.context_kv, mask, drafter.last_feature, depths=depth_t)


def paths_hidden(drafters, anchors: list[int], positions: list[int], paths: list[list[int]],
                 depths: list[int]) -> list[torch.Tensor]:
    """:func:`path_hidden` of several drafters of one head. A head that shifts tokens runs them in ONE
    head forward: each request's chain [anchor, anchor, t1..t(D-1)] padded to the longest (a chain
    slot never sees the slots after it); any other head's passes run one by one."""
    if not drafters[0].head.config.shift_tokens:
        return [path_hidden(*args) for args in zip(drafters, anchors, positions, paths, depths)]
    from jetflow.decoding.block_drafter import run_head_many  # (block_drafter imports this module)

    s = max(depths) + 1
    ids = torch.full((len(drafters), s), drafters[0].head.config.mask_token_id, dtype=torch.long)
    for i, (anchor, path, d) in enumerate(zip(anchors, paths, depths)):
        ids[i, : d + 1] = torch.tensor([anchor, anchor] + path[: d - 1])
    hidden = run_head_many(drafters, ids, positions, ancestor_matrix(list(range(-1, s - 1))),
                           depths=torch.arange(s))
    return [hidden[i, 2:d + 1] for i, d in enumerate(depths)]


@torch.inference_mode()
def refined_proposal(drafter, anchor: int, position: int, first: torch.Tensor, width: int,
                     passes: int = 1) -> RefinedProposal:
    """``passes`` path-conditioned passes after ``first`` [D, Vd], the first pass's rows from ``anchor``
    at ``position`` (the drafter's context must end right before it); the tree takes the last one's
    rows. Further passes stop early once the path is a fixed point."""
    return refined_proposals([drafter], [anchor], [position], [first], [width], passes)[0]


@torch.inference_mode()
def refined_proposals(drafters, anchors: list[int], positions: list[int], firsts: list[torch.Tensor],
                      widths: list[int], passes: int = 1) -> list[RefinedProposal]:
    """:func:`refined_proposal` of several requests of one head (each drafter with its own context),
    each pass of all of them in one head forward where the head allows (:func:`paths_hidden`)."""
    def target_ids(i: int, draft: torch.Tensor) -> list[int]:
        ids = drafters[i].draft_ids
        return (draft if ids is None else ids[draft]).tolist()

    depths = [f.shape[0] for f in firsts]
    path_ids = [f.argmax(-1) for f in firsts]
    after: list[torch.Tensor | None] = [None] * len(firsts)
    live = [i for i, d in enumerate(depths) if d >= 2]
    for n in range(passes):
        if not live:
            break
        hidden = paths_hidden([drafters[i] for i in live], [anchors[i] for i in live], [positions[i] for i in live],
                              [target_ids(i, path_ids[i]) for i in live], [depths[i] for i in live])
        still = []
        for i, h in zip(live, hidden):
            after[i] = drafters[i]._output_logprobs(h)
            nxt = repath(path_ids[i], after[i])
            if n + 1 < passes and not torch.equal(nxt, path_ids[i]):
                path_ids[i] = nxt
                still.append(i)
        live = still
    proposals = []
    for i, (first, d) in enumerate(zip(firsts, depths)):
        path = target_ids(i, path_ids[i])
        rows = first if after[i] is None else torch.cat([first, after[i]])
        proposals.append(RefinedProposal(rows, path_rows(d, path), anchors[i], widths[i], drafters[i].draft_ids, path))
    return proposals


@torch.inference_mode()
def tree_refined_proposal(drafter, anchor: int, position: int, first: torch.Tensor, width: int,
                          budget: int, passes: int = 1) -> RefinedProposal:
    """The tree-conditioned pass over the first pass's tree of ``budget`` nodes (rows ``first`` [D, Vd]
    from ``anchor`` at ``position``; the drafter's context must end right before it). Each further
    pass conditions the tree the pass before built."""
    d = first.shape[0]
    proposal = drafter.proposal(first, anchor, width)  # the single pass's own tree comes first
    for _ in range(passes if d >= 2 else 0):
        tree = proposal.tree(budget)
        if len(tree) < 2:
            break
        parents, depths, reads, nodes = tree_pass_layout(tree, d)
        hidden = slots_hidden(drafter, reads, parents, depths, position)[2:]
        node_rows = first.new_full((len(tree) - 1, first.shape[1]), float("-inf"))  # last-level nodes: unused
        node_rows[torch.tensor(nodes) - 1] = drafter._output_logprobs(hidden).to(first.dtype)
        proposal = RefinedProposal(torch.cat([first, node_rows]), tree_rows(tree, d), anchor, width, drafter.draft_ids)
    return proposal
