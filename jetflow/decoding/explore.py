"""Choosing between two ways to run a round by what they measured, while still trying the other.

Both budgets face a two-way choice round after round: draft or not (a batch under load, where the
two ways' measured tokens per millisecond decide once both were measured), draft or verify the
lookup chain alone (a single stream, where the head's measured gain decides). Whatever the
preference, the other way is tried again after ``explore_every`` rounds, then after twice as many,
and so on up to ``max_explore_every``, while it keeps losing; a change of preference starts the
gap again.
"""

from __future__ import annotations


class Explorer:
    def __init__(self, explore_every: int = 8, max_explore_every: int = 64):
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        self.rates: dict[bool, float] = {}  # way -> running measured tokens per ms
        self._since, self._gap, self._prefer = 0, explore_every, True
        self.decisions = 0

    def observe(self, way: bool, rate: float) -> None:
        old = self.rates.get(way)
        self.rates[way] = rate if old is None else 0.7 * old + 0.3 * rate

    def measured_preference(self) -> bool | None:
        """The faster way once both were measured, else None."""
        return self.rates[True] >= self.rates[False] if len(self.rates) == 2 else None

    def prefers(self, way: bool) -> bool:
        """Whether the latest decision preferred ``way`` (exploring aside)."""
        return self._prefer == way

    def decide(self, prefer: bool) -> bool:
        """``prefer``, or now and then the other way."""
        self.decisions += 1
        if prefer != self._prefer:
            self._prefer, self._since, self._gap = prefer, 0, self.explore_every
        self._since += 1
        if self._since >= self._gap:
            self._since, self._gap = 0, min(2 * self._gap, self.max_explore_every)
            return not prefer
        return prefer
