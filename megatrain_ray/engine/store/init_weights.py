"""A new run's random weights in the host store (no checkpoint to start from): see :func:`draw_random`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def draw_random(store, spec, seed: int) -> None:
    """Fill ``store`` (a :class:`~megatrain_ray.engine.store.host_store.HostStore`, laid out by ``spec``, a
    :class:`~megatrain_ray.engine.store.host_store.StoreSpec`) with: Normal(0, initializer_range) matrices, unit norms, zero biases; deterministic per unit and the
    same values, rounded to the master dtype, for every master dtype.

    Units are drawn on a pool of threads (torch's normal sampler is single-threaded, ~100 M
    values/s: a minute for 7B on one core), each from its own generator, in place. A quantized
    base's parameters are drawn one at a time into a transient of their own and quantized into
    the store, with torch's operations on one thread each meanwhile (the pool is the parallelism:
    its threads x intra-op threads would oversubscribe the cores many times over), so the
    transient memory is one parameter per thread.
    """
    std = spec.model.initializer_range

    quantized = store.base is not None
    compute = spec.precision.compute

    def init_unit(i: int) -> None:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        template = store.layout.templates[i]
        if quantized:
            params = ((name, torch.empty(shape, dtype=compute)) for name, shape, _ in template.params)
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

    units = range(len(store.layout.units))
    threads = torch.get_num_threads()
    if quantized:
        torch.set_num_threads(1)  # process-wide: the pool's threads see it too; restored below
    try:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(init_unit, sorted(units, key=lambda i: -store.layout.templates[i].numel)))
    finally:
        torch.set_num_threads(threads)
