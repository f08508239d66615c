"""Calls into the pipeline's actors: waits with a time limit, and Ray's failures as one sentence.

Every error names the role (``store``, ``compute-1``, ``grad-sink@1``, ...): an actor that died
becomes :class:`ActorDied` (the driver may restart the pipeline from a checkpoint), one killed by
Ray's memory monitor says what to lower, a role's own :class:`~megatrain_ray.errors.MegatrainError`
keeps its sentence.
"""

from __future__ import annotations

import ray

from ..errors import ActorDied, MegatrainError, PipelineError
from . import preflight


def actor_error(e: BaseException, role: str) -> MegatrainError:
    cause = getattr(e, "cause", None)
    if isinstance(cause, MegatrainError):
        return type(cause)(str(cause))
    if isinstance(e, ray.exceptions.OutOfMemoryError) or isinstance(cause, ray.exceptions.OutOfMemoryError):
        return PipelineError(
            f"the machine ran out of host memory: Ray's memory monitor killed the {role} actor's work "
            f"(it does past {preflight.RAY_MEMORY_THRESHOLD:.0%} of RAM by default); see what the run needs with "
            "`megatrain-ray plan` and stop other memory users, or lower it (runtime.master_dtype=bfloat16, "
            "runtime.offload_activations=false, a smaller model or micro-batch).")
    if isinstance(e, ray.exceptions.RayActorError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return ActorDied(f"the {role} actor died ({lines[-1] if lines else 'no reason given'}); "
                             "see its log in the Ray dashboard or /tmp/ray/session_latest/logs.")
    return PipelineError(f"the {role} actor failed: {cause or e}")


def get(ref, role: str, timeout: float):
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"the {role} actor did not answer within {timeout:.0f} s "
                            "(runtime.actor_timeout_s).") from None
    except (ray.exceptions.RayError, MegatrainError) as e:
        raise actor_error(e, role) from None
