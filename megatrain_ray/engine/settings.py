"""What each role of the engine is told about its run: its part of the resolved run
(:class:`~megatrain_ray.orchestration.resolve.ResolvedRun`), small, frozen and picklable.

A role is built from its part and its queues, and works nothing out again: every setting here is
already what the run resolved for its device (buffer depth, chunk sizes, compilation, where each
layer's activations wait, thread counts), so what ``megatrain-ray plan`` prints is what the roles
hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import OptimConfig
from .policy import UnitPolicy


@dataclass(frozen=True, kw_only=True)
class ComputeSettings:
    """A compute worker's part of the run."""

    device: str
    """cpu or cuda, resolved."""
    buffer_depth: int
    """Device weight slots (memory.buffer_depth, resolved)."""
    loss_chunk_size: int
    """Tokens per chunk of the LM head and loss (memory.loss_chunk_size, resolved)."""
    mlp_chunk_size: int
    """Positions per chunk of the sequence-tiled MLP; 0 = untiled (memory.mlp_chunk_size, resolved)."""
    compile: bool
    """torch.compile the decoder layer and the loss chunk (compute.compile, resolved)."""
    compile_threads: int
    """Parallel compile jobs (compute.compile_threads)."""
    attention_backend: str
    """The SDPA kernel (compute.attention_backend)."""
    activations: tuple[str, ...]
    """Each decoder layer's activation placement (:func:`~megatrain_ray.engine.compute.activations.layer_modes`)."""
    threads: int | None
    """torch's CPU threads in the worker (all usable CPUs on the cpu device); None: torch's default."""
    timeout_s: float
    """How long it waits on another role (cluster.actor_timeout_s)."""
    optim: OptimConfig
    """The AdamW settings, for the units resident on its device."""
    total_steps: int
    """The run's steps (train.steps), for the learning-rate schedule of the resident units."""
    policies: tuple[UnitPolicy, ...]
    """Each unit's policy (:mod:`megatrain_ray.engine.policy`)."""
    update_order: tuple[int, ...]
    """Every unit in the schedule's update order (:attr:`~megatrain_ray.engine.schedule.Schedule.update`):
    the order in which gradients held on the device until the step's norm go out."""
    seed: int = 0
    """train.seed: a LoRA run's adapters are initialised from it (:mod:`megatrain_ray.engine.compute.adapters`)."""


def updates_after_norm(optim: OptimConfig, sharded: bool) -> bool:
    """Whether the host's updates wait for the step's norm: clipping, or an optimizer sharded across
    nodes (then in update order, after the last gradient)."""
    return optim.max_grad_norm > 0 or sharded


@dataclass(frozen=True, kw_only=True)
class SinkSettings:
    """A gradient sink's part of the run."""

    optim: OptimConfig
    total_steps: int
    """The run's steps (train.steps), for the learning-rate schedule."""
    timeout_s: float
    """How long it waits on another role (cluster.actor_timeout_s)."""
    optimizer_threads: int
    """CPU threads of the AdamW update (parallel.optimizer_threads, resolved)."""
    optimizer_threads_per_cpu: bool = False
    """parallel.optimizer_threads is 0 (one per CPU): where the sink is pinned to CPUs
    (experimental.cpu_affinity), AdamW runs one thread per CPU it is given instead of ``optimizer_threads``
    (:meth:`pinned_optimizer_threads`)."""
    workers: int = 1
    """Compute workers of its node: the tickets per unit and step (see :mod:`megatrain_ray.engine.grad_reduce`)."""
    host_sum: bool = False
    """Each worker sends its whole gradient in a host copy of its own, which the sink sums
    (experimental.grad_reduce=host with several workers)."""
    sharded: bool = False
    """The nodes' sinks share the AdamW work (parallel.optimizer_sharding=sharded with several nodes)."""
    policies: tuple[UnitPolicy, ...]
    """Each unit's policy (:mod:`megatrain_ray.engine.policy`)."""
    updates: tuple[int, ...]
    """The units this sink updates (those with a host optimizer), in the schedule's update order."""
    version_only: tuple[int, ...]
    """The units whose version alone moves (:data:`~megatrain_ray.engine.policy.FROZEN`, a LoRA run's
    base: never updated), in update order: each step's end makes them current for the next step."""

    @property
    def after_norm(self) -> bool:
        """Whether the updates wait for the step's norm (clipping, or a sharded optimizer: then in
        update order, after the last gradient), unless it comes with the tickets (held gradients)."""
        return updates_after_norm(self.optim, self.sharded)

    def pinned_optimizer_threads(self, cpus: int) -> int:
        """AdamW's threads once the sink is pinned to ``cpus`` CPUs (see ``optimizer_threads_per_cpu``)."""
        return cpus if self.optimizer_threads_per_cpu else self.optimizer_threads
