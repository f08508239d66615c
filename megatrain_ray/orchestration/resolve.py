"""A run resolved once: every setting its roles need, worked out from the config and the facts of
the machine it runs on, before anything is spawned.

``resolve(config, facts) -> ResolvedRun`` is computed once by the driver (the Ray pipeline and the
single-process driver) and by ``megatrain-ray plan``, which prints exactly it
(:meth:`ResolvedRun.describe`). Every role is built from its part of it (the store's
:class:`~megatrain_ray.engine.store.host_store.StoreSpec`, the compute worker's
:class:`~megatrain_ray.engine.settings.ComputeSettings`, the gradient sink's
:class:`~megatrain_ray.engine.settings.SinkSettings`); nothing is planned again at spawn, and the
config is never rewritten: what the user wrote stays in ``config``, what it resolved to is here.

The facts (:class:`Facts`) are what the config cannot say: the device the cluster offers, the GPU
memory free for the run (which decides memory.resident=auto and memory.activations=auto), and
whether this process will start Ray (its object store then counts in the memory plan).

Every choice the memory plan depends on is made here, once: the device, the precision and the store,
the units resident on the device, each layer's activation placement and the expected step time
(:class:`~megatrain_ray.orchestration.preflight.Decisions`); :mod:`~megatrain_ray.orchestration.preflight`
only counts what they take, and :func:`check` counts again with the same decisions.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass

import torch

from ..config import TrainConfig, describe_resident, usable_cpus
from ..errors import PreflightError
from ..engine.policy import (ALL, DEVICE, FROZEN, HOST_OPTIMIZERS, ROUTED, STREAMED_ON_DEVICE, UnitPolicy,
                             host_optimizer, policies_of_run)
from ..engine.schedule import Schedule
from ..engine.settings import ComputeSettings, SinkSettings, updates_after_norm
from ..engine.store.host_store import StoreSpec, resident_units
from ..model.layout import StoreLayout
from ..model.lora import AdapterLayout
from ..model.precision import Precision, resolve_precision
from . import preflight
from ..engine.affinity import adamw_cpus_near
from ..engine.compute.activations import recompute_spans, recomputed_layers
from .device_memory import (GPU_USABLE, activation_placement, device_total, placed_rows, resident_fits,
                            resolve_resident)
from .machine import gpu_free_memory, gpu_memory, gpu_name, guess_device
from .pace import Pace, UpdatePace, expected_pace, role_wait_s
from .placement import units_on_device, update_pace


@dataclass(frozen=True)
class Facts:
    """What the machine says about a run, as the driver finds it before spawning."""

    device: str
    """cpu or cuda, as the cluster offers it (:func:`~megatrain_ray.model.precision.resolve_device`)."""
    device_bytes: int | None = None
    """GPU memory free for the run (None: unknown, or the cpu device)."""
    starts_ray: bool = False
    """Whether this process starts a private Ray (whose object store the memory plan then counts)."""
    device_tflops: float | None = None
    """The GPU's nominal bf16 dense rate, which scales the expected step time's H200 rates (None: by
    the GPU's name, :data:`~megatrain_ray.orchestration.pace.NOMINAL_TFLOPS`)."""
    host_bytes: int | None = None
    """Host RAM available to the run (None: what this machine has available when it is planned),
    which also bounds the activation checkpoints it may offload."""
    adamw_cpus: int | None = None
    """The CPUs the gradient sink's AdamW gets where experimental.cpu_affinity pins the roles beside the
    GPUs (:func:`~megatrain_ray.engine.affinity.adamw_cpus_near`; None: not pinned, or not known here):
    with parallel.optimizer_threads 0, its threads, one per CPU."""

    @classmethod
    def here(cls, cfg: TrainConfig, device: str | None = None, device_bytes: int | None = None,
             starts_ray: bool = False, device_tflops: float | None = None, host_bytes: int | None = None) -> Facts:
        """The facts of this machine: ``device`` (default: compute.device, auto = cuda where this
        process sees a GPU), ``device_bytes`` (default: what is free on GPU 0 now) and, on cuda, the
        CPUs the pinning would leave AdamW."""
        device = device or guess_device(cfg)
        if device == "cuda" and device_bytes is None:
            device_bytes = gpu_free_memory()
        adamw = None
        if device == "cuda" and cfg.experimental.cpu_affinity and torch.cuda.is_available():
            try:
                adamw = adamw_cpus_near(min(cfg.parallel.compute_workers, torch.cuda.device_count()))
            except (RuntimeError, OSError):
                adamw = None  # the topology unread: the threads as configured
        return cls(device, device_bytes if device == "cuda" else None, starts_ray, device_tflops, host_bytes, adamw)


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run's roles are built from (see the module docstring)."""

    config: TrainConfig
    """The config as the user wrote it (with its overrides), never rewritten."""
    facts: Facts
    precision: Precision
    layout: StoreLayout
    """The model's units (:class:`~megatrain_ray.model.layout.Unit` records) and their blocks."""
    schedule: Schedule
    """Fetch order, update order and the units resident on the device."""
    policies: tuple[UnitPolicy, ...]
    """Each unit's policy: where its weights live, where its gradient goes, which optimizer updates it."""
    resident_layers: int | None
    """memory.resident as resolved (auto made concrete): the decoder layers resident besides the
    embedding and the head, None for no unit resident (see
    :func:`~megatrain_ray.config.execution.describe_resident`)."""
    store: StoreSpec
    """The store of every node (its owner and run id filled in by :meth:`store_spec`)."""
    compute: ComputeSettings
    sink: SinkSettings
    decisions: preflight.Decisions
    """What the memory plan counts with: the device memory planned against, the store, the units
    resident by memory.resident, the activation placement (the compute workers' too) and the pace."""
    memory: preflight.MemoryPlan
    """The memory plan: host RAM, /dev/shm and device rows, and whether the run fits; with the
    expected step time (``memory.pace``, :mod:`megatrain_ray.orchestration.pace`)."""
    wait_s: float
    """How long a role waits for its next message before the run counts it stalled (from the
    expected step time and cluster.actor_timeout_s, :func:`~megatrain_ray.orchestration.pace.role_wait_s`)."""
    call_timeout_s: float
    """How long the driver waits for a call to a role to return, and the compute workers' data-parallel
    group for its collectives (cluster.actor_timeout_s)."""
    updates: UpdatePace
    """Where the step's AdamW updates run (the host's threads, the compute worker's device: each unit's
    policy says) and the time each path should take (optim.placement)."""

    @property
    def pace(self) -> Pace:
        """The expected step time the roles' waits follow from."""
        return self.decisions.pace

    @property
    def device(self) -> str:
        return self.facts.device

    def store_spec(self, owner_pid: int, run_id: str, owner_host: str = "") -> StoreSpec:
        """The store of a run whose segments ``owner_pid`` (the driver, on the machine ``owner_host``)
        owns under ``run_id``."""
        return dataclasses.replace(self.store, owner_pid=owner_pid, run_id=run_id, owner_host=owner_host)

    def describe(self) -> str:
        """What ``megatrain-ray plan`` prints: the memory table, then the settings the roles get."""
        cfg, s = self.config, self.store
        p = self.precision

        def dtype(t) -> str:
            return str(t).removeprefix("torch.")

        names = [u.name for u in self.layout.records]
        resident = ", ".join(self.layout.units[u] for u in self.schedule.resident) or "none"
        how = describe_resident(self.resident_layers)
        how = how if cfg.memory.resident != "auto" else f"auto: {how}"
        c, k = self.compute, self.sink
        if s.hold_grads:
            grads = f"held on the device until the step's norm is known, then through a ring of {s.grad_slots} slots"
        elif s.grad_slots:
            grads = f"to a ring of {s.grad_slots} unit slots in the host store"
        else:
            grads = "to a whole-model gradient array in the host store"
        if self.updates.device_params:
            on_device = sum(p == STREAMED_ON_DEVICE for p in self.policies)
            grads += f"; but those of the {on_device} streamed units updated on the device stay there until the step's end"
        if k.workers > 1:
            grads += (f"; {k.workers} workers' copies summed by the sink (experimental.grad_reduce=host)" if k.host_sum
                      else f"; summed over {k.workers} workers by an all-reduce, each sending its shard")
        lines = [
            self.memory.table(),
            "resolved:",
            f"  device: {self.device}" + (f" ({preflight.fmt(self.facts.device_bytes)} of GPU memory for the run)"
                                          if self.facts.device_bytes else ""),
            f"  precision: master {dtype(p.master)}, compute {dtype(p.compute)}, gradients {dtype(p.grad)}, "
            f"optimizer state {dtype(p.optim_state)}",
            f"  units: {len(names)}, by policy:",
            *(f"    {_names(group)}: {policy}" for policy, group in _by_policy(names, self.policies)),
            f"  resident on the device: {resident} (memory.resident={how})",
            f"  gradients: {grads}",
            f"  activations, layer by layer: {_runs(c.activations)} (host: checkpoint offloaded, gpu: checkpoint "
            "on the device, keep: whole graph kept, span: recomputed from the checkpoint before it)",
            f"  compute: {c.buffer_depth} weight slots, loss chunks of {c.loss_chunk_size} tokens, "
            f"MLP {'in chunks of %d tokens' % c.mlp_chunk_size if c.mlp_chunk_size else 'untiled'}, "
            f"compile {'on' if c.compile else 'off'}, attention {c.attention_backend}"
            + (f", {c.threads} CPU threads" if c.threads else ""),
            f"  host optimizer: AdamW on {k.optimizer_threads} CPU thread{'s' if k.optimizer_threads > 1 else ''}"
            + (" (one per CPU left to it where experimental.cpu_affinity pins it beside a GPU)"
               if k.optimizer_threads_per_cpu and cfg.experimental.cpu_affinity and self.device == "cuda" else "")
            + (f", sharded across {cfg.parallel.nodes} nodes" if cfg.parallel.sharded_optimizer else ""),
            f"  updated where: {_placements(self.policies)} (optim.placement={cfg.optim.placement})",
            f"  {self.updates.line(self.pace)}",
        ]
        return "\n".join(lines)


def _by_policy(names: list[str], policies) -> list[tuple]:
    """(policy, the names of its units) for each distinct policy, in the order of their first unit."""
    groups: dict = {}
    for name, policy in zip(names, policies):
        groups.setdefault(policy, []).append(name)
    return list(groups.items())


def _placements(policies) -> str:
    """How many units each update path takes: "4 on the host's CPU threads, 2 on the device (...)"."""
    host = sum(p.optimizer in HOST_OPTIMIZERS for p in policies)
    streamed = sum(p == STREAMED_ON_DEVICE for p in policies)
    resident = sum(p.optimizer == DEVICE for p in policies) - streamed
    never = sum(not p.trains for p in policies)
    parts = [f"{host} units on the host's CPU threads",
             f"{streamed} streamed units on the device (state copied in and written back each step)",
             f"{resident} resident units on the device"]
    return ", ".join(parts) + (f", {never} never updated" if never else "")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]} ({len(names)} units)"


def _runs(modes: tuple[str, ...]) -> str:
    """("host", "gpu", "gpu") -> "host x1, gpu x2"."""
    out: list[list] = []
    for mode in modes:
        if out and out[-1][0] == mode:
            out[-1][1] += 1
        else:
            out.append([mode, 1])
    return ", ".join(f"{mode} x{n}" for mode, n in out) or "no layers"


def resolve(cfg: TrainConfig, facts: Facts) -> ResolvedRun:
    """The run of ``cfg`` on a machine with these ``facts`` (see the module docstring)."""
    device = facts.device
    precision = resolve_precision(cfg.precision, device, cfg.optim.state)
    layout = StoreLayout.build(cfg.model)
    host = preflight.host_for(facts.host_bytes)
    threads = cfg.parallel.resolved_optimizer_threads()
    if facts.adamw_cpus and not cfg.parallel.optimizer_threads and cfg.experimental.cpu_affinity and device == "cuda":
        threads = facts.adamw_cpus  # one per CPU the pinning leaves AdamW, as the sink will run
    resident_layers = _resident_layers(cfg, facts, precision, layout, host, threads)
    resident = resident_units(cfg.model, resident_layers)
    store = StoreSpec.of_run(cfg, precision, device, 0, "plan", resident)
    decisions = decide(cfg, facts, layout, store, resident, host)

    tried = {(): decisions}  # units on the device -> the decisions with the activations placed beside them

    def plan_for(units: tuple[int, ...]) -> tuple[Pace, bool]:
        tried[units] = decided = tried.get(units) or decide(cfg, facts, layout, store, resident, host, units)
        return decided.pace, fits_device(cfg, decided, units)

    on_device = units_on_device(cfg, device, layout, resident, threads, precision, store.hold_grads,
                                None if decisions.device_bytes is None else plan_for, updates_wait_for_norm(cfg),
                                updates_split(cfg, precision, store))
    decisions = dataclasses.replace(tried.get(on_device) or decisions, on_device=on_device)
    memory = preflight.count(cfg, decisions, host, facts.starts_ray)
    activations = decisions.placement  # every GPU alike: the same share of the micro-batches
    # a LoRA run's embedding / head trained in full: on the compute worker's device beside the adapters
    trained = tuple(layout.units.index(t.unit) for t in AdapterLayout.build(cfg.model, cfg.lora).full)
    schedule = Schedule.build(layout, cfg.model.tie_word_embeddings, resident + trained, recompute_spans(activations))
    wait = role_wait_s(decisions.pace, cfg.cluster.actor_timeout_s)  # a role's wait for its next message
    host_sum = host_sums(cfg)
    splits = updates_split(cfg, precision, store)
    sparse = tuple(u.index for u in layout.layers if u.parts)  # data-parallel workers: each sees part of the routing
    policies = policies_of_run(len(layout.units), resident + trained, host_optimizer(precision.compact, splits),
                               cfg.lora.enabled, sparse, ALL if cfg.parallel.workers > 1 else ROUTED, on_device)
    compute = ComputeSettings(
        device=device, buffer_depth=cfg.memory.buffer_depth_on(device), loss_chunk_size=cfg.memory.loss_chunk_size_on(device),
        mlp_chunk_size=cfg.memory.mlp_chunk_size_for(cfg.train.seq_len), compile=cfg.compute.compile_on(device),
        compile_threads=cfg.compute.compile_threads, attention_backend=cfg.compute.attention_backend,
        activations=activations,
        threads=usable_cpus() if device == "cpu" else None, timeout_s=wait, optim=cfg.optim,
        total_steps=cfg.train.steps, policies=policies, update_order=schedule.update, seed=cfg.train.seed)
    sink = SinkSettings(optim=cfg.optim, total_steps=cfg.train.steps, timeout_s=wait,
                        optimizer_threads=threads,
                        optimizer_threads_per_cpu=not cfg.parallel.optimizer_threads, workers=cfg.parallel.compute_workers,
                        host_sum=host_sum, sharded=cfg.parallel.sharded_optimizer, policies=policies,
                        updates=tuple(u for u in schedule.update if policies[u].optimizer in HOST_OPTIMIZERS),
                        version_only=tuple(u for u in schedule.update if policies[u] == FROZEN))
    updates = update_pace(layout, sink.updates, threads, on_device, precision, store.hold_grads, sink.after_norm, splits)
    return ResolvedRun(cfg, facts, precision, layout, schedule, policies, resident_layers, store, compute, sink,
                       decisions, memory, wait, cfg.cluster.actor_timeout_s, updates)


def host_sums(cfg: TrainConfig) -> bool:
    """Whether the sink sums the node's compute workers' whole gradients (experimental.grad_reduce=host)."""
    return cfg.experimental.grad_reduce == "host" and cfg.parallel.compute_workers > 1


def updates_wait_for_norm(cfg: TrainConfig) -> bool:
    """Whether the host's updates of a run of ``cfg`` wait for the step's norm (:func:`updates_after_norm`)."""
    return updates_after_norm(cfg.optim, cfg.parallel.sharded_optimizer)


def updates_split(cfg: TrainConfig, precision: Precision, store: StoreSpec) -> bool:
    """Whether the host's updates run in two passes: where they wait for the norm and one optimizer
    has the node's whole gradient (no host sum, no shards, no gradients held on the device), from fp32
    master weights to a stream copy."""
    return (cfg.optim.max_grad_norm > 0 and not cfg.parallel.sharded_optimizer and not host_sums(cfg)
            and not store.hold_grads and precision.separate_stream_copy and precision.master == torch.float32)


def _resident_layers(cfg: TrainConfig, facts: Facts, precision, layout: StoreLayout, host: int,
                     threads: int) -> int | None:
    """The decoder layers resident besides the embedding and the head (None: no unit resident):
    :func:`~megatrain_ray.orchestration.device_memory.resolve_resident`'s, and with memory.resident auto,
    where the host's path paces that first fit (a mixture of experts' few FLOPs per parameter), the
    count, of those that fit with every checkpoint on the GPU, whose expected step time with the host's
    updates is the shortest (:class:`~megatrain_ray.orchestration.pace.UpdatePace`: the host updates
    fewer parameters; the resident layers' state and gradients take device memory kept activations
    had, so a layer more may bring recompute). Where the host's update paces the step, the state of
    the layers the GPU has room for moves there for good; where the step hides it (the 7B's), nothing
    changes."""
    first = resolve_resident(cfg, facts.device, facts.device_bytes)
    if first is None or cfg.memory.resident != "auto":
        return first

    def expected(layers: int) -> tuple[float, float]:  # (step, the host's path), seconds
        resident = resident_units(cfg.model, layers)
        store = StoreSpec.of_run(cfg, precision, facts.device, 0, "plan", resident)
        streamed = [u for u in range(len(layout.units)) if u not in resident]
        pace = decide(cfg, facts, layout, store, resident, host).pace
        updates = update_pace(layout, streamed, threads, (), precision, store.hold_grads, updates_wait_for_norm(cfg),
                              updates_split(cfg, precision, store))
        return updates.step_s(pace), updates.host_path_s(pace)

    best, (best_s, host_s) = first, expected(first)
    if host_s < best_s:
        return first  # the step hides the host's updates
    for layers in range(first + 1, cfg.model.num_hidden_layers + 1):
        if not resident_fits(cfg, facts.device, facts.device_bytes, layers):
            break
        step_s, _ = expected(layers)
        if step_s < best_s:
            best, best_s = layers, step_s
    return best


def decide(cfg: TrainConfig, facts: Facts, layout: StoreLayout, store: StoreSpec, resident: tuple[int, ...],
           host: int, on_device: tuple[int, ...] | None = None) -> preflight.Decisions:
    """The memory plan's decisions beyond the store and the resident units: the GPU memory it is
    planned against (the facts', or where they do not say, the whole of this process's GPU 0), each
    layer's activation placement in what that leaves beside the streamed units ``on_device`` updated
    on the device (None: as optim.placement names them; offloaded checkpoints within what ``host``
    bytes of host RAM leave), and the pace that placement gives."""
    device = facts.device
    device_bytes = gpu_memory() if device == "cuda" and facts.device_bytes is None else facts.device_bytes
    room = preflight.offload_room(cfg, device, store, facts.starts_ray, host)
    placement = activation_placement(cfg, device, device_bytes, resident, room, on_device)
    pace = expected_pace(cfg, device, *recomputed_layers(placement), tflops=facts.device_tflops,
                         gpu_name=gpu_name() if device == "cuda" else None,
                         resident_params=sum(layout.templates[u].numel for u in resident))
    return preflight.Decisions(device, device_bytes, store, resident, placement, pace)


def fits_device(cfg: TrainConfig, decided: preflight.Decisions, on_device: tuple[int, ...]) -> bool:
    """Whether the plan's device total, with the activations placed as ``decided`` and the streamed
    units ``on_device`` updated on the device, fits the device's usable memory (GPU_USABLE of it)."""
    rows = placed_rows(cfg, decided.device, cfg.train.micro_batch_size, decided.resident, decided.placement, on_device)
    return device_total(rows) <= decided.device_bytes * GPU_USABLE


def _fits_an_idle_machine(result: preflight.MemoryPlan, cfg: TrainConfig) -> bool:
    """Whether the run would fit this machine with nothing else on it (then waiting may help)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (result.total("shm") <= shutil.disk_usage(cfg.memory.shm_dir).total
            and result.total("host") <= physical)


RELEASE_WAIT_S = 30.0
"""Seconds :func:`check` waits, at most, for free memory that is still growing before it fails."""
RELEASE_POLL_S = 2.0


def check(run: ResolvedRun, log=print) -> preflight.MemoryPlan:
    """The memory plan of ``run`` about to start, once memory that a run which just ended is still releasing has come back; prints the
    table and raises PreflightError if it does not fit. While it waits it counts the plan again, with the
    machine's free memory as it is then and the run's own decisions (:attr:`ResolvedRun.decisions`):
    nothing is chosen again."""
    cfg, facts = run.config, run.facts
    result = run.memory
    problems = result.problems()
    waited = 0.0
    while problems and waited < RELEASE_WAIT_S and _fits_an_idle_machine(result, cfg):
        # A run that has just ended frees its memory only as its processes exit (its segments are
        # unlinked, but mappings live until then): wait while the free memory is still growing.
        time.sleep(RELEASE_POLL_S)
        waited += RELEASE_POLL_S
        again = preflight.count(cfg, run.decisions, preflight.host_for(facts.host_bytes), facts.starts_ray)
        growing = again.shm_free > result.shm_free or again.host_available > result.host_available
        if waited == RELEASE_POLL_S and growing:
            log("waiting for the memory of a run that just ended to be released")
        result, problems = again, again.problems()
        if not growing:
            break
    if problems:
        log(result.table())
        raise PreflightError(problems[0])
    return result
