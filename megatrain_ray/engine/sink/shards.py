"""The sharded optimizer across nodes (parallel.optimizer_sharding=sharded): each node's AdamW
updates 1/K of the units and broadcasts them to the other nodes.

By default (replicated) every node's gradient sink applies every unit's update to its own replica
of the store: K times the AdamW work, no traffic. Sharded, node k's sink owns the units u with
u % K == k: it updates those (master, AdamW states, stream copy) and broadcasts each updated
master block to the other sinks; a sink that does not own a unit receives its master block,
refreshes its stream copy and only then bumps its version (so its prefetcher never streams a
stale unit). The K sinks form a gloo group of their own; every sink enqueues one broadcast per
unit, in the same order (the update order: embedding, layers, head), so a node's updates of its
own units run while the others' arrive on the group's threads. The bytes are moved as raw bytes:
every replica's master weights stay bit-identical to the owner's.

To the gradient sink, a sharded optimizer is each unit's optimizer wrapped (:class:`ShardedOptimizer`,
the protocol of :mod:`megatrain_ray.engine.sink.updates`): the update where this node owns the unit,
then its exchange; :data:`UNSHARDED` stands for the group where there is none.

The AdamW states of a unit are only current on its owner. They are gathered to every node (one
broadcast per unit and state) at each checkpoint boundary and at the end of the run, so the first
node's checkpoints and exports hold the whole optimizer state.
"""

from __future__ import annotations

import datetime
import queue
import threading

import torch

from ..store.host_store import HostStore


class OptimizerShards:
    """This sink's membership in the sinks' group: which units it owns, and their exchange."""

    def __init__(self, store: HostStore, node: int, nodes: int, address: str, port: int, timeout_s: float):
        import torch.distributed as dist

        self.store, self.node, self.nodes = store, node, nodes
        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=node, world_size=nodes,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self._sent: list = []
        self._received: queue.Queue = queue.Queue()
        self._receiver: threading.Thread | None = None
        self._error: BaseException | None = None
        self.states_at: int | None = None
        """The step boundary the AdamW states were last gathered at."""

    def owner(self, unit: int) -> int:
        return unit % self.nodes

    def owns(self, unit: int) -> bool:
        return self.owner(unit) == self.node

    def _bytes(self, kind: str, unit: int) -> torch.Tensor:
        """Unit's block of ``kind`` as raw bytes (gloo moves any dtype bit for bit that way)."""
        return self.store.block(kind, unit).view(torch.uint8)

    def share(self, unit: int, version: int) -> None:
        """After the owner's update of ``unit`` (to ``version``): send its master weights; on the
        other nodes, receive them, then refresh the stream copy and set the version (on a thread)."""
        work = self.dist.broadcast(self._bytes("master", unit), src=self.owner(unit), async_op=True)
        if self.owns(unit):
            self._sent.append(work)
            return
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive_loop, daemon=True, name="shard-receiver")
            self._receiver.start()
        self._received.put((unit, version, work))

    def _receive_loop(self) -> None:
        while True:
            item = self._received.get()
            if item is None:
                return
            unit, version, work = item
            try:
                work.wait()
                self.store.refresh_stream(unit)
                self.store.set_version(unit, version)
            except BaseException as e:  # raised by end_step
                self._error = e
                return

    def end_step(self) -> None:
        """Wait until every broadcast of the step is done and every received unit is in place."""
        for work in self._sent:
            work.wait()
        self._sent = []
        if self._receiver is not None:
            self._received.put(None)
            self._receiver.join()
            self._receiver = None
        if self._error is not None:
            raise RuntimeError(f"receiving another node's updated units failed: {self._error}")

    def gather_states(self, step: int, units: int) -> None:
        """Give every node the AdamW states of all units (each from its owner), at boundary ``step``."""
        if self.states_at == step:
            return
        for unit in range(units):
            for kind in ("exp_avg", "exp_avg_sq"):
                self.dist.broadcast(self._bytes(kind, unit), src=self.owner(unit))
        self.states_at = step

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class ShardedOptimizer:
    """A unit's optimizer in a sharded run (the protocol of :mod:`megatrain_ray.engine.sink.updates`):
    ``update`` applies it where this node owns the unit, then exchanges the unit's master weights;
    it returns None where another node owns it (whose weights, once received, set its version)."""

    def __init__(self, inner, shards: OptimizerShards):
        self.inner, self.shards = inner, shards

    def update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> bool | None:
        done = self.inner.update(unit, grad, coef, step) if self.shards.owns(unit) else None
        self.shards.share(unit, step + 1)
        return done

    def finish(self, unit: int, step: int) -> None:
        self.inner.finish(unit, step)


class Unsharded:
    """No sharded optimizer: this sink updates every unit, and exchanges nothing."""

    def end_step(self) -> None:
        pass

    def gather_states(self, step: int, units: int) -> None:
        pass

    def close(self) -> None:
        pass


UNSHARDED = Unsharded()
