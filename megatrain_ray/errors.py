"""User-facing error types, all of them: each carries one sentence that names what to fix.

The CLI prints ``error: <message>`` for any :class:`MegatrainError` and exits non-zero without a
traceback; anything else is a bug and keeps its traceback. :class:`Interrupted` is the one outside
that family: the user stopped the run (it is a ``KeyboardInterrupt``), which is neither a mistake
nor a bug.
"""

import traceback


class MegatrainError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""


class ConfigError(MegatrainError):
    """The configuration is invalid; the message names the offending key."""


class PipelineError(MegatrainError):
    """An actor of the training pipeline died or timed out; the message names the role."""


class DataError(MegatrainError):
    """The dataset cannot be read or is too small for the requested batches."""


class PreflightError(ConfigError):
    """The run would not fit this machine (host RAM, /dev/shm); raised by
    :mod:`megatrain_ray.orchestration.preflight` before anything is allocated."""


class Diverged(PipelineError):
    """A step's gradient norm is not finite: its update is never applied and the run stops."""


class ActorDied(PipelineError):
    """An actor of the pipeline died (killed, OOM, node failure): the run can restart from a checkpoint."""


class CheckpointError(MegatrainError):
    """A checkpoint cannot be written or read; the message names the directory and what to do."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended the run; ``checkpoint`` is where its state was saved, if anywhere.

    Not a :class:`MegatrainError`: an interrupt is the user's choice, reported by the CLI with its
    own exit status (130) and where the state went."""

    def __init__(self, checkpoint: str | None = None, note: str = ""):
        super().__init__(checkpoint or note)
        self.checkpoint = checkpoint
        self.note = note


class WriteError(MegatrainError):
    """A file or directory could not be written (full disk, read-only path); the message names the
    path, and where space ran out, how much is needed."""


class CorruptFile(ValueError):
    """A file is not what was written: the message is the reason (callers name the file and what to
    do). Internal to io's checks, which turn it into a CheckpointError or DataError sentence."""


def thread_failed(e: BaseException, thread: str, doing: str = "") -> MegatrainError:
    """The error a role's helper ``thread`` (named as the sentence says it) ended with: its own sentence
    where it is a :class:`MegatrainError` (a dead queue host's ActorDied), else one naming the thread,
    what it was ``doing`` and the error's first line (a CUDA error runs on with advice over several),
    with the thread's traceback as the error's ``detail`` (the run's log file keeps it)."""
    if isinstance(e, MegatrainError):
        return type(e)(str(e))
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    error = PipelineError(f"{thread} failed{f' {doing}' if doing else ''}: {first or type(e).__name__}")
    error.detail = "".join(traceback.format_exception(e))
    return error
