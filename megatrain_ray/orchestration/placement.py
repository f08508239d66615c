"""Where each streamed unit's AdamW update runs (optim.placement), decided once by the resolved run.

- ``host``: every streamed unit by the gradient sink, on the host's CPU threads;
- ``device``: every streamed unit on the compute worker's device
  (:mod:`megatrain_ray.engine.compute.device_updates`), its state copied in and written back;
- ``auto``: from the plan's arithmetic (:class:`~megatrain_ray.orchestration.pace.UpdatePace`). The
  host's updates of a step run beside the device's next step, so they cost nothing while they and the
  forward before the first gradient take less than it; with clipping they wait for the step's norm,
  start at its backward's end and the next forward follows them (their first pass, where the update
  runs in two: :meth:`~megatrain_ray.orchestration.pace.UpdatePace.host_path_s`), so they cost nothing
  while that share of them takes less than that forward; the device's updates run from the step's end
  beside the next forward (:mod:`megatrain_ray.engine.compute.device_updates`), which follows them, so
  they cost what their state's trip over the link outlasts the forward over their units by. Auto keeps
  every unit on the host where that host path is no longer than the device's step (most dense runs at
  their FLOPs per parameter), else moves units to the device, from the front of the forward's order
  (the first it needs: the host's, last, then have that forward's time too): as many as give the
  shortest step (both paths finish closer together), weighing every count that fits (a move that does
  not shorten the step alone may let the next ones do).
  Each move is weighed with the activations placed again beside it: the moved units' fp32 gradients,
  held until their update, and the pieces of a unit's state on the device while it is updated take
  device memory that kept activations had, so a move may bring recompute with it; moving stops where
  the plan's device total would exceed the device's usable memory. With the gradients held on the
  device for the step's norm (experimental.hold_grads, the 8-bit state's default on a GPU) the host's
  updates start at the step's end and the next forward follows them, so a unit moved shortens that
  path by its host update; the units moved keep their fp32 gradients on the device instead of the
  held ones. It moves none where the device update cannot serve the run (the cpu device, whose
  "device" is the host; bf16 master weights with the exact state; several compute workers; LoRA) or
  where the GPU memory is not known.
"""

from __future__ import annotations

from typing import Callable

from ..config import TrainConfig
from ..engine.compute.device_updates import state_bytes
from ..engine.policy import updated_on_device
from ..model.layout import StoreLayout
from ..model.precision import Precision
from .pace import (HOST_ADAMW_PARAMS_PER_THREAD_S, HOST_COMPACT_PARAMS_PER_THREAD_S, SPLIT_FIRST_PASS, Pace,
                   UpdatePace)


def update_pace(layout: StoreLayout, host_units, host_threads: int, on_device, precision: Precision,
                held: bool, after_norm: bool = False, split: bool = False) -> UpdatePace:
    """The arithmetic of a split: ``host_units`` updated on ``host_threads`` CPU threads (at the rate of
    the run's optimizer state; ``held``: their gradients wait on the device for the step's norm;
    ``after_norm``: their updates wait for it, ``split``: in two passes, the next forward waiting on
    the first), ``on_device`` on the device (their state in and out,
    :func:`~megatrain_ray.engine.compute.device_updates.state_bytes`)."""
    numel = layout.templates
    stream = precision.compute.itemsize if precision.separate_stream_copy else 0
    rate = HOST_COMPACT_PARAMS_PER_THREAD_S if precision.compact else HOST_ADAMW_PARAMS_PER_THREAD_S
    last = max(host_units, default=len(numel))  # the last unit of the forward's order the host updates
    lead = max(on_device, default=-1) + 1  # the units of the forward's order up to the last the device updates
    return UpdatePace(sum(numel[u].numel for u in host_units), host_threads, sum(numel[u].numel for u in on_device),
                      *state_bytes(precision.compact, stream), rate, held, held or after_norm,
                      SPLIT_FIRST_PASS if split else 1.0, min(1.0, last / len(numel)), lead / len(numel))


def units_on_device(cfg: TrainConfig, device: str, layout: StoreLayout, resident: tuple[int, ...], host_threads: int,
                    precision: Precision, held: bool, plan_for: Callable[[tuple[int, ...]], tuple[Pace, bool]] | None,
                    after_norm: bool = False, split: bool = False) -> tuple[int, ...]:
    """The streamed units whose update runs on the device, in layout order (see the module docstring).
    ``held``: the host units' gradients wait on the device for the step's norm (``StoreSpec.hold_grads``);
    ``after_norm``, ``split``: the host's updates wait for it, in two passes (:func:`update_pace`);
    ``plan_for(units)``: the pace with the activations placed beside ``units`` updated on the device,
    and whether the plan's device total then fits (None: the GPU memory is unknown)."""
    placement, n = cfg.optim.placement, len(layout.units)
    if cfg.lora.enabled or placement != "auto":
        return () if cfg.lora.enabled else updated_on_device(n, resident, placement)
    if (device != "cuda" or plan_for is None or (precision.master.itemsize != 4 and not precision.compact)
            or cfg.parallel.workers > 1):
        return ()
    streamed = [u for u in range(n) if u not in resident]

    def updates(device_units: list[int]) -> UpdatePace:
        host = [u for u in streamed if u not in device_units]
        return update_pace(layout, host, host_threads, device_units, precision, held, after_norm, split)

    moved: list[int] = []
    pace = plan_for(())[0]
    if updates(moved).host_path_s(pace) <= pace.step_s:
        return ()  # the step hides the host's updates
    best, chosen = updates(moved).step_s(pace), 0
    for u in streamed:
        pace, fits = plan_for(tuple(sorted(moved + [u])))
        if not fits:
            break
        moved.append(u)
        shorter = updates(moved).step_s(pace)
        if shorter < best:
            best, chosen = shorter, len(moved)
    return tuple(sorted(moved[:chosen]))
