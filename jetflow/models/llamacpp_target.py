"""The target run by llama.cpp from its GGUF file as is (the engine CPU users already run).

Tree verification is ONE ``llama_decode``: every root-to-leaf path of the draft tree gets its own
sequence id, and each node carries the ids of every path through it (llama.cpp's unified KV cache
lets a cell belong to many sequences). llama.cpp masks a token against the cells holding its
*first* sequence id with position <= its own, so with the prefix copied to every path id, node i
sees the prefix, its ancestors and itself, at position past_len + depth(i) -- the tree mask.
Commit keeps the accepted path's cells as sequence 0 and frees the rest.

Tapped features come from llama.cpp's layer-input taps (``llama_set_embeddings_layer_inp``, C++
linkage in ``src/llama-ext.h``): the input of layer l equals transformers' ``hidden_states[l]``, so
the output of decoder layer t is tap t + 1. One row per batch token.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from jetflow.errors import InvalidRequestError, JetFlowError
from jetflow.models.backend import TargetOutput, TargetShape, chain_parents, check_path
from jetflow.models.gguf_meta import gguf_file_type
from jetflow.models.identity import weights_fingerprint
from jetflow.models.prefix_cache import CommittedFeatures, shared_prefix_length
from jetflow.tree.build import main_chain_nodes
from jetflow.tree.mask import check_parents, is_chain, tree_depths
from jetflow.utils.cpus import usable_cpus
from jetflow.utils.fs import file_digest

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: at most this many root-to-leaf paths per verified tree
DEFAULT_BATCH = 512  # prefill chunk and the largest tree one decode takes (as llama-cpp-python's Llama)


class LlamaCppError(JetFlowError):
    """llama.cpp (or its Python binding) is missing, lacks a needed symbol, or refused a batch."""


def _import_binding():
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp import llama_cpp as lib
    except ImportError as e:
        raise LlamaCppError(f"the llama.cpp backend needs llama-cpp-python (`make setup` builds it): {e}") from None
    check_no_amx(lib.llama_print_system_info().decode(errors="replace"))
    return lib


def check_no_amx(system_info: str) -> None:
    """Refuse a build with llama.cpp's AMX matmul, which crashes the process on the first decode
    (SIGSEGV in ``ggml_backend_amx_mul_mat`` on Xeon Sapphire Rapids and later; llama.cpp issue 20824,
    open, no fix) -- a clear error instead of a dead interpreter. ``JETFLOW_ALLOW_LLAMA_AMX=1``
    accepts such a build for machines where its AMX path works."""
    if "AMX_INT8 = 1" in system_info and os.environ.get("JETFLOW_ALLOW_LLAMA_AMX") != "1":
        raise LlamaCppError(
            "this llama-cpp-python build uses llama.cpp's AMX matmul, which crashes on the first decode "
            "(ggml_backend_amx_mul_mat, llama.cpp issue 20824); rebuild it without AMX (`make setup` does, "
            "with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16), or set JETFLOW_ALLOW_LLAMA_AMX=1 to try it anyway")


def _loaded_cpu_library() -> Path | None:
    """The ggml CPU library this process loaded with llama.cpp (from /proc/self/maps, so a
    ``LLAMA_CPP_LIB_PATH`` override counts), else the one beside the binding's libllama; None when
    the loaded file has since been replaced on disk (its bytes no longer name what runs)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            path = parts[5] if len(parts) == 6 else ""
            if "/libggml-cpu" in path:
                return Path(path) if os.path.isfile(path) else None  # " (deleted)": reinstalled under us
    except OSError:
        pass
    from llama_cpp import llama_cpp as lib

    found = sorted(Path(lib._lib._name).parent.glob("libggml-cpu*"))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def llama_build() -> dict:
    """Which llama.cpp CPU build runs here: ``cpu_library`` names the file's bytes (costs measured on
    one build do not price another), ``quant_dot_columns`` is 16 on a build with JetFlow's multi-token
    tiles (third_party/llama-cpp-python; cheaper multi-token verifies), 2 on one with the patch's first
    version (two-column kernels), 1 on a stock build."""
    _import_binding()
    path = _loaded_cpu_library()
    if path is None:
        return {"cpu_library": None, "quant_dot_columns": None}
    columns = getattr(ctypes.CDLL(str(path)), "jetflow_quant_dot_columns", None)
    if columns is not None:
        columns.restype, columns.argtypes = ctypes.c_int, []
    return {"cpu_library": file_digest(path), "quant_dot_columns": int(columns()) if columns is not None else 1}


# C++-linkage functions of src/llama-ext.h: bound by their (Itanium) mangled names.
_EXT_SYMBOLS = {
    "set_layer_inp": ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb", None,
                      [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]),
    "get_layer_inp": ("_Z30llama_get_embeddings_layer_inpP13llama_contextj", ctypes.POINTER(ctypes.c_float),
                      [ctypes.c_void_p, ctypes.c_uint32]),
}


def _bind_ext(lib) -> dict:
    shared = lib._lib
    out = {}
    for key, (symbol, restype, argtypes) in _EXT_SYMBOLS.items():
        try:
            fn = getattr(shared, symbol)
        except AttributeError:
            raise LlamaCppError(f"this llama.cpp build does not export {symbol} ({key}); JetFlow needs "
                                "llama-cpp-python 0.3.36 or a build with src/llama-ext.h") from None
        fn.restype, fn.argtypes = restype, argtypes
        out[key] = fn
    return out


class _Batch:
    """A ``llama_batch`` over numpy arrays we own (filled with vector ops, not per-element ctypes)."""

    def __init__(self, lib, capacity: int, max_seqs: int):
        self.capacity, self.max_seqs = capacity, max_seqs
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.zeros(capacity, np.int32)
        self.seq_ids = np.zeros((capacity, max_seqs), np.int32)
        self.logits = np.zeros(capacity, np.int8)
        row = ctypes.POINTER(ctypes.c_int32)
        base = self.seq_ids.ctypes.data
        self._rows = (row * capacity)(*[ctypes.cast(base + i * max_seqs * 4, row) for i in range(capacity)])
        self.struct = lib.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._rows,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def chain(self, tokens: np.ndarray, start_pos: int, all_logits: bool) -> None:
        n = len(tokens)
        self.token[:n] = tokens
        self.pos[:n] = np.arange(start_pos, start_pos + n)
        self.n_seq_id[:n] = 1
        self.seq_ids[:n, 0] = 0
        self.logits[:n] = 1 if all_logits else 0
        self.logits[n - 1] = 1
        self.struct.n_tokens = n

    def tree(self, tokens: np.ndarray, positions: np.ndarray, membership: np.ndarray) -> None:
        """membership [N, L]: node i lies on the path to leaf k (sequence id k)."""
        n = len(tokens)
        self.token[:n] = tokens
        self.pos[:n] = positions
        self.n_seq_id[:n] = membership.sum(1)
        self.seq_ids[:n] = 0
        rows, cols = np.nonzero(membership)  # row-major: each node's ids in ascending order
        slot = np.arange(len(rows)) - np.searchsorted(rows, rows)
        self.seq_ids[rows, slot] = cols
        self.logits[:n] = 1
        self.struct.n_tokens = n


_CHAIN = np.ones((0, 1), bool)  # the membership of any chain: one path (only its shape is read)


def _address(pointer) -> int:
    """The address a ctypes pointer returned by llama.cpp holds."""
    return ctypes.cast(pointer, ctypes.c_void_p).value


def path_membership(parents: Sequence[int]) -> np.ndarray:
    """[N, L] boolean: node i is on the root-to-leaf path of leaf k (leaves in node order)."""
    n = len(parents)
    has_child = np.zeros(n, bool)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    leaves = np.flatnonzero(~has_child)
    member = np.zeros((n, len(leaves)), bool)
    for k, leaf in enumerate(leaves):
        node = int(leaf)
        while node >= 0:
            member[node, k] = True
            node = parents[node]
    return member


def main_chain_first(parents: Sequence[int]) -> np.ndarray:
    """A batch order for a tree: the chain root -> first child -> first child ... (a best-first
    tree's most likely path) first, then the other nodes in their order (parents still precede
    children). llama.cpp places a batch's tokens in consecutive KV cells and sums attention in
    groups of cells, so the main chain's cells then sit exactly where one-token decoding puts
    them: its rows, and the cache after accepting a prefix of it, equal decoding bit for bit."""
    chain = main_chain_nodes(parents)
    on_chain = set(chain)
    return np.asarray(chain + [i for i in range(len(parents)) if i not in on_chain], dtype=np.int64)


class OwnsLlamaContext:
    """Frees a llama.cpp context (``_ctx``) and model (``_model``) once, on close or collection."""

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class LlamaCppTarget(OwnsLlamaContext):
    """The llama.cpp implementation of :class:`jetflow.models.backend.TargetBackend` (CPU)."""

    backend = "llamacpp"

    def __init__(self, gguf: str | os.PathLike, tokenizer, *, name: str | None = None,
                 tapped_layers: Sequence[int] | None = None, n_ctx: int = 4096, n_threads: int | None = None,
                 n_batch: int = DEFAULT_BATCH, flash_attn: bool = False):
        from jetflow.models.gguf_meta import gguf_shape, gguf_output_weights

        self._lib = lib = _import_binding()
        self._ext = _bind_ext(lib)
        self.gguf = Path(gguf)
        self.name = name or self.gguf.stem
        self.tokenizer = tokenizer
        lib.llama_backend_init()
        _silence_logs(lib)
        mparams = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(self.gguf).encode(), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {self.gguf}")
        self.num_layers = int(lib.llama_model_n_layer(self._model))
        self.hidden_size = int(lib.llama_model_n_embd(self._model))
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        train_ctx = int(lib.llama_model_n_ctx_train(self._model))
        self.n_threads = int(n_threads or usable_cpus())
        context = min(n_ctx, train_ctx) if train_ctx > 0 else n_ctx
        if context < MAX_SEQ or n_batch < MAX_SEQ:  # (llama.cpp would abort the process)
            raise LlamaCppError(f"the llama.cpp backend needs a context and a batch of at least {MAX_SEQ} tokens (a "
                                f"tree verifies up to {MAX_SEQ} paths, one output each), got {context} and {n_batch}")
        self.n_batch = min(int(n_batch), context)
        self.flash_attn = bool(flash_attn)
        # One KV buffer whose cells can belong to several paths; a whole tree runs as one graph.
        self._ctx = self.new_context(context, self.n_batch, MAX_SEQ, unified=True)
        self.max_context = int(lib.llama_n_ctx(self._ctx))
        self._mem = lib.llama_get_memory(self._ctx)
        self._batch = _Batch(lib, self.n_batch, MAX_SEQ)
        self._shape = gguf_shape(self.gguf, self.vocab_size)
        self._embedding, self._lm_head = gguf_output_weights(self.gguf, self._shape)
        self._row, self._row_address = None, None  # see _logits_row
        self.prefix_cache = True  # prefill keeps a shared prefix's cells (jetflow bench turns it off: fair timing)
        self.reused_tokens = 0
        self.features = CommittedFeatures()  # of the committed tokens, for a prefill that reuses cells
        self._taps_enabled: set[int] = set()
        self._taps_on = True
        self._stop_ids = self._eog_ids()
        self.tapped_layers: tuple[int, ...] = ()
        from jetflow.models.target import default_tapped_layers

        self.set_tapped_layers(default_tapped_layers(self.num_layers) if tapped_layers is None else tapped_layers)
        self.reset()

    def new_context(self, n_ctx: int, n_batch: int, n_seq_max: int, unified: bool):
        """A llama.cpp context on this model with this target's kernel settings (threads, flash
        attention): the decoding context, and the many-sequence ones of batching and regeneration.
        With ``unified`` False every sequence has cells of its own, n_ctx / n_seq_max of them."""
        lib = self._lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = unified
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                   else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise LlamaCppError(f"llama.cpp could not create a context for {self.gguf} "
                                f"(n_ctx={n_ctx}, {n_seq_max} sequences)")
        return ctx

    # ------------------------------------------------------------------ description
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # logits, features and the shared weights the drafters see

    def shape(self) -> TargetShape:
        return self._shape

    def identity(self) -> dict:
        return {"name": self.name, "model_type": self._shape.model_type, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers, "backend": self.backend,
                "dtype": gguf_file_type(self.gguf), "weights": self.weights}

    @functools.cached_property
    def weights(self) -> str:
        """Names the GGUF's weights (models/identity.py), as the torch runtime names its conversion."""
        return weights_fingerprint(self.gguf)

    def stop_token_ids(self) -> set[int]:
        return set(self._stop_ids)

    def _eog_ids(self) -> set[int]:
        """llama.cpp's end-of-generation tokens (what its own generate loop stops on), plus the
        tokenizer's EOS."""
        eog = {t for t in range(self.vocab_size) if self._lib.llama_vocab_is_eog(self._vocab, t)}
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            eog.add(int(eos))
        return eog

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids.cpu(), self._embedding)

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head

    def set_tapped_layers(self, layer_ids: Sequence[int]) -> None:
        taps = tuple(int(t) for t in layer_ids)
        if taps == self.tapped_layers:
            return
        # The last layer's output is the final hidden state, which llama.cpp does not tap.
        if not taps or any(not 0 <= t < self.num_layers - 1 for t in taps):
            raise ValueError(f"tapped layers {list(taps)} must be non-empty ids in [0, {self.num_layers - 1}) "
                             "on the llama.cpp backend")
        wanted = {t + 1 for t in taps}  # output of layer t = input of layer t+1
        if self._taps_on:
            for lid in self._taps_enabled ^ wanted:
                self._ext["set_layer_inp"](self._ctx, lid, lid in wanted)
        self._taps_enabled = wanted
        self.tapped_layers = taps
        self.features.clear()  # other layers' features

    def _compute_taps(self, on: bool) -> None:
        """Have the next decodes copy out the tapped layer inputs, or not. They cost ~0.7 ms of a
        ~14 ms one-token step here (benchmarks/llamacpp_step_overhead.py), so forwards that read no
        features (the autoregressive loop) switch them off; llama.cpp rebuilds its graph once per
        switch."""
        if on != self._taps_on:
            for lid in self._taps_enabled:
                self._ext["set_layer_inp"](self._ctx, lid, on)
            self._taps_on = on

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        # Cells only (data=False): freed cells are masked out, so their stale contents never count,
        # and zeroing the whole KV buffer (tens of MB at a 4k context) would cost every request.
        self._lib.llama_memory_clear(self._mem, False)
        self.past_len = 0
        self.token_ids: list[int] = []
        self.features.clear()
        self._reusable = True  # whether the committed tokens' cells may serve the next prefill
        self._pending_tokens: list[int] = []
        self._pending_parents: list[int] = []
        self._pending_hidden: torch.Tensor | None = None
        self._pending_members: np.ndarray | None = None
        self._pending_order: np.ndarray | None = None
        # Committed tokens whose cells were dropped because they were not where one-token decoding
        # puts them (a side branch was accepted); the next decode writes them again, contiguously.
        self._redo: list[int] = []

    def _decode(self, what: str) -> None:
        rc = self._lib.llama_decode(self._ctx, self._batch.struct)
        if rc == 1:
            raise InvalidRequestError(f"{what}: llama.cpp found no room in its KV cache "
                                      f"(context of {self.max_context} tokens is full)")
        if rc != 0:
            raise LlamaCppError(f"{what}: llama_decode failed with code {rc}")

    def _outputs(self, n_rows: int, n_tokens: int, return_hidden: bool) -> TargetOutput:
        # One memmove per buffer into arrays we own (the next decode overwrites llama.cpp's): cheaper
        # than building ctypes array views each call, which a ~19 ms plain round notices.
        logits = np.empty((n_rows, self.vocab_size), np.float32)
        ctypes.memmove(logits.ctypes.data, _address(self._lib.llama_get_logits(self._ctx)), logits.nbytes)
        hidden = None
        if return_hidden:
            taps = np.empty((len(self.tapped_layers), n_tokens, self.hidden_size), np.float32)
            for i, t in enumerate(self.tapped_layers):
                ctypes.memmove(taps[i].ctypes.data, _address(self._ext["get_layer_inp"](self._ctx, t + 1)),
                               taps[i].nbytes)
            hidden = torch.from_numpy(taps.transpose(1, 0, 2).reshape(n_tokens, -1))
        return TargetOutput(torch.from_numpy(logits), hidden)

    # ------------------------------------------------------------------ forwards
    def prefill(self, prompt_ids, return_hidden: bool = True) -> TargetOutput:
        """Start a new sequence with ``prompt_ids``. With ``prefix_cache`` on, the cells of the
        longest prefix it shares with what the cache holds are kept (the next turn of a chat, a
        shared system prompt) and only the rest is computed (``reused_tokens``): the logits are bit
        for bit a fresh prefill's (one-token and chained decodes give the same rows in this build,
        and the kept cells are where a fresh prefill puts them). With ``return_hidden``, only as much
        of the prefix as the features kept of the committed tokens cover (``features``), which are
        handed back for it: those of the prefill and the verifies' accepted paths, a fresh prefill's
        bit for bit too in this build. Not with flash attention, whose rows depend on how many are
        decoded together: it turns the cache off."""
        ids = np.asarray(torch.as_tensor(prompt_ids).flatten().tolist(), dtype=np.int32)
        if ids.size == 0:
            raise InvalidRequestError("empty prompt: nothing to prefill")
        if ids.size >= self.max_context:
            raise InvalidRequestError(f"prompt has {ids.size} tokens; the context is {self.max_context} tokens")
        keep = 0
        if self.reuses_prefixes and self._reusable:
            self._drop_pending()
            keep = self._cached_prefix(ids)
            if return_hidden:
                keep = min(keep, self.features.length)
        try:
            if keep:  # (the dropped cells of _redo lie past the kept ones)
                self.past_len, self.token_ids, self._redo = keep, self.token_ids[:keep], []
                self.features.truncate(keep)
                self._lib.llama_memory_seq_rm(self._mem, -1, keep, -1)
            else:
                self.reset()
            self._reusable = self.reuses_prefixes  # a request made with the cache off leaves nothing to reuse
            self.reused_tokens = keep
            self._compute_taps(return_hidden)
            hidden, out = [self.features.rows(keep)] if return_hidden and keep else [], None
            for start in range(keep, ids.size, self.n_batch):
                chunk = ids[start:start + self.n_batch]
                self._batch.chain(chunk, self.past_len, all_logits=False)
                self._decode("prefill")
                out = self._outputs(1, len(chunk), return_hidden)
                if out.hidden is not None:
                    hidden.append(out.hidden)
                    if self.reuses_prefixes:  # (kept only for the cache)
                        self.features.add(self.past_len, out.hidden)
                self.past_len += len(chunk)
                self.token_ids += chunk.tolist()
        except BaseException:  # (an interrupt too) cells and bookkeeping could disagree: start clean
            self.reset()
            raise
        return TargetOutput(out.logits, torch.cat(hidden) if hidden else None)

    def _cached_prefix(self, ids: np.ndarray) -> int:
        """How many leading tokens of ``ids`` (all but the last, whose logits are wanted) the cache
        holds in place: committed tokens whose cells were dropped (``_redo``) do not count."""
        return shared_prefix_length(self.token_ids, ids, min(self.past_len - len(self._redo), ids.size - 1))

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a prefill may start from cached cells: ``prefix_cache`` on, and not with flash
        attention, whose rows depend on how many are decoded together."""
        return self.prefix_cache and not self.flash_attn

    def verify(self, tokens, parents: Sequence[int], return_hidden: bool = True) -> TargetOutput:
        ids = np.asarray(tokens.flatten().tolist() if isinstance(tokens, torch.Tensor) else tokens, dtype=np.int32)
        parents = [int(p) for p in parents]
        n = ids.size
        if n == 0 or n != len(parents):
            raise ValueError(f"need one parent per token and at least one token (got {n} and {len(parents)})")
        redo = np.asarray(self._redo, dtype=np.int32)
        m = redo.size
        if n + m > self.n_batch:
            raise InvalidRequestError(f"tree of {n} nodes exceeds the llama.cpp batch of {self.n_batch - m} tokens")
        chain = is_chain(parents)  # plain rounds and extend(): no tree bookkeeping
        if not chain:
            check_parents(parents)
        self._drop_pending()
        depths = None if chain else np.asarray(tree_depths(parents), dtype=np.int32)
        if self.past_len + n > self.max_context:  # (a tree's depth fits whenever its nodes do)
            raise InvalidRequestError(f"a tree of {n} tokens needs as many free KV cells: {self.max_context - self.past_len} "
                                      f"of the {self.max_context}-token context are free")
        if (ids < 0).any() or (ids >= self.vocab_size).any():
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")
        member = _CHAIN if chain else path_membership(parents)
        if member.shape[1] > MAX_SEQ:
            raise InvalidRequestError(f"tree has {member.shape[1]} leaves; llama.cpp verifies at most {MAX_SEQ} paths")
        order = None
        if member.shape[1] == 1:  # a chain: sequence 0 alone
            self._batch.chain(np.concatenate([redo, ids]) if m else ids, self.past_len - m, all_logits=True)
        else:
            for k in range(1, member.shape[1]):  # the prefix becomes part of every path
                self._lib.llama_memory_seq_cp(self._mem, 0, k, -1, -1)
            order = main_chain_first(parents)
            self._batch.tree(np.concatenate([redo, ids[order]]),
                             np.concatenate([np.arange(self.past_len - m, self.past_len), self.past_len + depths[order]]),
                             np.concatenate([np.ones((m, member.shape[1]), bool), member[order]]))
        self._compute_taps(return_hidden)
        try:
            self._decode("verify")
        except Exception:
            self._pending_parents, self._pending_members = parents, member
            self._drop_pending()
            raise
        self._redo = []
        self._pending_tokens, self._pending_parents, self._pending_members = ids.tolist(), parents, member
        self._pending_order = order
        out = self._outputs(n + m, n + m, return_hidden)
        if m and self.features.length == self.past_len:
            # The side branch's features were kept from its tree's layout: the rows just computed
            # where one-token decoding puts them replace them (none: they go, not kept inexact).
            if out.hidden is not None:
                self.features.replace_tail(out.hidden[:m].clone())
            else:
                self.features.truncate(self.past_len - m)
        if order is None:  # rows already in node order
            out = TargetOutput(out.logits[m:], out.hidden[m:] if out.hidden is not None else None)
        else:
            rows = m + torch.from_numpy(np.argsort(order))  # node order
            out = TargetOutput(out.logits[rows], out.hidden[rows] if out.hidden is not None else None)
        self._pending_hidden = out.hidden  # the accepted path's rows are kept at commit
        return out

    def commit(self, nodes: Sequence[int]) -> None:
        nodes = check_path(nodes, self._pending_parents)
        member = self._pending_members
        keep_end = self.past_len + len(nodes)  # first position past the accepted path
        if member.shape[1] == 1:
            self._lib.llama_memory_seq_rm(self._mem, 0, keep_end, -1)
        else:
            # A path through the last accepted node (the root's when nothing was accepted).
            leaf = int(np.flatnonzero(member[nodes[-1] if nodes else 0])[0])
            self._lib.llama_memory_seq_keep(self._mem, leaf)  # frees every cell not on that path
            self._lib.llama_memory_seq_rm(self._mem, leaf, keep_end, -1)
            if leaf != 0:
                self._lib.llama_memory_seq_cp(self._mem, leaf, 0, -1, -1)
                self._lib.llama_memory_seq_rm(self._mem, leaf, -1, -1)
        accepted = [self._pending_tokens[i] for i in nodes]
        order = self._pending_order
        if order is not None and nodes and nodes != order[:len(nodes)].tolist():
            # Not the batch's leading chain: its cells have gaps one-token decoding never leaves, and
            # attention sums over cells in fixed groups. Drop them; the next decode writes them again.
            self._lib.llama_memory_seq_rm(self._mem, 0, self.past_len, -1)
            self._redo = accepted
        self.token_ids += accepted
        if self._pending_hidden is not None and nodes and self.reuses_prefixes and self.features.follows(self.past_len):
            self.features.add(self.past_len, self._pending_hidden[nodes])
        self.past_len = keep_end
        self._pending_tokens, self._pending_parents, self._pending_members = [], [], None
        self._pending_order, self._pending_hidden = None, None

    def _drop_pending(self) -> None:
        if self._pending_parents:
            self.commit([])

    def extend(self, tokens, return_hidden: bool = False) -> TargetOutput:
        ids = torch.as_tensor(tokens).flatten()
        out = self.verify(ids, chain_parents(ids.numel()), return_hidden=return_hidden)
        self.commit(range(ids.numel()))
        return out

    def tree_room(self) -> int:
        # every node takes a cell of the unified KV cache until commit, and a place in the decode's batch
        return min(self.max_context - self.past_len, self.n_batch - len(self._redo))

    def greedy_step(self, token: int) -> int:
        """Commit ``token`` and return the target's greedy next token: ``extend([token])`` and the
        argmax of its logits, without copying the 49k-float row out or any tree bookkeeping. A plain
        step's Python time decides whether JetFlow's plain loop keeps up with llama-cpp-python's
        (benchmarks/llamacpp_step_overhead.py)."""
        token = int(token)
        if self._redo or self._pending_parents:  # the general path handles those
            return int(self.extend([token]).logits[-1].numpy().argmax())
        if not 0 <= token < self.vocab_size:
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")
        if self.past_len + 1 > self.max_context:
            raise InvalidRequestError(f"context of {self.max_context} tokens is full")
        self._compute_taps(False)
        batch = self._batch
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.seq_ids[0, 0], batch.logits[0] = token, self.past_len, 1, 0, 1
        batch.struct.n_tokens = 1
        self._decode("step")
        self.past_len += 1
        self.token_ids.append(token)
        return int(self._logits_row().argmax())

    def _logits_row(self) -> np.ndarray:
        """The first output row of the last decode, as a numpy view of llama.cpp's buffer (read at
        once: the next decode overwrites it). The view is rebuilt only when the buffer moves."""
        address = _address(self._lib.llama_get_logits(self._ctx))
        if address != self._row_address:
            self._row = np.frombuffer((ctypes.c_float * self.vocab_size).from_address(address), np.float32)
            self._row_address = address
        return self._row

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                       generator: torch.Generator | None = None, slots: int = 16) -> list[list[int]]:
        """Answers to many prompts (regeneration of training data), ``slots`` sequences decoded
        together in a context of their own (jetflow/models/llamacpp_batch.py)."""
        from jetflow.models.llamacpp_batch import generate_many

        return generate_many(self, [list(map(int, p)) for p in prompts], max_new_tokens, temperature, generator,
                             slots=slots)



_LOG_CALLBACK = None


def _silence_logs(lib) -> None:
    """llama.cpp logs every load to stderr; keep errors only (unless JETFLOW_LLAMA_LOG is set)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None or os.environ.get("JETFLOW_LLAMA_LOG"):
        return

    def log(level, text, _user):
        if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
            os.write(2, text)

    _LOG_CALLBACK = lib.llama_log_callback(log)
    lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))

