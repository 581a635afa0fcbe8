"""Exceptions with messages meant for users: the CLI prints them without a traceback."""


class JetFlowError(Exception):
    """Base class of every error JetFlow raises on purpose."""


class ModelResolutionError(JetFlowError):
    """A model spec (short name, directory, .gguf file, hub id) could not be turned into a model."""


class InvalidRequestError(JetFlowError, ValueError):
    """Bad generation input: empty prompt, prompt too long, sampling parameters out of range, ..."""


def check_max_new_tokens(value) -> None:
    """InvalidRequestError unless ``value`` is an integer >= 1 (bools refused: True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {value!r}")


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line (third-party messages run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class RequestSupersededError(JetFlowError):
    """A stream of a JetFlow was resumed after a newer request had started on it."""
