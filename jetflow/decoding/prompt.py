"""Prompt text -> token ids, with the model's chat template when asked for."""

from __future__ import annotations

from jetflow.errors import InvalidRequestError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_unicode(text: str, what: str) -> None:
    """InvalidRequestError when ``text`` holds an unpaired UTF-16 surrogate (a valid JSON escape, and
    what a client that cuts an emoji in half sends): tokenizers refuse such strings."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode: an unpaired surrogate at character {e.start}") from None


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``: a string, or a list of chat messages ({"role", "content"}).

    ``chat=None`` applies the chat template when the tokenizer has one (strings become one user
    turn); ``chat=False`` encodes a string as raw text.
    """
    messages = prompt if isinstance(prompt, list) else None
    if messages is None:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        if not prompt.strip():
            raise InvalidRequestError("empty prompt")
    elif not messages:
        raise InvalidRequestError("messages must not be empty")
    if messages is None:
        check_unicode(prompt, "the prompt")
    use_chat = has_chat_template(tokenizer) if chat is None else chat
    if messages is not None and not use_chat:
        raise InvalidRequestError("chat messages need chat=True (got chat=False)" if chat is False
                                  else "chat messages need a tokenizer with a chat template")
    if use_chat:
        if not has_chat_template(tokenizer):
            raise InvalidRequestError("this model's tokenizer has no chat template; use chat=False / --no-chat")
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError("each chat message needs string fields 'role' and 'content'")
            check_unicode(m["content"], f"message {i}'s content")
        text = render_chat(tokenizer, messages)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The chat template applied to ``messages``, with the generation prompt. A template that refuses
    them (a system message where the model has none, roles that do not alternate) raises
    InvalidRequestError with its own words, not a template engine's traceback."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:
        raise InvalidRequestError(f"the model's chat template refused these messages: {e}") from None


def stop_token_ids(tokenizer, model_config=None) -> set[int]:
    """EOS ids of the tokenizer and of the model's generation config."""
    ids = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(model_config, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids
