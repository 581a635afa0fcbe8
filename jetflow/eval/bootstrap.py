"""How sure a measured speed-up is: a paired bootstrap over prompts.

On a shared CPU the same plain requests vary by 0.8-1.2x from one run to the next, so a set's
speed-up of 0.97x or 1.03x over 20 prompts may be no speed-up at all. Resampling prompts (with
their turns, and the reference's times for the same prompts) and recomputing the ratio of totals
each time gives a percentile interval for it.
"""

from __future__ import annotations

import random
from collections import defaultdict


def speedup_interval(records: list[dict], reference: list[dict], confidence: float = 0.95,
                     resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """Percentile interval of tokens/s(records) / tokens/s(reference), prompts resampled with
    replacement; turns are paired with the reference's by (id, turn). None with fewer than two
    paired prompts."""
    ref = {(r["id"], r["turn"]): r for r in reference}
    per_prompt = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # id -> tokens, seconds, ref tokens, ref seconds
    for r in records:
        if (k := (r["id"], r["turn"])) in ref:
            sums = per_prompt[r["id"]]
            sums[0] += r["new_tokens"]
            sums[1] += r["seconds"]
            sums[2] += ref[k]["new_tokens"]
            sums[3] += ref[k]["seconds"]
    prompts = list(per_prompt.values())
    if len(prompts) < 2:
        return None
    rng, ratios = random.Random(seed), []
    for _ in range(resamples):
        tokens = seconds = ref_tokens = ref_seconds = 0.0
        for t, s, rt, rs in rng.choices(prompts, k=len(prompts)):
            tokens, seconds, ref_tokens, ref_seconds = tokens + t, seconds + s, ref_tokens + rt, ref_seconds + rs
        if seconds > 0 and ref_tokens > 0:  # (tokens / seconds) / (ref_tokens / ref_seconds)
            ratios.append(tokens * ref_seconds / (seconds * ref_tokens))
    ratios.sort()
    tail = (1 - confidence) / 2
    return ratios[int(tail * (len(ratios) - 1))], ratios[round((1 - tail) * (len(ratios) - 1))]
