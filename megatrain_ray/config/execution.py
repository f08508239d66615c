"""The sections of how a run executes: ``precision`` (dtypes), ``compute`` (device and kernels),
``memory`` (what lives where: weight slots, chunks, activations, units resident on the device, the
host store's tmpfs), ``parallel`` (workers, nodes, the AdamW work's split and threads), ``cluster``
(which Ray, its dashboard, timeouts and restarts) and ``experimental`` (switches kept to measure one
choice against another). Each field is documented and validated by name; the defaults that depend on
the device are resolved by the ``*_on(device)`` methods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .fields import require as _require
from .host import unwritable, usable_cpus


EXECUTION_SECTIONS = ("precision", "compute", "memory", "parallel", "cluster", "experimental")
"""The sections of how a run executes (this module's), by their keys in a run config."""

GRAD_REDUCE = ("allreduce", "host")
"""Values of experimental.grad_reduce."""

RESIDENT = ("auto", "none", "embed_head")
"""Values of memory.resident."""

ACTIVATIONS = ("auto", "recompute", "offload", "keep", "counts")
"""Values of memory.activations."""

AUTO_BUFFER_DEPTH = {"cuda": 3, "cpu": 2}
"""memory.buffer_depth when null, per resolved device: on cuda the depth every measurement of the
benchmark (README, Performance) ran with; on cpu, where slots are host memory, double buffering."""
AUTO_MLP_CHUNK = (65536, 16384)
"""memory.mlp_chunk_size when null: (longest sequence run untiled, tokens per chunk beyond it).
Up to 64k tokens (the benchmark's shape) the MLP runs whole (its [S, intermediate] tensors fit and
one GEMM per projection is fastest); longer sequences run in 16k-token chunks: GEMMs of 16k rows
still run at full speed, and a chunk's [16k, intermediate] tensor is 0.6 GB at 7B width in bf16."""
AUTO_LOSS_CHUNK_SIZE = {"cuda": 8192, "cpu": 1024}
"""memory.loss_chunk_size when null, per resolved device: on cuda the benchmark's (larger LM-head
GEMMs, for 10 bytes of device memory per token and vocabulary entry, which ``plan`` counts); on cpu
smaller chunks of logits."""


def describe_resident(layers: int | None) -> str:
    """memory.resident as resolved (None: no unit resident; K: the embedding, the head and the
    first K decoder layers), in the config's words."""
    if layers is None:
        return "none"
    return "embed_head" + (f", resident_layers {layers}" if layers else "")


def _one_of(value: str, values: tuple[str, ...], key: str) -> None:
    _require(value in values, key, f"must be {', '.join(values[:-1])} or {values[-1]}, got {value!r}")


@dataclass(frozen=True)
class PrecisionSection:
    """The dtypes of the weights the device computes with, of the master weights and of the gradients."""

    compute_dtype: str = "auto"
    """Dtype of streamed weights and activations: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16."""
    master_dtype: str = "float32"
    """Dtype of the master weights in host RAM: float32, or bfloat16 to save host memory."""
    grad_dtype: str = "auto"
    """Dtype in which gradients cross to the host and wait for the update: auto (the compute dtype:
    bf16 on cuda, accumulated in fp32 on the device and rounded once per step), float32 (exact; twice
    the device-to-host bytes and, with clipping, 4 more host bytes per parameter), or bfloat16."""

    def validate(self) -> None:
        _one_of(self.compute_dtype, ("auto", "float32", "bfloat16"), "precision.compute_dtype")
        _one_of(self.master_dtype, ("float32", "bfloat16"), "precision.master_dtype")
        _one_of(self.grad_dtype, ("auto", "float32", "bfloat16"), "precision.grad_dtype")


@dataclass(frozen=True)
class ComputeSection:
    """The device the layers run on and the kernels they run with."""

    device: str = "auto"
    """Compute device: auto (cuda if present, else cpu), cpu, or cuda."""
    compile: bool | None = None
    """torch.compile the decoder layer and the LM head's loss chunk (fused elementwise kernels); None (default) = on cuda only."""
    compile_threads: int = 1
    """Parallel compile jobs for the layer's kernels: 1 (default) compiles inside the compute process;
    more start a pool of Inductor worker processes (~0.4 GiB of host RAM each, which the store then
    cannot use) that shortens the first step's compile and is shut down after it."""
    attention_backend: str = "auto"
    """The kernel of scaled_dot_product_attention, applied around every model call: auto (default,
    torch's own choice), flash, cudnn, efficient (memory-efficient) or math; on cpu only auto, flash
    and math exist."""

    def compile_on(self, device: str) -> bool:
        """Whether the decoder layer is compiled on the resolved ``device``."""
        return device == "cuda" if self.compile is None else self.compile

    def validate(self) -> None:
        _one_of(self.device, ("auto", "cpu", "cuda"), "compute.device")
        _require(self.compile_threads >= 1, "compute.compile_threads",
                 f"must be >= 1 (1 = compile in the compute process), got {self.compile_threads}")
        _one_of(self.attention_backend, ("auto", "flash", "cudnn", "efficient", "math"), "compute.attention_backend")


@dataclass(frozen=True)
class MemorySection:
    """What lives where: the device's weight slots and chunks, each layer's activations, the units
    resident on the device, and the host store's directory."""

    buffer_depth: int | None = None
    """Number of device weight slots (2 = double buffering), also the fetch-queue capacity; None
    (default) = what the benchmark uses: 3 on cuda, 2 on cpu (see ``buffer_depth_on``)."""
    loss_chunk_size: int | None = None
    """Tokens per chunk of the LM head and loss, so full logits are never materialised; None
    (default) = what the benchmark uses: 8192 on cuda, 1024 on cpu (see ``loss_chunk_size_on``)."""
    mlp_chunk_size: int | None = None
    """Positions per chunk of the sequence-tiled MLP block (post-attention norm, SwiGLU, down
    projection, residual; forward and recompute-backward; each chunk spans all sequences of the
    micro-batch), so its [S, intermediate] tensors exist for one chunk at a time; same math. 0 = off;
    None (default) = off up to 65536 tokens per sequence, 16384 beyond (see ``mlp_chunk_size_for``)."""
    activations: str = "auto"
    """Where each decoder layer's activations wait for its backward (see
    megatrain_ray.engine.compute.activations): auto (default) = on cuda, chosen by the planner from the GPU's
    memory: as many layers as fit keep their whole forward graph on the GPU (no recompute in the
    backward: ~25% less GEMM work for those layers), the rest keep their input checkpoint on the GPU,
    and where even those do not fit, the first layers' checkpoints go to pinned host memory, and
    where host RAM cannot take those either, some layers have no checkpoint of their own and are
    recomputed within a span from the checkpoint before them (one more layer forward each); on cpu,
    recompute. recompute = every layer's checkpoint on the device, recomputed in the backward;
    offload = every checkpoint in pinned host memory, so device memory no longer grows with the
    number of layers; keep = every layer's graph kept; counts = as many of each as
    memory.kept_layers, memory.offloaded_layers and memory.spanned_layers say, the rest checkpointed
    on the device. ``megatrain-ray plan`` shows the choice and the memory of each."""
    kept_layers: int = 0
    """With memory.activations counts: the last this many decoder layers keep their whole forward graph."""
    offloaded_layers: int = 0
    """With memory.activations counts: the first this many decoder layers' checkpoints wait in pinned
    host memory."""
    spanned_layers: int = 0
    """With memory.activations counts: this many of the other decoder layers keep no checkpoint of
    their own and are recomputed within a span from the checkpoint before them."""
    resident: str = "auto"
    """Units resident on the compute worker's device, their fp32 master weights and moments there
    and their AdamW run there: auto (default: embed_head and memory.resident_layers 1 on one GPU
    where the plan fits it with every activation checkpoint on the GPU, else embed_head, else none;
    where the host's updates pace that first fit, the number of decoder layers, of those that fit,
    with the shortest expected step time with the host's updates, so where the host's AdamW would
    pace the step, as a mixture of experts' few FLOPs per parameter make it, the layers the GPU has
    room for keep their state there; none on the CPU, with several compute workers, a bf16 master or
    8-bit moments; see
    megatrain_ray.orchestration.device_memory.resolve_resident and
    megatrain_ray.orchestration.resolve), none (every unit on the host) or
    embed_head = the embedding and the LM head (with the final norm). They sit at the step boundary:
    the next forward needs the embedding first, its gradient comes last, and on the host its update
    and the copies around it are time the GPU waits (~0.2 s a step at 7B). 14 bytes per parameter of
    those units in device memory (fp32 master and moments, compute-dtype weights; Qwen2.5-7B shape:
    14.2 GiB, less 1.8 GiB of weight slots that shrink to a decoder layer's; ``plan`` counts both;
    the fp32 gradient of a resident decoder layer after layer 0, 4 more, stays there until the step's end),
    never streamed; their host copy is brought up to date at checkpoint boundaries and at the end.
    One compute worker, fp32 master weights and moments (see megatrain_ray.engine.compute.resident)."""
    resident_layers: int = 0
    """With memory.resident embed_head: the first this many decoder layers are resident too (layer 0
    is the next the forward waits for after the embedding)."""
    shm_dir: str = "/dev/shm"
    """Directory (a tmpfs) holding the host parameter store's shared-memory segments."""

    def buffer_depth_on(self, device: str) -> int:
        """Device weight slots on the resolved ``device`` (see ``buffer_depth``)."""
        return self.buffer_depth or AUTO_BUFFER_DEPTH[device]

    def mlp_chunk_size_for(self, seq_len: int) -> int:
        """Tokens per MLP chunk for sequences of ``seq_len`` tokens (0 = untiled; see ``mlp_chunk_size``)."""
        if self.mlp_chunk_size is not None:
            return self.mlp_chunk_size
        return 0 if seq_len <= AUTO_MLP_CHUNK[0] else AUTO_MLP_CHUNK[1]

    def loss_chunk_size_on(self, device: str) -> int:
        """Tokens per loss chunk on the resolved ``device`` (see ``loss_chunk_size``)."""
        return self.loss_chunk_size or AUTO_LOSS_CHUNK_SIZE[device]

    def activation_counts(self, device: str, n_layers: int) -> tuple[int, int, int] | None:
        """(layers kept whole, checkpoints offloaded, layers in recompute spans) as ``activations``
        sets them on the resolved ``device``, or None where the planner chooses (auto on cuda)."""
        if self.activations == "auto":
            return None if device == "cuda" else (0, 0, 0)
        return {"recompute": (0, 0, 0), "offload": (0, n_layers, 0), "keep": (n_layers, 0, 0)}.get(
            self.activations, (self.kept_layers, self.offloaded_layers, self.spanned_layers))

    @property
    def resident_given(self) -> int | None:
        """The decoder layers resident besides the embedding and the head as set (None: none
        resident; for auto, see :func:`megatrain_ray.orchestration.device_memory.resolve_resident`)."""
        return self.resident_layers if self.resident == "embed_head" else None

    def validate(self) -> None:
        _require(self.buffer_depth is None or self.buffer_depth >= 2, "memory.buffer_depth",
                 f"must be >= 2 (or null: 3 on cuda, 2 on cpu), got {self.buffer_depth}")
        _require(self.loss_chunk_size is None or self.loss_chunk_size > 0, "memory.loss_chunk_size",
                 f"must be positive (or null: 8192 on cuda, 1024 on cpu), got {self.loss_chunk_size}")
        _require(self.mlp_chunk_size is None or self.mlp_chunk_size >= 0, "memory.mlp_chunk_size",
                 f"must be >= 0 (0 = off, null = off up to 65536 tokens, 16384 beyond), got {self.mlp_chunk_size}")
        _one_of(self.activations, ACTIVATIONS, "memory.activations")
        for key in ("kept_layers", "offloaded_layers", "spanned_layers"):
            count = getattr(self, key)
            _require(count >= 0, f"memory.{key}", f"must be >= 0, got {count}")
            _require(not count or self.activations == "counts", f"memory.{key}",
                     f"({count}) is read only with memory.activations counts (got {self.activations!r}); "
                     "set memory.activations: counts or leave it out")
        _one_of(self.resident, RESIDENT, "memory.resident")
        _require(self.resident_layers >= 0, "memory.resident_layers", f"must be >= 0, got {self.resident_layers}")
        _require(not self.resident_layers or self.resident == "embed_head", "memory.resident_layers",
                 f"({self.resident_layers}) is read only with memory.resident embed_head (got {self.resident!r}); "
                 "set memory.resident: embed_head or leave it out")
        _require(os.path.isdir(self.shm_dir), "memory.shm_dir", f"is not a directory: {self.shm_dir!r}")
        why = unwritable(self.shm_dir)  # before anything is started or created, not at the first write
        _require(why is None, "memory.shm_dir", f"{self.shm_dir!r} cannot be written to ({why})")


@dataclass(frozen=True)
class ParallelSection:
    """How the work is spread: data-parallel compute workers and nodes, the AdamW work among nodes,
    and the AdamW threads of each node."""

    compute_workers: int = 1
    """Compute workers per node, data parallel: one per GPU on cuda (each holds one GPU), CPU
    processes on cpu. Each takes an equal share of the step's micro-batches (train.num_micro_batches
    must divide among all workers of all nodes); every unit's gradient is summed over them by an
    all-reduce before its one update (see megatrain_ray.engine.grad_reduce)."""
    nodes: int = 1
    """Nodes of the Ray cluster to train on, data parallel: each runs its own store, prefetchers,
    compute workers and gradient sink; gradients are all-reduced across all of them, so every
    node's AdamW applies the same update to its own replica."""
    optimizer_sharding: str = "replicated"
    """With parallel.nodes > 1, how the nodes share the AdamW work: replicated (every node's sink
    updates every unit of its own replica, no traffic) or sharded (node k updates the units
    u % nodes == k and broadcasts their new weights to the others: 1/nodes of the CPU work per
    node; the AdamW states are gathered at checkpoint boundaries and at the end, so an interrupt
    saves no checkpoint of its own). See megatrain_ray.engine.sink.shards."""
    optimizer_threads: int = 0
    """CPU threads of the gradient sink's AdamW; 0 = one per CPU of the node but one (left to the
    compute worker's kernel launches), or, where experimental.cpu_affinity pins the roles beside a
    GPU, one per CPU left to AdamW (each compute worker takes 4 near its GPU)."""

    @property
    def workers(self) -> int:
        """Compute workers of the whole run (every node's)."""
        return self.compute_workers * self.nodes

    @property
    def sharded_optimizer(self) -> bool:
        """Whether the nodes split the AdamW work (``optimizer_sharding`` sharded, several nodes)."""
        return self.optimizer_sharding == "sharded" and self.nodes > 1

    def resolved_optimizer_threads(self) -> int:
        """``optimizer_threads`` resolved: the AdamW update's threads (0 made one per CPU but one)."""
        return self.optimizer_threads or max(1, usable_cpus() - 1)

    def validate(self) -> None:
        _require(self.compute_workers >= 1, "parallel.compute_workers", f"must be >= 1, got {self.compute_workers}")
        _require(self.nodes >= 1, "parallel.nodes", f"must be >= 1, got {self.nodes}")
        _one_of(self.optimizer_sharding, ("replicated", "sharded"), "parallel.optimizer_sharding")
        _require(self.optimizer_threads >= 0, "parallel.optimizer_threads",
                 f"must be >= 0 (0 = one per CPU but one), got {self.optimizer_threads}")


@dataclass(frozen=True)
class ClusterSection:
    """Which Ray the run uses, its dashboard, and how the run notices and survives a role that stops."""

    ray_address: str | None = None
    """Which Ray the run uses: None (default) = the job's cluster under ``ray job submit``, else the
    cluster ``ray start --head`` runs on this machine if there is one (a line says so), else a private
    one started for the run; ``local`` = always a private one; ``auto`` = the cluster running on this
    machine (an error if none); ``host:port`` or ``ray://host:port`` = that cluster (with token
    authentication on, export RAY_AUTH_MODE=token). See megatrain_ray.orchestration.cluster."""
    object_store_memory: int = 256 * 2**20
    """Bytes of Ray object store when the run starts a private Ray (only control messages go through
    it); a cluster it joins keeps its own."""
    dashboard: bool = True
    """Start Ray's dashboard when the run starts a private Ray: bound to 127.0.0.1 (port 8265, or the
    next free one), token authentication on; its URL and the node's metrics endpoint are printed at
    start. false starts none (the ``ray_megatrain_*`` gauges are still exported). A cluster the run
    joins keeps its own (``ray start --head --dashboard-host=127.0.0.1``)."""
    actor_timeout_s: float = 300.0
    """The floor of the run's timeouts: the health check calls the run stalled when no message moves
    between its roles for 3 expected step times (``megatrain-ray plan`` prints both), never sooner
    than this; a periodic checkpoint pauses the updates, so it must exceed the time one checkpoint
    takes to write (see megatrain_ray.orchestration.pace). The tokenizing step is stopped when its
    actor pool, one of whose actors died, writes no block for this long (megatrain_ray.data.watchdog)."""
    start_timeout_s: float = 600.0
    """Seconds the roles may take to start (a store allocating and filling the model's host memory, a
    compute worker's device, the roles joining each other), each start-up call bounded by it; one not
    done by then ends the run naming the role and saying it was start-up. Apart from
    actor_timeout_s, so a short floor for a stall does not fail a slow start on a loaded machine."""
    max_restarts: int = 0
    """How many times the driver restarts the pipeline from the newest checkpoint when an actor dies
    (the run then ends with the weights an uninterrupted run would have); 0 fails on the first death."""
    health_timeout_s: float = 30.0
    """Seconds an idle role (a parameter store, a data loader, a queue) may leave a health check
    unanswered before the run counts it as hung and fails or restarts (it answers in milliseconds);
    deaths are noticed within a second regardless (see :mod:`megatrain_ray.orchestration.health`)."""

    def validate(self) -> None:
        _require(self.object_store_memory >= 75 * 2**20, "cluster.object_store_memory",
                 f"must be at least 78643200 bytes (Ray's minimum), got {self.object_store_memory}")
        _require(isinstance(self.dashboard, bool), "cluster.dashboard",
                 f"must be true or false, got {self.dashboard!r}")
        _require(self.actor_timeout_s > 0, "cluster.actor_timeout_s", f"must be positive, got {self.actor_timeout_s}")
        _require(self.start_timeout_s > 0, "cluster.start_timeout_s", f"must be positive, got {self.start_timeout_s}")
        _require(self.max_restarts >= 0, "cluster.max_restarts", f"must be >= 0, got {self.max_restarts}")
        _require(self.health_timeout_s > 0, "cluster.health_timeout_s",
                 f"must be positive, got {self.health_timeout_s}")


@dataclass(frozen=True)
class ExperimentalSection:
    """Switches kept to measure one choice against another; their defaults are what a run should use."""

    hold_grads: bool | None = None
    """Keep each step's gradients on the device (in precision.grad_dtype) until the step's global norm
    is known, then send them to a ring of unit slots in the host store in the order they are updated,
    instead of keeping a whole-model gradient array in host memory: with clipping and no stream copy
    (precision.master_dtype bfloat16, optim.state 8bit) 2 bytes per parameter less host memory for 2
    more of device memory (``plan`` counts them). None (default) = on cuda, where it applies."""
    grad_reduce: str = "allreduce"
    """How the compute workers of a node sum a unit's gradient before its update: allreduce (an
    NCCL/gloo all-reduce among the workers' devices, then each copies its shard of the sum to the
    host) or host (each worker copies its whole gradient to a host block of its own and the
    gradient sink sums them on the CPU: N times the device-to-host bytes and one more model-sized
    gradient array in host memory per extra worker; one node only). See megatrain_ray.engine.grad_reduce."""
    cpu_affinity: bool = True
    """Pin each compute worker's threads to 4 CPUs local to its GPU (its NUMA node, as the machine's
    sysfs reports it) and the gradient sink's AdamW threads to the node's other CPUs; where the
    machine gives no topology (no GPU) nothing is pinned and one line says so. See
    megatrain_ray.engine.affinity."""

    def hold_grads_on(self, device: str) -> bool:
        """Whether gradients wait on the resolved ``device`` for the norm (see ``hold_grads``)."""
        return device == "cuda" if self.hold_grads is None else self.hold_grads

    def validate(self) -> None:
        _one_of(self.grad_reduce, GRAD_REDUCE, "experimental.grad_reduce")
