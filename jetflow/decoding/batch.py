"""Speculative decoding of many requests at once (continuous batching): per round, one draft per
request and ONE target forward that verifies all their trees.

    add(request)  -> prefill it alone, join the batch (between two rounds)
    step()        -> every active request: draft tree -> one batched verify -> accept -> commit;
                     finished requests leave the batch and are returned with their results

Each request keeps everything of its own: its row of the target's batched cache, its committed
tokens, its drafter context, its sampling generator and output stream. Acceptance is the same rule
as the single-sequence loop, applied to each request's own logits, so a request's output does not
depend on what else is in the batch (up to the floating-point effect of batch shape on the
target's kernels; the tests check identical greedy output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jetflow.decoding.acceptance import accept_path
from jetflow.decoding.drafter import make_drafter, propose_many
from jetflow.decoding.load_budget import LoadBudget
from jetflow.decoding.output import OutputStream
from jetflow.decoding.result import GenerationResult
from jetflow.decoding.sampling import SamplingParams, next_token
from jetflow.decoding.stats import SpeculativeStats
from jetflow.models.batched_target import batched_target
from jetflow.tree.build import DraftTree


@dataclass(eq=False)  # compared by identity
class BatchRequest:
    prompt_ids: list[int]
    params: SamplingParams
    output: OutputStream
    budget: int | None = 16  # draft nodes per round (0: plain decoding; None: the decoder's load budget)
    width: int = 7
    id: int = -1  # its row in the batch, once added
    root: int = 0  # the next round's root token
    result: GenerationResult | None = None
    stats: SpeculativeStats | None = None
    _drafter: object = None
    _generator: object = None
    _t0: float = 0.0
    _prefill_s: float = 0.0
    _cached: int = 0  # prompt tokens taken from the batch's prefix cache
    _drafted_last: bool = False  # its previous round drafted (its draft then projects that round's rows only)
    _build_ms: float = 0.0  # this round's tree build, when it drafted

    @property
    def finished(self) -> bool:
        return self.output.finished


class _RowView:
    """A target as one request's drafter sees it: the shared model, this row's committed tokens."""

    def __init__(self, batch, row_id: int):
        self._batch, self._row_id = batch, row_id

    def __getattr__(self, name):
        return getattr(self._batch.target, name)

    @property
    def max_context(self) -> int:
        return self._batch.max_context

    @property
    def token_ids(self) -> list[int]:
        return self._batch.token_ids(self._row_id)

    @property
    def past_len(self) -> int:
        return self._batch.length(self._row_id)


class BatchDecoder:
    def __init__(self, target, head=None, *, lookup: bool = True, int8: bool = False,
                 load_budget: LoadBudget | None = None, max_batch: int = 32, prefix_slots: int | None = None):
        """``load_budget`` sizes the trees of requests whose budget is None (decoding/load_budget.py);
        ``max_batch``: the most requests at once (llama.cpp reserves a KV stream for each);
        ``prefix_slots``: entries of the batch's prefix cache (models/batched_target.py, llamacpp_batched.py)."""
        if head is not None:  # the batch keeps features of the layers tapped when it is made: its head's
            target.set_tapped_layers(head.config.target_layer_ids)
        self.batch = batched_target(target, max_batch, prefix_slots)
        self.target, self.head, self.lookup, self.int8 = target, head, lookup, int8
        self.load_budget = load_budget
        self._template = None  # the drafter requests' drafters are forked from
        self.active: list[BatchRequest] = []
        self.forwards = 0  # batched verify forwards so far
        self.last_step = {"batch": 0, "tokens": 0, "nodes": 0}  # what the last step verified

    def add(self, request: BatchRequest) -> BatchRequest:
        """Prefill ``request`` and add it to the batch (it may finish at once: then it is not kept)."""
        return self.add_many([request])[0]

    def add_many(self, requests: list[BatchRequest]) -> list[BatchRequest]:
        """Prefill several requests together (one forward per prompt chunk where the backend
        batches prefills) and add them to the batch."""
        t0 = time.perf_counter()
        for request in requests:
            if request.budget is None and self.load_budget is None:
                raise ValueError("a request without a budget needs the decoder's load budget")
            request._t0 = t0
            request.stats = SpeculativeStats(device=self.target.device)
            request._generator = request.params.make_generator(self.target.device)
        joined = self.batch.join_many([r.prompt_ids for r in requests])
        prefill_s = time.perf_counter() - t0
        try:  # all or nothing: each request is set up before any of them is running
            for request, (row_id, out) in zip(requests, joined):
                request.id = row_id
                if hasattr(self.batch, "cached_prompt_tokens"):
                    request._cached = self.batch.cached_prompt_tokens(row_id)
                if self.head is not None and request.budget != 0:
                    request._drafter = self._new_drafter(_RowView(self.batch, request.id))
                    request._drafter.reset()
                    request._drafter.extend(out.hidden)
                request.root = next_token(out.logits[-1], request.params, request._generator)
        except Exception:  # the batch keeps no row of them, and no output has a token yet: they can be added again
            for row_id, _ in joined:
                self.batch.leave(row_id)
            raise
        for request in requests:
            request._prefill_s = prefill_s
            request.output.add(request.root)
            self.active.append(request)
            if request.finished:
                self._finish(request)
        return requests

    def _new_drafter(self, view: _RowView):
        """A request's drafter: forked from one prepared per decoder (int8 weights are quantized
        once, not per request), or made afresh for drafters that cannot fork."""
        if self._template is None:
            self._template = make_drafter(self.head, self.target, int8=self.int8, lookup=self.lookup)
        if hasattr(self._template, "fork"):
            return self._template.fork(view)
        return make_drafter(self.head, view, int8=self.int8, lookup=self.lookup)

    def close(self) -> None:
        """Free the batch's own runtime resources now (a llama.cpp context), not when collected."""
        self.active.clear()
        if hasattr(self.batch, "close"):
            self.batch.close()

    def cancel(self, request: BatchRequest) -> None:
        """Drop a request between two steps (client gone)."""
        if request in self.active:
            self.active.remove(request)
            self.batch.leave(request.id)

    def step(self) -> list[BatchRequest]:
        """One round for every active request; returns the requests that finished in it."""
        done = []
        for r in list(self.active):  # no room left for even the root: the context is full
            if self.batch.max_context - self.batch.length(r.id) - 1 < 0:
                r.output.finish("length")
                done.append(self._finish(r))
        if not self.active:
            self.last_step = {"batch": 0, "tokens": 0, "nodes": 0}  # nothing verified
            return done
        trees, shared = {}, []  # shared: requests sized by the load budget
        auto = [r for r in self.active if r.budget is None and r._drafter is not None]
        all_auto, t_draft = len(auto) == len(self.active), time.perf_counter()
        chain = None  # a lone request's paying lookup chain: a round without a head forward
        plain_due = False  # a lone request's plain step that re-times the step every price is scaled by
        if all_auto and len(auto) == 1:
            r = auto[0]
            chain = self.load_budget.single.lookup_chain(r._drafter, r.root,
                                                         self.batch.max_context - self.batch.length(r.id) - 1)
            if self.load_budget.single.plain_step_due():
                chain, plain_due = None, True
        modes = [r.params.greedy for r in self.active]
        drafting = bool(auto) and not plain_due and self.load_budget.should_draft(modes, chain)
        drafts = [r for r in self.active if r._drafter is not None and (r.budget is not None or drafting)]
        for r in self.active:
            if r not in drafts:
                trees[r.id] = chain.tree if chain is not None else DraftTree.root_only(r.root)
            r.stats.round_kinds["drafted" if r in drafts else "plain" if chain is None else "lookup"] += 1
        if drafts:  # one head forward for all of them
            nodes = [r.budget if r.budget is not None else self.load_budget.draft_nodes(len(self.active))
                     for r in drafts]
            lengths = [self.batch.length(r.id) for r in drafts]
            t_propose = time.perf_counter()
            proposals = propose_many([r._drafter for r in drafts], [r.root for r in drafts], lengths,
                                     [self.batch.max_context - n - 1 for n in lengths], [r.width for r in drafts], nodes)
            t_drafted = time.perf_counter()
            draft_s = (t_drafted - t_draft) / len(drafts)
            for r, proposal, n in zip(drafts, proposals, nodes):
                r.stats.seconds["draft"] += draft_s
                t_build = time.perf_counter()
                with r.stats.timed("tree"):
                    trees[r.id] = proposal.tree(n)
                    r._build_ms = (time.perf_counter() - t_build) * 1e3
                    if self.batch.chains_only:  # the backend verifies one path per request
                        trees[r.id] = trees[r.id].main_chain()
                if r.budget is None:
                    shared.append(r)
        t_tree = time.perf_counter() if not drafts else t_drafted
        shared_ids = {r.id for r in shared}
        if shared:  # one node cap for this step, priced over the whole batch
            others = [(r.params.greedy, len(trees[r.id]) - 1) for r in self.active if r.id not in shared_ids]
            cap = self.load_budget.choose([trees[r.id] for r in shared], (time.perf_counter() - t_draft) * 1e3,
                                          [r.params.greedy for r in shared], others)
            for r in shared:
                trees[r.id] = trees[r.id].prefix(min(cap, len(trees[r.id]) - 1) + 1)
        capacity = getattr(self.batch, "n_batch", None)  # llama.cpp: the tokens one decode takes
        if capacity is not None:
            _fit_batch(trees, capacity)
        t0 = time.perf_counter()
        outs = self.batch.verify({rid: (tree.tokens, tree.parents) for rid, tree in trees.items()})
        verify_s = time.perf_counter() - t0
        t_verified = t0 + verify_s
        self.forwards += 1
        sizes = [len(t) for t in trees.values()]
        tokens = sum(sizes) if self.batch.chains_only else len(sizes) * max(sizes)  # torch pads trees to the largest
        self.last_step = {"batch": len(sizes), "tokens": tokens, "nodes": sum(sizes) - len(sizes)}
        paths, bonuses = {}, {}
        for r in self.active:
            tree, out = trees[r.id], outs[r.id]
            r.stats.seconds["verify"] += verify_s
            paths[r.id], bonuses[r.id] = accept_path(tree, out.logits, r.params, r._generator)
            if r._drafter is not None and len(tree) > 1:
                r._drafter.observe(tree, paths[r.id])
            lone = len(trees) == 1 and r.budget is None and r._drafter is not None
            if lone:  # its round outside draft (tree build included) and verify, and its verify, in ms
                other_s = (t0 - t_tree) + (time.perf_counter() - t_verified)
                other_ms = other_s * 1e3 - (r._build_ms if r in drafts else 0.0)
                timed = r in drafts and r._drafted_last  # as the single-stream loop times drafts
                self.load_budget.observe(tree, paths[r.id], other_ms, verify_s * 1e3,
                                         draft_ms=(t_drafted - t_propose) * 1e3 + r._build_ms if timed else None,
                                         drafted_nodes=nodes[drafts.index(r)] if timed else None,
                                         drafted=r in drafts, greedy=r.params.greedy)
            elif r.id in shared_ids:
                self.load_budget.observe(tree, paths[r.id], greedy=r.params.greedy)
        self.batch.commit(paths)
        for r in self.active:
            r._drafted_last = r in drafts
        for r in list(self.active):
            tree, path = trees[r.id], paths[r.id]
            if r._drafter is not None:
                r._drafter.extend(outs[r.id].hidden[path])
            emitted = [tree.tokens[i] for i in path[1:]] + [bonuses[r.id]]
            r.stats.accept_lengths.append(len(emitted))
            r.stats.tree_sizes.append(len(tree) - 1)
            r.output.add_many(emitted)
            r.root = bonuses[r.id]
            if r.finished:
                done.append(self._finish(r))
        if all_auto and len(trees) > 1:  # what this step achieved decides the next steps' drafting
            emitted = sum(len(p) for p in paths.values())  # accepted drafts + a bonus token per request
            self.load_budget.observe_step(modes, drafting, emitted, (time.perf_counter() - t_draft) * 1e3)
        return done

    def _finish(self, r: BatchRequest) -> BatchRequest:
        self.active.remove(r)
        if hasattr(self.batch, "remember"):  # its conversation so far, for its next turn
            self.batch.remember(r.id)
        self.batch.leave(r.id)
        r.result = GenerationResult.from_output(
            r.output, len(r.prompt_ids), time.perf_counter() - r._t0, r._prefill_s, method="jetflow-batch",
            stats={"budget": "auto" if r.budget is None else r.budget, "width": r.width, **r.stats.to_dict()},
            cached_prompt_tokens=r._cached)
        return r


def _fit_batch(trees: dict, capacity: int) -> None:
    """Cut the largest trees (to prefixes, still trees) until all of them fit one decode of
    ``capacity`` tokens: long lookup chains of many requests at once would otherwise fail the step,
    and with it every request in the batch. Each request keeps at least its root."""
    total = sum(len(t) for t in trees.values())
    while total > capacity:
        rid = max(trees, key=lambda r: len(trees[r]))
        if len(trees[rid]) <= 1:
            return  # roots alone: the batch itself holds more requests than a decode takes
        trees[rid] = trees[rid].prefix(len(trees[rid]) - 1)
        total -= 1
