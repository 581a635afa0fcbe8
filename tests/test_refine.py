"""The path-conditioned second pass (jetflow/decoding/refine.py) against brute-force references:
each of its rows equals a plain causal block whose first slots hold the path (the training layout
of revealed blocks), its trees equal an enumeration of every candidate path, and greedy decoding
with it equals autoregressive decoding."""

import random

import pytest
import torch

import jetflow
from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.decoding.refine import path_rows, refine_layout, tree_pass_layout, tree_rows
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from jetflow.tree.build import build_tree, build_tree_rows
from jetflow.tree.mask import ancestor_matrix, path_to_root
from test_tree_build import brute_force_rows
from tiny import tiny_model


@pytest.fixture(scope="module")
def target(tokenizer):
    return TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])


def make_head(target, **kw):
    torch.manual_seed(0)
    return DraftHead(DraftHeadConfig.for_target(target, block_size=6, feed_last_feature=True, depth_embedding=True,
                                                **kw)).eval()


def test_layout_is_the_path_with_a_mask_slot_under_each_token():
    parents, depths = refine_layout(4)  # [anchor, t1, t2, t3, q1, q2, q3]
    assert parents == [-1, 0, 1, 2, 1, 2, 3] and depths == [0, 1, 2, 3, 2, 3, 4]


@pytest.mark.parametrize("draft_vocab,gain,shift,proj", [(None, 1.0, False, False), (40, 1.0, False, False),
                                                         (None, 8.0, False, False), (None, 1.0, True, False),
                                                         (40, 8.0, True, False), (40, 1.0, True, True)])
def test_second_pass_rows_equal_blocks_with_the_path_revealed(target, draft_vocab, gain, shift, proj):
    head = make_head(target, draft_vocab_size=draft_vocab, slot_token_gain=gain, shift_tokens=shift,
                     path_projection=proj)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(target.vocab_size)[:draft_vocab].sort().values)
    drafter = BlockDrafter(head, target, refine=True)
    torch.manual_seed(1)
    drafter.extend(torch.randn(7, 2 * 64))
    anchor, position = 11, 7
    proposal = drafter.propose(anchor, position, room=5, width=3)
    first = drafter.head_logprobs(anchor, position)
    d = first.shape[0]
    torch.testing.assert_close(proposal.rows[:d], first)
    path = proposal.path_tokens
    ids = first.argmax(-1)
    assert path == (ids if head.draft_ids is None else head.draft_ids[ids]).tolist()
    mask_id = head.config.mask_token_id
    for j in range(1, d):  # row q_j: a plain causal block [anchor, t1..tj, MASK] read at its last slot
        block = torch.tensor([anchor] + path[:j] + [mask_id])
        hidden = head(target.embed(block), torch.arange(position, position + j + 2), drafter.context_kv,
                      head.block_mask(drafter.context_len)[: j + 2, : drafter.context_len + j + 2],
                      drafter.last_feature)
        expected = drafter._output_logprobs(hidden[-1:])[0]
        torch.testing.assert_close(proposal.rows[d + j - 1], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(12))
def test_trees_over_both_passes_equal_brute_force(seed):
    rng = random.Random(seed)
    depth, vocab, width = rng.randint(2, 4), 9, rng.randint(1, 3)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(2 * depth - 1, vocab, generator=g).mul(2).log_softmax(-1)
    path = rows[:depth].argmax(-1).tolist()
    if seed % 3 == 0:  # the path conditioned rows may prefer other tokens than the first pass's path
        path = [int(t) for t in torch.randint(0, vocab, (depth,), generator=g)]
    nxt = path_rows(depth, path)
    expected = brute_force_rows(rows, nxt, 10_000, width)
    budget = rng.randint(0, len(expected) + 2)
    tree = build_tree_rows(rows, nxt, 99, budget, width)
    got = [(tree.scores[n], tuple(tree.tokens[j] for j in path_to_root(tree.parents, n)[1:])) for n in range(1, len(tree))]
    assert len(got) == min(budget, len(expected))
    assert sorted(p for _, p in got) == sorted(p for _, p in expected[:budget])
    assert all(tree.parents[i] < i for i in range(1, len(tree)))
    # the path's nodes take their children from the conditioned rows, the rest from the first pass
    assert max(tree.depths) <= depth


def test_per_depth_rows_are_the_special_case():
    lp = torch.randn(4, 20).log_softmax(-1)
    a, b = build_tree(lp, 5, 30, 3), build_tree_rows(lp, lambda r, t: r + 1 if r + 1 < 4 else None, 5, 30, 3)
    assert (a.tokens, a.parents, a.scores) == (b.tokens, b.parents, b.scores)


@pytest.mark.parametrize("int8,shift,proj", [(False, False, False), (True, False, False), (False, True, False),
                                             (True, True, False), (False, True, True), (True, True, True)])
def test_greedy_decoding_with_the_second_pass_equals_autoregressive(target, int8, shift, proj):
    head = make_head(target, shift_tokens=shift, path_projection=proj)
    head.config.path_refine = True
    jf = jetflow.JetFlow(target, head, budget=12, width=3, int8_draft=int8, lookup=False)
    assert jf.drafter.refine
    for prompt in ([3, 14, 15, 92, 65], [7] * 9, [101, 5]):
        ar = jetflow.generate(target, prompt, max_new_tokens=30)
        got = jf.generate(prompt, max_new_tokens=30)
        assert got.token_ids == ar.token_ids
        assert got.stats["rounds"] > 0


def test_the_second_pass_needs_a_causal_head(target):
    head = make_head(target, attention="bidirectional")
    with pytest.raises(ValueError, match="causal"):
        BlockDrafter(head, target, refine=True)
    assert not BlockDrafter(make_head(target), target).refine  # off unless the head was trained for it


def test_slot_token_gain_scales_the_slots_after_the_anchor(target):
    """A gain-G head equals a gain-1 head (same weights) fed slot embeddings scaled by G after the
    anchor, in the block layout and in the second pass's tree layout."""
    plain, gained = make_head(target), make_head(target, slot_token_gain=8.0)
    torch.manual_seed(2)
    fused = plain.fuse(torch.randn(5, 2 * 64))
    ctx, last = plain.context_kv(fused, torch.arange(5)), fused[-1]
    block = torch.randn(6, 64)
    scaled = torch.cat([block[:1], 8.0 * block[1:]])
    mask = plain.block_mask(5)
    torch.testing.assert_close(gained(block, torch.arange(5, 11), ctx, mask, last),
                               plain(scaled, torch.arange(5, 11), ctx, mask, last), atol=1e-5, rtol=0)
    parents, depths = refine_layout(3)
    depth_t = torch.tensor(depths)
    tree_mask = torch.cat([torch.ones(5, 5, dtype=torch.bool), ancestor_matrix(parents)], 1)
    nodes = torch.randn(5, 64)
    torch.testing.assert_close(gained(nodes, 5 + depth_t, ctx, tree_mask, last, depths=depth_t),
                               plain(torch.cat([nodes[:1], 8.0 * nodes[1:]]), 5 + depth_t, ctx, tree_mask, last,
                                     depths=depth_t), atol=1e-5, rtol=0)


def test_shifted_slots_read_the_token_before_them(target):
    """A shift-tokens head equals the same weights fed, in each slot, the embedding of the slot before
    it (the anchor keeps its own), block by block; so slot j's output never depends on slot j's own
    token. Trees of slots (the unshifted second pass's layout) are refused."""
    plain, shifted = make_head(target), make_head(target, shift_tokens=True)
    torch.manual_seed(3)
    fused = plain.fuse(torch.randn(5, 2 * 64))
    ctx, last = plain.context_kv(fused, torch.arange(5)), fused[-1]
    blocks = torch.randn(12, 64)  # two blocks of 6 slots, as training lays them out
    by_hand = torch.cat([blocks[0:1], blocks[0:5], blocks[6:7], blocks[6:11]])
    positions = torch.cat([torch.arange(5, 11), torch.arange(7, 13)])
    mask = torch.cat([torch.ones(12, 5, dtype=torch.bool), torch.block_diag(*[torch.ones(6, 6).tril()] * 2).bool()], 1)
    torch.testing.assert_close(shifted(blocks, positions, ctx, mask, last),
                               plain(by_hand, positions, ctx, mask, last), atol=1e-5, rtol=0)
    changed = blocks.clone()
    changed[3] += 1.0  # slot 3's own token: only the slots after it may move
    out, ref = shifted(changed, positions, ctx, mask, last), shifted(blocks, positions, ctx, mask, last)
    torch.testing.assert_close(out[:4], ref[:4], atol=1e-6, rtol=0)
    assert not torch.allclose(out[4], ref[4])
    parents, depths = refine_layout(3)
    depth_t = torch.tensor(depths)
    tree_mask = torch.cat([torch.ones(5, 5, dtype=torch.bool), ancestor_matrix(parents)], 1)
    nodes = torch.randn(5, 64)  # a tree of slots: the caller gives each slot the token it reads
    torch.testing.assert_close(shifted(nodes, 5 + depth_t, ctx, tree_mask, last, depths=depth_t),
                               plain(nodes, 5 + depth_t, ctx, tree_mask, last, depths=depth_t), atol=1e-5, rtol=0)


def test_path_projection_projects_the_token_each_slot_reads(target):
    """A path-projection head equals the same weights without it fed, after the anchor, the projection
    of the slot before's embedding (the anchor keeps its own): the brute-force layout of each block."""
    proj = make_head(target, shift_tokens=True, path_projection=True)
    plain = DraftHead(DraftHeadConfig.for_target(target, block_size=6, feed_last_feature=True,
                                                 depth_embedding=True)).eval()
    plain.load_state_dict({k: v for k, v in proj.state_dict().items() if not k.startswith("path_proj")})
    with torch.no_grad():
        proj.path_proj[0].weight.uniform_(0.5, 1.5)  # a non-trivial norm scale as well
    torch.manual_seed(4)
    fused = plain.fuse(torch.randn(5, 2 * 64))
    ctx, last = plain.context_kv(fused, torch.arange(5)), fused[-1]
    blocks = torch.randn(12, 64)
    p = proj.path_proj
    by_hand = torch.cat([blocks[0:1], p(blocks[0:5]), blocks[6:7], p(blocks[6:11])])
    positions = torch.cat([torch.arange(5, 11), torch.arange(7, 13)])
    mask = torch.cat([torch.ones(12, 5, dtype=torch.bool), torch.block_diag(*[torch.ones(6, 6).tril()] * 2).bool()], 1)
    torch.testing.assert_close(proj(blocks, positions, ctx, mask, last), plain(by_hand, positions, ctx, mask, last),
                               atol=1e-5, rtol=0)


def test_path_projection_needs_shifted_tokens(target):
    with pytest.raises(ValueError, match="shift_tokens"):
        make_head(target, path_projection=True)


def test_more_passes_iterate_the_path_to_its_fixed_point(target):
    """refine=3: each pass runs on the path the one before chose greedily (t1 from the first pass, t(j+1)
    the top token after t1..tj), stopping early at a fixed point; the tree takes the last pass's rows.
    Rows by brute force: one plain causal block [anchor, t1..tj, MASK] per prefix."""
    head = make_head(target, shift_tokens=True, path_projection=True)
    with torch.no_grad():  # path tokens that move the rows (at init every row picks the anchor)
        head.path_proj[1].weight.normal_(std=0.3)
    drafter = BlockDrafter(head, target, refine=3)
    torch.manual_seed(1)
    drafter.extend(torch.randn(7, 2 * 64))
    anchor, position = 11, 7
    first = drafter.head_logprobs(anchor, position)
    d = first.shape[0]
    proposal = drafter.propose(anchor, position, room=5, width=3)
    ctx_len = drafter.context_len

    def rows_after(path):
        rows = []
        for j in range(1, d):
            block = torch.tensor([anchor] + path[:j] + [head.config.mask_token_id])
            hidden = head(target.embed(block), torch.arange(position, position + j + 2), drafter.context_kv,
                          head.block_mask(ctx_len)[: j + 2, : ctx_len + j + 2], drafter.last_feature)
            rows.append(drafter._output_logprobs(hidden[-1:])[0])
        return torch.stack(rows)

    path, seen = first.argmax(-1).tolist(), []
    for n in range(3):
        seen.append(path)
        rows = rows_after(path)
        new = [path[0]] + rows.argmax(-1).tolist()
        if n == 2 or new == path:
            break
        path = new
    assert len(seen) > 1  # this head's passes do move the path
    assert proposal.path_tokens == path
    torch.testing.assert_close(proposal.rows[:d], first)
    torch.testing.assert_close(proposal.rows[d:], rows, atol=1e-5, rtol=0)
    jf = jetflow.JetFlow(target, head, budget=12, width=3, lookup=False, refine=3)
    for prompt in ([3, 14, 15, 92, 65], [7] * 9):
        assert jf.generate(prompt, max_new_tokens=30).token_ids == jetflow.generate(target, prompt,
                                                                                    max_new_tokens=30).token_ids


@pytest.mark.parametrize("passes", [1, 2])
def test_tree_pass_rows_equal_blocks_along_each_node_path(target, passes):
    """refine="tree": the row of every first-tree node equals a plain causal block [anchor, path to the
    node, MASK] read at its last slot (brute force, one block per node), and the first pass's rows
    are kept; "tree:2": the same over the tree the first tree pass built."""
    head = make_head(target, shift_tokens=True, path_projection=True, draft_vocab_size=40)
    head.set_draft_vocab(torch.randperm(target.vocab_size)[:40].sort().values)
    with torch.no_grad():
        head.path_proj[1].weight.normal_(std=0.3)
    drafter = BlockDrafter(head, target, refine="tree" if passes == 1 else f"tree:{passes}")
    torch.manual_seed(5)
    drafter.extend(torch.randn(7, 2 * 64))
    anchor, position, budget = 11, 7, 16
    proposal = drafter.propose(anchor, position, room=3, width=3, max_nodes=budget)
    first = drafter.head_logprobs(anchor, position)[:3]
    d = first.shape[0]
    first_tree = build_tree_rows(first, lambda r, t: r + 1 if r + 1 < d else None, anchor, budget, 3, head.draft_ids)
    if passes == 2:  # the tree the first tree pass built
        one = BlockDrafter(head, target, refine="tree")
        torch.manual_seed(5)
        one.extend(torch.randn(7, 2 * 64))  # the same context
        first_tree = one.propose(anchor, position, room=3, width=3, max_nodes=budget).tree(budget)
    assert len(first_tree) == budget + 1 and max(first_tree.depths) == d  # the last level is reached
    torch.testing.assert_close(proposal.rows[:d], first)
    ctx_len, mask_id = drafter.context_len, head.config.mask_token_id
    for n in range(1, len(first_tree)):
        if first_tree.depths[n] == d:  # no slot, no children
            continue
        path = [first_tree.tokens[j] for j in path_to_root(first_tree.parents, n)[1:]]
        block = torch.tensor([anchor] + path + [mask_id])
        k = len(block)
        hidden = head(target.embed(block), torch.arange(position, position + k), drafter.context_kv,
                      head.block_mask(ctx_len)[:k, : ctx_len + k], drafter.last_feature)
        torch.testing.assert_close(proposal.rows[d + n - 1], drafter._output_logprobs(hidden[-1:])[0],
                                   atol=1e-5, rtol=0)


def test_tree_pass_layout_and_rows_by_hand():
    tree = build_tree(torch.tensor([[0.0, -1.0, -9.0], [-0.5, -2.0, -9.0], [-0.1, -3.0, -9.0]]).log_softmax(-1),
                      7, 5, 2)
    nxt, d = tree_rows(tree, 3), 3
    assert max(tree.depths) == d  # the last level gets no slot: its nodes can have no children
    parents, depths, reads, nodes = tree_pass_layout(tree, d)
    assert nodes == [n for n in range(1, len(tree)) if tree.depths[n] < d]
    slot = {0: 1, **{n: i + 2 for i, n in enumerate(nodes)}}
    assert reads == [7, 7] + [tree.tokens[n] for n in nodes]
    assert depths == [0, 1] + [tree.depths[n] + 1 for n in nodes]
    assert parents == [-1, 0] + [slot[tree.parents[n]] for n in nodes]
    for n in range(1, len(tree)):  # a first-tree node's children come from its own row
        row = 0 if tree.parents[n] == 0 else d + tree.parents[n] - 1
        assert nxt(row, tree.tokens[n]) == (d + n - 1 if tree.depths[n] < d else None)
    assert nxt(0, 99) == 1 and nxt(1, 0) == 2 and nxt(2, 0) is None  # off the first tree: the first pass's rows


@pytest.mark.parametrize("int8,mode", [(False, "tree"), (True, "tree"), (False, "tree:2")])
def test_greedy_decoding_with_the_tree_pass_equals_autoregressive(target, int8, mode):
    head = make_head(target, shift_tokens=True, path_projection=True)
    with torch.no_grad():
        head.path_proj[1].weight.normal_(std=0.3)
    jf = jetflow.JetFlow(target, head, budget=12, width=3, int8_draft=int8, lookup=False, refine=mode)
    assert jf.drafter.refine_tree
    for prompt in ([3, 14, 15, 92, 65], [7] * 9, [101, 5]):
        assert jf.generate(prompt, max_new_tokens=30).token_ids == jetflow.generate(target, prompt,
                                                                                    max_new_tokens=30).token_ids
    with pytest.raises(ValueError, match="shifts tokens"):
        BlockDrafter(make_head(target), target, refine="tree")
    for bad in ("tree:0", "tree:x", "trees"):
        with pytest.raises(ValueError, match="'tree:N'"):
            BlockDrafter(head, target, refine=bad)
