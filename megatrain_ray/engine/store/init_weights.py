"""A new run's random weights in the host store (no checkpoint to start from): see :func:`draw_random`."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

PROCESS_DRAW_MIN = 2_000_000_000
"""Parameters from which a draw runs on a pool of processes instead of threads (see :func:`draw_random`)."""


def draw_unit(store, seed: int, i: int) -> None:
    """Draw unit i of ``store`` (a :class:`~megatrain_ray.engine.store.host_store.HostStore`) in place, from
    its own generator: Normal(0, initializer_range) matrices, unit norms, zero biases (see :func:`draw_random`)."""
    spec = store.spec
    std = spec.model.initializer_range
    quantized = store.base is not None
    gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
    template = store.layout.templates[i]
    if quantized:
        params = ((name, torch.empty(shape, dtype=spec.precision.compute)) for name, shape, _ in template.params)
    else:
        params = store.params("master", i).items()
    for name, p in params:
        if p.dim() >= 2 and p.dtype == torch.float32:
            torch.randn(p.shape, generator=gen, out=p)
            p.mul_(std)
        elif p.dim() >= 2:  # drawn in fp32 (a transient copy), as above: the same model rounded
            p.copy_(torch.randn(p.shape, generator=gen).mul_(std))
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.zero_()
        if quantized:
            store.write(i, name, p)
    store.refresh_stream(i)


def draw_random(store, spec, seed: int, processes: bool | None = None) -> None:
    """Fill ``store`` (a :class:`~megatrain_ray.engine.store.host_store.HostStore`, laid out by ``spec``, a
    :class:`~megatrain_ray.engine.store.host_store.StoreSpec`) with: Normal(0, initializer_range) matrices,
    unit norms, zero biases; deterministic per unit and the same values, rounded to the master dtype, for
    every master dtype (:func:`draw_unit`).

    Units are drawn in parallel, one per worker at a time (torch's normal sampler is single-threaded,
    ~100 M values/s: a minute for 7B on one core), each from its own generator, in place, with
    torch's operations on one thread each (the workers are the parallelism: their number x intra-op
    threads would oversubscribe the cores many times over). A quantized base's parameters are drawn
    one at a time into a transient of their own and quantized into the store, so the transient
    memory is one parameter per worker.

    The workers are threads for a small model and, from :data:`PROCESS_DRAW_MIN` parameters on
    (``processes`` None), processes that map the store's segments: a quantizer issues hundreds of
    small torch operations per parameter, each taking the interpreter lock, and each parameter's
    transients are mapped and unmapped again under the process's memory-map lock, so threads of one
    process on many cores contend (a 117B MXFP4 base drawn by 16 threads on 16 cores had not
    finished after 9 minutes, over 4x what one thread's rate gives). A process costs a second or two
    to start (an interpreter that imports torch), which only a large model repays.
    """
    units = sorted(range(len(store.layout.units)), key=lambda i: -store.layout.templates[i].numel)
    workers = max(1, torch.get_num_threads())
    if processes is None:
        processes = workers > 1 and store.layout.num_params >= PROCESS_DRAW_MIN
    if processes:
        _draw_in_processes(type(store), spec, seed, units, min(workers, len(units)))
        return
    torch.set_num_threads(1)  # process-wide: the pool's threads see it too; restored below
    try:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda i: draw_unit(store, seed, i), units))
    finally:
        torch.set_num_threads(workers)


_attached = None
"""The store's mapping in a drawing process (:func:`_attach`)."""


def _attach(mapping: type, spec) -> None:
    global _attached
    torch.set_num_threads(1)
    _attached = mapping(spec)


def _draw_attached(seed: int, i: int) -> None:
    draw_unit(_attached, seed, i)


def _draw_in_processes(mapping: type, spec, seed: int, units: list[int], workers: int) -> None:
    """Draw ``units`` (largest first) on ``workers`` spawned processes, each mapping the store's segments
    as a ``mapping`` (the store's class, HostStore) of ``spec``."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_attach,
                                 initargs=(mapping, spec)) as pool:
            for future in [pool.submit(_draw_attached, seed, i) for i in units]:
                future.result()
    except BrokenProcessPool as e:
        raise RuntimeError(f"a process drawing the model's random weights died ({e}); the machine may be out of "
                           "memory: free some, or start from a checkpoint with train.init_from") from e
