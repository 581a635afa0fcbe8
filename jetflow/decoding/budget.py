"""Adaptive draft budget: each round, verify the prefix of the best-first tree that maximises the
expected tokens per millisecond.

Best-first building adds nodes in descending score order and every parent precedes its children,
so the tree of budget n is exactly the first n + 1 nodes of the tree of any larger budget. One build
at the largest budget therefore prices every smaller budget at once:

    E[tokens | n] = 1 + sum_{i <= n} P(node i is on the accepted path)
    P(node i on path) = P(parent on path) * a(depth_i, q_i)

where q_i is the head's own probability of node i's token at its depth and a(d, q) is the measured
rate at which the target agreed with such a node when its parent was accepted (counts per depth and
probability bin over a window of the latest ``ACCEPTANCE_WINDOW`` trials, starting from a(d, q) = q;
one table for greedy requests and one for sampled ones, whose nodes are accepted with probability
min(1, p/q) rather than when they are the target's argmax; what decides whether to draft at all --
the running rate of drafted rounds, the head's measured gain over a lookup chain, exploring and
re-probing -- is kept per mode too, in :class:`ModePolicy`, so one mode's rounds do not decide for
the other's). The cost of a round is the machine's
measured draft + verify cost at that size (:class:`CostCurve`) plus a running mean of the rest
(one for rounds that verify nodes, one for plain rounds).

When even the best tree is expected to yield fewer tokens per millisecond than a plain one-token step
(low acceptance: text far from the drafter's training data, or a machine where verification is
dear), rounds skip the draft and verify the root alone -- plain decoding -- except one exploring
round after ``explore_every`` plain ones, which drafts again to keep the estimate current; while
exploring keeps finding that drafting does not pay, the gap doubles (up to ``max_explore_every``),
so a machine where it never pays (llama.cpp on a 2-core CPU) decodes almost plainly.

A drafter with prompt lookup also offers a third kind of round: its lookup chain alone, verified
without a head forward (``chain_offer``). Its tokens are priced by the lookup's own calibrated
acceptance rates. When it beats a plain step, the choice between it and a drafted round (the head's
tree with the chain merged in) is made by the model at first; once drafted rounds have shown how
many tokens the head adds beyond the chain (measured exactly, see ``observe``), that gain, priced
with the draft and the bigger verify, decides, and the other kind of round is still tried now and
then. On copy-heavy requests most rounds then verify the chain alone and save the head's forward.

Where drafting has settled as losing against plain steps (exploring at its longest gap) and the
latest paying lookup chain was preferred over drafting, a request does not even collect the target
features the head reads (``collects_features``): on llama.cpp copying them out of every forward
costs about 5% of a one-token step, paid for drafts that never come. Such requests decode plainly
and with lookup chains alone; every ``reprobe_every``-th one collects features and explores as
before, so a head that starts to pay (other prompts, a less loaded machine) is found again. Each
such re-probe that finds the head still losing doubles the gap to the next (up to
``max_reprobe_every`` requests), as exploring does within requests: a long-running server on a
machine where the head never pays stops paying for re-probes too. A re-probe drafts at its first
chance rather than after the longest exploring gap, and a request that collects features stops
collecting them once it has drafted and the head is (still, or now) settled as losing
(``keeps_features``): a re-probe then costs a few rounds with features, not a whole request.
All of this -- settling, re-probing, the head's gain, exploring -- goes by the rounds of the
request's own mode: greedy requests may settle the head as losing while sampled ones still probe it,
or the other way round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jetflow.decoding.costs import CostCurve
from jetflow.decoding.mixed_drafter import MixedDrafter, chain_followed
from jetflow.decoding.mode_policy import ModePolicy
from jetflow.decoding.saved_state import check_count, finite_number
from jetflow.tree.build import DraftTree


# Trials per (depth, probability bin) cell the acceptance counts remember: past it a cell's counts are
# scaled down, so each trial then weighs 1/500 and old evidence halves every ~350 trials. A busy cell
# (depth 1, the top bin) sees about one trial per round, so a change of workload (math, then chat;
# another drafter) is followed within a few hundred rounds; summed over a server's life, the counts
# weighed each new trial 1/(all trials so far). Acceptance is a Bernoulli per node: 500 trials still pin a rate to
# about +-0.02 (standard error at most 0.5/sqrt(500)). A cell below the window is not scaled, so
# the prior's pseudo-trials keep their full weight until evidence outweighs them.
ACCEPTANCE_WINDOW = 500
# The least weight in the plain steps' running scale of a plain step that was due (the first in
# ``max_explore_every`` rounds): it stands for all the rounds since the last one (see plain_step_due).
DUE_STEP_WEIGHT = 0.5


def _weight(count: int) -> float:
    """A measured ratio's weight in its running mean after ``count`` measurements: the mean of the
    first 20, then a running mean over about 20 (a machine's speed drifts)."""
    return 1 / min(count, 20)


def _window(hits: list[float], trials: list[float], b: int) -> None:
    """Scale cell ``b``'s counts down to ``ACCEPTANCE_WINDOW`` trials once they exceed it (the rate
    stays, older trials weigh less)."""
    if trials[b] > ACCEPTANCE_WINDOW:
        hits[b] *= ACCEPTANCE_WINDOW / trials[b]
        trials[b] = float(ACCEPTANCE_WINDOW)


@dataclass
class ChainOffer:
    """A lookup chain cut to the length that pays best, with its expected tokens and round cost."""
    tree: DraftTree
    expected: float
    cost_ms: float

    @property
    def rate(self) -> float:
        return self.expected / self.cost_ms


class AdaptiveBudget:
    def __init__(self, costs: CostCurve, max_budget: int = 256, min_budget: int = 1, bins: int = 10,
                 max_depth: int = 32, prior_trials: float = 4.0, explore_every: int = 8,
                 max_explore_every: int = 64, reprobe_every: int = 8, max_reprobe_every: int = 64):
        self.costs, self.max_budget, self.min_budget = costs, max_budget, min_budget
        self.bins, self.max_depth, self.prior_trials = bins, max_depth, prior_trials
        # Greedy and sampled requests accept nodes by different rules, so each mode has its own counts.
        self.hits, self.trials = self._prior_counts()
        self.sampled_hits, self.sampled_trials = self._prior_counts()
        # Running means of a round's time outside draft and verify (tree build, acceptance, cache
        # commit), kept apart for rounds that verify nodes and plain ones: where most rounds are
        # plain steps, which have almost none of it, one mean over all would price a tree's at a
        # fraction of what it costs (on llama.cpp about 0.2 ms a lookup chain, 2% of a step).
        # Rounds that verify a lookup chain alone have none of a drafted round's choice, tree prefix
        # and head bookkeeping (about 0.2 ms against 1.3 on llama.cpp, 8% of a step): their own mean,
        # or every chain offer would be priced as a drafted round's.
        self.overhead_ms, self.plain_overhead_ms, self.chain_overhead_ms = 0.0, 0.0, 0.0
        self._rounds, self._tree_rounds, self._chain_rounds = 0, 0, 0
        # The cost curve is measured once per machine and cached, but a machine's speed, and the
        # ratio of a tree verify to a plain step with it, drift with its load (seen: 1.62 when
        # cached, 1.35 later the same day). So verify times are measured as rounds run, and the
        # curve is scaled by the running ratio of measured to predicted time of plain steps (the
        # machine's speed, measured nearly every round), and trees by that times the running ratio
        # of their own measured scale to the plain steps' at the time (pooled over all sizes: a
        # size judged dear by one slow measurement would otherwise never be tried, and so never
        # corrected). Trees are verified rarely where they do not pay; a tree scale of its own
        # would keep the machine speed of the last verify, so that once the machine sped up,
        # trees looked dear, were not verified, and their price was never corrected.
        self._curve = [costs.c1_ms] + [costs.verify_ms(n) for n in range(1, max_budget + 1)]
        self._draft = [costs.draft_ms(n) for n in range(max_budget + 1)]
        self._plain_scale, self._tree_rel, self._scale_count = 1.0, 1.0, [0, 0]  # counts: [plain, trees]
        # Drafts are timed as rounds run too, and the draft curve scaled by the machine's speed times
        # the running ratio of their measured to cached time to it (see draft_cost).
        self._draft_scale, self._draft_count = 1.0, 0
        self._since_plain: int | None = None  # timed rounds since the last plain step (None: none yet)
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        # Per mode (greedy: True, sampled: False): the running rate of drafted rounds, the head's gain
        # over a paying lookup chain, exploring and re-probing (see ModePolicy). Rounds where a paying
        # lookup chain is on offer: draft (the head's tree with the chain merged in) or verify the
        # chain alone? What the head adds is measured exactly in drafted rounds: greedy acceptance is
        # deterministic, so the chain alone would have emitted its prefix that the target followed
        # plus a bonus token, and the rest of what the round emitted is the head's gain (timing rounds
        # is too noisy on a shared CPU: a round's time moves by more than the draft's few percent of
        # it). In a sampled request the same count is an estimate: the chain alone would have been
        # accepted by its own draws, not by the tokens this round drew.
        self.modes = {greedy: ModePolicy(explore_every, max_explore_every) for greedy in (True, False)}
        self._offer: ChainOffer | None = None  # this round's paying chain, when the round drafted
        self._recent_choice = max_budget  # budgets chosen lately bound how big a tree to draft
        self._chosen = False  # whether a size was chosen yet (the first choice sets _recent_choice)
        self.reprobe_every, self.max_reprobe_every = reprobe_every, max_reprobe_every
        # Within a request (not kept between processes): a re-probe's draft is due at its first
        # chance; whether this request has drafted since it began.
        self._probe_due, self._drafted = False, False
        self._greedy = True  # whether this request decodes greedily (told to collects_features)
        self._chain_prices: dict = {}  # lookup chain scores_key -> _best_chain_prefix (see lookup_chain)

    # What `auto` has learned, kept from one process to the next (JetFlow saves it after each request):
    # acceptance counts (greedy and sampled), cost scales, the rest of a round, and each mode's
    # drafting rate, head gain and where its exploring and re-probing stand. Not kept: the plain-step
    # timing (a new process times a plain step first) and in-round counters.
    _STATE = ("hits", "trials", "sampled_hits", "sampled_trials", "overhead_ms", "plain_overhead_ms",
              "chain_overhead_ms", "_rounds", "_tree_rounds", "_chain_rounds", "_plain_scale",
              "_tree_rel", "_scale_count", "_draft_scale", "_draft_count", "_recent_choice", "_chosen")
    _MODE_NAMES = {True: "greedy", False: "sampled"}

    def state(self) -> dict:
        """What this budget has learned, as JSON-able values (:meth:`load_state` restores it)."""
        return {**{name: getattr(self, name) for name in self._STATE},
                "modes": {self._MODE_NAMES[greedy]: mode.state() for greedy, mode in self.modes.items()}}

    def _one_mode_state(self, state: dict) -> dict:
        """A state saved when both modes shared one drafting policy, with its fields as the greedy
        mode's (the requests it learned from were mostly greedy) and a fresh sampled mode that keeps
        its own drafted-round rate where the state had one."""
        fresh = ModePolicy(self.explore_every, self.max_explore_every).state()
        shared = {key: state[old] for key, old in (
            ("draft_rate", "draft_rate"), ("head_gain", "head_gain"), ("explore_gap", "_explore_gap"),
            ("reprobing", "_reprobing"), ("gains", "_gains"), ("featureless", "_featureless"),
            ("reprobe_doublings", "_reprobe_doublings"), ("chain_explorer", "chain_explorer"))}
        return {**state, "modes": {"greedy": shared,
                                   "sampled": {**fresh, "draft_rate": state.get("sampled_draft_rate")}}}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state`; ValueError (nothing changed) when it does not fit this budget."""
        if not isinstance(state, dict):
            raise ValueError(f"not a saved budget state (a JSON {type(state).__name__}, not an object)")
        if "chain_overhead_ms" not in state:  # saved before chain rounds had their own mean, and drafts
            # their scale relative to the plain steps' (a state of the same curve: rare, its name holds it)
            plain, draft = state.get("_plain_scale"), state.get("_draft_scale")
            state = {**state, "chain_overhead_ms": state.get("overhead_ms"), "_chain_rounds": 0, "_chosen": True,
                     **({"_draft_scale": draft / plain} if finite_number(plain) and finite_number(draft) and plain > 0 else {})}
        if "sampled_hits" not in state and "sampled_trials" not in state:  # saved with one table for both
            # modes, mostly greedy requests: it stays the greedy one, sampled requests start from the prior
            state = dict(zip(("sampled_hits", "sampled_trials"), self._prior_counts()), **state)
        try:
            if "modes" not in state:  # saved with one drafting policy for both modes
                state = self._one_mode_state(state)
            values = {name: state[name] for name in self._STATE}
            saved_modes = state["modes"]
            modes = {greedy: ModePolicy.from_state(saved_modes[name], self.explore_every, self.max_explore_every,
                                                   f"modes.{name}")
                     for greedy, name in self._MODE_NAMES.items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a saved budget state ({e!r} missing or of the wrong kind)") from None
        for name in ("hits", "trials", "sampled_hits", "sampled_trials"):
            table = values[name]
            if (not isinstance(table, list) or len(table) != self.max_depth + 1
                    or any(not isinstance(row, list) or len(row) != self.bins for row in table)):
                raise ValueError(f"{name}: expected {self.max_depth + 1} rows of {self.bins} counts")
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) for row in table for x in row):
                raise ValueError(f"{name}: counts must be numbers")
            values[name] = [[float(x) for x in row] for row in table]
        for mode in ("", "sampled_"):
            if any(not math.isfinite(t) or t <= 0 for row in values[f"{mode}trials"] for t in row):
                raise ValueError(f"{mode}trials: counts must be positive")
            if any(not math.isfinite(h) or h < 0 for row in values[f"{mode}hits"] for h in row):
                raise ValueError(f"{mode}hits: counts must be finite and >= 0")
        if not isinstance(values["_scale_count"], list) or len(values["_scale_count"]) != 2:
            raise ValueError("_scale_count: expected two counts")
        counts = [("_scale_count", c) for c in values["_scale_count"]] + [
            (name, values[name]) for name in ("_draft_count", "_rounds", "_tree_rounds", "_chain_rounds",
                                              "_recent_choice")]
        for name, value in counts:
            check_count(name, value)
        for name in ("_plain_scale", "_tree_rel", "_draft_scale"):
            if not finite_number(values[name]) or values[name] <= 0:
                raise ValueError(f"{name}: expected a positive ratio, got {values[name]!r}")
        for name in ("overhead_ms", "plain_overhead_ms", "chain_overhead_ms"):
            if not finite_number(values[name]) or values[name] < 0:
                raise ValueError(f"{name}: expected milliseconds >= 0, got {values[name]!r}")
        if not isinstance(values["_chosen"], bool):
            raise ValueError(f"_chosen: expected true or false, got {values['_chosen']!r}")
        for name, value in values.items():
            setattr(self, name, value)
        self.modes = modes
        for hits, trials in (self._counts(True), self._counts(False)):  # (an old state summed without a window)
            for hit_row, trial_row in zip(hits, trials):
                for b in range(self.bins):
                    _window(hit_row, trial_row, b)
        self._chain_prices.clear()

    def head_settled_losing(self) -> bool:
        """Whether drafting lost against plain steps until exploring reached its longest gap, and
        the latest round with a paying lookup chain on offer (if any) preferred the chain alone
        (in the policy of the mode the request told ``collects_features``)."""
        mode = self._mode()
        against_plain = (mode.explore_gap >= self.max_explore_every and mode.draft_rate is not None
                         and mode.draft_rate < self.plain_rate())
        chains = mode.chain_explorer
        return against_plain and (chains.decisions == 0 or chains.prefers(False))

    def collects_features(self, greedy: bool = True) -> bool:
        """Once per request (``greedy``: whether it decodes greedily, which this request's rounds
        then decide by): whether its forwards return the target features the head reads. False
        while the head has settled as losing, except for re-probes: every ``reprobe_every``-th
        request, the gap doubling after each re-probe that leaves the head losing (each mode
        settles and re-probes by its own rounds)."""
        self._drafted, self._probe_due, self._greedy = False, False, greedy
        mode = self._mode()
        if not self.head_settled_losing():
            mode.featureless, mode.reprobe_doublings, mode.reprobing = 0, 0, False
            return True
        if mode.reprobing:  # the latest re-probe left the head losing
            mode.reprobe_doublings += 1
            mode.reprobing = False
        if mode.featureless + 1 >= self.reprobe_gap():
            mode.featureless, mode.reprobing, self._probe_due = 0, True, True
            return True
        mode.featureless += 1
        return False

    def keeps_features(self) -> bool:
        """Asked each round of a request that collects features: False once this request has
        drafted and the head is settled as losing (a re-probe that found it still losing, or the
        exploring that settled it), after which the request decodes without features."""
        return not (self._drafted and self.head_settled_losing())

    def reprobe_gap(self) -> int:
        """Requests (of the current request's mode) from one re-probe to the next while the head has
        settled as losing."""
        doublings = self._mode().reprobe_doublings
        return min(self.reprobe_every << doublings, max(self.reprobe_every, self.max_reprobe_every))

    def draft_nodes(self) -> int:
        """How many nodes to draft this round: twice the largest recent choice (so the choice can
        grow), which lets a causal head skip slots deeper than any tree it will be asked for."""
        return min(self.max_budget, max(8, 2 * self._recent_choice))

    def plain_rate(self) -> float:
        """Tokens per ms of a round that verifies the root alone (no draft forward)."""
        return 1.0 / (self.verify_cost(0) + self.plain_overhead_ms)

    def verify_scales(self) -> tuple[float, float]:
        """The measured-to-cached cost ratios of plain steps and of trees."""
        return self._plain_scale, self._plain_scale * self._tree_rel

    def verify_cost(self, n: int) -> float:
        """Milliseconds of a verify of n draft nodes (plus the root): measured, else predicted."""
        return self._curve[min(n, self.max_budget)] * self.verify_scales()[n > 0]

    def draft_cost(self, n: int) -> float:
        """Milliseconds of a draft for a tree of n nodes: the cached curve, scaled by the machine's
        speed (the plain steps') times the drafts' own measured ratio to it. Drafts are timed only
        in runs of drafted rounds, rare where drafting loses: a scale of their own would keep the
        machine speed of the last such run, and a machine that sped up would never draft again."""
        return self._draft[min(n, self.max_budget)] * self._draft_scale * self._plain_scale

    def plain_step_due(self) -> bool:
        """Whether this round must be a plain step whatever pays: the first timed round, then one
        whenever ``max_explore_every`` rounds in a row were not plain. Every price is scaled by the
        plain steps' measured time (trees by a ratio to it), so a decoder whose rounds all draft or
        verify lookup chains would otherwise never correct a cached curve measured on a busy
        machine (seen: a one-token step cached at 73 ms that takes 13, which made every chain and
        draft look cheap). Such a step, the only one in a long while, weighs at least
        ``DUE_STEP_WEIGHT`` in the running scale: at the usual 1/20, plain steps timed slow during a
        few seconds of load kept drafts and chains looking cheap for the rest of a 20-request set
        (seen once, in a llama.cpp headline run that was stopped: GSM8K verified a tree or a chain in
        all but one round of every request), no other plain step coming to correct them."""
        return self._since_plain is None or self._since_plain >= self.max_explore_every

    def observe_plain(self, verify_ms: float) -> None:
        """``observe`` of a plain round (the root alone) whose only timed phase was its verify."""
        self._observe_overhead(0.0, tree=False)
        self._observe_step(verify_ms)

    def _observe_step(self, ms: float) -> None:
        """A plain step's time: the machine's speed (see ``plain_step_due`` for a due one's weight)."""
        least = DUE_STEP_WEIGHT if self.plain_step_due() else None
        self._since_plain = 0
        self._observe_verify(0, ms, least)

    def _observe_overhead(self, ms: float, tree: bool, drafted: bool = True) -> None:
        self._rounds += 1
        if tree and drafted:
            self._tree_rounds += 1
            self.overhead_ms += (ms - self.overhead_ms) / min(self._tree_rounds, 100)
        elif tree:
            self._chain_rounds += 1
            self.chain_overhead_ms += (ms - self.chain_overhead_ms) / min(self._chain_rounds, 100)
        else:
            plain = self._rounds - self._tree_rounds - self._chain_rounds
            self.plain_overhead_ms += (ms - self.plain_overhead_ms) / min(plain, 100)

    def _observe_verify(self, nodes: int, ms: float, least_weight: float | None = None) -> None:
        k = int(nodes > 0)
        if k or self._scale_count[0] % 16 == 0 or least_weight:  # tree costs moved, 16 plain steps since the last, or a due one
            self._chain_prices.clear()
        self._scale_count[k] += 1
        ratio, weight = ms / self._curve[min(nodes, self.max_budget)], _weight(self._scale_count[k])
        weight = max(weight, least_weight or 0.0)
        if k:  # mean, then running
            self._tree_rel += (ratio / self._plain_scale - self._tree_rel) * weight
        else:
            self._plain_scale += (ratio - self._plain_scale) * weight

    def _observe_draft(self, nodes: int, ms: float) -> None:
        predicted = self._draft[min(nodes, self.max_budget)]
        if predicted > 0:  # (a curve measured without a drafter has none)
            self._draft_count += 1
            self._draft_scale += (ms / predicted / self._plain_scale - self._draft_scale) * _weight(self._draft_count)

    def chain_offer(self, tree: DraftTree) -> ChainOffer | None:
        """For a tree whose scores are calibrated log-probabilities of acceptance and that costs no
        draft forward (a lookup chain): its prefix that gives the most tokens per ms, or None when
        not even one node beats a plain step."""
        best = self._best_chain_prefix(tree.scores)
        if best is None:
            return None
        n, expected, cost = best
        return ChainOffer(tree.prefix(n + 1), expected, cost)

    def _best_chain_prefix(self, scores: list[float]) -> tuple[int, float, float] | None:
        """(n, expected tokens, cost ms) of the chain prefix of n nodes (scores: cumulative log P of
        acceptance, root first) with the most tokens per ms, if it beats a plain step."""
        expected, best = 1.0, None
        best_rate, (_, tree_scale) = self.plain_rate(), self.verify_scales()
        curve, overhead = self._curve, self.chain_overhead_ms  # (verify_cost inlined: priced every round)
        for n in range(1, min(len(scores) - 1, self.max_budget) + 1):
            expected += math.exp(scores[n])  # a chain: node n is on the path with P = exp(score)
            cost = curve[n] * tree_scale + overhead
            if expected / cost > best_rate:
                best, best_rate = (n, expected, cost), expected / cost
        return best

    def lookup_chain(self, drafter, root: int, room: int) -> ChainOffer | None:
        """The lookup chain that a drafter with prompt lookup offers this round without a head
        forward, cut to the size that pays best; None when there is none, or when not even one node
        of it beats a plain step. Runs every round of ``auto``, so the chain's tree is built only
        when it pays."""
        if not isinstance(drafter, MixedDrafter):
            return None
        chain = drafter.propose_lookup(root, room)
        if chain is None:
            return None
        # Most rounds offer a chain that does not pay, and its price depends only on the lookup's
        # calibration, its match length and its length: priced once until the costs move.
        key = chain.scores_key
        best = self._chain_prices.get(key, ()) if key is not None else ()
        if best == ():
            best = self._best_chain_prefix(chain.scores())
            if key is not None:
                self._chain_prices[key] = best
        if best is None:
            return None
        n, expected, cost = best
        return ChainOffer(chain.tree(n), expected, cost)

    def should_draft(self, chain: ChainOffer | None = None, greedy: bool | None = None) -> bool:
        """False when drafting is expected to be slower than a plain step, or than verifying the
        paying lookup ``chain`` alone (see the module doc); ``greedy``: whether the request decodes
        greedily (None: the mode ``collects_features`` was told at the request's start)."""
        self._offer = None
        if self._probe_due:  # a re-probe: draft now rather than after the longest exploring gap
            self._probe_due, self._drafted, self._offer = False, True, chain
            return True
        drafted = self._decide_draft(chain, self._mode(greedy))
        self._drafted = self._drafted or drafted
        return drafted

    def _decide_draft(self, chain: ChainOffer | None, mode: ModePolicy) -> bool:
        """``mode``: the policy of the request's mode."""
        if chain is not None:
            if mode.head_gain is None:  # the head's gain not measured yet: the model's estimate
                prefer = mode.draft_rate is None or mode.draft_rate >= chain.rate
            else:  # the chain's tokens plus the head's measured gain, for a draft and a bigger tree
                nodes = len(chain.tree) - 1 + self._recent_choice
                cost = self.draft_cost(self.draft_nodes()) + self.verify_cost(nodes) + self.overhead_ms
                prefer = (chain.expected + mode.head_gain) / cost > chain.rate
            drafted = mode.chain_explorer.decide(prefer)
            self._offer = chain if drafted else None
            return drafted
        if mode.draft_rate is None or mode.draft_rate >= self.plain_rate():
            mode.plain_rounds, mode.explore_gap = 0, self.explore_every
            return True
        if mode.plain_rounds + 1 >= mode.explore_gap:
            mode.plain_rounds = 0
            mode.explore_gap = min(2 * mode.explore_gap, self.max_explore_every)
            return True
        mode.plain_rounds += 1
        return False

    def _cell(self, tree: DraftTree, node: int) -> tuple[int, int]:
        q = math.exp(tree.scores[node] - tree.scores[tree.parents[node]])
        return min(tree.depths[node], self.max_depth), min(self.bins - 1, int(q * self.bins))

    def _prior_counts(self) -> tuple[list[list[float]], list[list[float]]]:
        """(hits, trials) of pseudo-counts: before any evidence a node is accepted as often as the
        head believes."""
        mids = [(b + 0.5) / self.bins for b in range(self.bins)]
        rows = range(self.max_depth + 1)
        return [[self.prior_trials * m for m in mids] for _ in rows], [[self.prior_trials] * self.bins for _ in rows]

    def _counts(self, greedy: bool) -> tuple[list[list[float]], list[list[float]]]:
        """(hits, trials) of requests that decode greedily, or of sampled ones."""
        return (self.hits, self.trials) if greedy else (self.sampled_hits, self.sampled_trials)

    def _mode(self, greedy: bool | None = None) -> ModePolicy:
        """The drafting policy of requests that decode greedily, or of sampled ones (None: the mode
        ``collects_features`` was told at the request's start)."""
        return self.modes[self._greedy if greedy is None else greedy]

    def acceptance(self, depth: int, q: float, greedy: bool = True) -> float:
        d, b = min(depth, self.max_depth), min(self.bins - 1, int(q * self.bins))
        hits, trials = self._counts(greedy)
        return hits[d][b] / trials[d][b]

    def expected_tokens(self, tree: DraftTree, greedy: bool = True) -> list[float]:
        """E[tokens per round] when verifying the first n + 1 nodes, for n = 0 .. len(tree) - 1, for
        a request that decodes greedily or (``greedy`` False) samples."""
        hits, trials = self._counts(greedy)
        on_path = [1.0] + [0.0] * (len(tree) - 1)
        expected = [1.0]
        for node in range(1, len(tree)):
            d, b = self._cell(tree, node)
            on_path[node] = on_path[tree.parents[node]] * hits[d][b] / trials[d][b]
            expected.append(expected[-1] + on_path[node])
        return expected

    def choose(self, tree: DraftTree, greedy: bool | None = None) -> int:
        """The number of draft nodes (a prefix of ``tree``'s node order) to verify this round
        (``greedy``: whether the request decodes greedily; None: the mode ``collects_features`` was
        told at the request's start)."""
        greedy = self._greedy if greedy is None else greedy
        expected = self.expected_tokens(tree, greedy)
        top = min(len(tree) - 1, self.max_budget)
        if top < self.min_budget:
            return top
        # The round drafted draft_nodes() nodes whatever prefix it verifies: every size is charged
        # that draft (charged only its own size's, a small tree's round looked up to half a llama.cpp
        # step cheaper than it is, and drafting seemed to pay where it did not).
        draft = self.draft_cost(self.draft_nodes())
        cost = [draft + self.verify_cost(n) + (self.overhead_ms if n else self.plain_overhead_ms)
                for n in range(top + 1)]
        best = max(range(self.min_budget, top + 1), key=lambda n: expected[n] / cost[n])
        # The first choice sets it (its initial max_budget only lets the first tree be as big as it
        # may), later ones let it shrink slowly.
        self._recent_choice = best if not self._chosen else max(best, int(0.8 * self._recent_choice))
        self._chosen = True
        mode, rate = self._mode(greedy), expected[best] / cost[best]
        mode.draft_rate = rate if mode.draft_rate is None else 0.7 * mode.draft_rate + 0.3 * rate
        return best

    def observe(self, tree: DraftTree, path: list[int], other_ms: float | None = None,
                verify_ms: float | None = None, draft_ms: float | None = None, drafted_nodes: int | None = None,
                drafted: bool = True, greedy: bool | None = None) -> None:
        """Count, for every verified node whose parent was accepted, whether it was accepted too (in
        the counts of greedy requests, or of sampled ones when ``greedy`` is False; None: the mode
        ``collects_features`` was told at the request's start);
        ``other_ms``: the round's time outside draft and verify; ``verify_ms``: its verify's time;
        ``draft_ms``: its draft's time, for ``drafted_nodes`` (the draft's ``max_nodes``), given for a
        draft that projected only the previous round's features (not a prompt's, nor those of a run
        of plain rounds: exploring pays those, drafting every round would not); ``drafted``: False
        for a round that verified a lookup chain alone."""
        greedy = self._greedy if greedy is None else greedy
        if draft_ms is not None:
            self._observe_draft(drafted_nodes, draft_ms)
        accepted = set(path)
        hits, trials = self._counts(greedy)
        for node in range(1, len(tree)):
            if tree.parents[node] in accepted:
                d, b = self._cell(tree, node)
                trials[d][b] += 1
                hits[d][b] += node in accepted
                _window(hits[d], trials[d], b)
        if other_ms is not None:
            self._observe_overhead(other_ms, tree=len(tree) > 1, drafted=drafted)
        if verify_ms is not None:
            if len(tree) == 1:
                self._observe_step(verify_ms)
            else:
                self._since_plain = None if self._since_plain is None else self._since_plain + 1
                self._observe_verify(len(tree) - 1, verify_ms)
        if self._offer is not None:  # a drafted round that had a paying chain: what did the head add?
            followed = chain_followed(self._offer.tree.tokens[1:], tree, path)
            self._mode(greedy).observe_gain(len(path) - (followed + 1))  # emitted minus the chain alone's
            self._offer = None
