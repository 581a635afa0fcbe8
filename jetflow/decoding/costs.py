"""The cost model behind a speed-up: how much one round costs relative to one plain decoding step.

A round drafts (one head forward + tree build) and verifies a tree of n draft nodes plus the root
(n + 1 tokens) in one target forward. With c(k) the time of a target forward over k tokens at a
given context length, and tau tokens per round, the best speed-up a round can give is

    bound(n) = tau * c(1) / (c_draft + c(n + 1))

(other per-round work -- acceptance, cache commits, Python -- only lowers it). Measuring c and
c_draft on the machine shows how far a measured speed-up is from what its tau allows, and why a
bigger budget stops paying off where c(n) grows steeply (CPUs) rather than staying flat (GPUs).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from jetflow.decoding.drafter import Drafter
from jetflow.models.backend import TargetBackend
from jetflow.utils.timing import median_ms  # noqa: F401  (benchmarks import it from here)


def _random_tree(n: int, generator: torch.Generator) -> list[int]:
    """Parents of a random tree of n nodes rooted at node 0 (node i hangs under an earlier node)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


@torch.inference_mode()
def measure_costs(target: TargetBackend, budgets: list[int], drafter: Drafter | None = None,
                  context: int = 256, reps: int = 5, width: int = 7) -> dict:
    """Median milliseconds of: a one-token target step (``c1_ms``), verifying a tree of each budget's
    size (``verify_ms[n]``, n draft nodes + root), and drafting a tree of each budget (``draft_ms[n]``,
    the head's forward over a round's newly committed features and the tree build; empty without a
    drafter), all after a ``context``-token prefix (and, with a drafter, up to 2 * (reps + 1) tokens
    committed after it). A twin of the drafter is timed, so the drafter is left as it was (one that
    cannot fork, EAGLE's head drafter, is timed itself and left reset to the measurement's context;
    the loop resets it before a request); lookup counts are always the twin's own.

    Each rep of a size also times a one-token step right before its verify, and ``verify_ms[n]`` is
    the median of those reps' own ratios times ``c1_ms``: a machine whose speed drifts while the
    sizes are measured one after another (seen here: a third within minutes) moves a size's verify
    and its paired step alike, where a ratio to the one step timed at the start moved with it."""
    g = torch.Generator().manual_seed(0)
    twin = None
    if drafter is not None:
        target.set_tapped_layers(drafter.head.config.target_layer_ids)
        twin = _scratch_twin(drafter, target)
    prefix = torch.randint(0, target.vocab_size, (context,), generator=g).tolist()
    target.prefill(prefix, return_hidden=False)
    root = prefix[-1]
    # As the loop runs them: with a drafter every forward returns features (a plain round's too).
    step = lambda: target.verify([root], [-1], return_hidden=drafter is not None)  # noqa: E731
    c1 = median_ms(step, reps)
    verify_ms, draft_ms = {}, {}
    for n in budgets:
        parents = _random_tree(n + 1, g)
        tokens = torch.randint(0, target.vocab_size, (n + 1,), generator=g).tolist()
        if twin is None:
            ratio = _paired_ratio(lambda: target.verify(tokens, parents, return_hidden=False), step, reps)
        else:
            ratio, draft_ms[n] = _verify_then_draft_ms(target, twin, prefix, tokens, parents, n, width, reps, g)
        verify_ms[n] = ratio * c1
    # Once more at the end: a machine whose speed moved during the curve shows it here.
    target.prefill(prefix, return_hidden=False)
    c1_after = median_ms(step, reps)
    target.reset()
    return {"context": context, "reps": reps, "c1_ms": c1, "c1_after_ms": c1_after, "verify_ms": verify_ms,
            "verify_ratio": {n: v / c1 for n, v in verify_ms.items()}, "draft_ms": draft_ms}


def _after_step(step, fn) -> tuple[float, object]:
    """fn()'s time over the time of a ``step()`` run right before it, and what fn returned."""
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t1) / (t1 - t0), out


def _paired_ratio(fn, step, reps: int) -> float:
    """Median over ``reps`` of :func:`_after_step` (after one warm-up of each)."""
    step()
    fn()
    return statistics.median(_after_step(step, fn)[0] for _ in range(reps))


def _verify_then_draft_ms(target: TargetBackend, drafter: Drafter, prefix: list[int], tokens: list[int],
                          parents: list[int], n: int, width: int, reps: int, g: torch.Generator) -> tuple[float, float]:
    """The median ratio of a verify of the tree (tokens, parents) to a one-token step timed right
    before it at the same position (the verify replaces it), and the median ms of a draft of n nodes, each draft as
    the loop runs it: right after a verify (whose weights then fill the CPU's caches), projecting the
    features of the tokens that verify committed (its root and first node: node 1 always hangs under
    the root), from a fresh anchor (the round's bonus token). Timed back to back on a warm head with
    nothing to project, a draft took about 0.6 of its time in decoding (llama.cpp, SmolLM2's head, one
    node: 2.2 ms against 3.9 ms), which made drafting look cheap. The drafter's features are handed over outside
    the timing, as the loop hands them over in its commit."""
    pre = target.prefill(prefix, return_hidden=True)  # back to the prefix: every size at one context
    drafter.reset()
    drafter.extend(pre.hidden)
    ratios, draft_t = [], []
    for rep in range(reps + 1):  # the first, a warm-up, also projects the prefix
        ratio, out = _after_step(lambda: target.verify(tokens[:1], [-1], return_hidden=True),
                                 lambda: target.verify(tokens, parents, return_hidden=True))
        ratios.append(ratio)
        target.commit([0, 1])
        drafter.extend(out.hidden[:2])
        anchor = int(torch.randint(0, target.vocab_size, (1,), generator=g))
        t0 = time.perf_counter()
        drafter.propose(anchor, target.past_len, target.max_context - target.past_len - 1, width, max_nodes=n).tree(n)
        draft_t.append(time.perf_counter() - t0)
    return statistics.median(ratios[1:]), statistics.median(draft_t[1:]) * 1e3


def _scratch_twin(drafter: Drafter, target: TargetBackend) -> Drafter:
    """A drafter to time in place of ``drafter``: the same weights, a context of its own, and for a
    drafter with prompt lookup, lookup counts of its own (the timed rounds' made-up tokens must not
    count as chains the target followed)."""
    from jetflow.decoding.mixed_drafter import MixedDrafter

    if isinstance(drafter, MixedDrafter):
        return MixedDrafter(_scratch_twin(drafter.primary, target), target, drafter.max_ngram, drafter.max_draft,
                            drafter.request_prior)
    return drafter.fork(target) if hasattr(drafter, "fork") else drafter


def disturbance(costs: dict, tolerance: float = 1.5) -> str | None:
    """Why a measured cost curve looks disturbed by other load on the machine, or None. Noise only
    adds time, so a bigger tree measured cheaper than a smaller one by more than ``tolerance``, or
    the one-token step timed at the start and at the end differing by as much, means the machine
    was busy during the measurement (seen: a cached curve with a 3-token verify at 3,556 ms and a
    9-token one at 415 ms, and a one-token step at 73 ms that takes 13 ms idle)."""
    c1, after = costs["c1_ms"], costs.get("c1_after_ms")
    if after is not None and max(c1, after) > tolerance * min(c1, after):
        return f"one-token step {c1:.1f} ms at the start, {after:.1f} ms at the end"
    for name in ("verify_ms", "draft_ms"):
        points, least = costs.get(name) or {}, float("inf")
        for n in sorted(points, reverse=True):
            if points[n] > tolerance * least:
                return f"{name}[{n}] = {points[n]:.1f} ms, above a bigger size's {least:.1f} ms"
            least = min(least, points[n])
    return None


def least_costs(runs: list[dict]) -> dict:
    """Several measurements of one curve merged point by point, each the least time measured
    (timing noise only adds time)."""
    def least(name: str) -> dict:
        return {n: min(r[name][n] for r in runs) for n in runs[0][name]}

    c1 = min(min(r["c1_ms"], r.get("c1_after_ms", r["c1_ms"])) for r in runs)
    verify_ms = least("verify_ms")
    return {**runs[0], "c1_ms": c1, "c1_after_ms": c1, "verify_ms": verify_ms, "draft_ms": least("draft_ms"),
            "verify_ratio": {n: v / c1 for n, v in verify_ms.items()}, "attempts": len(runs)}


def speedup_bound(tau: float, costs: dict, budget: int, draft_ms: float | None = None) -> float:
    """tau * c(1) / (c_draft + c(n + 1)) for a budget measured by :func:`measure_costs`."""
    draft = costs["draft_ms"].get(budget, 0.0) if draft_ms is None else draft_ms
    return tau * costs["c1_ms"] / (draft + costs["verify_ms"][budget])


def _interpolate(points: dict, n: float) -> float:
    """Piecewise-linear through the measured (size, ms) points, extended linearly past the ends."""
    xs = sorted(points)
    ys = [points[x] for x in xs]
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < n:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def _monotone(points: dict) -> dict:
    """Each size's time lowered to the least time measured at that size or above. A bigger tree
    costs at least as much as a smaller one, and timing noise on a busy machine only adds time, so
    a smaller size measured dearer than a bigger one was disturbed (seen: 3 nodes 194 ms, 8 nodes
    147 ms), and such a bump would otherwise make the budget avoid the sizes below it."""
    out, least = {}, float("inf")
    for n in sorted(points, reverse=True):
        least = min(least, points[n])
        out[n] = least
    return dict(sorted(out.items()))


class CostCurve:
    """Milliseconds of a round's parts as functions of the budget, from :func:`measure_costs`."""

    def __init__(self, costs: dict):
        self.costs = costs
        self.c1_ms = costs["c1_ms"]
        self._verify, self._draft = _monotone(costs["verify_ms"]), _monotone(costs["draft_ms"])

    def verify_ms(self, budget: int) -> float:
        return _interpolate(self._verify, budget)

    def draft_ms(self, budget: int) -> float:
        return _interpolate(self._draft, budget) if self._draft else 0.0

    def round_ms(self, budget: int) -> float:
        return self.draft_ms(budget) + self.verify_ms(budget)


# Every small size: llama.cpp's cost is not a line between two measured sizes. With JetFlow's tiles
# (third_party/llama-cpp-python) 2-3 tokens run one kernel and 4 and more another, and a 17th token goes
# through the one-row kernel alone; with the patch's first version an odd count paid a one-column pass
# for its last token (3 tokens cost about what 4 did).
COST_BUDGETS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 24, 32, 48, 64, 96, 128, 192, 256]

# The modules whose code decides what a verify or a draft costs. A cached curve is keyed by their
# source: a change to a kernel or to the draft path measures it again (seen: a layout fix made a
# 2-token verify 1.5x cheaper, and the curve cached before it still priced that verify at 1.62 steps).
COST_CODE = ("models/few_row_linear.py", "models/int8.py", "models/target.py", "models/layers.py",
             "models/gqa_attention.py", "models/draft_head.py", "models/eagle_head.py", "models/kv_cache.py",
             "models/llamacpp_target.py", "models/llamacpp_draft.py", "models/llamacpp_batch.py",
             "decoding/block_drafter.py", "decoding/refine.py", "decoding/eagle_drafter.py",
             "decoding/mixed_drafter.py", "decoding/lookup_drafter.py", "decoding/costs.py", "tree/build.py",
             "tree/mask.py")


def cost_code_digest(package: Path | None = None) -> str:
    """A digest of the source of the modules in ``COST_CODE`` (of this package, or of ``package``)."""
    root, h = Path(__file__).resolve().parents[1] if package is None else package, hashlib.sha1()
    for name in COST_CODE:
        h.update(name.encode())
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def cached_costs(target: TargetBackend, drafter: Drafter, cache_dir: str | Path, budgets=COST_BUDGETS,
                 context: int = 256, reps: int = 5, width: int = 7, attempts: int = 3, log=None) -> dict:
    """:func:`measure_costs` once per machine, model, dtype, thread count, head shape and version of
    the code that runs them (:func:`cost_code_digest`); later
    calls read ``cache_dir/<key>.json`` (a damaged file is measured again). A measurement that
    looks disturbed (:func:`disturbance`) is repeated, up to ``attempts`` in all, and the attempts
    merged point by point (:func:`least_costs`); a file written before that check existed is
    checked when read and measured again if it fails."""
    from jetflow.eval.machine import cpu_name
    from jetflow.utils.fs import write_json_atomic

    context, budgets = fitting_costs(target, context, reps, budgets)
    c = drafter.head.config
    key = {"target": target.name, "kind": c.kind, "width": width, "device": str(target.device), "dtype": str(target.dtype),
           "threads": torch.get_num_threads(), "cpu": cpu_name(), "layers": c.num_hidden_layers,
           "block_size": c.block_size, "draft_vocab": c.draft_vocab_size if c.reduced_vocab else None,
           "budgets": list(budgets), "context": context, "backend": target.backend,
           "backend_threads": getattr(target, "n_threads", None), "int8": getattr(drafter, "int8", False),
           "attention": c.attention, "code": cost_code_digest()}
    if getattr(target, "linear_form", "standard") != "standard":  # verifies priced as they now run
        key["linear_form"] = target.linear_form
    if target.backend == "llamacpp":  # c1 timed with features on, as the loop's plain rounds run
        key["c1_features"] = True
        from jetflow.models.llamacpp_target import llama_build

        key["cpu_library"] = llama_build()["cpu_library"]  # another build (its kernels), other costs
        if getattr(target, "flash_attn", False):  # another attention kernel, other costs
            key["flash_attn"] = True
    if getattr(drafter, "lookup", False):  # only when set, so costs measured before lookup existed still apply
        key["lookup"] = True
    if getattr(getattr(drafter, "primary", drafter), "refine", False):  # a second head pass per draft
        key["refine"] = True
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"costs-{digest}.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            costs = _int_keys(stored["costs"])
            if stored.get("key") == key and ("attempts" in costs or disturbance(costs) is None):
                return {**costs, "cache_digest": digest}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    if log is not None:  # the first `auto` request on a machine waits for this (under a minute on a 2-core CPU)
        log(f"measuring this machine's verify and draft costs for budget 'auto' (once; cached in {path})")
    runs = []
    while True:
        runs.append(measure_costs(target, list(budgets), drafter, context=context, reps=reps, width=width))
        costs = least_costs(runs)
        reason = disturbance(costs)
        if reason is None or len(runs) >= attempts:
            break
        if log is not None:
            log(f"cost curve looks disturbed ({reason}); measuring again")
    write_json_atomic(path, {"key": key, "costs": costs})
    return {**costs, "cache_digest": digest}  # names the curve (what `auto` learns is kept per curve)


def fitting_costs(target: TargetBackend, context: int, reps: int, budgets) -> tuple[int, list[int]]:
    """The measurement's prefix length and the budgets it can time on ``target``: a prefix of at
    most a quarter of the context, and trees that fit after it and the 2 * (reps + 1) tokens the
    timed drafts commit, and in one verify (llama.cpp's batch). A target with a small context or
    batch is then priced over the sizes it can run (``auto`` chooses among those) instead of failing
    every request in the measurement."""
    context = max(1, min(context, target.max_context // 4))
    room = target.max_context - context - 2 * (reps + 1) - 1  # nodes a tree may have after the prefix
    batch = getattr(target, "n_batch", None)
    if batch is not None:
        room = min(room, batch - 1)
    fitting = [b for b in budgets if b <= room]
    if not fitting:
        raise ValueError(f"budget 'auto' needs a target that verifies a tree of at least {min(budgets) + 1} tokens "
                         f"after a {context}-token prefix; this one's context is {target.max_context} tokens")
    return context, fitting


def _int_keys(costs: dict) -> dict:
    """JSON turns the budget keys into strings; back to ints."""
    return {k: ({int(n): v for n, v in val.items()} if isinstance(val, dict) else val) for k, val in costs.items()}
