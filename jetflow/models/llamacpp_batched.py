"""Many sequences of one llama.cpp target in one context: a sequence id (and a KV stream) per
request, one ``llama_decode`` per step for all of them (the serving counterpart of
jetflow/models/batched_target.py).

The context is *not* unified: each sequence has cells of its own, so a query attends over its own
request's cells only (a unified cache of 32 requests costs 3x more per step on 2 cores, since every
query scans every request's cells) and its cells sit where they would sit if it ran alone. The price
is that llama.cpp then cuts a batch into ubatches holding the same number of tokens of consecutive
sequence ids, and a token may belong to one sequence only. So:

* what a request verifies each step is a *chain* (its tree's most likely path); chains of
  different lengths share one decode, which llama.cpp then splits into several ubatches;
* requests hold sequence ids 0..n-1 with no gap: when one leaves, the last one's stream is copied
  into its place.

Rows of a verify are in sequence-id order; llama.cpp returns logits and layer-input taps in batch
order, so every request gets exactly its own rows.

Prefix cache: ``prefix_slots`` more streams keep recent sequences' cells (and their tapped
features): prompts as they join, and whole conversations (prompt and answer) as they finish, so a
chat's next turn finds its previous turn there. A joining prompt that shares at least ``MIN_SHARED``
leading tokens with one of them (a chat template's system block, a shared document, the turns so
far) starts from a copy of that stream and prefills only the rest. The copied cells are what its own
prefill would have written (rows do not depend on the batch), so the output is unchanged. The least
recently used entry makes room. Costs: a copy between streams moves the whole stream (llama.cpp
copies full stream buffers: every cell of a sequence's context, 94 MB for SmolLM2 at 4,096 cells),
inside the next decode of the whole batch, once per finished request; each slot holds a sequence's
KV cells; and every running sequence and entry keeps its tokens' features in host memory (float32,
taps x hidden per token: 11.5 KB for SmolLM2, half its KV again). Whether a batch caches is decided
when it is made (no slots, no copies, no features without it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from jetflow.errors import InvalidRequestError, JetFlowError
from jetflow.models.backend import TargetOutput, check_path, check_same_taps
from jetflow.models.llamacpp_target import MAX_SEQ, LlamaCppError, OwnsLlamaContext, _Batch
from jetflow.models.prefix_cache import DEFAULT_PREFIX_SLOTS, MIN_SHARED, PrefixEntries, shared_prefix_length




def check_sequence_count(max_seqs: int, prefix_slots: int) -> None:
    """JetFlowError, naming both flags, when the batch and its cache need more sequences than
    llama.cpp holds (its own error names neither)."""
    if max_seqs + prefix_slots > MAX_SEQ:
        raise JetFlowError(f"llama.cpp holds at most {MAX_SEQ} sequences: --max-batch {max_seqs} + "
                           f"--prefix-cache-slots {prefix_slots} is {max_seqs + prefix_slots}; lower one of them")


@dataclass
class _Seq:
    id: int
    slot: int  # llama.cpp sequence id
    length: int
    token_ids: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # features of its cells, kept for the cache
    cached: int = 0  # prompt tokens its join took from the cache


@dataclass
class _Cached:
    slot: int  # the cache stream holding its cells
    token_ids: list[int]
    hidden: torch.Tensor | None  # their tapped features (None without taps)


class LlamaCppBatchedTarget(OwnsLlamaContext):
    chains_only = True  # each sequence verifies one chain per step (see the module docstring)

    def __init__(self, target, max_seqs: int = 32, context_per_seq: int | None = None, n_batch: int | None = None,
                 prefix_slots: int = DEFAULT_PREFIX_SLOTS):
        if target.backend != "llamacpp":
            raise JetFlowError("LlamaCppBatchedTarget needs a llama.cpp target")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        if prefix_slots < 0:
            raise ValueError(f"prefix_slots must be >= 0, got {prefix_slots}")
        if not target.reuses_prefixes:  # the cache off (or flash attention): no streams for it
            prefix_slots = 0
        check_sequence_count(max_seqs, prefix_slots)
        self.target, self._lib, self.max_seqs = target, target._lib, int(max_seqs)
        per_seq = int(context_per_seq or target.max_context)
        per_seq = -(-per_seq // 256) * 256  # llama.cpp rounds each sequence's share up to 256 cells
        self.n_batch = int(n_batch or max(target.n_batch, 17 * self.max_seqs))
        # streams 0..max_seqs-1 for requests, the next prefix_slots for the prefix cache
        streams = self.max_seqs + int(prefix_slots)
        self._ctx = target.new_context(per_seq * streams, self.n_batch, streams, unified=False)
        self._model = None  # the model belongs to the target
        self.max_context = per_seq
        self._mem = self._lib.llama_get_memory(self._ctx)
        self._batch = _Batch(self._lib, self.n_batch, 1)
        self._taps = tuple(target.tapped_layers)
        for t in self._taps:  # the output of layer t is the input of layer t + 1
            target._ext["set_layer_inp"](self._ctx, t + 1, True)
        self.seqs: list[_Seq] = []  # seqs[i].slot == i
        self._next_id = 0
        self._pending: dict[int, int] | None = None  # sequence id -> nodes of its verified chain
        self._cache_slots = list(range(self.max_seqs, streams))
        self._cached = PrefixEntries(len(self._cache_slots))
        self._features = bool(target.tapped_layers) and bool(self._cache_slots)  # kept per sequence, for the cache
        self.prefix_tokens_reused = 0  # prompt tokens not prefilled thanks to the cache

    # ------------------------------------------------------------------ sequences
    def _seq(self, seq_id: int) -> _Seq:
        for s in self.seqs:
            if s.id == seq_id:
                return s
        raise KeyError(f"no sequence {seq_id} in the batch")

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def token_ids(self, seq_id: int) -> list[int]:
        return self._seq(seq_id).token_ids

    def cached_prompt_tokens(self, seq_id: int) -> int:
        """Prompt tokens of the sequence that its join took from the prefix cache."""
        return self._seq(seq_id).cached

    def join(self, prompt_ids: Sequence[int]) -> tuple[int, TargetOutput]:
        """Prefill a new sequence and add it to the batch; returns its id and the prefill output."""
        (seq_id, out), = self.join_many([prompt_ids])
        return seq_id, out

    def join_many(self, prompts: Sequence[Sequence[int]]) -> list[tuple[int, TargetOutput]]:
        """Prefill several new sequences together (their prompt chunks share each decode: llama.cpp
        cuts equal shares per sequence into one graph) and add them to the batch."""
        if self._pending is not None:
            raise RuntimeError("join() between verify() and commit()")
        check_same_taps(self._taps, self.target)
        prompts = [np.asarray([int(t) for t in p], dtype=np.int32) for p in prompts]
        if len(self.seqs) + len(prompts) > self.max_seqs:
            raise InvalidRequestError(f"the batch holds at most {self.max_seqs} sequences")
        for p in prompts:
            if p.size == 0:
                raise InvalidRequestError("empty prompt: nothing to prefill")
            if p.size >= self.max_context:
                raise InvalidRequestError(f"prompt has {p.size} tokens; a batched sequence has "
                                          f"{self.max_context} tokens of context")
            if (p < 0).any() or (p >= self.target.vocab_size).any():
                raise InvalidRequestError(f"token ids must be in [0, {self.target.vocab_size})")
        offers = [self._cached_prefix(p) for p in prompts]
        shared = [m for _, m in offers]
        if self._caching() and len(prompts) > 1 and max(shared) == 0 and any(
                shared_prefix_length(prompts[0], p, p.size) >= MIN_SHARED for p in prompts[1:]):
            # they share a prefix the cache lacks: the first prompt goes alone and fills the cache
            head = self.join_many(prompts[:1])
            try:
                return head + self.join_many(prompts[1:])
            except Exception:
                self.leave(head[0][0])  # all or nothing
                raise
        first = len(self.seqs)
        fed = list(shared)
        logits: list[torch.Tensor | None] = [None] * len(prompts)
        hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
        for i, (entry, m) in enumerate(offers):
            if m:  # start from a copy of the cache stream, cut to the shared part
                self._lib.llama_memory_seq_cp(self._mem, entry.slot, first + i, -1, -1)
                self._lib.llama_memory_seq_rm(self._mem, first + i, m, -1)
                if entry.hidden is not None:
                    hidden[i].append(entry.hidden[:m])
        try:
            while any(f < p.size for f, p in zip(fed, prompts)):
                n, spans = 0, []  # spans: (prompt index, first batch row, rows)
                for i, p in enumerate(prompts):
                    take = min(p.size - fed[i], self.n_batch - n)
                    if take <= 0:
                        continue
                    b = self._batch
                    b.token[n:n + take] = p[fed[i]:fed[i] + take]
                    b.pos[n:n + take] = np.arange(fed[i], fed[i] + take)
                    b.n_seq_id[n:n + take] = 1
                    b.seq_ids[n:n + take, 0] = first + i
                    b.logits[n:n + take] = 0
                    if fed[i] + take == p.size:
                        b.logits[n + take - 1] = 1
                    spans.append((i, n, take))
                    fed[i] += take
                    n += take
                self._batch.struct.n_tokens = n
                self._decode("prefill", n)
                rows = np.flatnonzero(self._batch.logits[:n])
                out = self._outputs(rows, n)
                for i, start, take in spans:
                    if out.hidden is not None:
                        hidden[i].append(out.hidden[start:start + take])
                    if fed[i] == prompts[i].size:
                        logits[i] = out.logits[int(np.searchsorted(rows, start + take - 1))][None]
        except Exception:
            for i in range(len(prompts)):
                self._lib.llama_memory_seq_rm(self._mem, first + i, -1, -1)
            raise
        self.prefix_tokens_reused += sum(shared)
        joined = []
        for i, p in enumerate(prompts):
            features = torch.cat(hidden[i]) if hidden[i] else None
            s = _Seq(self._next_id, first + i, int(p.size), p.tolist(), [features] if self._features else [], shared[i])
            self._next_id += 1
            self.seqs.append(s)
            joined.append((s.id, TargetOutput(logits[i], features)))
        if max(shared) == 0:  # the cache serves none of them: the first one's prompt goes in
            self._remember(self.seqs[first])
        return joined

    def _caching(self) -> bool:
        return bool(self._cache_slots) and self.target.reuses_prefixes  # (off whenever the target's own cache is)

    def _cached_prefix(self, prompt: np.ndarray) -> tuple[_Cached | None, int]:
        """The cache entry sharing the longest prefix with ``prompt`` and how many leading tokens
        that is ((None, 0) when too few to bother); at least one token is left to prefill, whose
        logits the caller needs."""
        return self._cached.best(prompt) if self._caching() else (None, 0)

    def remember(self, seq_id: int) -> None:
        """Keep the cells of sequence ``seq_id`` (prompt and answer so far) in the prefix cache, for
        a next turn that starts with them; called as a finished request leaves."""
        self._remember(self._seq(seq_id))

    def _remember(self, s: _Seq) -> None:
        tokens = s.token_ids
        keep, victim = self._cached.make_room(tokens) if self._caching() else (False, None)
        if not keep:
            return
        used = {e.slot for e in self._cached.entries}
        slot = victim.slot if victim is not None else next(x for x in self._cache_slots if x not in used)
        self._lib.llama_memory_seq_cp(self._mem, s.slot, slot, -1, -1)  # the stream's cells, copied whole
        hidden = torch.cat(s.hidden) if self._features else None
        if hidden is not None:
            s.hidden = [hidden]
        self._cached.add(_Cached(slot, list(tokens), hidden))

    def leave(self, seq_id: int) -> None:
        if self._pending is not None:
            raise RuntimeError("leave() between verify() and commit()")
        s = self._seq(seq_id)
        last = self.seqs[-1]
        self._lib.llama_memory_seq_rm(self._mem, s.slot, -1, -1)
        if last is not s:  # keep the ids gapless: the last sequence's stream takes the freed one
            self._lib.llama_memory_seq_cp(self._mem, last.slot, s.slot, -1, -1)
            self._lib.llama_memory_seq_rm(self._mem, last.slot, -1, -1)
            last.slot = s.slot
            self.seqs[s.slot] = last
        self.seqs.pop()

    # ------------------------------------------------------------------ forwards
    def _decode(self, what: str, n: int) -> None:
        rc = self._lib.llama_decode(self._ctx, self._batch.struct)
        if rc == 1:
            raise InvalidRequestError(f"{what}: llama.cpp found no room in the batch's KV cache")
        if rc != 0:
            raise LlamaCppError(f"{what}: llama_decode of {n} tokens failed with code {rc}")

    def _outputs(self, rows: np.ndarray, n_tokens: int) -> TargetOutput:
        lib, t = self._lib, self.target
        logits = torch.from_numpy(np.ctypeslib.as_array(lib.llama_get_logits(self._ctx),
                                                        shape=(len(rows), t.vocab_size)).copy())
        parts = [np.ctypeslib.as_array(t._ext["get_layer_inp"](self._ctx, layer + 1), shape=(n_tokens, t.hidden_size))
                 for layer in t.tapped_layers]
        return TargetOutput(logits, torch.from_numpy(np.concatenate(parts, axis=1)) if parts else None)

    def verify(self, trees: Mapping[int, tuple[Sequence[int], Sequence[int]]],
               return_hidden: bool = True) -> dict[int, TargetOutput]:
        """One decode over every sequence's chain: ``trees[seq_id] = (tokens, parents)`` with
        parents -1, 0, 1, ... (a chain rooted at the sequence's next token). Returns each
        sequence's logits [n, V] and tapped features [n, taps*H]."""
        if set(trees) != {s.id for s in self.seqs}:
            raise ValueError("verify() needs a chain for every sequence in the batch, and only for those")
        if self._pending is not None:  # its cells would sit at the same positions as this verify's
            raise RuntimeError("verify() before the last verify was committed")
        check_same_taps(self._taps, self.target)
        total = sum(len(tokens) for tokens, _ in trees.values())
        if total > self.n_batch:
            raise InvalidRequestError(f"{total} tokens to verify exceed the batch of {self.n_batch}")
        b, n, spans = self._batch, 0, {}
        for s in self.seqs:
            tokens, parents = trees[s.id]
            k = len(tokens)
            if k < 1 or [int(p) for p in parents] != list(range(-1, k - 1)):
                raise ValueError(f"sequence {s.id}: the llama.cpp batch verifies chains (parents -1, 0, 1, ...)")
            if s.length + k > self.max_context:
                raise InvalidRequestError(f"sequence {s.id} would extend past its context of {self.max_context} tokens")
            ids = np.asarray([int(x) for x in tokens], dtype=np.int32)
            if (ids < 0).any() or (ids >= self.target.vocab_size).any():
                raise InvalidRequestError(f"token ids must be in [0, {self.target.vocab_size})")
            b.token[n:n + k] = ids
            b.pos[n:n + k] = np.arange(s.length, s.length + k)
            b.n_seq_id[n:n + k] = 1
            b.seq_ids[n:n + k, 0] = s.slot
            b.logits[n:n + k] = 1
            spans[s.id] = (n, k, ids.tolist())
            n += k
        b.struct.n_tokens = n
        try:
            self._decode("verify", n)
        except Exception:
            for s in self.seqs:  # whatever llama.cpp wrote of the chains goes
                self._lib.llama_memory_seq_rm(self._mem, s.slot, s.length, -1)
            raise
        out = self._outputs(np.arange(n), n)
        self._pending = {sid: (*span, None if out.hidden is None else out.hidden[span[0]:span[0] + span[1]])
                         for sid, span in spans.items()}
        return {sid: TargetOutput(out.logits[start:start + k], None if out.hidden is None or not return_hidden
                                  else out.hidden[start:start + k])
                for sid, (start, k, _) in spans.items()}

    def commit(self, paths: Mapping[int, Sequence[int]]) -> None:
        """Keep each sequence's accepted nodes (a prefix of its chain) and drop the rest."""
        if self._pending is None:
            raise RuntimeError("commit() without a verify()")
        if set(paths) != set(self._pending):
            raise ValueError("commit() needs a path for every sequence of the last verify()")
        for s in self.seqs:
            _, k, tokens, hidden = self._pending[s.id]
            nodes = check_path(paths[s.id], list(range(-1, k - 1)))
            s.token_ids += [tokens[i] for i in nodes]
            if self._features:  # the features of its cells, for the cache
                s.hidden.append(hidden[nodes])
            s.length += len(nodes)
            self._lib.llama_memory_seq_rm(self._mem, s.slot, s.length, -1)
        self._pending = None

