"""A DFlash-format draft GGUF (``jetflow export-gguf``) run by llama.cpp next to a llama.cpp target.

The draft context shares the target's token embedding and LM head (``ctx_other``); target features
go in as an embedding batch, which llama.cpp's DFlash graph fuses (``fc`` -> norm) and writes into
the draft's K/V cache at their positions; a token batch ``[anchor, MASK x (n-1)]`` then gives the
logits of every depth in one decode. This is what llama.cpp's own ``draft-dflash`` driver does;
JetFlow uses it to check an export against the torch head and to time the draft inside llama.cpp.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from jetflow.models.llamacpp_target import LlamaCppError, LlamaCppTarget, OwnsLlamaContext, _import_binding


class LlamaCppDFlashDraft(OwnsLlamaContext):
    def __init__(self, gguf: str | os.PathLike, target: LlamaCppTarget, *, n_batch: int = 512):
        lib = self._lib = _import_binding()
        self.gguf = Path(gguf)
        self._model = lib.llama_model_load_from_file(str(self.gguf).encode(), lib.llama_model_default_params())
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load the draft {self.gguf}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = target.max_context
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = target.n_threads
        cparams.ctx_other = target._ctx  # token embedding and LM head come from the target
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise LlamaCppError(f"llama.cpp could not create a context for the draft {self.gguf}")
        self._target = target  # keeps the shared weights alive
        self.n_batch = n_batch
        self.vocab_size = target.vocab_size
        self.causal = self._meta("dflash.attention.causal") == "true"
        self.block_size = int(self._meta("dflash.block_size") or 16)
        lib.llama_set_causal_attn(self._ctx, self.causal)
        self._mem = lib.llama_get_memory(self._ctx)

    def _meta(self, key: str) -> str | None:
        import ctypes

        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def _decode(self, batch, what: str) -> None:
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise LlamaCppError(f"llama_decode of the draft failed on {what} (rc={rc})")

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)

    def truncate(self, n: int) -> None:
        """Drop every cached context position >= n."""
        self._lib.llama_memory_seq_rm(self._mem, 0, n, -1)

    def inject(self, features: torch.Tensor, start: int) -> None:
        """Tapped target features [C, taps*H] of positions start..start+C-1 into the draft's cache."""
        lib, feats = self._lib, features.detach().float().cpu().numpy()
        for lo in range(0, feats.shape[0], self.n_batch):
            part = feats[lo:lo + self.n_batch]
            n = part.shape[0]
            batch = lib.llama_batch_init(n, part.shape[1], 1)
            try:
                batch.n_tokens = n
                np.ctypeslib.as_array(batch.embd, shape=(part.size,))[:] = part.reshape(-1)
                for i in range(n):
                    batch.pos[i], batch.n_seq_id[i], batch.logits[i] = start + lo + i, 1, 0
                    batch.seq_id[i][0] = 0
                self._decode(batch, "the context features")
            finally:
                lib.llama_batch_free(batch)

    def block_logits(self, anchor: int, position: int, mask_token_id: int, n: int | None = None) -> torch.Tensor:
        """Logits [n, vocab] of the block [anchor, MASK x (n-1)] at ``position``, slot by slot: row 0
        is the anchor's own (unused), row k depth k.
        The block's own cache entries are dropped again, so the next call starts from the context."""
        lib, n = self._lib, n or self.block_size
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i in range(n):
                batch.token[i] = anchor if i == 0 else mask_token_id
                batch.pos[i], batch.n_seq_id[i], batch.logits[i] = position + i, 1, 1
                batch.seq_id[i][0] = 0
            self._decode(batch, "the draft block")
        finally:
            lib.llama_batch_free(batch)
        logits = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(n * self.vocab_size,))
        out = torch.from_numpy(logits.reshape(n, self.vocab_size).copy())
        self.truncate(position)
        return out
