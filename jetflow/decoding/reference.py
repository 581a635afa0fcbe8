"""A speculative generation together with plain autoregressive decoding of the same request: the
reference it must equal token for token (lossless), and the speed it is compared with."""

from __future__ import annotations

from collections.abc import Callable

from jetflow.decoding.api import generate as autoregressive_generate
from jetflow.decoding.result import GenerationResult


def generate_with_reference(jf, prompt, *, reference: bool, on_delta: Callable[[str], None] | None = None,
                            **request) -> tuple[GenerationResult, GenerationResult | None]:
    """Run :class:`jetflow.JetFlow` ``jf`` on the request, handing each text delta to ``on_delta``;
    with ``reference``, then decode it autoregressively on the same target. Returns both results
    (the reference None without ``reference``)."""
    result = None
    for event in jf.stream(prompt, **request):
        if isinstance(event, str):
            if on_delta is not None:
                on_delta(event)
        else:
            result = event
    if not reference:
        return result, None
    jf.target.reset()  # the reference prefills the prompt in full too, not from the run's cached cells
    return result, autoregressive_generate(jf.target, prompt, **request)
