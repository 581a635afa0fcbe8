"""Per-call statistics of speculative decoding."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class SpeculativeStats:
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per round (bonus included)
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes verified per round (root excluded)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(("draft", "tree", "verify", "accept", "commit"), 0.0))
    # rounds by what was verified: "drafted" (a head's tree), "lookup" (the lookup chain alone, no
    # head forward) or "plain" (the root alone)
    round_kinds: Counter = field(default_factory=Counter)
    device: torch.device | None = None
    _timers: dict = field(default_factory=dict, repr=False)

    def timed(self, phase: str) -> "_PhaseTimer":
        """``with stats.timed("verify"): ...`` adds the block's seconds to ``seconds[phase]``."""
        timer = self._timers.get(phase)
        if timer is None:  # one reusable timer per phase: a plain llama.cpp round has a few of them
            timer = self._timers[phase] = _PhaseTimer(self, phase)
        return timer

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per round, bonus token included."""
        return sum(self.accept_lengths) / max(1, self.rounds)

    def per_depth_acceptance(self) -> list[float]:
        """Fraction of rounds whose accepted draft path reached depth d (d = 1, 2, ...)."""
        deepest = max(self.accept_lengths, default=1) - 1
        return [sum(a - 1 >= d for a in self.accept_lengths) / max(1, self.rounds) for d in range(1, deepest + 1)]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.tau if self.rounds else None,  # (a request that ended at its first token had no round)
            "accept_lengths": list(self.accept_lengths),
            "accept_histogram": dict(sorted(Counter(self.accept_lengths).items())),
            "per_depth_acceptance": self.per_depth_acceptance(),
            "mean_tree_size": sum(self.tree_sizes) / max(1, len(self.tree_sizes)),
            "time_split": dict(self.seconds),
            "round_kinds": dict(self.round_kinds),
        }


class _PhaseTimer:
    """Times one phase; on CUDA it synchronizes first, so the phase's kernels are counted in it."""

    def __init__(self, stats: SpeculativeStats, phase: str):
        self.seconds, self.phase = stats.seconds, phase
        self.cuda = stats.device if stats.device is not None and stats.device.type == "cuda" else None

    def __enter__(self):
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        self.seconds[self.phase] += time.perf_counter() - self.t0
        return False
