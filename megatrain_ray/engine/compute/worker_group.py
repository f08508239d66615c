"""Where a compute worker sits and the data-parallel group it joins: the methods the roles' wiring
(:mod:`megatrain_ray.orchestration.roles`) calls on each compute worker at spawn, before any step.

A mixin of :class:`~megatrain_ray.engine.compute.compute_worker.ComputeWorker`, whose ``backend``, ``device_name``,
``store``, ``layout`` and ``grads_out`` it reads.
"""

from __future__ import annotations

import os
from typing import Any

from .. import affinity
from ..grad_reduce import GradReducer, rendezvous


class GroupMember:
    """A compute worker's placement on the machine and its data-parallel group."""

    reducer: GradReducer | None = None
    """This worker's data-parallel group (:meth:`join_group`); None when it trains alone."""

    def rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where the data-parallel group meets (rank 0's)."""
        return rendezvous()

    def cpu_topology(self) -> dict[str, Any]:
        """Where this worker's GPU sits: its PCI address, NUMA node and local CPUs (None where the
        machine does not say), and the CPUs this process may run on (see :mod:`.affinity`)."""
        pci = affinity.gpu_pci_address(self.backend.device.index or 0) if self.device_name == "cuda" else None
        node, cpus = affinity.local_cpus(pci)
        return {"pci": pci, "numa_node": node, "local_cpus": cpus, "usable": sorted(os.sched_getaffinity(0))}

    def pin_cpus(self, cpus: list[int]) -> int:
        """Run every thread of this worker on ``cpus`` from now on; returns the threads pinned."""
        return affinity.pin_process(cpus)

    def join_group(self, rank: int, world: int, local_rank: int, local_world: int, address: str, port: int,
                   timeout_s: float, mode: str = "allreduce") -> int:
        """Form the data-parallel group with the other workers (all call this at once); returns rank.
        ``mode``: experimental.grad_reduce (with host, this worker's own host gradient copy is pinned)."""
        self.reducer = self.grads_out.reducer = GradReducer(rank, world, local_rank, local_world, address, port,
                                                            self.device_name, timeout_s, mode)
        if self.reducer.copy:
            total = self.layout.total
            self.backend.register_host(self.store.arrays["peer_grad"][(self.reducer.copy - 1) * total:
                                                                      self.reducer.copy * total],
                                       self.layout.offsets)
        return rank
