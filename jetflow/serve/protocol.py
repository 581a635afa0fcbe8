"""Request parsing for the OpenAI-compatible endpoints: raw body -> a validated :class:`GenerationRequest`.

Every rule names the offending field, so a client sees exactly what to fix (HTTP 400), and nothing
reaches the model unless it is well-formed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from jetflow.decoding.prompt import check_unicode
from jetflow.decoding.sampling import SEED_RANGE
from jetflow.errors import InvalidRequestError
from jetflow.serve.errors import APIError, bad_request

MAX_STOP_STRINGS = 4  # as OpenAI
# OpenAI parameters this server does not implement, with the values that leave a response unchanged:
# any other value is refused (400) rather than silently ignored.
UNSUPPORTED = {"echo": (False,), "logprobs": (False,), "top_logprobs": (0,), "best_of": (1,), "suffix": ("",),
               "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "tools": ([],),
               "functions": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
               "response_format": ({"type": "text"},), "modalities": (["text"],)}


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str
    prompt: str | list[dict]  # completion text, or chat messages
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's; vLLM's and llama.cpp's servers take it too (0: off)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    limit_name: str = "max_tokens"  # which field gave max_tokens (newer clients send max_completion_tokens)


def parse_body(raw: bytes, max_bytes: int) -> dict:
    if len(raw) > max_bytes:
        raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # valid JSON that Python will not read: an integer of more than 4,300 digits
        raise bad_request(f"request body could not be read: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                           and not math.isfinite(value)):
        raise bad_request(f"'{name}' must be a number, got {json.dumps(value)}", name)
    if value < low or (low_open and value == low) or value > high:  # (exact for any int: no float conversion)
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad_request(f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _text(value: str, name: str, param: str) -> str:
    """``value``, refused (400 naming ``param``) when it holds an unpaired UTF-16 surrogate."""
    try:
        check_unicode(value, name)
    except InvalidRequestError as e:
        raise bad_request(str(e), param) from None
    return value


def _neutral(value, neutral: tuple) -> bool:
    # exact types: true is not 1 here, nor false 0 (JSON keeps them apart; Python's bool is an int)
    number = (int, float)
    return any(value == v and (type(value) is type(v) or type(value) in number and type(v) in number)
               for v in neutral)


def _unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not _neutral(value, neutral):
            raise bad_request(f"'{name}' is not supported by this server (got {json.dumps(value)})", name)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise bad_request(f"messages[{i}] needs a 'role' of system, user, assistant or developer", "messages")
        content = m.get("content")
        if content is None and m["role"] == "assistant":  # an assistant turn that only called tools
            content = ""
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string", "messages")
        _text(content, f"messages[{i}].content", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise bad_request("'messages' must contain a non-empty user message", "messages")
    return out


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (batches of prompts are not supported)", "prompt")
    if not prompt.strip():
        raise bad_request("'prompt' must not be empty", "prompt")
    return _text(prompt, "'prompt'", "prompt")


def parse_request(body: dict, kind: str, models: set[str]) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    if model not in models:
        raise APIError(404, f"The model {ascii(model)} does not exist; this server has: {', '.join(sorted(models))}",
                       param="model", code="model_not_found")
    _unsupported(body)
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, limit_name)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{limit_name}' must be >= 1, got {max_tokens}", limit_name)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise bad_request(f"only n=1 is supported, got n={n}", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    for i, s in enumerate(stop):
        _text(s, f"stop[{i}]", "stop")
    stream = body.get("stream")
    stream = False if stream is None else stream  # null is the default, as for every other parameter
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request(f"'stream_options.include_usage' must be a boolean, got {json.dumps(include_usage)}",
                          "stream_options")
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(0, _integer(body, "top_k", -1, 2**31 - 1) or 0),  # -1 is vLLM's "off"
        stop=stop, seed=_integer(body, "seed", *SEED_RANGE), stream=stream, include_usage=include_usage,
        limit_name=limit_name)
