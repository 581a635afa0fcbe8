"""Per-call statistics of speculative decoding."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
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

    @contextmanager
    def timed(self, phase: str):
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        yield
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[phase] += time.perf_counter() - t

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
            "tau": self.tau,
            "accept_lengths": list(self.accept_lengths),
            "accept_histogram": dict(sorted(Counter(self.accept_lengths).items())),
            "per_depth_acceptance": self.per_depth_acceptance(),
            "mean_tree_size": sum(self.tree_sizes) / max(1, len(self.tree_sizes)),
            "time_split": dict(self.seconds),
            "round_kinds": dict(self.round_kinds),
        }
