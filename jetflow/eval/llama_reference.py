"""llama.cpp's own autoregressive decoding, exactly as a user gets it from llama-cpp-python's
``Llama`` API: the reference JetFlow-on-llama.cpp must reproduce and the speed it must beat."""

from __future__ import annotations

import time
from pathlib import Path

from jetflow.decoding.output import OutputStream
from jetflow.models.llamacpp_target import DEFAULT_BATCH, LlamaCppError
from jetflow.utils.cpus import usable_cpus


def open_llama(gguf: str | Path, *, n_ctx: int = 4096, n_threads: int | None = None, flash_attn: bool = False):
    """A ``llama_cpp.Llama`` with the context settings the JetFlow backend uses (threads, batch,
    attention kernel), so both run the same kernels."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise LlamaCppError(f"llama-cpp-python is not installed: {e}") from None
    threads = n_threads or usable_cpus()
    return Llama(str(gguf), n_ctx=n_ctx, n_batch=DEFAULT_BATCH, n_ubatch=DEFAULT_BATCH, n_threads=threads,
                 n_threads_batch=threads, flash_attn=flash_attn, verbose=False)


def llama_greedy(llm, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                 output: OutputStream | None = None, reuse_prefix: bool = False) -> tuple[list[int], float, str]:
    """Greedy tokens (a stop token included, as JetFlow's output counts it), seconds, finish reason.
    The KV cache is cleared first unless ``reuse_prefix``: ``Llama.generate`` then reuses the prompt
    prefix it shares with the previous call, as it does by default. ``output``: each token is added
    to it as it comes, inside the timing, so the reference turns tokens into text as JetFlow's loops
    do (a speed comparison does the same work on both sides); generation also ends where it finishes."""
    if not reuse_prefix:
        llm.reset()
    tokens: list[int] = []
    reason = "length"
    t0 = time.perf_counter()
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if output is not None and output.add(token):
            reason = output.finish_reason
            break
        if token in stop_ids:
            reason = "stop"
            break
        if len(tokens) >= max_new_tokens:
            break
    return tokens, time.perf_counter() - t0, reason
