"""Sampling parameters and the target's sampling distribution.

Speculative sampling needs the *distribution* the target samples from, not just a sample, so
temperature, top-k and top-p are applied here once, as a function of logits to probabilities, and
both the autoregressive loop and the speculative verifier use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jetflow.errors import InvalidRequestError


# Temperatures below this decode greedily (as vLLM's do): the distribution is one-hot up to float
# rounding there, and dividing float32 logits by a temperature near 1e-38 overflows them to NaN.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidRequestError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] the target samples from under ``params`` (one-hot argmax if greedy)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token always stays (a top_p below float32's range is 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D probability vector by inverting the CDF at one uniform draw.

    Exactly one uniform per token, and tiny perturbations of ``probs`` (a tree-verify forward vs a
    one-token forward) almost never change the outcome, so speculative sampling with a seed
    reproduces autoregressive sampling with the same seed token for token."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[-1] - 1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's next token for 1-D ``logits``: argmax when greedy, else a sample."""
    if params.greedy:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy: the same first-maximum rule, much faster than torch's on a full-vocabulary row
            # (benchmarks/llamacpp_step_overhead.py)
            return int(logits.detach().numpy().argmax())
        return int(logits.argmax())
    return sample(target_probs(logits, params), generator)
