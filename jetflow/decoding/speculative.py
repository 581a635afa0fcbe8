"""The speculative decoding loop: per round one draft forward, one tree build, one target verify.

    prefill -> root token
    repeat: draft tree from the root -> verify the tree -> accept a path + bonus -> commit the path
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from jetflow.decoding.acceptance import accept_path
from jetflow.decoding.budget import AdaptiveBudget
from jetflow.decoding.drafter import Drafter
from jetflow.decoding.output import OutputStream
from jetflow.decoding.result import GenerationResult
from jetflow.decoding.sampling import SamplingParams, next_token
from jetflow.decoding.stats import SpeculativeStats
from jetflow.models.backend import TargetBackend
from jetflow.tree.build import DraftTree


def speculative_stream(
    target: TargetBackend,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    output: OutputStream,
    budget: int | AdaptiveBudget,
    width: int,
    every_round: bool = False,
) -> Iterator[str | GenerationResult]:
    """Yield text deltas as rounds commit tokens, then the :class:`GenerationResult`. ``budget`` is a
    node count, or an :class:`AdaptiveBudget` that picks one per round. ``every_round``: a delta
    before every round, empty when no text is final yet, so the caller can stop between any two."""
    adaptive = budget if isinstance(budget, AdaptiveBudget) else None
    t0 = time.perf_counter()
    stats = SpeculativeStats(device=target.device)
    generator = params.make_generator(target.device)
    head = getattr(drafter, "head", None)
    if head is not None:  # several decoders may share the target: this one reads its own head's layers
        target.set_tapped_layers(head.config.target_layer_ids)
    # Without features (the head settled as losing, decoding/budget.py) no round may draft; a request
    # that collects them stops once it has drafted and the head is settled as losing. A drafter
    # without a head (prompt lookup) and a budget of 0 never read them.
    features = adaptive.collects_features(params.greedy) if adaptive is not None else head is not None and budget != 0
    pre = target.prefill(prompt_ids, return_hidden=features)
    cached = target.reused_tokens
    drafter.reset()
    if features:
        drafter.extend(pre.hidden)
    root = next_token(pre.logits[-1], params, generator)
    prefill_s = time.perf_counter() - t0
    # Most rounds of `auto` where drafts do not pay: the runtime's own greedy step, with no tree and
    # one timing (their Python runs right after a decode, with cold caches, so it costs ~1% of a step).
    plain_steps = (adaptive is not None or budget == 0) and params.greedy and not features
    dropped = False  # features stopped mid-request: the head drafted and settled as losing
    drafted_last = False  # the previous round drafted: this round's draft projects only its features
    finished = output.add(root)
    while not finished:
        if (delta := output.drain()) or every_round:
            yield delta
        if features and adaptive is not None and not adaptive.keeps_features():
            features, plain_steps, dropped = False, params.greedy, True
        room = target.max_context - target.past_len - 1  # deepest node that still fits the context
        if room < 0:
            output.finish("length")
            break
        tree = None
        if budget == 0:
            tree = PLAIN
            stats.round_kinds["plain"] += 1
        elif adaptive is not None:
            tree = _round_without_draft(adaptive, drafter, root, room, stats, params.greedy, may_draft=features)
        if tree is PLAIN and plain_steps:  # no logits copied out, no tree bookkeeping
            t = time.perf_counter()
            root = target.greedy_step(root)
            t = time.perf_counter() - t
            stats.seconds["verify"] += t
            if adaptive is not None:
                adaptive.observe_plain(t * 1e3)
            stats.accept_lengths.append(1)
            stats.tree_sizes.append(0)
            finished, drafted_last = output.add(root), False
            continue
        if tree is PLAIN:
            tree = DraftTree.root_only(root)
        before = dict(stats.seconds)
        drafted, nodes, build_ms = tree is None, None, 0.0
        if drafted:
            stats.round_kinds["drafted"] += 1
            nodes = budget if adaptive is None else adaptive.draft_nodes()
            with stats.timed("draft"):
                proposal = drafter.propose(root, target.past_len, room, width, max_nodes=nodes)
            with stats.timed("tree"):
                t = time.perf_counter()
                tree = proposal.tree(nodes)
                build_ms = (time.perf_counter() - t) * 1e3
                if adaptive is not None:  # one build at the largest budget prices every smaller one (decoding/budget.py)
                    tree = tree.prefix(adaptive.choose(tree, params.greedy) + 1)
        cells = target.tree_room()
        if cells is not None and len(tree) > cells:  # near the context's end, fewer nodes than levels fit
            tree = tree.prefix(cells)
        path, bonus = _verify_round(target, drafter, tree, params, generator, features, stats)
        if adaptive is not None:
            spent = {phase: (stats.seconds[phase] - before[phase]) * 1e3 for phase in before}  # this round, ms
            # A draft's time as the cost curve takes it: projection, head forward and tree build (the
            # build is priced with the draft, so the rest of the round leaves it out).
            timed_draft = drafted and drafted_last
            adaptive.observe(tree, path, other_ms=spent["tree"] - build_ms + spent["accept"] + spent["commit"],
                             verify_ms=spent["verify"], draft_ms=spent["draft"] + build_ms if timed_draft else None,
                             drafted_nodes=nodes if timed_draft else None, drafted=drafted, greedy=params.greedy)
        drafted_last = drafted
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        stats.accept_lengths.append(len(emitted))
        stats.tree_sizes.append(len(tree) - 1)
        output.add_many(emitted)
        finished = output.finished
        root = bonus
    if delta := output.drain():
        yield delta
    yield GenerationResult.from_output(output, len(prompt_ids), time.perf_counter() - t0, prefill_s,
                                       method="jetflow",
                                       stats={"budget": "auto" if adaptive else budget, "width": width,
                                              "features": features or dropped, "features_dropped": dropped,
                                              **stats.to_dict()}, cached_prompt_tokens=cached)


def _verify_round(target: TargetBackend, drafter: Drafter, tree: DraftTree, params: SamplingParams,
                  generator: torch.Generator | None, features: bool, stats: SpeculativeStats) -> tuple[list[int], int]:
    """Verify ``tree`` in one target forward, accept a path and commit it: (path, bonus token).
    (Plain greedy rounds without features take the runtime's own step in the loop instead.)"""
    with stats.timed("verify"):
        out = target.verify(tree.tokens, tree.parents, return_hidden=features)
    with stats.timed("accept"):
        path, bonus = accept_path(tree, out.logits, params, generator)
        if len(tree) > 1:
            drafter.observe(tree, path)
    with stats.timed("commit"):
        target.commit(path)
        if features:
            drafter.extend(out.hidden[path])
    return path, bonus


PLAIN = "plain"  # a round that verifies the root alone


def _round_without_draft(adaptive: AdaptiveBudget, drafter: Drafter, root: int, room: int,
                         stats: SpeculativeStats, greedy: bool, may_draft: bool = True) -> DraftTree | str | None:
    """The round's tree when a head forward is not expected to pay (or ``may_draft`` is False): the
    lookup chain alone (it costs no forward) when it beats a plain step, else ``PLAIN`` (the root
    alone); None when drafting pays or explores."""
    with stats.timed("draft"):
        chain = adaptive.lookup_chain(drafter, root, room)
    if adaptive.plain_step_due():  # re-times the step every other price is scaled by
        chain = None
    elif may_draft and adaptive.should_draft(chain, greedy):
        return None
    stats.round_kinds["plain" if chain is None else "lookup"] += 1
    return PLAIN if chain is None else chain.tree
