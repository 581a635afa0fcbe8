"""One draft tree from two proposers: a draft head and context lookup, checked in one verify.

The target copies from its input a lot (translation, summaries, code edits), and a head trained on
other text does not see it coming; prompt lookup does, and costs nothing to run. Each round the
head's best-first tree and the lookup chain (the tokens that followed the latest earlier match of
the context's last n-gram) are merged into one tree: candidates of both are taken in order of their
estimated probability of being accepted, ``P(node) = P(parent) * q``, where q is the head's own
probability for head nodes and, for lookup nodes, the measured rate at which the target accepted a
lookup token at that depth after a match of about that length (how far back the context agreed
with the text before the copied tokens; running counts, starting from a uniform prior, and for
each request shrunk from the counts of all towards its own). A token both propose becomes one node,
valued by the better of the two. Head nodes keep the head's own order, valued from their merged
parent (:meth:`MixedProposal.tree`). Acceptance never looks at q, so the merged tree is verified as
losslessly as any other; q only decides which nodes the budget buys.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right

import numpy as np
import torch

from jetflow.decoding.lookup_drafter import MAX_MATCH, MAX_NGRAM, LookupIndex
from jetflow.tree.build import DraftTree

# Longer than plain lookup's 10 tokens: a merged chain only gets the nodes its calibrated value buys,
# and once the target follows a copy it tends to go on. GSM8K-50 replayed with the fifth drafter:
# 10 -> 32 tokens lifts tau@64 4.36 -> 4.47 and tau@256 4.70 -> 4.81; 64 adds nothing more
# (docs/results.md, "Longer lookup chains").
MAX_CHAIN = 32
LOOKUP_WINDOW = 200  # trials per calibration cell a decoder remembers (LookupCalibration)
# Chains that no verify held are counted in batches of this many: each count changes the
# calibration, and with it the price of every chain offered after it, so counting each round made
# `auto` re-derive rates and prices every round (work done between two decodes, with cold caches).
FOLLOW_EVERY = 16
# Pseudo-trials at the pooled rate behind a request's own lookup counts (RequestCalibration).
REQUEST_PRIOR = 8.0
# A chain's calibration row: by its match length (lookup_drafter.matched_length), one row per length
# up to 7, then 8-11, 12-19 and 20 (MAX_MATCH); row 0 is no match.
MATCH_ROW_STARTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, MAX_MATCH)
MATCH_ROWS = len(MATCH_ROW_STARTS) + 1


def match_row(length: int) -> int:
    """The calibration row of a chain whose match is ``length`` tokens long."""
    return bisect_right(MATCH_ROW_STARTS, length)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def log_probs(q) -> list[float]:
    """log q per element, with q clipped to [1e-9, 1] (a token never accepted still gets a rank)."""
    log, floor = math.log, math.log(1e-9)
    return [(log(x) if x < 1.0 else 0.0) if x > 1e-9 else floor for x in q]


def less_one_error(points: list[float], variances: list[float]) -> list[float]:
    """Each estimate less one standard error, floored at 0."""
    sqrt = math.sqrt
    return [max(0.0, p - sqrt(v)) for p, v in zip(points, variances)]


def chain_followed(chain: list[int], tree: DraftTree, path: list[int]) -> int:
    """How many leading tokens of ``chain`` the accepted ``path`` (root first) of ``tree`` took."""
    return common_prefix(chain, [tree.tokens[n] for n in path[1:]])


class _DepthRates:
    """``rates`` and ``log_rates`` from a subclass's ``_depth_rates(row)``: (rates, their logs) at
    every depth."""

    def rates(self, row: int, depth: int) -> np.ndarray:
        """Each depth's estimate less one standard error. Chains are taken where their estimate is
        high, so an unbiased estimate would be too high for the chains taken (and where lookup
        barely pays, as on llama.cpp for text that copies little, that costs speed); with more
        trials the margin shrinks."""
        return np.array(self._depth_rates(row)[0][:depth])

    def log_rates(self, row: int, depth: int) -> list[float]:
        """``log_probs(rates(row, depth))``."""
        return self._depth_rates(row)[1][:depth]


class LookupCalibration(_DepthRates):
    """P(target accepts the lookup token at depth d | it accepted the one before), per row (a range
    of match lengths, :func:`match_row`).

    Counts are shrunk towards the previous depth's rate (``prior`` pseudo-trials; depth 1 towards
    one half), not towards a constant: deep depths are tried rarely, and once the target follows a
    copy it tends to go on following it, so an unseen depth is best guessed from the one above it.

    ``window``: a cell's counts are scaled down so that its trials never exceed it, which keeps the
    estimate a running one. A decoder serves a stream of requests whose text changes (code, then
    math): counts summed since the start would take hundreds of rounds to notice that chains no
    longer pay (seen: `auto` on llama.cpp fell to 0.85x of plain llama.cpp on AIME after four other
    sets; docs/results.md, "Lookup chains priced by a running window"). None: plain sums (the offline
    replay, whose sessions are short)."""

    def __init__(self, rows: int = MATCH_ROWS, max_depth: int = MAX_CHAIN, prior: float = 2.0,
                 window: float | None = None):
        self.prior, self.window = prior, window
        self.hits = np.zeros((rows, max_depth + 1))
        self.trials = np.zeros((rows, max_depth + 1))
        self._rates: dict[int, tuple] = {}  # row -> (rates, logs, point estimates, trials)
        # per row: a row's rates change only with its own counts, so a price cached on the row's
        # version outlives the counting of other rows' chains (priced every round of `auto`)
        self._row_versions = [0] * rows

    def _depth_rates(self, row: int) -> tuple[list[float], list[float]]:
        """(rates, their logs) at every depth."""
        return self._estimates(row)[:2]

    def _estimates(self, row: int) -> tuple[list[float], list[float], list[float], list[float]]:
        """(rates, their logs, point estimates, trials behind them, pseudo-trials included) per depth."""
        cached = self._rates.get(row)
        if cached is None:  # asked every round of auto, changed by every round that counted a chain
            trials = self.trials[row, 1:].tolist()
            tried = next((d for d in range(len(trials), 0, -1) if trials[d - 1] > 0), 0)  # deepest tried depth
            points, ns, previous, prior = [], [], 0.5, self.prior
            for hits, n in zip(self.hits[row, 1:tried + 1].tolist(), trials[:tried]):
                n += prior
                previous = (hits + prior * previous) / n
                points.append(previous)
                ns.append(n)
            # deeper, untried depths keep the last estimate (shrunk towards the depth above, no counts)
            points += [previous] * (len(trials) - tried)
            ns += [prior] * (len(trials) - tried)
            out = less_one_error(points, [p * (1 - p) / n for p, n in zip(points, ns)])
            cached = self._rates[row] = (out, log_probs(out), points, ns)
        return cached

    def row_version(self, row: int) -> int:
        """Changes whenever row ``row``'s rates may."""
        return self._row_versions[row]

    @property
    def version(self) -> int:
        """Changes whenever any row's rates may (every count grows it)."""
        return sum(self._row_versions)

    def counts(self) -> dict:
        """The counts, as JSON (a resumed replay restores them with :meth:`load_counts`)."""
        return {"hits": self.hits.tolist(), "trials": self.trials.tolist()}

    def load_counts(self, counts: dict) -> None:
        hits, trials = np.asarray(counts["hits"], dtype=float), np.asarray(counts["trials"], dtype=float)
        if hits.shape != self.hits.shape or trials.shape != self.trials.shape:
            raise ValueError(f"lookup calibration counts of shape {hits.shape}, expected {self.hits.shape}")
        self.hits, self.trials = hits, trials
        self._rates.clear()
        self._row_versions = [v + 1 for v in self._row_versions]

    def observe(self, row: int, verified: int, accepted: int) -> None:
        """``verified`` chain tokens were in the verified tree, the first ``accepted`` of them taken."""
        self._rates.pop(row, None)
        self._row_versions[row] += 1
        for d in range(1, min(verified, accepted + 1) + 1):
            self.trials[row, d] += 1
            self.hits[row, d] += d <= accepted
            if self.window is not None and self.trials[row, d] > self.window:
                shrink = self.window / self.trials[row, d]
                self.trials[row, d] *= shrink
                self.hits[row, d] *= shrink


class RequestCalibration(_DepthRates):
    """Lookup rates for one request: its own counts, shrunk towards a pooled calibration's rates.

    How often the target follows a copy depends on the request (a proof that restates the problem's
    expressions, a translation, code edits), and the pooled counts mix every request a decoder
    served, in its running window; so a request whose chains keep failing went on paying for them
    at the pooled price (seen: MATH-500 on llama.cpp, 121 chains of 2.11 nodes emitting 2.01 tokens
    where their verify cost 2.14 steps; docs/results.md, "What a new user hits, fixed"). Each depth's
    rate here is (own hits + k * pooled rate) / (own trials + k), k = ``strength`` pseudo-trials:
    the pooled rate until the request has evidence of its own. Every count goes to both."""

    def __init__(self, pooled: LookupCalibration, strength: float = REQUEST_PRIOR):
        if not strength > 0:
            raise ValueError(f"a request calibration needs strength > 0 (pseudo-trials), got {strength}")
        self.pooled, self.strength = pooled, strength
        self._requests = -1
        self._rates: dict[int, tuple[tuple, list[float], list[float]]] = {}  # row -> (version, rates, logs)
        self.start_request()

    def row_version(self, row: int) -> tuple[int, int, int]:
        """Changes whenever row ``row``'s rates may (what a chain's price is cached on)."""
        return self._requests, self.pooled.row_version(row), self.own.row_version(row)

    def start_request(self) -> None:
        """Forget the own counts: a new request begins."""
        rows, depths = self.pooled.hits.shape
        self.own = LookupCalibration(rows, depths - 1, prior=self.pooled.prior)
        self._requests += 1
        self._rates.clear()

    def observe(self, row: int, verified: int, accepted: int) -> None:
        self.pooled.observe(row, verified, accepted)
        self.own.observe(row, verified, accepted)

    def _depth_rates(self, row: int) -> tuple[list[float], list[float]]:
        version, cached = self.row_version(row), self._rates.get(row)
        if cached is None or cached[0] != version:
            k, (_, _, pooled, pooled_n) = self.strength, self.pooled._estimates(row)
            own = zip(pooled, pooled_n, self.own.hits[row, 1:].tolist(), self.own.trials[row, 1:].tolist())
            points, variances = [], []
            for p, n_pooled, hits, n in own:
                m = (hits + k * p) / (n + k)
                points.append(m)
                variances.append((n * m * (1 - m) + k * k * p * (1 - p) / n_pooled) / (n + k) ** 2)
            rates = less_one_error(points, variances)
            cached = self._rates[row] = (version, rates, log_probs(rates))
        return cached[1], cached[2]


class PendingChains:
    """Lookup chains offered but not yet counted, each as (calibration row, chain, where its first token
    goes: an index into the committed tokens followed by the anchor): chains no verify held (plain
    rounds, trees without them) and chains whose verified part was taken whole. They are counted
    into ``calibration`` once the target's own tokens since have decided them (a token it missed, or
    all of the chain taken), every ``FOLLOW_EVERY`` rounds and when a request ends: greedy
    acceptance is decided by the target's own next tokens, so how far it would have followed a chain
    is known for free (and a sampled token equals a one-token draft with the probability that draft
    is accepted). Without this, a calibration that prices chains (or their deeper tokens) too low to
    be verified would never see them again, and featureless requests, which verify no head tree,
    would never learn it. Decoding (:class:`MixedDrafter`) and its offline replay share it."""

    def __init__(self, calibration: LookupCalibration | RequestCalibration):
        self.calibration, self.chains, self.rounds = calibration, [], 0

    def add(self, row: int, chain: list[int], start: int) -> None:
        self.chains.append((row, chain, start))

    def tick(self, tokens, anchor: int) -> None:
        """A round begins (``tokens`` committed, ``anchor`` the target's latest token after them)."""
        self.rounds += 1
        if self.rounds >= FOLLOW_EVERY and self.chains:
            self.follow(tokens, anchor)

    def follow(self, tokens, anchor: int) -> None:
        """Count the chains that ``tokens`` and ``anchor`` decide; keep the others."""
        pending, self.rounds = [], 0
        for row, chain, start in self.chains:
            produced = [int(t) for t in tokens[start:start + len(chain)]]  # the target's tokens where the chain's went
            if start + len(produced) == len(tokens) and len(produced) < len(chain):
                produced.append(int(anchor))  # ... the anchor (its latest token) included
            followed = common_prefix(chain, produced)
            if followed < len(produced) or followed == len(chain):  # a token it missed, or all of it taken
                self.calibration.observe(row, len(chain), followed)
            else:
                pending.append((row, chain, start))
        self.chains = pending

    def observe_verified(self, row: int, chain: list[int], start: int, verified: int, followed: int) -> None:
        """A verify held the chain's first ``verified`` tokens and the target took ``followed``."""
        if verified == 0:  # a tree cut before its first chain node (a small `auto` budget): decided later
            self.add(row, chain, start)
        elif followed == verified < len(chain):
            # All of the verified part was taken and the chain went on past the cut: follow the rest
            # later. Counted only up to the cut, the depths below it would stay untried, priced by the
            # prior alone, and so never verified (seen: code edits whose 10-token chains the target
            # takes whole, cut to 4 nodes round after round; docs/results.md, "Copy-heavy requests on
            # torch, with few-row products").
            self.add(row, chain, start)
        else:
            self.calibration.observe(row, verified, followed)


class MixedProposal:
    def __init__(self, primary, root: int, chain: list[int], chain_logq: list[float], scores_key=None):
        """``chain_logq[d-1]``: estimated log P(chain token d accepted | token d-1 accepted).
        ``primary``: the head's proposal, or None for the lookup chain alone (a round without a head
        forward). ``scores_key``: equal keys promise equal ``chain_logq`` (what a budget may cache
        its price on)."""
        self.primary, self.root, self.chain = primary, root, chain
        self.chain_logq, self.scores_key = chain_logq, scores_key

    def scores(self) -> list[float]:
        """The lookup chain alone as a tree's scores: root 0, then cumulative log P of acceptance."""
        return list(itertools.accumulate(self.chain_logq, initial=0.0))

    def tree(self, budget: int) -> DraftTree:
        """``budget`` nodes (fewer if both run out), parents before children: the head's nodes in the
        head's best-first order, each valued at its merged parent's value plus its own log q, and the
        chain's next token taken whenever its value beats the head's next node's. A chain token the
        head already took is passed at once, so the chain goes on from that node's value.

        Not strictly best first where a chain token raises a head node: the head's nodes below it
        keep their place in the head's order rather than overtake the head's earlier ones (strict
        best-first over both was measured 0.6% behind at budget 16 and 0.2% at 64; docs/results.md,
        "How the lookup chain is merged"). Each step depends only on the ones before it and the
        head's trees are prefixes of each other, so every budget's tree is a prefix of a larger
        one's (what decoding/budget.py prices)."""
        base = self.primary.tree(budget) if self.primary is not None else DraftTree.root_only(self.root)
        if not self.chain:
            return base
        tree = DraftTree.root_only(self.root)
        where = [0] * len(base)  # base node -> node in the merged tree
        i, j, at = 1, 0, 0  # next base node, next chain token, merged node the chain has reached
        while len(tree) - 1 < budget and (i < len(base) or j < len(self.chain)):
            head_value = (tree.scores[where[base.parents[i]]] + base.scores[i] - base.scores[base.parents[i]]
                          if i < len(base) else -math.inf)
            chain_value = tree.scores[at] + self.chain_logq[j] if j < len(self.chain) else -math.inf
            if head_value >= chain_value:
                parent, token, value = where[base.parents[i]], base.tokens[i], head_value
            else:
                parent, token, value = at, self.chain[j], chain_value
            node = tree.children[parent].get(token)
            if node is None:
                node = tree.add(token, parent, value)
            if head_value >= chain_value:
                where[i], i = node, i + 1
            else:
                at, j = node, j + 1
            # The head took the chain's next token: go on below it now, not once the chain's own
            # (lower) value of that token would have come up.
            while j < len(self.chain) and self.chain[j] in tree.children[at]:
                at, j = tree.children[at][self.chain[j]], j + 1
        return tree


class MixedDrafter:
    """A head's drafter with prompt lookup merged into its trees (the :class:`Drafter` interface)."""

    def __init__(self, primary, target, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_CHAIN,
                 request_prior: float | None = REQUEST_PRIOR, pooled: LookupCalibration | None = None):
        """``request_prior``: chains priced per request (:class:`RequestCalibration`, with that many
        pseudo-trials of the pooled rates); None: by the pooled counts alone. ``pooled``: the pooled
        counts to share (a fork's: its template's); None: counts of its own."""
        self.primary, self.target = primary, target
        self.head, self.block_size = primary.head, primary.block_size
        self.int8, self.lookup = getattr(primary, "int8", False), True  # (what the cost cache is keyed on)
        self.max_ngram, self.max_draft, self.request_prior = max_ngram, max_draft, request_prior
        # pooled over requests (one decoder's in turn, or a batch's side by side)
        self.calibration = pooled if pooled is not None else LookupCalibration(MATCH_ROWS, max_draft, window=LOOKUP_WINDOW)
        # what prices chains and counts them into the pooled calibration
        self.rates = self.calibration if request_prior is None else RequestCalibration(self.calibration, request_prior)
        # (calibration row, chain, where its first token goes) of the latest proposal, until a verify
        # that held it is observed
        self._last: tuple[int, list[int], int] | None = None
        self._pending = PendingChains(self.rates)
        self._anchor: int | None = None  # the latest proposal's anchor
        self.index = LookupIndex(max_ngram)  # n-grams of the target's committed tokens

    def fork(self, target) -> "MixedDrafter":
        """The same for another sequence (a batch's request): the head drafter forked, the pooled
        lookup counts shared, so a batching server learns from every request it served as a
        single stream does; the request's own counts are its own."""
        return MixedDrafter(self.primary.fork(target), target, self.max_ngram, self.max_draft, self.request_prior,
                            pooled=self.calibration)

    def reset(self) -> None:
        if self._pending.chains:  # the last batch, counted against the tokens the latest proposal saw
            self._pending.follow(self.index.tokens, self._anchor)
        self.primary.reset()
        self._last, self._anchor = None, None
        if isinstance(self.rates, RequestCalibration):
            self.rates.start_request()
        self._pending = PendingChains(self.rates)
        self.index = LookupIndex(self.max_ngram)

    def extend(self, features: torch.Tensor) -> None:
        self.primary.extend(features)

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None,
                primary=None) -> MixedProposal:
        """``primary``: the head's proposal when it was already made (batched drafting)."""
        if primary is None:
            primary = self.primary.propose(anchor, position, room, width, max_nodes)
        return self._proposal(anchor, primary, *self._lookup(anchor, room))

    def propose_lookup(self, anchor: int, room: int) -> MixedProposal | None:
        """The lookup chain alone, no head forward (None without a match). Its tree's scores are the
        calibrated log-probabilities of each chain token being accepted, which is what lets a budget
        weigh a round of it against a drafted round (decoding/budget.py, ``chain_offer``)."""
        row, chain = self._lookup(anchor, room)
        return self._proposal(anchor, None, row, chain) if chain else None

    def _proposal(self, anchor: int, primary, row: int, chain: list[int]) -> MixedProposal:
        cal = self.rates  # a chain's rates depend on its row and length, not its tokens
        return MixedProposal(primary, int(anchor), chain, cal.log_rates(row, len(chain)),
                             scores_key=(id(cal), cal.row_version(row), row, len(chain)))

    def _lookup(self, anchor: int, room: int) -> tuple[int, list[int]]:
        """This round's lookup match (calibration row, chain), with the bookkeeping of offered chains."""
        tokens, anchor = self.target.token_ids, int(anchor)
        if self._last is not None and self._last[2] != len(tokens) + 1:  # a past round's, no verify held it
            self._pending.add(*self._last)
            self._last = None
        self._pending.tick(tokens, anchor)
        self.index.sync(tokens)
        self._anchor = anchor
        length, chain = self.index.match(anchor, min(self.max_draft, room))
        row = match_row(length)
        self._last = (row, chain, len(tokens) + 1) if chain else None
        return row, chain

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """Count how far the target followed the lookup chain, where the verified tree held it."""
        self.primary.observe(tree, path)
        if self._last is None:
            return
        row, chain, start = self._last
        node, verified = 0, 0
        for token in chain:
            node = tree.children[node].get(token)
            if node is None:
                break
            verified += 1
        self._pending.observe_verified(row, chain, start, verified, chain_followed(chain, tree, path))
        self._last = None
