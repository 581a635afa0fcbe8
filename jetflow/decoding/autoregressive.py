"""Plain autoregressive decoding on the target runtime: the baseline every speed-up is measured
against, and the reference speculative decoding must reproduce token for token."""

from __future__ import annotations

import time
from collections.abc import Iterator

from jetflow.decoding.output import OutputStream
from jetflow.decoding.result import GenerationResult
from jetflow.decoding.sampling import SamplingParams, next_token
from jetflow.models.backend import TargetBackend


def autoregressive_stream(
    target: TargetBackend, prompt_ids: list[int], params: SamplingParams, output: OutputStream,
    every_round: bool = False,
) -> Iterator[str | GenerationResult]:
    """Yield text deltas as tokens are produced, then the final :class:`GenerationResult`.
    ``every_round``: a delta before every step, empty when no text is final yet (as in
    :func:`~jetflow.decoding.speculative.speculative_stream`)."""
    t0 = time.perf_counter()
    generator = params.make_generator(target.device)
    token = next_token(target.prefill(prompt_ids, return_hidden=False).logits[-1], params, generator)
    cached = target.reused_tokens
    prefill_s = time.perf_counter() - t0
    while True:
        if output.add(token) or target.past_len >= target.max_context:
            output.finish("length")
            break
        if (delta := output.drain()) or every_round:
            yield delta
        if params.greedy:  # the runtime's own plain step: no logits copied out
            token = target.greedy_step(token)
        else:
            token = next_token(target.extend([token]).logits[-1], params, generator)
    if delta := output.drain():
        yield delta
    yield GenerationResult.from_output(output, len(prompt_ids), time.perf_counter() - t0, prefill_s, method="ar",
                                       cached_prompt_tokens=cached)
