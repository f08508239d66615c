"""A recorder of every tensor an eager computation allocates, for checking the planner's memory rows.

:class:`AllocationRecorder` is a TorchDispatchMode: each op's output tensors that bring a storage
not seen before are counted (the storage's bytes) until that storage is freed (a weakref finalizer
on it: torch keeps one Python object per storage, so it fires when the storage itself dies, however
many views or autograd's saved tensors held it). ``peak`` is the largest sum of live storages, and
``at_peak`` what made it up (bytes, shape, dtype, op, the Python stack). Tensors that exist before
the recorded call (inputs, weights) are not counted, nor an op's output that shares an input's
storage (a view, an in-place result). What a
kernel allocates internally (a workspace that no op returns) is invisible here.
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Allocation:
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    op: str
    stack: tuple[str, ...]
    """file:line of the package's frames that made it, innermost last."""


class AllocationRecorder(TorchDispatchMode):
    """Live bytes of the storages the ops run under it allocate; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, Allocation] = {}
        self.bytes = 0
        self.peak = 0
        self.at_peak: list[Allocation] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self.live or ptr in inputs:  # a view or an in-place result: no allocation
                continue
            frames = tuple(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()
                           if "megatrain_ray" in f.filename)
            self.live[ptr] = Allocation(nbytes, tuple(t.shape), t.dtype, str(func), frames)
            self.bytes += nbytes
            weakref.finalize(storage, self._free, ptr)
            if self.bytes > self.peak:
                self.peak, self.at_peak = self.bytes, list(self.live.values())
        return out

    def _free(self, ptr: int) -> None:
        self.bytes -= self.live.pop(ptr).nbytes

    def report(self, per: int = 1) -> str:
        """The allocations live at the peak, largest first (bytes / ``per``, e.g. per token)."""
        return "\n".join(f"{a.nbytes / per:>12,.1f} {a.shape} {str(a.dtype).removeprefix('torch.')} {a.op} "
                         f"{' > '.join(a.stack[-2:])}" for a in sorted(self.at_peak, key=lambda a: -a.nbytes))
