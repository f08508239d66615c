"""Calls into the pipeline's actors: waits with a time limit, and Ray's failures as one sentence.

Every error names the role (``store``, ``compute-1``, ``grad-sink@1``, ...): an actor that died
becomes :class:`ActorDied` (the driver may restart the pipeline from a checkpoint), one killed by
Ray's memory monitor says what to lower, a role's own :class:`~megatrain_ray.errors.MegatrainError`
keeps its sentence.
"""

from __future__ import annotations

import os
import re

import ray

from .. import errors
from ..errors import ActorDied, MegatrainError, PipelineError
from . import preflight


_ROLES: dict[str, str] = {}
"""Actor id (hex) -> role name, for the pipeline's actors now spawned (:func:`name_role`)."""


def name_role(handle, role: str) -> None:
    """Register a spawned role's actor, so that its death is told under its own name wherever it
    surfaces (a compute worker's step that needed a dead loader's batch names the loader)."""
    _ROLES[handle._actor_id.hex()] = role


def forget_roles() -> None:
    _ROLES.clear()


def actor_error(e: BaseException, role: str) -> MegatrainError:
    """One sentence for a failed call into the ``role`` actor (or into the role whose actor it
    reports dead, where that is another: see :func:`name_role`)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayActorError):
        role = _ROLES.get(getattr(e, "actor_id", None) or "", role)
    if isinstance(cause, MegatrainError):
        return _with_detail(type(cause)(str(cause)), getattr(cause, "detail", None))
    if isinstance(e, ray.exceptions.OutOfMemoryError) or isinstance(cause, ray.exceptions.OutOfMemoryError):
        return PipelineError(
            f"the machine ran out of host memory: Ray's memory monitor killed the {role} actor's work "
            f"(it does past {preflight.RAY_MEMORY_THRESHOLD:.0%} of RAM by default); see what the run needs with "
            "`megatrain-ray plan` and stop other memory users, or lower it (precision.master_dtype=bfloat16, "
            "memory.activations other than offload, a smaller model or micro-batch).")
    if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
        ours = _raised_in_constructor(str(e))
        if ours is not None:  # its own sentence, e.g. a loader's data that changed under the run
            return ours
    if isinstance(e, ray.exceptions.RayActorError):
        return ActorDied(f"the {role} actor died ({_death_cause(e)}); "
                         f"see its log in the Ray dashboard or {ray_logs()}.")
    first = next((line.strip() for line in str(cause or e).splitlines() if line.strip()), type(cause or e).__name__)
    return _with_detail(PipelineError(f"the {role} actor failed: {first}"), str(e))


def _with_detail(error: MegatrainError, detail: str | None) -> MegatrainError:
    """``error`` carrying ``detail`` (a traceback, Ray's full text of a failed call), which the run
    writes to its log file only (:func:`detail`), its sentence being what the terminal shows."""
    if detail:
        error.detail = detail
    return error


def detail(error: BaseException) -> str | None:
    """The traceback or full text behind an error's sentence (see :func:`_with_detail`), or None."""
    return getattr(error, "detail", None)


def ray_logs() -> str:
    """The log directory of the Ray session this process is connected to (under RAY_TMPDIR or the
    cluster's --temp-dir where one is set), else where Ray puts the newest session's logs."""
    try:
        from ray._private.worker import _global_node

        if _global_node is not None:
            return os.path.join(_global_node.get_session_dir_path(), "logs")
    except Exception:  # noqa: BLE001 (a private API: fall back to the documented place)
        pass
    tmp = os.environ.get("RAY_TMPDIR")
    return os.path.join(os.path.join(tmp, "ray") if tmp else "/tmp/ray", "session_latest", "logs")


def _raised_in_constructor(text: str) -> MegatrainError | None:
    """The MegatrainError a role's constructor raised, from Ray's text of its failed creation task
    (which keeps only the text: its last line is ``megatrain_ray.errors.<Type>: <sentence>``)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    m = re.fullmatch(r"megatrain_ray\.errors\.(\w+): (.*)", lines[-1]) if lines else None
    kind = m and getattr(errors, m.group(1), None)
    if not (isinstance(kind, type) and issubclass(kind, MegatrainError)):
        return None
    return kind(m.group(2))


def _death_cause(e: BaseException) -> str:
    """Why an actor died, in a few words: Ray's own line where it knows (``ray.kill``, an error in its
    constructor), else — its process vanished — whether the kernel's OOM killer acted since the
    attempt began (:func:`mark_oom_kills`), instead of Ray's paragraph that guesses at an OOM kill."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    last = lines[-1] if lines else "no reason given"
    if "worker process has died" not in last and "Worker unexpectedly exits" not in last:
        return last
    now = oom_kills()
    if now is None or _OOM_KILLS[0] is None:
        return "its process was killed (by a signal or the kernel's OOM killer) or crashed"
    if now > _OOM_KILLS[0]:
        return (f"its process was killed, and the kernel's OOM killer ended {now - _OOM_KILLS[0]} process(es) on "
                "this machine meanwhile: host memory ran out; see what the run needs with `megatrain-ray plan`")
    return "its process was killed by a signal or crashed, not for lack of memory (the kernel's OOM-kill count " \
           "did not change)"


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (/proc/vmstat), or None if unknown."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


_OOM_KILLS: list[int | None] = [oom_kills()]
"""The kernel's OOM-kill count when the pipeline's attempt began."""


def mark_oom_kills() -> None:
    """Note the kernel's OOM-kill count now (at the start of each attempt), for :func:`_death_cause`."""
    _OOM_KILLS[0] = oom_kills()


def get(ref, role: str, timeout: float):
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"the {role} actor did not answer within {timeout:.0f} s "
                            "(cluster.actor_timeout_s).") from None
    except (ray.exceptions.RayError, MegatrainError) as e:
        raise actor_error(e, role) from None


def get_started(ref, role: str, timeout: float):
    """:func:`get` for a call of the run's start-up (a role's construction, the roles joining each
    other), bounded by cluster.start_timeout_s and said to be start-up when it is not done in time."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"the {role} actor did not finish starting within {timeout:.0f} s of the run's start-up "
                            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); raise cluster.start_timeout_s on a busy machine, or see its log in the Ray "
                            f"dashboard or {ray_logs()}.") from None
    except (ray.exceptions.RayError, MegatrainError) as e:
        raise actor_error(e, role) from None
