"""Many sequences of one torch target in one KV cache: a row per sequence, one forward for all.

Row r holds its committed tokens in cells [0, length_r) of its row of the cache; the cache is as wide
as the longest row, and a shorter row's cells past its length are left over (from dropped draft
nodes, or padding) and masked out. ``verify`` appends every row's draft tree at the same cells
[W, W + N) (N = the largest tree, smaller ones padded) with a per-row tree mask and positions
length_r + depth; ``commit`` moves each row's accepted nodes right behind its prefix and cuts the
cache to the longest row. A sequence joins after a prefill of its own (the target's single-sequence
cache is the scratch space) into a spare row of the cache's buffers, and leaves by moving the last
row into its place: neither copies the rest of the batch.

Prefix cache: ``prefix_slots`` entries keep recent sequences' keys, values and tapped features:
prompts as they join, and whole conversations (prompt and answer) as they finish, so a chat's next
turn finds its previous turn there. A joining prompt that shares at least ``MIN_SHARED`` leading
tokens with one starts its prefill from them (the scratch target's own prefix cache,
:meth:`TargetModel.prefill`), as a single stream does; the least recently used entry makes room.
Costs: each entry holds its tokens' keys and values (46 KB a token for SmolLM2 in float32) and
features (11.5 KB), copied out of the batch as its request finishes; every running row keeps its
features too. Kept rows equal a fresh prefill's up to float rounding, as verifies do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from jetflow.errors import InvalidRequestError, JetFlowError
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from jetflow.models.backend import TargetOutput, check_path, check_same_taps
from jetflow.models.prefix_cache import DEFAULT_PREFIX_SLOTS, CommittedFeatures, PrefixEntries
from jetflow.tree.mask import ancestor_matrix, check_parents, tree_depths


class _RowsLayer(DynamicLayer):
    """One layer's keys/values for a batch whose rows come and go: buffers with spare rows and
    cells (doubled when outgrown); ``keys``/``values`` are views of the first ``rows`` rows and
    ``width`` cells, which is what the model's attention reads."""

    def __init__(self):
        super().__init__()
        self.kbuf = self.vbuf = None
        self.rows = self.width = 0

    def ensure(self, rows: int, cells: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        if self.kbuf is not None and rows <= self.kbuf.shape[0] and cells <= self.kbuf.shape[2]:
            return
        old = self.kbuf
        r = rows if old is None else max(rows, old.shape[0] if rows <= old.shape[0] else 2 * old.shape[0])
        c = cells if old is None else max(cells, old.shape[2] if cells <= old.shape[2] else 2 * old.shape[2])
        kbuf = like_k.new_zeros(r, like_k.shape[1], c, like_k.shape[3])
        vbuf = like_v.new_zeros(r, like_v.shape[1], c, like_v.shape[3])
        if old is not None:
            kbuf[:self.rows, :, :self.width] = self.kbuf[:self.rows, :, :self.width]
            vbuf[:self.rows, :, :self.width] = self.vbuf[:self.rows, :, :self.width]
        self.kbuf, self.vbuf = kbuf, vbuf
        self.view()

    def view(self) -> None:
        self.keys = self.kbuf[:self.rows, :, :self.width]
        self.values = self.vbuf[:self.rows, :, :self.width]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self.ensure(self.rows, self.width + n, key_states, value_states)
        self.kbuf[:self.rows, :, self.width:self.width + n] = key_states
        self.vbuf[:self.rows, :, self.width:self.width + n] = value_states
        self.width += n
        self.view()
        return self.keys, self.values


@dataclass
class _Row:
    id: int
    length: int
    token_ids: list[int] = field(default_factory=list)
    features: CommittedFeatures | None = None  # kept while the batch has a prefix cache
    cached: int = 0  # prompt tokens its join took from the cache


@dataclass
class _Cached:
    token_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [heads, tokens, head_dim]
    features: torch.Tensor | None


def batched_target(target, max_seqs: int = 32, prefix_slots: int | None = None):
    """The many-sequence view of ``target`` for its backend; ``prefix_slots``: entries of its prefix
    cache (None: the default)."""
    slots = DEFAULT_PREFIX_SLOTS if prefix_slots is None else prefix_slots
    if target.backend == "llamacpp":
        from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget

        return LlamaCppBatchedTarget(target, max_seqs=max_seqs, prefix_slots=slots)
    return BatchedTarget(target, prefix_slots=slots)


class BatchedTarget:
    chains_only = False  # verifies whole trees, each row with its own tree mask

    def __init__(self, target, prefix_slots: int = 0):
        if prefix_slots < 0:
            raise ValueError(f"prefix_slots must be >= 0, got {prefix_slots}")
        if target.backend != "torch":
            raise JetFlowError("batched decoding runs on the torch backend")
        if target._sliding_window:
            raise JetFlowError(f"batched decoding does not support sliding-window attention ({target.name}) yet")
        self.target = target
        self._taps = tuple(target.tapped_layers)  # the rows' and the cache's features are of these layers
        self.max_context = target.max_context
        self.cache = Cache(layers=[_RowsLayer() for _ in range(target.num_layers)])
        self.rows: list[_Row] = []
        self._next_id = 0
        self._pending: dict[int, list[int]] | None = None  # row id -> parents of its verified tree
        self._width = 0  # cache cells before the pending trees
        self._cached = PrefixEntries(prefix_slots)
        self._pending_hidden: dict[int, torch.Tensor] = {}  # rows' verified features, kept at commit while caching
        self.prefix_tokens_reused = 0  # prompt tokens not prefilled thanks to the cache

    # ------------------------------------------------------------------ rows
    def _row(self, row_id: int) -> tuple[int, _Row]:
        for i, row in enumerate(self.rows):
            if row.id == row_id:
                return i, row
        raise KeyError(f"no sequence {row_id} in the batch")

    def length(self, row_id: int) -> int:
        return self._row(row_id)[1].length

    def token_ids(self, row_id: int) -> list[int]:
        return self._row(row_id)[1].token_ids

    def cached_prompt_tokens(self, row_id: int) -> int:
        """Prompt tokens of the sequence that its join took from the prefix cache."""
        return self._row(row_id)[1].cached

    def _caching(self) -> bool:
        return self._cached.capacity > 0 and self.target.prefix_cache  # (off whenever the target's own cache is)

    @property
    def width(self) -> int:
        return self.cache.layers[0].width

    @torch.inference_mode()
    def join(self, prompt_ids: Sequence[int], remember_prompt: bool = True) -> tuple[int, TargetOutput]:
        """Prefill a new sequence alone and add it as a row; returns its id and the prefill output.
        ``remember_prompt``: a prompt the cache serves none of goes into it (of several joining
        together only the first, as in the llama.cpp batch: a burst of unrelated prompts would
        otherwise push out the finished conversations)."""
        if self._pending is not None:
            raise RuntimeError("join() between verify() and commit()")
        check_same_taps(self._taps, self.target)
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        entry, m = self._cached.best(prompt.numpy()) if self._caching() and prompt.numel() else (None, 0)
        if entry is not None:  # the scratch target starts from the entry's first m tokens
            features = entry.features[:m] if entry.features is not None else None
            self.target.start_from(entry.token_ids[:m], [(k[:, :m], v[:, :m]) for k, v in entry.kv], features)
        else:
            self.target.reset()
        out = self.target.prefill(prompt)
        reused = self.target.reused_tokens
        self.prefix_tokens_reused += reused
        n = self.target.cache.layers[0].keys.shape[2]
        for layer, scratch in zip(self.cache.layers, self.target.cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(scratch.keys, scratch.values)
            layer.ensure(layer.rows + 1, max(layer.width, n), scratch.keys, scratch.values)
            layer.kbuf[layer.rows, :, :n] = scratch.keys[0]
            layer.vbuf[layer.rows, :, :n] = scratch.values[0]
            layer.rows += 1
            layer.width = max(layer.width, n)
            layer.view()
        row = _Row(self._next_id, n, prompt.tolist(), cached=reused)
        if self._caching():
            row.features = CommittedFeatures()
            row.features.add(0, out.hidden)
            if entry is None and remember_prompt:  # the cache serves none of it: the prompt goes in (a system block)
                self._remember(row.token_ids, [(layer.keys[0].clone(), layer.values[0].clone())
                                               for layer in self.target.cache.layers], out.hidden)
        self.target.reset()  # the scratch cache is not needed any more
        self._next_id += 1
        self.rows.append(row)
        return row.id, out

    def join_many(self, prompts: Sequence[Sequence[int]]) -> list[tuple[int, TargetOutput]]:
        """:meth:`join` for each prompt (prefills run one at a time: rows differ in length)."""
        joined = []
        try:
            for i, p in enumerate(prompts):
                joined.append(self.join(p, remember_prompt=i == 0))
        except Exception:
            for row_id, _ in joined:
                self.leave(row_id)
            raise
        return joined

    @torch.inference_mode()
    def remember(self, row_id: int) -> None:
        """Keep the keys, values and features of sequence ``row_id`` (prompt and answer so far) in the
        prefix cache, for a next turn that starts with them; called as a finished request leaves."""
        if self._caching():
            b, row = self._row(row_id)
            kv = [(layer.kbuf[b, :, :row.length].clone(), layer.vbuf[b, :, :row.length].clone())
                  for layer in self.cache.layers]
            held = row.features  # (None: it joined while the target's cache was off)
            features = held.rows(held.length) if held is not None and held.length else None
            self._remember(row.token_ids, kv, features)

    def _remember(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], features) -> None:
        keep, _ = self._cached.make_room(tokens)
        if keep:
            self._cached.add(_Cached(list(tokens), kv, features))

    @torch.inference_mode()
    def leave(self, row_id: int) -> None:
        if self._pending is not None:
            raise RuntimeError("leave() between verify() and commit()")
        index, _ = self._row(row_id)
        last = len(self.rows) - 1
        if index != last:  # the last row takes the leaver's place: one row is copied
            self.rows[index] = self.rows[last]
        self.rows.pop()
        width = max((r.length for r in self.rows), default=0)
        for layer in self.cache.layers:
            if index != last:
                layer.kbuf[index, :, :layer.width] = layer.kbuf[last, :, :layer.width]
                layer.vbuf[index, :, :layer.width] = layer.vbuf[last, :, :layer.width]
            layer.rows, layer.width = last, width
            layer.view()

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def verify(self, trees: Mapping[int, tuple[Sequence[int], Sequence[int]]],
               return_hidden: bool = True) -> dict[int, TargetOutput]:
        """One forward over every row's tree: ``trees[row_id] = (tokens, parents)`` for every row in
        the batch (parents as in :meth:`TargetModel.verify`). Returns each row's logits [n, V] and
        tapped features [n, taps*H]."""
        if set(trees) != {r.id for r in self.rows}:
            raise ValueError("verify() needs a tree for every sequence in the batch, and only for those")
        check_same_taps(self._taps, self.target)
        t = self.target
        sizes = {rid: len(tokens) for rid, (tokens, _) in trees.items()}
        if min(sizes.values()) < 1:
            raise ValueError("every tree needs at least its root")
        width, n_max, device = self.width, max(sizes.values()), t.device
        ids = torch.zeros(len(self.rows), n_max, dtype=torch.long)
        positions = torch.zeros(len(self.rows), n_max, dtype=torch.long)
        allowed = torch.zeros(len(self.rows), n_max, width + n_max, dtype=torch.bool)
        for b, row in enumerate(self.rows):
            tokens, parents = trees[row.id]
            parents = [int(p) for p in parents]
            check_parents(parents)
            n = len(parents)
            if n != len(tokens):
                raise ValueError(f"sequence {row.id}: one parent per token needed")
            depths = tree_depths(parents)
            if row.length + max(depths) + 1 > t.max_context:
                raise InvalidRequestError(f"sequence {row.id} would extend past the context of {t.max_context} tokens")
            ids[b, :n] = torch.as_tensor(list(tokens), dtype=torch.long)
            positions[b] = row.length
            positions[b, :n] += torch.tensor(depths)
            allowed[b, :, :row.length] = True
            allowed[b, :n, width:width + n] = ancestor_matrix(parents)
            allowed[b, n:, width + n:] = torch.eye(n_max - n, dtype=torch.bool)  # padding sees itself only
        mask = torch.zeros(allowed.shape, dtype=t.dtype).masked_fill_(~allowed, torch.finfo(t.dtype).min)
        t._capture = return_hidden
        t._captured.clear()
        try:
            out = t.model(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask[:, None].to(device),
                          cache=self.cache, use_cache=True)
        finally:
            t._capture = False
        hidden = torch.cat([t._captured[i] for i in t.tapped_layers], dim=-1) if return_hidden else None
        t._captured.clear()
        self._pending = {rid: [int(p) for p in trees[rid][1]] for rid in trees}
        self._pending_tokens = {rid: [int(x) for x in trees[rid][0]] for rid in trees}
        self._pending_hidden = ({row.id: hidden[b, :sizes[row.id]] for b, row in enumerate(self.rows)}
                                if hidden is not None and self._caching() else {})
        self._width = width
        logits = out.logits.float()
        return {row.id: TargetOutput(logits[b, :sizes[row.id]], hidden[b, :sizes[row.id]] if hidden is not None else None)
                for b, row in enumerate(self.rows)}

    @torch.inference_mode()
    def commit(self, paths: Mapping[int, Sequence[int]]) -> None:
        """Keep each row's accepted path (root-to-node node indices of its verified tree)."""
        if self._pending is None:
            raise RuntimeError("commit() without a verify()")
        if set(paths) != set(self._pending):
            raise ValueError("commit() needs a path for every sequence of the last verify()")
        rows_idx, src, dst = [], [], []
        for b, row in enumerate(self.rows):
            nodes = check_path(paths[row.id], self._pending[row.id])
            rows_idx += [b] * len(nodes)
            src += [self._width + n for n in nodes]
            dst += list(range(row.length, row.length + len(nodes)))
            row.token_ids += [self._pending_tokens[row.id][n] for n in nodes]
            if row.features is not None:
                row.features.add(row.length, self._pending_hidden[row.id][nodes] if row.id in self._pending_hidden else None)
            row.length += len(nodes)
        width = max(r.length for r in self.rows)
        device = self.target.device
        r_, s_, d_ = (torch.tensor(x, device=device, dtype=torch.long) for x in (rows_idx, src, dst))
        for layer in self.cache.layers:
            for buf in (layer.kbuf, layer.vbuf):
                buf[r_, :, d_] = buf[r_, :, s_]  # the right side is a copy: overlaps are safe
            layer.width = width
            layer.view()
        self._pending, self._pending_hidden = None, {}

