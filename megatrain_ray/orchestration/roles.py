"""Who runs where: the pipeline's roles of every node, spawned and joined by queues in one place.

Per node: one :class:`~megatrain_ray.engine.store.host_store.ParameterStore` (owns that node's shared memory),
and per compute worker (one per GPU) a :class:`~megatrain_ray.engine.prefetch.prefetcher.Prefetcher` with its
own fetch and release queues (the worker's device slots) and a
:class:`~megatrain_ray.engine.compute.compute_worker.ComputeWorker`; one
:class:`~megatrain_ray.engine.sink.gradient_sink.GradientSink` takes the node's gradient tickets (one per worker
and unit: each worker sends its shard of the summed gradient). The data loaders run on the first
node. Checkpoints are written by the first node's sink only (every replica holds the same state).
The queues of a node live in one actor of their own, the node's queue host
(:mod:`megatrain_ray.orchestration.queues`).

Once spawned, :meth:`RaySpawner.form_group` joins the compute workers (the gradient sum),
:meth:`RaySpawner.form_shards` the nodes' sinks (parallel.optimizer_sharding=sharded), and
:func:`place_cpus` pins each node's compute workers near their GPUs and its AdamW on the other CPUs.

Both drivers wire through :func:`spawn_roles`: the Ray driver with :class:`RaySpawner` (actors in
one STRICT_PACK placement group per node, one queue host per node) and the single-process driver with
:class:`LocalSpawner` (the same plain classes as objects, Python queues), so N workers and K nodes
are one loop here, not an edit per driver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import TrainConfig, usable_cpus
from ..engine.compute.compute_worker import ComputeWorker
from ..engine.prefetch.prefetcher import Prefetcher
from ..engine.sink.gradient_sink import GradientSink
from ..engine.store.host_store import ParameterStore, StoreSpec
from ..errors import PipelineError
from .calls import forget_roles, name_role
from .pace import Pace
from .labels import labelled
from .queues import LocalQueue, QueueClient, QueueHost

STORE, PREFETCH, COMPUTE, SINK, LOADER = (
    {"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.25})
"""Ray resources of each role (logical CPUs: the heavy threads are set by the roles themselves)."""


@dataclass
class NodeRoles:
    """The roles of one node, in worker order."""

    store: Any
    sink: Any
    grad_q: Any
    stats_q: Any
    prefetchers: list = field(default_factory=list)
    computes: list = field(default_factory=list)
    fetch_qs: list = field(default_factory=list)
    """Each compute worker's fetch queue (tickets of the units ready in its slots), in worker order."""
    queues: Any = None
    """The actor holding the node's queues (a :class:`~megatrain_ray.orchestration.queues.QueueHost`);
    None where they are Python queues."""


@dataclass
class Roles:
    """Every role of a run; handles are Ray actors or plain objects, as the spawner made them."""

    nodes: list[NodeRoles]
    loaders: list = field(default_factory=list)
    activations: tuple[str, ...] = ()
    """Each decoder layer's activation placement on every compute worker (see
    :func:`~megatrain_ray.orchestration.device_memory.activation_placement`)."""
    pace: Pace | None = None
    """The expected step time the roles' waits follow from (:mod:`megatrain_ray.orchestration.pace`)."""

    @property
    def computes(self) -> list:
        """All compute workers, in data-parallel rank order (node by node)."""
        return [c for n in self.nodes for c in n.computes]

    @property
    def head(self) -> NodeRoles:
        """The first node: its store saves the final weights, its sink the checkpoints and stats."""
        return self.nodes[0]

    def named(self) -> dict[str, Any]:
        """role name (as in errors and the dashboard) -> handle."""
        out = {}
        for k, n in enumerate(self.nodes):
            at = f"@{k}" if len(self.nodes) > 1 else ""
            out[f"store{at}"], out[f"grad-sink{at}"] = n.store, n.sink
            if n.queues is not None:
                out[f"queues{at}"] = n.queues
            for w, (p, c) in enumerate(zip(n.prefetchers, n.computes)):
                suffix = f"-{w}" if len(n.computes) > 1 else ""
                out[f"prefetch{suffix}{at}"], out[f"compute{suffix}{at}"] = p, c
        out.update({f"data-{k}": h for k, h in enumerate(self.loaders)})
        return out


def node_resources(cfg: TrainConfig, device: str, node: int) -> list[dict[str, float]]:
    """The resources of a node's roles, in the order :func:`spawn_roles` spawns them."""
    gpu = {"GPU": 1} if device == "cuda" else {}
    per_worker = [PREFETCH, {**COMPUTE, **gpu}]
    loaders = [LOADER] * cfg.data.num_workers if node == 0 else []
    return [STORE, *per_worker * cfg.parallel.compute_workers, SINK, *loaders]


def spawn_roles(run, specs: list[StoreSpec], spawner, resume: str | None = None,
                checkpoints=None, loader: tuple[type, tuple] | None = None) -> Roles:
    """Spawn the roles of every node (``specs``: one store per node) of ``run`` (a
    :class:`~megatrain_ray.orchestration.resolve.ResolvedRun`, whose parts they are built from)
    through ``spawner``, wired by queues.

    ``checkpoints``: the checkpoint settings (the first node's sink writes it); ``loader``: (class, arguments)
    of the data-loader actors, or None where the driver reads batches itself.
    """
    cfg = run.config
    cpu = usable_cpus()
    depth = run.compute.buffer_depth
    workers = cfg.parallel.compute_workers
    sharded = cfg.parallel.sharded_optimizer
    device = run.device
    wait = run.wait_s  # a role's wait for its next message (orchestration.pace)
    nodes = []
    for k, spec in enumerate(specs):
        spawner.node(k)
        grad_q, stats_q = spawner.queue(0, "grad"), spawner.queue(0, "stats")
        grad_slot_q = spawner.queue(0, "grad-slots") if spec.grad_slots else None
        store = spawner.actor(ParameterStore, "store")(spec, cfg.train.seed, cfg.train.init_from, cpu, resume_from=resume,
                                                       reap=True)
        spawner.ready(store, "store")
        roles = NodeRoles(store=store, sink=None, grad_q=grad_q, stats_q=stats_q, queues=spawner.queue_host())
        for w in range(workers):
            fetch_q, release_q = spawner.queue(depth, f"fetch-{w}"), spawner.queue(depth, f"release-{w}")
            roles.fetch_qs.append(fetch_q)
            roles.prefetchers.append(spawner.actor(Prefetcher, "prefetch")(
                spec, run.schedule, depth, fetch_q, release_q, wait))
            roles.computes.append(spawner.actor(ComputeWorker, "compute", gpu=device == "cuda")(
                spec, run.compute, fetch_q, grad_q, release_q, grad_slot_q,
                **({"checkpoint": checkpoints if w == 0 and k == 0 else None, "resume_from": resume}  # the first writes
                   if cfg.lora.enabled else {})))
        roles.sink = spawner.actor(GradientSink, "grad-sink")(
            spec, run.sink, grad_q, stats_q, grad_slot_q,  # a LoRA run's checkpoints: the compute worker's
            checkpoint=checkpoints if (k == 0 or sharded) and not cfg.lora.enabled else None, writes_checkpoints=k == 0)
        nodes.append(roles)
    loaders = []
    if loader is not None:
        spawner.node(0)
        loaders = [spawner.actor(loader[0], f"data-{k}")(*loader[1]) for k in range(cfg.data.num_workers)]
    return Roles(nodes, loaders, run.compute.activations, run.pace)


def place_cpus(run, roles: Roles, get: Callable, log) -> list[str]:
    """Pin each node's compute workers to CPUs near their GPUs and its sink's AdamW to the rest
    (experimental.cpu_affinity; see :mod:`megatrain_ray.engine.affinity`), before their loops start,
    AdamW on the threads ``run`` resolved for it (:meth:`~megatrain_ray.engine.settings.SinkSettings.pinned_optimizer_threads`);
    returns the lines logged, one per node (or one saying why nothing was pinned)."""
    from ..engine.affinity import format_cpulist, pick_cpus

    cfg, device = run.config, run.device
    if not cfg.experimental.cpu_affinity or device != "cuda":
        why = "experimental.cpu_affinity is false" if not cfg.experimental.cpu_affinity else "no GPU to be near on the cpu device"
        lines = [f"cpu placement: none ({why}); threads run where the OS puts them"]
    else:
        lines = []
        for k, node in enumerate(roles.nodes):
            at = f" on node {k}" if len(roles.nodes) > 1 else ""
            tops = get([c.cpu_topology.remote() for c in node.computes], "compute")
            picks, rest = pick_cpus([t["local_cpus"] for t in tops], tops[0]["usable"])
            if not any(picks):
                lines.append(f"cpu placement{at}: none (the machine does not say which CPUs are near its GPUs"
                             f"{'' if tops[0]['pci'] else ': no PCI address'}); threads run where the OS puts them")
                continue
            get([c.pin_cpus.remote(cpus) for c, cpus in zip(node.computes, picks) if cpus], "compute")
            if rest:
                get(node.sink.pin_cpus.remote(rest, run.sink.pinned_optimizer_threads(len(rest))), "grad-sink")
            workers = ", ".join(
                f"compute-{w} (GPU {t['pci']}, NUMA node {t['numa_node'] if t['numa_node'] is not None else '?'}) "
                f"on CPUs {format_cpulist(cpus) if cpus else 'any (unknown topology)'}"
                for w, (t, cpus) in enumerate(zip(tops, picks)))
            adamw = f"AdamW on CPUs {format_cpulist(rest)}" if rest else "AdamW unpinned (no CPU left)"
            lines.append(f"cpu placement{at}: {workers}; {adamw}")
    for line in lines:
        log(line)
    return lines


class LocalSpawner:
    """The roles as plain objects in this process (one node, one compute worker), Python queues."""

    def __init__(self) -> None:
        self.moved = [time.monotonic()]
        """When the node's queues last moved an item (see :class:`~.queues.LocalQueue`)."""

    def node(self, k: int) -> None:
        if k:
            raise PipelineError("the single-process driver runs one node; set parallel.nodes=1.")

    def queue(self, maxsize: int, name: str) -> LocalQueue:
        return LocalQueue(maxsize, self.moved)

    def queue_host(self) -> None:
        return None  # the queues are plain objects of this process

    def actor(self, cls: type, role: str, gpu: bool = False) -> Callable:
        return cls

    def ready(self, handle, role: str) -> None:
        pass  # constructed: ready


class RaySpawner:
    """The roles as Ray actors: one STRICT_PACK placement group per node (on distinct nodes when
    there are several), bundles in :func:`node_resources` order; the queues of each node in one
    :class:`~megatrain_ray.orchestration.queues.QueueHost` actor in its group (bundle 0, no CPU of its own)."""

    def __init__(self, cfg: TrainConfig, device: str, run_id: str, get: Callable):
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        self.cfg, self.run_id, self.get = cfg, run_id, get
        """``get(ref, role)``: the driver's ray.get that turns actor failures into one-sentence errors."""
        self.handles: dict[str, Any] = {}
        self.hosts: dict[int, Any] = {}
        """node -> its queue host."""
        self.pgs: list = []
        self.resources = [node_resources(cfg, device, k) for k in range(cfg.parallel.nodes)]
        targets = self._target_nodes(ray, device) if cfg.parallel.nodes > 1 else [None]
        for k, bundles in enumerate(self.resources):
            self.pgs.append(placement_group(bundles, strategy="STRICT_PACK", name=f"megatrain-{run_id}-n{k}",
                                            _soft_target_node_id=targets[k]))
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=60)
        if len(ready) < len(self.pgs):
            need = self.resources[0]
            raise PipelineError(
                f"the Ray cluster cannot place the pipeline's actors ({sum(b.get('CPU', 0) for b in need):g} CPUs"
                f"{f' and {cfg.parallel.compute_workers} GPUs' if device == 'cuda' else ''} on each of "
                f"{cfg.parallel.nodes} node(s)); free resources, start Ray with more, or lower "
                "parallel.compute_workers / parallel.nodes / data.num_workers.")
        placed = [set(placement_group_table(pg)["bundles_to_node_id"].values()) for pg in self.pgs]
        if len({n for p in placed for n in p}) < len(self.pgs):
            raise PipelineError(f"parallel.nodes is {cfg.parallel.nodes} but Ray placed two nodes' roles on one node; "
                                "give each node of the cluster the resources of one node's roles.")
        self.k, self.next_bundle, self.counts = 0, [0] * len(self.pgs), {}

    def _target_nodes(self, ray, device: str) -> list[str]:
        """Node ids for parallel.nodes nodes: the driver's first, then other alive ones with the resources."""
        need = self.resources[0]
        cpus, gpus = sum(b.get("CPU", 0) for b in need), sum(b.get("GPU", 0) for b in need)
        own = ray.get_runtime_context().get_node_id()
        alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= cpus
                 and n["Resources"].get("GPU", 0) >= gpus]
        alive.sort(key=lambda n: n["NodeID"] != own)
        if len(alive) < self.cfg.parallel.nodes:
            raise PipelineError(f"parallel.nodes is {self.cfg.parallel.nodes} but the Ray cluster has {len(alive)} node(s) "
                                f"with {cpus:g} CPUs{f' and {gpus:g} GPUs' if gpus else ''} each; add nodes or "
                                "lower parallel.nodes.")
        return [n["NodeID"] for n in alive[:self.cfg.parallel.nodes]]

    def _strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pgs[self.k], placement_group_bundle_index=bundle)

    def node(self, k: int) -> None:
        self.k = k

    def queue_host(self):
        """The current node's queue host, spawned on first use: named ``queues[@k]-<run id>`` and
        labelled like a role, so the dashboard lists it with the run's roles."""
        import ray

        if self.k not in self.hosts:
            name = self._host_name()
            # No task events: its puts and gets (several per unit and step) would flood Ray's task
            # table, hiding the roles' own tasks from the dashboard and the state API.
            host = ray.remote(labelled(QueueHost, name, self.k, self.run_id)).options(
                name=f"{name}-{self.run_id}", max_restarts=0, num_cpus=0, scheduling_strategy=self._strategy(0),
                enable_task_events=False)
            self.hosts[self.k] = self.handles[name] = host.remote()
            name_role(self.hosts[self.k], name)
        return self.hosts[self.k]

    def queue(self, maxsize: int, name: str) -> QueueClient:
        """The current node's queue ``name`` (bounded by ``maxsize``; 0: unbounded), on its queue host."""
        return QueueClient(self.queue_host(), name, maxsize, role=self._host_name())

    def _host_name(self) -> str:
        return f"queues{f'@{self.k}' if len(self.pgs) > 1 else ''}"

    def actor(self, cls: type, role: str, gpu: bool = False) -> Callable:
        import ray

        bundle = self.next_bundle[self.k]  # the node's roles take its bundles in node_resources order
        self.next_bundle[self.k] += 1
        resources = self.resources[self.k][bundle]
        strategy = self._strategy(bundle)
        i = self.counts[self.k, role] = self.counts.get((self.k, role), -1) + 1
        many = role in ("prefetch", "compute") and self.cfg.parallel.compute_workers > 1
        name = f"{role}{f'-{i}' if many else ''}{f'@{self.k}' if len(self.pgs) > 1 else ''}"

        def spawn(*args, **kwargs):
            handle = ray.remote(labelled(cls, name, self.k, self.run_id)).options(
                name=f"{name}-{self.run_id}", max_concurrency=1, max_restarts=0, num_cpus=resources["CPU"],
                num_gpus=resources.get("GPU", 0), scheduling_strategy=strategy).remote(*args, **kwargs)
            self.handles[name] = handle
            name_role(handle, name)
            return handle

        return spawn

    def ready(self, handle, role: str) -> None:
        self.get(handle.ready.remote(), role)

    def form_group(self, computes: list, timeout_s: float) -> None:
        """Make the compute workers one data-parallel group (nothing to do for one worker), whose
        collectives wait ``timeout_s`` (the run's :attr:`~megatrain_ray.orchestration.resolve.ResolvedRun.call_timeout_s`)."""
        if len(computes) < 2:
            return
        address, port = self.get(computes[0].rendezvous.remote(), "compute")
        workers = self.cfg.parallel.compute_workers
        self.get([c.join_group.remote(rank, len(computes), rank % workers, workers, address, port, timeout_s,
                                      self.cfg.experimental.grad_reduce) for rank, c in enumerate(computes)], "compute")

    def form_shards(self, sinks: list) -> None:
        """Make the nodes' sinks one sharded optimizer (parallel.optimizer_sharding=sharded, several nodes)."""
        if not self.cfg.parallel.sharded_optimizer:
            return
        address, port = self.get(sinks[0].rendezvous.remote(), "grad-sink")
        self.get([s.join_shards.remote(k, len(sinks), address, port) for k, s in enumerate(sinks)], "grad-sink")

    def kill(self) -> None:
        """Remove every actor (the queue hosts too) and placement group (stores on other nodes free
        their shared memory first, where they still answer)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        stores = [h for name, h in self.handles.items() if name.startswith("store@") and name != "store@0"]
        if stores:
            try:
                ray.wait([s.close.remote() for s in stores], num_returns=len(stores), timeout=10)
            except Exception:
                pass
        for handle in self.handles.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.handles, self.hosts, self.pgs = {}, {}, []
        forget_roles()
