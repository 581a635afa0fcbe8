"""The Python API: ``generate`` (a result) and ``stream`` (text deltas, then the result).

Without a drafter these run the target's own autoregressive loop; :class:`jetflow.JetFlow` adds the
speculative decoder on top of the same request handling.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from jetflow.decoding.autoregressive import autoregressive_stream
from jetflow.decoding.output import OutputStream
from jetflow.decoding.prompt import encode_prompt
from jetflow.decoding.result import GenerationResult
from jetflow.decoding.sampling import SamplingParams
from jetflow.errors import InvalidRequestError
from jetflow.models.backend import TargetBackend


REQUEST_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "chat")


def prepare_request(
    target: TargetBackend,
    prompt: str | list[dict] | list[int],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = (),
    chat: bool | None = None,
) -> tuple[list[int], SamplingParams, OutputStream]:
    """Validate a request and turn it into prompt ids, sampling parameters and an output stream.

    ``prompt`` is text (chat template applied when the model has one, unless ``chat=False``), a list
    of chat messages, or a list of token ids used as is. ``stop``: a string, several, or None.
    """
    if isinstance(target, (str, os.PathLike)):
        raise InvalidRequestError(f"expected a loaded target, got the name {str(target)!r}: load it with "
                                  "jetflow.load_target(name), or use jetflow.JetFlow.from_pretrained(name)")
    params = SamplingParams(temperature, top_k, top_p, seed)
    if chat is not None and not isinstance(chat, bool):
        raise InvalidRequestError(f"chat must be True, False or None (the model's default), got {chat!r}")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequestError(f"stop must be a string, a list of strings or None, got {stop!r}")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_ids = list(prompt)
        if any(not 0 <= t < target.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {target.vocab_size})")
    else:
        prompt_ids = encode_prompt(target.tokenizer, prompt, chat)
    if len(prompt_ids) >= target.max_context:
        raise InvalidRequestError(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {target.max_context} tokens"
        )
    output = OutputStream(
        target.tokenizer,
        max_new_tokens=max_new_tokens,
        stop_token_ids=target.stop_token_ids(),
        stop_strings=[] if stop is None else [stop] if isinstance(stop, str) else list(stop),
    )
    # prompt and answer within the context, as the server counts them (OpenAI's rule): "length" there
    output.max_new_tokens = min(output.max_new_tokens, target.max_context - len(prompt_ids))
    return prompt_ids, params, output


def check_request_options(request: dict, also: tuple[str, ...] = ()) -> None:
    """InvalidRequestError naming any keyword that is not a request option (``also``: the caller's
    own keywords, named in the message too)."""
    unknown = sorted(set(request) - set(REQUEST_OPTIONS))
    if unknown:
        raise InvalidRequestError(f"unknown request option(s) {', '.join(unknown)}; the options are "
                                  f"{', '.join(REQUEST_OPTIONS + also)}")


def stream(target: TargetBackend, prompt, **request) -> Iterator[str | GenerationResult]:
    """Autoregressive decoding: yield text deltas, then one :class:`GenerationResult`.
    Keyword arguments as in :func:`prepare_request`."""
    check_request_options(request)
    prompt_ids, params, output = prepare_request(target, prompt, **request)
    return autoregressive_stream(target, prompt_ids, params, output)


def generate(target: TargetBackend, prompt, **request) -> GenerationResult:
    """Run :func:`stream` to the end and return its result."""
    *_, result = stream(target, prompt, **request)
    return result
