"""Turns committed token ids into user-visible text, and decides when generation is over.

Shared by every decoding loop (autoregressive and speculative): a round may commit several tokens,
and ``OutputStream.add`` takes them one at a time so EOS, stop strings and ``max_new_tokens`` end
generation at exactly the same token whatever the loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jetflow.errors import InvalidRequestError, check_max_new_tokens


class OutputStream:
    def __init__(
        self,
        tokenizer,
        *,
        max_new_tokens: int,
        stop_token_ids: Iterable[int] = (),
        stop_strings: Sequence[str] = (),
    ):
        check_max_new_tokens(max_new_tokens)
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise InvalidRequestError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self._decode = _fast_decode(tokenizer)
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded text of the generated tokens (stop string and EOS excluded)
        self._emitted = 0  # characters of self.text already handed out by drain()
        self._prefix_offset = 0  # incremental detokenization window (see _decode_new)
        self._read_offset = 0
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> bool:
        """Append one generated token; returns True when generation is finished."""
        if self.finished:
            raise RuntimeError("add() after the output stream finished")
        token = int(token)
        self.token_ids.append(token)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            return True
        self.text += self._decode_new()
        if self.stop_strings:
            self._check_stop_strings()
        if not self.finished and len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finished

    def add_many(self, tokens: Iterable[int]) -> int:
        """Append tokens until finished; returns how many were consumed."""
        n = 0
        for t in tokens:
            n += 1
            if self.add(t):
                break
        return n

    def finish(self, reason: str) -> None:
        """End generation for a reason decided outside (e.g. the context is full)."""
        if not self.finished:
            self.finish_reason = reason

    def drain(self) -> str:
        """Text that is final and not yet returned. While running, characters that could still turn
        out to start a stop string, or an incomplete UTF-8 sequence, are held back."""
        end = len(self.text) if self.finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _decode_new(self) -> str:
        # Decode a short window before the new token too: tokenizers may merge or add spaces at a
        # token boundary, so the new text is the difference of two decodes of that window.
        ids = self.token_ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        full = self._decode(ids[self._prefix_offset :])
        if full.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]

    def _check_stop_strings(self) -> None:
        window_start = max(0, self._emitted - self._hold)
        hits = [i for s in self.stop_strings if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"


def _fast_decode(tokenizer):
    """``tokenizer.decode`` for short id lists, twice per generated token. A transformers fast
    tokenizer's wrapper costs about three times its Rust decode (argument conversion, options), so
    call the Rust tokenizer directly when that gives the same text: no clean-up of tokenization
    spaces. Other tokenizers keep their own ``decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return lambda ids: backend.decode(ids, skip_special_tokens=False)
