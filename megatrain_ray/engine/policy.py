"""Per-unit policies: how each unit of the model is stored, differentiated and updated.

A :class:`UnitPolicy` says, for one unit (a :class:`~megatrain_ray.model.layout.Unit`):

- ``weights``: ``streamed`` (its weights live in the host store and the prefetcher streams them to
  a device slot twice a step) or ``resident`` (they stay on the compute worker's device for the
  whole run: today the units of memory.resident);
- ``gradient``: ``host`` (its gradient crosses to the host store and a ticket tells the sink),
  ``device`` (it stays on the device, and only its squared norm goes to the sink, which counts it
  in the step's norm), or ``none`` (no gradient at all, not even its adapters': no run gives one
  today; a *frozen* unit, one that does not train, is :data:`FROZEN`, whose adapters' gradient
  stays on the device);
- ``experts``: for a unit with routed experts (a sparse layer, :class:`~megatrain_ray.model.layout.Part`),
  ``routed`` (an expert that no token of the step chose sends no gradient back: its gradient is
  zero, implicitly, and its update still applies it) or ``all`` (every expert's gradient crosses:
  data-parallel workers each see only their share of the step's routing); "" for a unit without;
- ``optimizer``: which update it gets, by whom: ``exact`` (AdamW on the host in one pass),
  ``split`` (the same update in two passes, the stream copy first, see :mod:`megatrain_ray.engine.sink.gradient_sink`),
  ``compact`` (8-bit moments, :mod:`megatrain_ray.engine.compact`), ``device`` (AdamW on the compute
  worker's device: a resident unit's, :mod:`megatrain_ray.engine.compute.resident`, or a streamed unit's,
  :data:`STREAMED_ON_DEVICE`, whose state is copied in and written back, optim.placement device,
  :mod:`megatrain_ray.engine.compute.device_updates`) or ``none`` (never updated).

Policies are resolved once per run (:func:`policies_of_run`, from the settings the run resolved)
and the roles take their behaviour from them: the prefetcher streams the ``streamed`` units, the
compute worker holds the ``resident`` ones and sends gradients as ``gradient`` says, and the sink
runs each unit's ``optimizer`` (:mod:`megatrain_ray.engine.sink.updates`). A new kind of unit joins by
being given a policy, not by a new branch in those loops.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAMED, RESIDENT = "streamed", "resident"
HOST, DEVICE, NONE = "host", "device", "none"
EXACT, SPLIT, COMPACT = "exact", "split", "compact"
"""The optimizers of the host (``device`` and ``none`` as above)."""
HOST_OPTIMIZERS = (EXACT, SPLIT, COMPACT)
ROUTED, ALL = "routed", "all"
"""Which of a sparse unit's routed experts send a gradient: those the step's routing chose, or all."""
WEIGHTS, GRADIENTS, OPTIMIZERS = (STREAMED, RESIDENT), (HOST, DEVICE, NONE), (EXACT, SPLIT, COMPACT, DEVICE, NONE)
EXPERTS = ("", ROUTED, ALL)


@dataclass(frozen=True)
class UnitPolicy:
    """Where one unit's weights live, where its gradient goes, and which optimizer updates it."""

    weights: str = STREAMED
    gradient: str = HOST
    optimizer: str = EXACT
    experts: str = ""

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.weights, WEIGHTS, "weights"), (self.gradient, GRADIENTS, "gradient"),
                                     (self.optimizer, OPTIMIZERS, "optimizer"), (self.experts, EXPERTS, "experts")):
            if value not in allowed:
                raise ValueError(f"a unit policy's {what} must be one of {', '.join(allowed)}, got {value!r}")
        if self.optimizer == DEVICE and self.gradient != DEVICE:
            raise ValueError(f"a unit updated on the device keeps its gradient there, got {self}")
        if self.weights == RESIDENT and self.optimizer != DEVICE:
            raise ValueError(f"a unit resident on the device is updated there, got {self}")
        if self.gradient == DEVICE and self.optimizer not in (DEVICE, NONE):
            raise ValueError(f"a unit whose gradient stays on the device is updated there or not at all, got {self}")

    def __str__(self) -> str:
        experts = f", experts {self.experts}" if self.experts else ""
        return f"weights {self.weights}, gradient {self.gradient}{experts}, optimizer {self.optimizer}"

    @property
    def trains(self) -> bool:
        """Whether the unit's own weights are trained: only then does its backward compute their
        gradient (a frozen unit, one that does not train: its weights are no autograd leaves that require one, so its backward
        runs only the input-gradient GEMMs, and its adapters' where it has some)."""
        return self.optimizer != NONE


FROZEN = UnitPolicy(STREAMED, DEVICE, NONE)
"""A LoRA run's base unit (:mod:`megatrain_ray.engine.compute.adapters`): streamed, never updated, so no
gradient of its weights is computed (:attr:`UnitPolicy.trains`); the gradient that stays on the
device is its adapters', whose squared norm goes to the sink."""


STREAMED_ON_DEVICE = UnitPolicy(STREAMED, DEVICE, DEVICE)
"""A streamed unit updated on the compute worker's device (optim.placement device,
:mod:`megatrain_ray.engine.compute.device_updates`): its weights are fetched as any streamed unit's,
its whole fp32 gradient stays on the device (only its squared norm goes to the sink), and at the
step's end its master weights and moments are copied in, updated and written back to the host store."""


def policies_of_run(units: int, resident: tuple[int, ...], host_optimizer: str, lora: bool = False,
                    sparse: tuple[int, ...] = (), experts: str = ROUTED,
                    on_device: tuple[int, ...] = ()) -> tuple[UnitPolicy, ...]:
    """Each of ``units`` units' policy: the ``resident`` ones on the device (weights, gradient and
    AdamW), the ``on_device`` ones streamed and updated on the device (:data:`STREAMED_ON_DEVICE`),
    the others streamed, their gradients to the host, updated there by ``host_optimizer``,
    the ``sparse`` ones' (units with routed experts) sending their experts' gradients as ``experts``
    says; ``lora`` (a LoRA run): every other unit :data:`FROZEN` (its resident ones: the embedding
    or head trained in full beside the adapters)."""
    resident_policy, on_host = UnitPolicy(RESIDENT, DEVICE, DEVICE), UnitPolicy(STREAMED, HOST, host_optimizer)
    if lora:
        return tuple(resident_policy if u in resident else FROZEN for u in range(units))
    with_experts = UnitPolicy(STREAMED, HOST, host_optimizer, experts)
    return tuple(resident_policy if u in resident else STREAMED_ON_DEVICE if u in on_device
                 else with_experts if u in sparse else on_host for u in range(units))


def updated_on_device(units: int, resident: tuple[int, ...], placement: str) -> tuple[int, ...]:
    """The streamed units whose update runs on the compute worker's device under optim.placement
    ``placement``: every unit not ``resident`` for device, none for host."""
    return tuple(u for u in range(units) if u not in resident) if placement == DEVICE else ()


def host_optimizer(compact: bool, splits: bool) -> str:
    """The host optimizer of a run's streamed units: ``compact`` with 8-bit moments, else ``split``
    where the run's updates can run in two passes (``splits``, see
    :func:`~megatrain_ray.orchestration.resolve.resolve`), else ``exact``."""
    if compact:
        return COMPACT
    return SPLIT if splits else EXACT
