"""The draft budget when many requests share each verify forward (``jetflow serve`` under load).

The shared resource is the number of tokens one batched forward verifies. Trees are padded to the
largest one in the batch, so a step that gives each of B requests up to n draft nodes costs a
forward over B * (n + 1) tokens, c(B (n + 1)), plus each request's draft. Each step picks the one
cap n that maximises expected tokens per millisecond over all requests:

    rate(n) = sum_r E_r[tokens | first min(n, |T_r|) nodes of its tree] / (drafts + c(B * (n_eff + 1)))

with E_r from the requests' own draft scores through the acceptance rates measured so far
(:class:`AdaptiveBudget`'s estimator, shared by all requests of a mode: greedy and sampled requests
have a table each) and c from the machine's cost curve
(a forward over k tokens costs about what a k-token tree costs alone: the matmuls see the same
tokens). A lone request gets the single-stream policy itself (:class:`AdaptiveBudget`: trees up to
256 nodes, its own exploration and overhead estimate); as the batch grows the trees shrink, and
when even the best cap is slower than a plain batched step (n = 0, no drafts) steps are plain, with
an exploring drafted step now and then to keep the estimate current (the gap doubles, up to
``max_explore_every``, while exploring keeps finding that drafting does not pay). What drafting
achieved is remembered per batch-size bucket (1, 2, 3-4, 5-8, ...), so a batch whose size moves by
one or two as requests come and go is not re-explored at every new size, and per mix of decoding
modes (all greedy, all sampled, or both): sampled requests accept fewer nodes, so a batch of them
profits less from drafting, and one mix's steps would otherwise decide for another's.

The cost curve is the single sequence's; a batched forward can cost more than it says (torch pads
every tree to the largest, and builds a mask per row). So the decoder also reports each step's
measured tokens per millisecond (:meth:`observe_step`), and once a bucket and mix has measured both
drafted and plain steps, those measurements decide whether to draft; the other way is still tried
now and then. A step that also verifies requests with budgets of their own is priced and
remembered as the whole batch it is (those requests emit a token each at least).
"""

from __future__ import annotations

from collections.abc import Sequence

from jetflow.decoding.budget import AdaptiveBudget, ChainOffer
from jetflow.decoding.costs import CostCurve
from jetflow.decoding.explore import Explorer
from jetflow.tree.build import DraftTree


class LoadBudget:
    def __init__(self, costs: CostCurve, max_budget: int = 64, explore_every: int = 8, max_explore_every: int = 64):
        self.costs, self.max_budget = costs, max_budget
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        # A lone request's policy; its per-(depth, q) acceptance counts serve every batch size.
        # (no bigger trees than the curve measured, as JetFlow.adaptive_budget caps them: a target with a
        # small context or batch measures only the trees it can verify)
        self.single = self.acceptance = AdaptiveBudget(costs, max_budget=max(int(n) for n in costs.costs["verify_ms"]))
        # (batch-size bucket, mix of modes) -> running tokens/ms of drafted steps; -> measured drafted /
        # plain steps (drafted: True)
        self.draft_rate: dict[tuple[int, str], float] = {}
        self.ways: dict[tuple[int, str], Explorer] = {}
        self.recent_cap = max_budget

    @staticmethod
    def bucket(batch: int) -> int:
        """The power of two at or above ``batch``."""
        return 1 << max(0, batch - 1).bit_length()

    @classmethod
    def key(cls, greedy: Sequence[bool]) -> tuple[int, str]:
        """What a batch's drafting is remembered by: its size's bucket and its mix of modes
        (``greedy``: whether each request decodes greedily)."""
        mix = "greedy" if all(greedy) else "sampled" if not any(greedy) else "mixed"
        return cls.bucket(len(greedy)), mix

    def forward_ms(self, tokens: int) -> float:
        """A target forward over ``tokens`` tokens (the single-sequence curve: c(n + 1) = verify_ms(n))."""
        return self.costs.c1_ms if tokens <= 1 else self.costs.verify_ms(tokens - 1)

    def plain_rate(self, batch: int) -> float:
        return batch / self.forward_ms(batch)

    def draft_nodes(self, batch: int = 2) -> int:
        """How many nodes each request drafts (trees are then cut to the chosen cap)."""
        if batch == 1:
            return self.single.draft_nodes()
        return min(self.max_budget, max(4, 2 * self.recent_cap))

    def should_draft(self, greedy: Sequence[bool], chain: ChainOffer | None = None) -> bool:
        """Whether this step drafts, for a batch whose requests decode greedily or not (``greedy``,
        one per request); ``chain``: a lone request's paying lookup chain (see
        AdaptiveBudget.should_draft)."""
        if len(greedy) == 1:
            return self.single.should_draft(chain, greedy[0])
        key = self.key(greedy)
        way = self._way(key)
        prefer = way.measured_preference()  # both ways measured for this batch: they decide
        if prefer is None:
            rate = self.draft_rate.get(key)
            prefer = rate is None or rate >= self.plain_rate(len(greedy))
        return way.decide(prefer)

    def _way(self, key: tuple[int, str]) -> Explorer:
        if key not in self.ways:
            self.ways[key] = Explorer(self.explore_every, self.max_explore_every)
        return self.ways[key]

    def observe_step(self, greedy: Sequence[bool], drafted: bool, tokens: int, ms: float) -> None:
        """A batched step's measured outcome: ``tokens`` emitted over all requests in ``ms``
        (``greedy``: whether each request decodes greedily)."""
        if len(greedy) < 2 or ms <= 0:
            return
        self._way(self.key(greedy)).observe(drafted, tokens / ms)

    def choose(self, trees: list[DraftTree], draft_ms: float, greedy: Sequence[bool] | None = None,
               others: Sequence[tuple[bool, int]] = ()) -> int:
        """The per-request node cap for this step's trees (0: verify the roots only); ``greedy``:
        whether each tree's request decodes greedily (None: all do); ``others``: (greedy, draft
        nodes) of each other request the step verifies whatever the cap (one with a budget of its
        own): each emits a token at least, and its tree is padded like the rest."""
        greedy = [True] * len(trees) if greedy is None else list(greedy)
        batch = greedy + [g for g, _ in others]
        if len(batch) == 1:
            return self.single.choose(trees[0], greedy[0])
        fixed = max((n for _, n in others), default=0)  # the widest tree verified whatever the cap
        expected = [self.acceptance.expected_tokens(t, g) for t, g in zip(trees, greedy)]
        best, best_rate = 0, len(batch) / self.forward_ms(len(batch) * (fixed + 1))
        top = min(self.max_budget, max(len(t) - 1 for t in trees))
        for cap in range(1, top + 1):
            widest = max([fixed] + [min(cap, len(t) - 1) for t in trees])
            tokens = len(others) + sum(e[min(cap, len(e) - 1)] for e in expected)
            rate = tokens / (draft_ms + self.forward_ms(len(batch) * (widest + 1)))
            if rate > best_rate:
                best, best_rate = cap, rate
        self.recent_cap = best if best else max(1, self.recent_cap // 2)
        key = self.key(batch)
        if best:
            old = self.draft_rate.get(key)
            self.draft_rate[key] = best_rate if old is None else 0.7 * old + 0.3 * best_rate
        else:  # drafting did not pay for this batch: remember it so the next steps stay plain
            self.draft_rate[key] = 0.9 * best_rate
        return best

    def observe(self, tree: DraftTree, path: list[int], other_ms: float | None = None,
                verify_ms: float | None = None, draft_ms: float | None = None, drafted_nodes: int | None = None,
                drafted: bool = True, greedy: bool = True) -> None:
        """A shared request's verified tree and accepted path (``greedy``: whether it decodes
        greedily); the times (a lone request's round outside draft and verify, its verify and its
        draft; ``drafted``: False for a lookup chain verified alone) feed the single-stream policy."""
        self.single.observe(tree, path, other_ms, verify_ms, draft_ms, drafted_nodes, drafted, greedy=greedy)
