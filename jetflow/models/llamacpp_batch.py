"""Many answers at once on llama.cpp (regeneration of training data): continuous batching over slots.

Each slot is a llama.cpp sequence with its own cells in a context of its own (the target's decoding
context is left alone). Every step is ONE ``llama_decode`` holding the next token of every slot that
is generating plus prompt chunks of slots that are starting; a slot whose answer ends takes the next
prompt at once, so the batch stays full while prompts remain. Answers come back in prompt order.
"""

from __future__ import annotations

import numpy as np
import torch

from jetflow.decoding.sampling import MIN_TEMPERATURE
from jetflow.errors import InvalidRequestError, check_max_new_tokens
from jetflow.models.llamacpp_target import LlamaCppError, _Batch


class _Slot:
    __slots__ = ("index", "prompt", "fed", "pos", "answer")

    def __init__(self, index: int, prompt: list[int]):
        self.index, self.prompt, self.fed, self.pos, self.answer = index, prompt, 0, 0, []


def generate_many(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                  generator: torch.Generator | None = None, slots: int = 16, n_batch: int = 512) -> list[list[int]]:
    """Answers (token ids, a stop token included when produced) of ``target`` (a LlamaCppTarget)
    to every prompt; greedy below a temperature of 1e-5 (as every decoder), else sampled with ``generator``."""
    lib = target._lib
    check_max_new_tokens(max_new_tokens)
    if not prompts:
        return []
    longest = max(len(p) for p in prompts) + max_new_tokens
    if any(len(p) == 0 for p in prompts):
        raise InvalidRequestError("empty prompt: nothing to generate from")
    slots = max(1, min(slots, len(prompts)))
    # llama.cpp splits cells evenly over sequences
    ctx = target.new_context(slots * (-(-longest // 256) * 256), n_batch, slots, unified=False)
    mem = lib.llama_get_memory(ctx)
    batch = _Batch(lib, n_batch, 1)
    stop = np.asarray(sorted(target.stop_token_ids()), dtype=np.int64)
    answers: list[list[int] | None] = [None] * len(prompts)
    waiting = iter(range(len(prompts)))
    active: list[_Slot | None] = [None] * slots
    try:
        for s in range(slots):
            i = next(waiting)
            active[s] = _Slot(i, prompts[i])
        while any(a is not None for a in active):
            n, readers = 0, []  # readers: (slot, batch row) whose logits give the slot's next token
            for s, slot in enumerate(active):  # the next token of every generating slot first
                if slot is not None and slot.fed == len(slot.prompt):
                    n = _put(batch, n, slot.answer[-1], slot.pos, s, True)
                    slot.pos += 1
                    readers.append((s, n - 1))
            for s, slot in enumerate(active):  # then prompt chunks, as much as the batch holds
                if slot is None or slot.fed == len(slot.prompt) or n == n_batch:
                    continue
                take = min(len(slot.prompt) - slot.fed, n_batch - n)
                for t in slot.prompt[slot.fed:slot.fed + take]:
                    n = _put(batch, n, t, slot.pos, s, False)
                    slot.pos += 1
                slot.fed += take
                if slot.fed == len(slot.prompt):
                    batch.logits[n - 1] = 1
                    readers.append((s, n - 1))
            batch.struct.n_tokens = n
            rc = lib.llama_decode(ctx, batch.struct)
            if rc != 0:
                raise LlamaCppError(f"llama_decode failed with code {rc} while generating {len(prompts)} answers")
            rows = np.flatnonzero(batch.logits[:n])  # outputs come in batch order
            logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(rows), target.vocab_size))
            out_row = {int(r): k for k, r in enumerate(rows)}
            for s, row in readers:
                token = _pick(logits[out_row[row]], temperature, generator)
                slot = active[s]
                slot.answer.append(token)
                if token in stop or len(slot.answer) >= max_new_tokens:
                    answers[slot.index] = slot.answer
                    lib.llama_memory_seq_rm(mem, s, -1, -1)
                    i = next(waiting, None)
                    active[s] = None if i is None else _Slot(i, prompts[i])
    finally:
        lib.llama_free(ctx)
    return answers


def _put(batch: _Batch, n: int, token: int, pos: int, seq: int, logits: bool) -> int:
    batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.seq_ids[n, 0] = token, pos, 1, seq
    batch.logits[n] = 1 if logits else 0
    return n + 1


def _pick(row: np.ndarray, temperature: float, generator: torch.Generator | None) -> int:
    if temperature < MIN_TEMPERATURE:  # greedy, as every decoder (dividing by it would overflow)
        return int(row.argmax())
    probs = torch.from_numpy(row / temperature).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
