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

The alternative, ``experimental.grad_reduce=host`` (one node only): no collective; each worker copies
its whole gradient (its own micro-batches' sum) into a host block of its own (worker 0 into the
unit's grad block, worker k into copy k of the store's ``peer_grad`` arrays) and the node's sink,
once it holds every worker's ticket of a unit, sums the copies into the first one on its CPU
threads (:func:`sum_copies`) and takes the squared norm of that sum. It moves N times the bytes
over the links and through host memory and adds an N-way sum to the sink's critical path; the
all-reduce instead runs over NVLink at a few ms per 7B layer. Both are selectable so that the two
can be measured on the same box. The math is the same: the same fp32 partial sums, added in
another order (on the device in fp32 by the collective; on the host in fp32 from the copies in
the gradient dtype, so with bf16 gradients each worker's partial is rounded once before the sum).
"""

from __future__ import annotations

import datetime
import socket
from concurrent.futures import Executor

import torch

from .optim import run_pieces


def free_port() -> int:
    """A TCP port that is free on this host now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous() -> tuple[str, int]:
    """(this node's IP, a free port on it): where a group of actors meets (its first member's)."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


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
    workers of this node (those sharing one host store). ``mode``: experimental.grad_reduce; with
    ``host`` no process group is formed (the sink sums the workers' copies).
    """

    def __init__(self, rank: int, world: int, local_rank: int, local_world: int, address: str, port: int,
                 device: str, timeout_s: float, mode: str = "allreduce"):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.local_rank, self.local_world = local_rank, local_world
        self.mode = mode
        self.dist = dist
        if mode == "allreduce":
            dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{address}:{port}",
                                    rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def copy(self) -> int:
        """Which host copy of a unit's gradient this worker writes (0: the unit's grad block; k:
        ``peer_grad`` copy k, with experimental.grad_reduce=host)."""
        return self.local_rank if self.mode == "host" else 0

    def reduce(self, grad: torch.Tensor) -> tuple[int, int]:
        """grad: [numel] fp32 on this worker's device; returns the [lo, hi) part of it that this
        worker copies to the host store: with allreduce, its shard of the sum over all workers
        (summed in place); with host, all of its own gradient."""
        if self.mode == "host":
            return 0, grad.numel()
        self.dist.all_reduce(grad)
        return shard_bounds(grad.numel(), self.local_world, self.local_rank)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


SUM_CHUNK = 1 << 20
"""Elements per piece of :func:`sum_copies` (4 MiB of fp32: the piece and its addends stay in cache)."""


def sum_copies(copies: list[torch.Tensor], pool: Executor | None = None, threads: int = 1) -> float:
    """copies: N x [numel] host gradients of one unit (any float dtype, one per worker); their sum
    is written into ``copies[0]``; returns its squared L2 norm.

    Piece by piece on ``threads`` of ``pool``'s threads (torch's kernels release the GIL): each
    piece is summed in fp32 (the first copy upcast, the others added in order) and rounded once into ``copies[0]``;
    the squared norm is taken of the fp32 sum, piece by piece, and the pieces' norms are added in
    piece order (deterministic, whatever the threads' timing).
    """
    first, rest = copies[0], copies[1:]
    numel = first.numel()
    pieces = [(a, min(numel, a + SUM_CHUNK)) for a in range(0, numel, SUM_CHUNK)]
    norms = [0.0] * len(pieces)

    def work(i: int) -> None:
        a, b = pieces[i]
        acc = first[a:b] if first.dtype == torch.float32 else first[a:b].float()
        for other in rest:
            acc.add_(other[a:b])
        if acc.data_ptr() != first[a:b].data_ptr():
            first[a:b].copy_(acc)
        norms[i] = float(torch.dot(acc, acc))

    run_pieces(pool, threads, len(pieces), work)
    return sum(norms)
