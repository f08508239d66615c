"""User-facing error types: each carries one sentence that names what to fix.

The CLI prints ``error: <message>`` for any :class:`MegatrainError` and exits non-zero without a
traceback; anything else is a bug and keeps its traceback.
"""


class MegatrainError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""


class ConfigError(MegatrainError):
    """The configuration is invalid; the message names the offending key."""


class PipelineError(MegatrainError):
    """An actor of the training pipeline died or timed out; the message names the role."""


class DataError(MegatrainError):
    """The dataset cannot be read or is too small for the requested batches."""
