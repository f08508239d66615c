"""The optimizer protocol of the host store's units, and its implementations.

One protocol, two calls, whatever the update's precision or number of passes:

- ``update(unit, grad, coef, step) -> bool``: apply step ``step``'s update to ``unit`` (an index
  of the layout) from its gradient ``grad`` (a flat block, scaled by the clipping factor ``coef``
  as it is read); True when the unit is then whole at ``step + 1`` updates, False when the stream
  copy (what the next forward fetches) and the moments are, but its master weights wait for
  ``finish``;
- ``finish(unit, step)``: the rest of an update that returned False.

The sink sets the versions the call completes (:class:`~megatrain_ray.engine.store.host_store.HostStore`) and
knows nothing else of the update. :func:`host_optimizer` builds the one a policy names
(:mod:`megatrain_ray.engine.policy`): :class:`ExactAdamW`, :class:`SplitAdamW` or
:class:`CompactAdamW`, all over the same :class:`~megatrain_ray.engine.optim.AdamWRunner` and the
store's blocks; the device-side optimizer of resident units implements the same protocol on the
compute worker (:class:`~megatrain_ray.engine.compute.resident.DeviceAdamW`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...config import OptimConfig, lr_at
from ..optim import AdamWRunner
from ..policy import COMPACT, EXACT, SPLIT


class UnitOptimizer(Protocol):
    def update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> bool: ...

    def finish(self, unit: int, step: int) -> None: ...


class ExactAdamW:
    """AdamW in one pass on the host store's blocks (master, moments, stream copy)."""

    def __init__(self, store, runner: AdamWRunner, optim: OptimConfig, total_steps: int):
        self.store, self.runner, self.optim, self.total_steps = store, runner, optim, total_steps

    def lr(self, step: int) -> float:
        return lr_at(self.optim, step, self.total_steps)

    def _stream(self, unit: int) -> torch.Tensor | None:
        return self.store.block("stream", unit) if self.store.separate_stream_copy else None

    def _decay_numel(self, unit: int) -> int:
        return self.store.layout.templates[unit].decay_numel

    def update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> bool:
        s = self.store
        self.runner.update(s.block("master", unit), grad, s.block("exp_avg", unit), s.block("exp_avg_sq", unit),
                           self._stream(unit), self._decay_numel(unit), step + 1, self.lr(step), self.optim,
                           grad_scale=coef, unit=unit)
        return True

    def finish(self, unit: int, step: int) -> None:
        pass


class SplitAdamW(ExactAdamW):
    """The same update in two passes where the kernel allows (fp32 master, a compute-dtype stream
    copy, the native kernel; see :meth:`~megatrain_ray.engine.optim.AdamWRunner.splits`): first
    the moments and the stream copy, then (``finish``) the master weights from the new moments.
    Bit for bit :class:`ExactAdamW`; where the kernel does not allow it, that."""

    def update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> bool:
        s = self.store
        stream = self._stream(unit)
        if not self.runner.splits(s.block("master", unit), grad, stream):
            return super().update(unit, grad, coef, step)
        self.runner.update_stream(s.block("master", unit), grad, s.block("exp_avg", unit), s.block("exp_avg_sq", unit),
                                  stream, self._decay_numel(unit), step + 1, self.lr(step), self.optim, grad_scale=coef)
        return False

    def finish(self, unit: int, step: int) -> None:
        s = self.store
        self.runner.update_master(s.block("master", unit), s.block("exp_avg", unit), s.block("exp_avg_sq", unit),
                                  self._decay_numel(unit), step + 1, self.lr(step), self.optim)


class CompactAdamW(ExactAdamW):
    """AdamW with 8-bit moments and their block scales (:mod:`megatrain_ray.engine.compact`)."""

    def update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> bool:
        s = self.store
        self.runner.update_compact(
            s.block("master", unit), grad, s.block("exp_avg", unit), s.block("exp_avg_sq", unit),
            s.scale_block("exp_avg_scale", unit), s.scale_block("exp_avg_sq_scale", unit), self._stream(unit),
            self._decay_numel(unit), unit, step + 1, self.lr(step), self.optim, grad_scale=coef)
        return True


def host_optimizer(kind: str, store, runner: AdamWRunner, optim: OptimConfig, total_steps: int) -> UnitOptimizer:
    """The host optimizer a policy names: exact, split or compact."""
    classes = {EXACT: ExactAdamW, SPLIT: SplitAdamW, COMPACT: CompactAdamW}
    return classes[kind](store, runner, optim, total_steps)
