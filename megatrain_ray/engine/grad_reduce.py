"""Data parallelism across compute workers: one gradient per unit, summed over every worker.

With several compute workers (one per GPU of a node, on one node or several), each takes its
share of a step's micro-batches and computes its unit gradients in fp32 on its device as usual.
Before a unit's gradient leaves the device it is summed over all workers of the run by one
all-reduce (NCCL between GPUs, gloo on the CPU), inside a ``torch.distributed`` group that the
workers form among themselves. Then the workers of one node split the summed gradient: local
worker r copies only its contiguous shard of the unit's flat block into the node's host store
(the link traffic per GPU stays one unit's worth, spread over the node's links), with the squared
norm of that shard; the node's gradient sink takes one ticket per shard. Every node's store ends
up with the same summed gradient, so every node's sink applies the same update and the replicas
stay identical (an all-reduce leaves the same bits on every rank).

Chosen over summing each GPU's full copy into the host block on the CPU: that would move N times
the bytes over the links and through host memory and add an N-way sum to the sink's critical
path, where the all-reduce runs over NVLink at a few ms per 7B layer.
"""

from __future__ import annotations

import datetime
import socket

import torch


def free_port() -> int:
    """A TCP port that is free on this host now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def shard_bounds(numel: int, shards: int, index: int, align: int = 1024) -> tuple[int, int]:
    """[lo, hi) of shard ``index`` of ``shards`` over a flat block of ``numel`` elements, cut at
    multiples of ``align`` elements (the last shard takes the rest; shards may be empty)."""
    per = -(-numel // shards)
    per = -(-per // align) * align
    lo = min(numel, index * per)
    return lo, min(numel, lo + per)


class GradReducer:
    """This worker's membership in the run's data-parallel group.

    ``rank``/``world``: over all workers of the run; ``local_rank``/``local_world``: over the
    workers of this node (those sharing one host store).
    """

    def __init__(self, rank: int, world: int, local_rank: int, local_world: int, address: str, port: int,
                 device: str, timeout_s: float):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.local_rank, self.local_world = local_rank, local_world
        self.dist = dist
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{address}:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))

    def reduce(self, grad: torch.Tensor) -> tuple[int, int]:
        """grad: [numel] fp32 on this worker's device, summed in place over all workers; returns the
        [lo, hi) shard of it that this worker copies to the host store."""
        self.dist.all_reduce(grad)
        return shard_bounds(grad.numel(), self.local_world, self.local_rank)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
