"""The runtime section of a run's config: where and how it runs (device, dtypes, memory placement,
Ray, workers and nodes), each field documented and validated by name, and the defaults resolved per device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .fields import require as _require
from .host import unwritable, usable_cpus


LOGGERS = ("tensorboard", "mlflow", "wandb")
"""Values in runtime.loggers (the trackers of megatrain_ray.orchestration.trackers)."""

GRAD_REDUCE = ("allreduce", "host")
"""Values of runtime.grad_reduce."""

DEVICE_ADAMW = ("auto", "none", "edges", "edges+K")
"""Values of runtime.device_adamw (K: a number of decoder layers, see ``device_adamw_layers``)."""


def device_adamw_layers(setting: str) -> int | None:
    """The decoder layers runtime.device_adamw puts on the device besides the edges: edges -> 0,
    ``edges+K`` -> K; None for none or a value of another form."""
    if setting == "edges":
        return 0
    head, _, count = str(setting).partition("+")
    return int(count) if head == "edges" and count.isdigit() else None

AUTO_BUFFER_DEPTH = {"cuda": 3, "cpu": 2}
"""runtime.buffer_depth when null, per resolved device: on cuda the depth every measurement of the
benchmark (README, Performance) ran with; on cpu, where slots are host memory, double buffering."""
AUTO_MLP_CHUNK = (65536, 16384)
"""runtime.mlp_chunk_size when null: (longest sequence run untiled, tokens per chunk beyond it).
Up to 64k tokens (the benchmark's shape) the MLP runs whole (its [S, intermediate] tensors fit and
one GEMM per projection is fastest); longer sequences run in 16k-token chunks: GEMMs of 16k rows
still run at full speed, and a chunk's [16k, intermediate] tensor is 0.6 GB at 7B width in bf16."""
AUTO_LOSS_CHUNK_SIZE = {"cuda": 8192, "cpu": 1024}
"""runtime.loss_chunk_size when null, per resolved device: on cuda the benchmark's (larger LM-head
GEMMs, for 10 bytes of device memory per token and vocabulary entry, which ``plan`` counts); on cpu
smaller chunks of logits."""


_ACTIVATION_MODES = ("auto", "recompute", "offload", "keep")


def parse_activation_counts(text: str) -> tuple[int, int, int] | None:
    """``"keep=K,host=H,span=P"`` (any part may be left out) -> (K, H, P); None if it is not of that form."""
    counts = {"keep": 0, "host": 0, "span": 0}
    for part in str(text).replace(" ", "").split(","):
        key, _, value = part.partition("=")
        if key not in counts or not value.isdigit():
            return None
        counts[key] = int(value)
    return counts["keep"], counts["host"], counts["span"]


@dataclass
class RuntimeSection:
    """Where and how the pipeline runs: device, precision, buffering, Ray and output locations."""

    device: str = "auto"
    """Compute device: auto (cuda if present, else cpu), cpu, or cuda."""
    compute_dtype: str = "auto"
    """Dtype of streamed weights and activations: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16."""
    master_dtype: str = "float32"
    """Dtype of the master weights in host RAM: float32, or bfloat16 to save host memory."""
    grad_dtype: str = "auto"
    """Dtype in which gradients cross to the host and wait for the update: auto (the compute dtype:
    bf16 on cuda, accumulated in fp32 on the device and rounded once per step), float32 (exact; twice
    the device-to-host bytes and, with clipping, 4 more host bytes per parameter), or bfloat16."""
    buffer_depth: int | None = None
    """Number of device weight slots (2 = double buffering), also the fetch-queue capacity; None
    (default) = what the benchmark uses: 3 on cuda, 2 on cpu (see ``buffer_depth_on``)."""
    loss_chunk_size: int | None = None
    """Tokens per chunk of the LM head and loss, so full logits are never materialised; None
    (default) = what the benchmark uses: 8192 on cuda, 1024 on cpu (see ``loss_chunk_size_on``)."""
    mlp_chunk_size: int | None = None
    """Positions per chunk of the sequence-tiled MLP block (post-attention norm, SwiGLU, down
    projection, residual; forward and recompute-backward; each chunk spans all sequences of the
    micro-batch), so its [S, intermediate] tensors exist for one chunk at a time; same math. 0 = off; None (default) = off up to 65536 tokens per
    sequence, 16384 beyond (see ``mlp_chunk_size_for``)."""
    compile: bool | None = None
    """torch.compile the decoder layer and the LM head's loss chunk (fused elementwise kernels); None (default) = on cuda only."""
    compile_threads: int = 1
    """Parallel compile jobs for the layer's kernels: 1 (default) compiles inside the compute process;
    more start a pool of Inductor worker processes (~0.4 GiB of host RAM each, which the store then
    cannot use) that shortens the first step's compile and is shut down after it."""
    compute_workers: int = 1
    """Compute workers per node, data parallel: one per GPU on cuda (each holds one GPU), CPU
    processes on cpu. Each takes an equal share of the step's micro-batches (train.num_micro_batches
    must divide among all workers of all nodes); every unit's gradient is summed over them by an
    all-reduce before its one update (see megatrain_ray.engine.grad_reduce)."""
    nodes: int = 1
    """Nodes of the Ray cluster to train on, data parallel: each runs its own store, prefetchers,
    compute workers and gradient sink; gradients are all-reduced across all of them, so every
    node's AdamW applies the same update to its own replica."""
    grad_reduce: str = "allreduce"
    """How the compute workers of a node sum a unit's gradient before its update: allreduce (an
    NCCL/gloo all-reduce among the workers' devices, then each copies its shard of the sum to the
    host) or host (each worker copies its whole gradient to a host block of its own and the
    gradient sink sums them on the CPU: N times the device-to-host bytes and one more model-sized
    gradient array in host memory per extra worker; one node only). See megatrain_ray.engine.grad_reduce."""
    optimizer_sharding: str = "replicated"
    """With runtime.nodes > 1, how the nodes share the AdamW work: replicated (every node's sink
    updates every unit of its own replica, no traffic) or sharded (node k updates the units
    u % nodes == k and broadcasts their new weights to the others: 1/nodes of the CPU work per
    node; the AdamW states are gathered at checkpoint boundaries and at the end, so an interrupt
    saves no checkpoint of its own). See megatrain_ray.engine.shards."""
    hold_grads: bool | None = None
    """Keep each step's gradients on the device (in runtime.grad_dtype) until the step's global norm is
    known, then send them to a ring of unit slots in the host store in the order they are updated,
    instead of keeping a whole-model gradient array in host memory: with clipping and no stream copy
    (runtime.master_dtype bfloat16, optim.state 8bit) 2 bytes per parameter less host memory for 2
    more of device memory (``plan`` counts them). None (default) = on cuda, where it applies."""
    offload_activations: bool = False
    """The same as activations: offload (kept for existing configs): every layer's forward input in
    pinned host memory, copied out and back on the copy streams, so device memory no longer grows
    with the number of layers, at the cost of host memory and link time."""
    activations: str = "auto"
    """Where each decoder layer's activations wait for its backward (see
    megatrain_ray.engine.activations): auto (default) = on cuda, chosen by the planner from the GPU's
    memory: as many layers as fit keep their whole forward graph on the GPU (no recompute in the
    backward: ~25% less GEMM work for those layers), the rest keep their input checkpoint on the GPU,
    and where even those do not fit, the first layers' checkpoints go to pinned host memory, and
    where host RAM cannot take those either, some layers have no checkpoint of their own and are
    recomputed within a span from the checkpoint before them (one more layer forward each); on cpu,
    recompute. recompute = every layer's checkpoint on the device, recomputed in the backward;
    offload = every checkpoint in host memory; keep = every layer's graph kept; or counts
    "keep=K,host=H,span=P": the last K layers kept whole, P of the others in recompute spans, the
    first H checkpoints offloaded, the rest checkpointed on the device. ``megatrain-ray plan`` shows
    the choice and the memory of each."""
    cpu_affinity: bool = True
    """Pin each compute worker's threads to 4 CPUs local to its GPU (its NUMA node, as the machine's
    sysfs reports it) and the gradient sink's AdamW threads to the node's other CPUs; where the
    machine gives no topology (no GPU) nothing is pinned and one line says so. See
    megatrain_ray.engine.affinity."""
    attention_backend: str = "auto"
    """The kernel of scaled_dot_product_attention, applied around every model call: auto (default,
    torch's own choice), flash, cudnn, efficient (memory-efficient) or math; on cpu only auto, flash
    and math exist."""
    optimizer_threads: int = 0
    """CPU threads of the gradient sink's AdamW; 0 = one per CPU of the node but one (left to the
    compute worker's kernel launches)."""
    split_update: bool = True
    """With clipping, update each unit in two passes where it can (fp32 master, bf16 stream copy,
    the native AdamW kernel, one optimizer per node): first the moments and the stream copy that the
    next forward fetches (24 of the update's 28 bytes per parameter), then, while the next step runs,
    the master weights (16 bytes), so the forward waits less on AdamW. Bit for bit the one-pass
    update; false: one pass (see megatrain_ray.engine.sink)."""
    device_adamw: str = "auto"
    """Units whose AdamW runs on the compute worker's device, their fp32 master weights and moments
    resident there: auto (default: edges+1 on one GPU where the plan fits it with every activation
    checkpoint on the GPU, else edges, else none; none on the CPU, with several compute workers, a
    bf16 master or 8-bit moments; see megatrain_ray.orchestration.device_memory.resolve_resident),
    none (every unit on the host) or edges = the embedding and the LM head
    (with the final norm). They sit at the step boundary: the next forward needs the embedding
    first, its gradient comes last, and on the host its update and the copies around it are time
    the GPU waits (~0.2 s a step at 7B). 14 bytes per parameter of those units in device memory
    (fp32 master and moments, compute-dtype weights; Qwen2.5-7B shape: 14.2 GiB, less 1.8 GiB of
    weight slots that shrink to a decoder layer's; ``plan`` counts both), never streamed; their host
    copy is brought up to date at checkpoint boundaries and at the end. edges+K: the first K decoder
    layers too (layer 0 is the next the forward waits for after the embedding). One compute
    worker, fp32 master weights and moments (see megatrain_ray.engine.resident)."""
    init_from: str | None = None
    """A Hugging Face model directory (config.json + safetensors) to start from; None = random init."""
    run_dir: str = "runs"
    """Directory where each run writes its config, metrics, checkpoints and final weights (in
    <run_dir>/<run id>). Relative paths are taken from the current directory, except in a Ray job,
    whose working directory is Ray's temporary copy: there from ~/megatrain-ray on the job's node."""
    shm_dir: str = "/dev/shm"
    """Directory (a tmpfs) holding the host parameter store's shared-memory segments."""
    loggers: tuple[str, ...] = ()
    """Experiment trackers that get every step's metrics (the Ray gauges' names) besides
    metrics.jsonl: any of tensorboard, mlflow (a local SQLite store), wandb (offline unless
    WANDB_MODE says otherwise), all writing into the run's directory; e.g. ``[tensorboard, mlflow]``.
    Their libraries are optional: ``pip install 'megatrain-ray[trackers]'``. See
    megatrain_ray.orchestration.trackers."""
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
    takes to write (see megatrain_ray.orchestration.pace)."""
    max_restarts: int = 0
    """How many times the driver restarts the pipeline from the newest checkpoint when an actor dies
    (the run then ends with the weights an uninterrupted run would have); 0 fails on the first death."""
    health_timeout_s: float = 30.0
    """Seconds an idle role (a parameter store, a data loader, a queue) may leave a health check
    unanswered before the run counts it as hung and fails or restarts (it answers in milliseconds);
    deaths are noticed within a second regardless (see :mod:`megatrain_ray.orchestration.health`)."""

    @property
    def sharded_optimizer(self) -> bool:
        """Whether the nodes split the AdamW work (``optimizer_sharding`` sharded, several nodes)."""
        return self.optimizer_sharding == "sharded" and self.nodes > 1

    def adamw_threads(self) -> int:
        """Threads of the AdamW update (see ``optimizer_threads``)."""
        return self.optimizer_threads or max(1, usable_cpus() - 1)

    def compile_on(self, device: str) -> bool:
        """Whether the decoder layer is compiled on the resolved ``device``."""
        return device == "cuda" if self.compile is None else self.compile

    def hold_grads_on(self, device: str) -> bool:
        """Whether gradients wait on the resolved ``device`` for the norm (see ``hold_grads``)."""
        return device == "cuda" if self.hold_grads is None else self.hold_grads

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
        """(layers kept whole, checkpoints offloaded, layers in recompute spans) as set by
        ``activations`` (and ``offload_activations``) on the resolved ``device``, or None where the
        planner chooses (auto on cuda)."""
        setting = "offload" if self.offload_activations else self.activations
        if setting == "auto":
            return None if device == "cuda" else (0, 0, 0)
        return {"recompute": (0, 0, 0), "offload": (0, n_layers, 0), "keep": (n_layers, 0, 0)}.get(setting) \
            or parse_activation_counts(setting)

    def validate(self) -> None:
        _require(isinstance(self.loggers, tuple) and all(name in LOGGERS for name in self.loggers)
                 and len(set(self.loggers)) == len(self.loggers), "runtime.loggers",
                 f"must be a list of distinct names of {', '.join(LOGGERS)} (e.g. [tensorboard, mlflow]), "
                 f"got {list(self.loggers)!r}")
        _require(self.activations in _ACTIVATION_MODES or parse_activation_counts(self.activations) is not None,
                 "runtime.activations", "must be auto, recompute, offload, keep or counts like \"keep=4,host=2,span=2\" "
                 f"(layers kept whole, checkpoints offloaded, layers in recompute spans), got {self.activations!r}")
        _require(not self.offload_activations or self.activations in ("auto", "offload"), "runtime.offload_activations",
                 f"(true) contradicts runtime.activations={self.activations!r}; drop runtime.offload_activations "
                 "(runtime.activations: offload says the same)")
        _require(self.attention_backend in ("auto", "flash", "cudnn", "efficient", "math"), "runtime.attention_backend",
                 f"must be auto, flash, cudnn, efficient or math, got {self.attention_backend!r}")
        _require(self.device in ("auto", "cpu", "cuda"), "runtime.device",
                 f"must be auto, cpu or cuda, got {self.device!r}")
        _require(self.compute_dtype in ("auto", "float32", "bfloat16"), "runtime.compute_dtype",
                 f"must be auto, float32 or bfloat16, got {self.compute_dtype!r}")
        _require(self.master_dtype in ("float32", "bfloat16"), "runtime.master_dtype",
                 f"must be float32 or bfloat16, got {self.master_dtype!r}")
        _require(self.grad_dtype in ("auto", "float32", "bfloat16"), "runtime.grad_dtype",
                 f"must be auto, float32 or bfloat16, got {self.grad_dtype!r}")
        _require(self.buffer_depth is None or self.buffer_depth >= 2, "runtime.buffer_depth",
                 f"must be >= 2 (or null: 3 on cuda, 2 on cpu), got {self.buffer_depth}")
        _require(self.compile_threads >= 1, "runtime.compile_threads",
                 f"must be >= 1 (1 = compile in the compute process), got {self.compile_threads}")
        _require(self.optimizer_threads >= 0, "runtime.optimizer_threads",
                 f"must be >= 0 (0 = one per CPU but one), got {self.optimizer_threads}")
        _require(self.loss_chunk_size is None or self.loss_chunk_size > 0, "runtime.loss_chunk_size",
                 f"must be positive (or null: 8192 on cuda, 1024 on cpu), got {self.loss_chunk_size}")
        _require(self.mlp_chunk_size is None or self.mlp_chunk_size >= 0, "runtime.mlp_chunk_size",
                 f"must be >= 0 (0 = off, null = off up to 65536 tokens, 16384 beyond), got {self.mlp_chunk_size}")
        _require(os.path.isdir(self.shm_dir), "runtime.shm_dir", f"is not a directory: {self.shm_dir!r}")
        _require(not os.path.exists(self.run_dir) or os.path.isdir(self.run_dir), "runtime.run_dir",
                 f"names a file, not a directory: {self.run_dir!r}")
        for key in ("run_dir", "shm_dir"):  # before anything is started or created, not at the first write
            why = unwritable(getattr(self, key))
            _require(why is None, f"runtime.{key}", f"{getattr(self, key)!r} cannot be written to ({why})")
        _require(self.object_store_memory >= 75 * 2**20, "runtime.object_store_memory",
                 f"must be at least 78643200 bytes (Ray's minimum), got {self.object_store_memory}")
        _require(isinstance(self.dashboard, bool), "runtime.dashboard",
                 f"must be true or false, got {self.dashboard!r}")
        _require(self.actor_timeout_s > 0, "runtime.actor_timeout_s",
                 f"must be positive, got {self.actor_timeout_s}")
        _require(self.max_restarts >= 0, "runtime.max_restarts", f"must be >= 0, got {self.max_restarts}")
        _require(self.health_timeout_s > 0, "runtime.health_timeout_s",
                 f"must be positive, got {self.health_timeout_s}")
        _require(self.device_adamw in ("auto", "none") or device_adamw_layers(self.device_adamw) is not None,
                 "runtime.device_adamw", f"must be one of {', '.join(DEVICE_ADAMW)}, got {self.device_adamw!r}")
        _require(self.compute_workers >= 1, "runtime.compute_workers", f"must be >= 1, got {self.compute_workers}")
        _require(self.nodes >= 1, "runtime.nodes", f"must be >= 1, got {self.nodes}")
        _require(self.optimizer_sharding in ("replicated", "sharded"), "runtime.optimizer_sharding",
                 f"must be replicated or sharded, got {self.optimizer_sharding!r}")
        _require(self.grad_reduce in GRAD_REDUCE, "runtime.grad_reduce",
                 f"must be one of {', '.join(GRAD_REDUCE)}, got {self.grad_reduce!r}")
        _require(self.grad_reduce != "host" or self.nodes == 1, "runtime.grad_reduce",
                 f"host needs runtime.nodes=1 (got {self.nodes}): it sums the gradients of one node's workers in "
                 "that node's host memory; use allreduce across nodes")
        if self.init_from is not None:
            _require(os.path.isfile(os.path.join(self.init_from, "config.json")), "runtime.init_from",
                     f"must be a Hugging Face model directory with a config.json, got {self.init_from!r}")
