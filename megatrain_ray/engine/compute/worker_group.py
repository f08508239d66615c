"""Where a compute worker sits and the data-parallel group it joins: the methods the roles' wiring
(:mod:`megatrain_ray.orchestration.roles`) calls on each compute worker at spawn, before any step.

A mixin of :class:`~megatrain_ray.engine.compute.compute_worker.ComputeWorker`, whose ``backend``, ``device_name``,
``store``, ``layout`` and ``grads_out`` it reads. A worker that trains alone is in a group of one
(:class:`GroupOfOne`): rank 0 of 1, its share of a step all of it, its gradient the group's sum.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import affinity
from ..grad_reduce import GradReducer, rendezvous


class GroupOfOne:
    """The data-parallel group of a worker that trains alone: no collective, no shard split."""

    rank, world = 0, 1
    local_rank, local_world = 0, 1
    copy = 0
    """This worker writes the unit's own grad block (as :attr:`GradReducer.copy`)."""

    def reduce(self, grad: torch.Tensor) -> tuple[int, int]:
        """grad: [numel] fp32; the sum over a group of one is ``grad`` itself, and all of it is this
        worker's part: (0, numel)."""
        return 0, grad.numel()

    def close(self) -> None:
        pass


class GroupMember:
    """A compute worker's placement on the machine and its data-parallel group."""

    reducer: GradReducer | GroupOfOne
    """This worker's data-parallel group: a :class:`GroupOfOne` until it joins one (:meth:`join_group`)."""

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
