"""What a finished generation reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    seconds: float  # wall time including prefill
    prefill_seconds: float
    method: str
    stats: dict = field(default_factory=dict)  # method-specific numbers (e.g. rounds, tau)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the prefill took from the cache (llama.cpp)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole request, prefill included."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prefill (which gave the first): the decoding speed, which a
        long prompt's prefill would otherwise hide."""
        decode_s = self.seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0

    @classmethod
    def from_output(cls, output, prompt_tokens: int, seconds: float, prefill_seconds: float, method: str,
                    stats: dict | None = None, cached_prompt_tokens: int = 0):
        return cls(output.text, list(output.token_ids), prompt_tokens, output.finish_reason or "length",
                   seconds, prefill_seconds, method, stats or {}, cached_prompt_tokens)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(new_tokens=self.new_tokens, tokens_per_s=self.tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s)
        return d
