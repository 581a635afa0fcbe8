"""Exceptions with messages meant for users: the CLI prints them without a traceback."""


class JetFlowError(Exception):
    """Base class of every error JetFlow raises on purpose."""


class ModelResolutionError(JetFlowError):
    """A model spec (short name, directory, .gguf file, hub id) could not be turned into a model."""


class InvalidRequestError(JetFlowError, ValueError):
    """Bad generation input: empty prompt, prompt too long, sampling parameters out of range, ..."""


class RequestSupersededError(JetFlowError):
    """A stream of a JetFlow was resumed after a newer request had started on it."""
