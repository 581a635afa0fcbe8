"""Tree calibration: a head's draft log-probability turned into the probability that the target
accepts the node, so that best-first building spends the budget by expected acceptance.

A block head gives each depth one distribution for every path (a marginal over paths). Measured on
held-out data, given that the node's parent was accepted, that probability is close to the target's
acceptance rate along the head's most likely path, and too high under other branches: there the
depth's top tokens mostly belong to the continuation of the main path. So the map is fitted per
depth and per kind of parent (on the all-top-1 chain or not), each a monotone (isotonic) curve over
the draft log-probability. Acceptance never reads the scores, so a calibrated tree is verified as
losslessly as any other; the map only decides which nodes a budget buys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Pooled (flat) stretches of an isotonic fit would tie; a small share of the draft log-probability
# keeps the map strictly increasing, so the top-w order of a depth is the head's own.
TIE_SLOPE = 1e-3
MIN_BIN = 200  # samples per bin of the fit
MAX_BINS = 30


@dataclass
class Curve:
    """Piecewise-linear log acceptance over draft log-probability: knots ``log_probs`` (increasing)
    with values ``log_accept`` (non-decreasing, <= 0). Below the first knot it falls with slope 1."""
    log_probs: list[float]
    log_accept: list[float]

    def __call__(self, lp: float) -> float:
        xs, ys = self.log_probs, self.log_accept
        if lp <= xs[0]:
            value = ys[0] + (lp - xs[0])
        else:
            value = float(np.interp(lp, xs, ys))
        return min(0.0, value + TIE_SLOPE * lp)


@dataclass
class TreeCalibration:
    main: list[Curve]  # [d-1]: children at depth d of a node on the all-top-1 chain (the root included)
    off_main: list[Curve]  # [d-1]: children of any other node
    samples: int = 0  # candidates the fit saw

    def __post_init__(self):
        if not self.main or len(self.main) != len(self.off_main):
            raise ValueError("tree calibration needs one curve per depth for both kinds of parent")
        for curve in [*self.main, *self.off_main]:
            xs, ys = curve.log_probs, curve.log_accept
            if not xs or len(xs) != len(ys):
                raise ValueError("a calibration curve needs as many values as knots (at least one)")
            if any(b <= a for a, b in zip(xs, xs[1:])) or any(b < a for a, b in zip(ys, ys[1:])):
                raise ValueError("a calibration curve must have increasing knots and non-decreasing values")
            if max(ys) > 0 or not all(math.isfinite(v) for v in [*xs, *ys]):
                raise ValueError("calibration values are log-probabilities: finite and <= 0")

    def score(self, depth: int, parent_on_main: bool, log_prob: float) -> float:
        """Log-probability that a depth-``depth`` node is accepted given its parent was; depths past
        the fitted ones use the deepest curve."""
        curves = self.main if parent_on_main else self.off_main
        return curves[min(depth, len(curves)) - 1](log_prob)

    def to_json(self) -> dict:
        def pack(curves):
            return [[c.log_probs, c.log_accept] for c in curves]
        return {"main": pack(self.main), "off_main": pack(self.off_main), "samples": self.samples}

    @classmethod
    def from_json(cls, d: dict) -> "TreeCalibration":
        try:
            def unpack(rows):
                return [Curve([float(x) for x in xs], [float(y) for y in ys]) for xs, ys in rows]
            return cls(unpack(d["main"]), unpack(d["off_main"]), int(d.get("samples", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid tree_calibration: {e}") from None


def candidate_records(top_lp: np.ndarray, top_ids: np.ndarray, continuation: list[int]) -> list[tuple]:
    """Fitting records of one anchor: every top-w candidate whose parent lies on the true path, as
    (depth, parent on the all-top-1 chain, draft log-prob, accepted). ``top_lp``/``top_ids`` [D, w]
    are each depth's top-w; ``continuation`` the tokens the target produced after the anchor. The
    walk stops where the true token falls outside a depth's top-w (no deeper node has its parent
    in the tree)."""
    records, on_main = [], True
    for d, token in enumerate(continuation[:len(top_ids)]):
        ids = list(top_ids[d])
        records += [(d + 1, on_main, float(top_lp[d][r]), ids[r] == token) for r in range(len(ids))]
        if token not in ids:
            break
        on_main = on_main and ids[0] == token
    return records


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Pool adjacent violators: the non-decreasing sequence closest to ``values`` (weighted)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            b = blocks.pop()
            a = blocks[-1]
            a[0], a[1], a[2] = (a[0] * a[1] + b[0] * b[1]) / (a[1] + b[1]), a[1] + b[1], a[2] + b[2]
    return [v for v, _, n in blocks for _ in range(n)]


def fit_curve(log_probs: np.ndarray, accepted: np.ndarray) -> Curve:
    """Equal-count bins over the draft log-probability, each bin's acceptance rate (with half a
    pseudo-count each way, so no bin reads 0 or 1), made monotone. Knots are the bins' mean log-probs."""
    order = np.argsort(log_probs, kind="stable")
    lp, acc = np.asarray(log_probs, dtype=np.float64)[order], np.asarray(accepted, dtype=np.float64)[order]
    bins = max(1, min(MAX_BINS, len(lp) // MIN_BIN))
    parts = [p for p in np.array_split(np.arange(len(lp)), bins) if len(p)]
    xs = [float(lp[p].mean()) for p in parts]
    rates = _isotonic([(acc[p].sum() + 0.5) / (len(p) + 1) for p in parts], [float(len(p)) for p in parts])
    keep = [i for i in range(len(xs)) if i == 0 or xs[i] > xs[i - 1]]  # bins of equal mean: keep the first
    return Curve([xs[i] for i in keep], [math.log(rates[i]) for i in keep])


def fit_calibration(records: list[tuple], depths: int) -> TreeCalibration:
    """One curve per depth 1..``depths`` and kind of parent from :func:`candidate_records`' records.
    A cell with fewer than MIN_BIN records borrows the curve above it (same kind of parent), or
    the other kind's at the same depth; with none at all the fit is refused."""
    if not records:
        raise ValueError("no calibration records: the held-out sequences have no answer tokens")
    arr = np.array([(d, m, lp, a) for d, m, lp, a in records], dtype=np.float64)
    curves: dict[tuple[int, bool], Curve] = {}
    for main in (True, False):
        for d in range(1, depths + 1):
            sel = (arr[:, 0] == d) & (arr[:, 1] == float(main))
            if sel.sum() >= MIN_BIN:
                curves[(d, main)] = fit_curve(arr[sel, 2], arr[sel, 3])
            elif (d - 1, main) in curves:
                curves[(d, main)] = curves[(d - 1, main)]
    for d in range(1, depths + 1):
        for main in (True, False):
            if (d, main) not in curves:
                other = curves.get((d, not main))
                if other is None:
                    raise ValueError(f"too few calibration records at depth {d} (need {MIN_BIN}): "
                                     "calibrate on more held-out sequences")
                curves[(d, main)] = other
    return TreeCalibration([curves[(d, True)] for d in range(1, depths + 1)],
                           [curves[(d, False)] for d in range(1, depths + 1)], samples=len(records))


def reliability(records: list[tuple], depths: int) -> list[dict]:
    """Per depth and kind of parent: candidates, their mean draft probability and how many the
    target accepted -- how far the head's own probabilities are from acceptance, before any fit."""
    rows = []
    for d in range(1, depths + 1):
        for main in (True, False):
            cell = [(math.exp(lp), a) for dd, m, lp, a in records if dd == d and bool(m) == main]
            if cell:
                rows.append({"depth": d, "parent_on_main": main, "candidates": len(cell),
                             "mean_draft_prob": sum(p for p, _ in cell) / len(cell),
                             "accept_rate": sum(a for _, a in cell) / len(cell)})
    return rows
