"""Control messages of the pipeline (the order of their units: :mod:`megatrain_ray.engine.schedule`).

Queues between actors carry only these small tickets, never tensors: the bytes they refer to live
in the host store's shared memory (grad blocks) or in the compute worker's device slots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchTicket:
    """Prefetcher -> compute: stream ``unit``'s weights at version ``step`` into device slot ``slot``."""

    unit: int
    step: int
    slot: int


@dataclass(frozen=True)
class GradTicket:
    """Compute -> sink: ``unit``'s gradient for ``step`` is complete in its host grad block."""

    unit: int
    step: int
    sq_norm: float
    """Squared L2 norm of the gradient, taken on the device in fp32."""
    slot: int = -1
    """The gradient ring's slot holding it, when the store has a ring (else -1: the unit's block)."""
    step_sq_norm: float = -1.0
    """With gradients held on the device (``StoreSpec.hold_grads``): the squared norm of the whole step's
    gradient, summed in the order the units' gradients were computed, so the sink can clip and update
    at once; else -1."""
