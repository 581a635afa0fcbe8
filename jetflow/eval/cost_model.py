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

import statistics
import time

import torch

from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.models.target import TargetModel
from jetflow.tree.build import build_tree


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _random_tree(n: int, generator: torch.Generator) -> list[int]:
    """Parents of a random tree of n nodes rooted at node 0 (node i hangs under an earlier node)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


@torch.inference_mode()
def measure_costs(target: TargetModel, budgets: list[int], drafter: BlockDrafter | None = None,
                  context: int = 256, reps: int = 5, width: int = 7) -> dict:
    """Median milliseconds of: a one-token target step (``c1_ms``), verifying a tree of each budget's
    size (``verify_ms[n]``, n draft nodes + root), and drafting a tree of each budget (``draft_ms[n]``,
    head forward + tree build; empty without a drafter), all after a ``context``-token prefix."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (context,), generator=g).tolist()
    pre = target.prefill(prefix, return_hidden=drafter is not None)
    if drafter is not None:
        drafter.reset()
        drafter.extend(pre.hidden)
    root = prefix[-1]
    c1 = _median_ms(lambda: target.verify([root], [-1], return_hidden=False), reps)
    verify_ms, draft_ms = {}, {}
    for n in budgets:
        parents = _random_tree(n + 1, g)
        tokens = torch.randint(0, target.vocab_size, (n + 1,), generator=g).tolist()
        verify_ms[n] = _median_ms(lambda: target.verify(tokens, parents, return_hidden=drafter is not None), reps)
        if drafter is not None:
            draft_ms[n] = _median_ms(
                lambda: build_tree(drafter.depth_logprobs(root, target.past_len), root, n, width), reps)
    target.reset()
    return {"context": context, "reps": reps, "c1_ms": c1, "verify_ms": verify_ms,
            "verify_ratio": {n: v / c1 for n, v in verify_ms.items()}, "draft_ms": draft_ms}


def speedup_bound(tau: float, costs: dict, budget: int, draft_ms: float | None = None) -> float:
    """tau * c(1) / (c_draft + c(n + 1)) for a budget measured by :func:`measure_costs`."""
    draft = costs["draft_ms"].get(budget, 0.0) if draft_ms is None else draft_ms
    return tau * costs["c1_ms"] / (draft + costs["verify_ms"][budget])
