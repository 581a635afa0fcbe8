"""What decides whether one decoding mode's rounds draft, kept apart for greedy and sampled requests.

A sampled request accepts a node with probability min(1, p/q) rather than when it is the target's
argmax, so it accepts fewer nodes, and the head's worth differs between the modes. Shared, one
mode's rounds would decide for the other's: a server whose greedy requests profit from the head
would draft for sampled ones where it loses, or a run of sampled requests would settle the head as
losing, stop collecting features and leave greedy requests plain until the next re-probe.

So each mode has its own running rate of drafted rounds, measured gain of the head over a paying
lookup chain, exploring gap (plain rounds between exploring drafts) and chain-or-draft explorer,
and its own re-probing counters (requests served without features, doublings of the re-probe gap).
:class:`jetflow.decoding.budget.AdaptiveBudget` holds one per mode; what they decide from
(acceptance counts per mode, the machine's costs) is described there.
"""

from __future__ import annotations

from jetflow.decoding.explore import Explorer
from jetflow.decoding.saved_state import check_count, finite_number


class ModePolicy:
    """One mode's drafting decisions as they stand (read and moved by AdaptiveBudget), saved with
    :meth:`state` and read back with :meth:`from_state`."""

    _COUNTS = ("gains", "featureless", "reprobe_doublings")  # integers >= 0
    _EXPLORER_STATE = ("_since", "_gap", "_prefer", "decisions")

    def __init__(self, explore_every: int, max_explore_every: int):
        self.draft_rate: float | None = None  # running tokens per ms of this mode's drafted rounds
        # Running mean of what the head's tree adds beyond a paying lookup chain, tokens per drafted
        # round (see AdaptiveBudget.observe), and how many rounds measured it.
        self.head_gain: float | None = None
        self.gains = 0
        self.explore_gap = explore_every  # plain rounds before the next exploring draft
        self.plain_rounds = 0  # consecutive rounds without a draft (in-process only)
        self.chain_explorer = Explorer(explore_every, max_explore_every)  # draft, or the chain alone?
        self.featureless = 0  # requests in a row served without features (the head settled as losing)
        self.reprobe_doublings = 0  # re-probes in a row that found the head still losing
        self.reprobing = False  # the latest request collected features although the head had settled

    def observe_gain(self, gain: float) -> None:
        self.gains += 1
        self.head_gain = gain if self.head_gain is None else self.head_gain + (gain - self.head_gain) / min(self.gains, 20)

    def state(self) -> dict:
        chains = self.chain_explorer
        return {"draft_rate": self.draft_rate, "head_gain": self.head_gain, "explore_gap": self.explore_gap,
                "reprobing": self.reprobing, **{name: getattr(self, name) for name in self._COUNTS},
                "chain_explorer": {**{name: getattr(chains, name) for name in self._EXPLORER_STATE},
                                   "rates": {str(way).lower(): rate for way, rate in chains.rates.items()}}}

    @classmethod
    def from_state(cls, state: dict, explore_every: int, max_explore_every: int, name: str) -> "ModePolicy":
        """:meth:`state` read back; ValueError naming the field (``name``: the mode's, for the message)."""
        policy = cls(explore_every, max_explore_every)
        try:
            values = {key: state[key] for key in ("draft_rate", "head_gain", "explore_gap", "reprobing", *cls._COUNTS)}
        except (KeyError, TypeError) as e:
            raise ValueError(f"{name}: not a saved mode state ({e!r} missing or of the wrong kind)") from None
        try:
            chains = state["chain_explorer"]
            explorer = {key: chains[key] for key in cls._EXPLORER_STATE}
            rates = {{"true": True, "false": False}[way]: rate for way, rate in chains["rates"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{name}.chain_explorer: not a saved explorer ({e!r} missing or of the wrong kind)") from None
        for key in cls._COUNTS:
            check_count(f"{name}.{key}", values[key])
        check_count(f"{name}.explore_gap", values["explore_gap"], 1)
        for key, least in (("_since", 0), ("decisions", 0), ("_gap", 1)):
            check_count(f"{name}.chain_explorer.{key}", explorer[key], least)
        for key in ("draft_rate", "head_gain"):  # None until measured
            if values[key] is not None and not finite_number(values[key]):
                raise ValueError(f"{name}.{key}: expected a number or null, got {values[key]!r}")
        for key, value in (("reprobing", values["reprobing"]), ("chain_explorer._prefer", explorer["_prefer"])):
            if not isinstance(value, bool):
                raise ValueError(f"{name}.{key}: expected true or false, got {value!r}")
        if not all(finite_number(rate) for rate in rates.values()):
            raise ValueError(f"{name}.chain_explorer.rates: expected finite rates")
        for key, value in values.items():
            setattr(policy, key, value)
        for key, value in explorer.items():
            setattr(policy.chain_explorer, key, value)
        policy.chain_explorer.rates = {way: float(rate) for way, rate in rates.items()}
        return policy
