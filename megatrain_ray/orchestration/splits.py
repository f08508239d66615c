"""The micro-batch split ``megatrain-ray plan`` advises: the step's sequences in fewer, larger micro-batches.

Layer-major order passes every unit once per micro-batch (its fixed costs, the addition of its weight
gradient into the fp32 accumulator) and, in a mixture of experts, reads every routed expert's weights
once per micro-batch and pass: where each expert gets few rows, those reads rival its GEMMs. The same
sequences a step in fewer micro-batches are the same data (a router's load-balancing loss, where the
model adds one, is taken per micro-batch) and may be faster. :func:`split_note` asks the pace for
each such split that fits the device with the run's other decisions (its resident units, its
updates' placement; each layer's activations placed again for the larger micro-batch) and names the
splits that save at least :data:`ADVISED_SAVING` of the step; the run trains the split its config
names.
"""

from __future__ import annotations

import dataclasses

from .pace import duration
from .preflight import host_for
from .resolve import ResolvedRun, decide, fits_device

ADVISED_SAVING = 0.05
"""The least share of the expected step a split must save to be advised."""


def faster_splits(run: ResolvedRun) -> list[tuple[int, int, float]]:
    """(micro-batches, sequences each, expected step s) of every split of ``run``'s sequences a step
    into fewer micro-batches (a multiple of the compute workers) that fits its device, the fastest
    first; none on a CPU or where the device's memory is not known."""
    cfg, t = run.config, run.config.train
    largest = run.memory.largest_micro_batch
    if run.device != "cuda" or not largest:
        return []
    sequences = t.micro_batch_size * t.num_micro_batches
    decided, host, out = run.decisions, host_for(run.facts.host_bytes), []
    for n in range(cfg.parallel.workers, t.num_micro_batches, cfg.parallel.workers):
        if sequences % n or sequences // n > largest:
            continue
        other = dataclasses.replace(cfg, train=dataclasses.replace(t, micro_batch_size=sequences // n,
                                                                   num_micro_batches=n))
        placed = decide(other, run.facts, run.layout, run.store, decided.resident, host, decided.on_device)
        if fits_device(other, placed, decided.on_device):
            out.append((n, sequences // n, run.updates.step_s(placed.pace)))
    return sorted(out, key=lambda split: split[2])


def split_note(run: ResolvedRun) -> str | None:
    """The plan's ``micro-batches:`` line where fewer, larger micro-batches would save at least
    :data:`ADVISED_SAVING` of the expected step (the three fastest such splits); None where none would."""
    now, t = run.updates.step_s(run.pace), run.config.train
    better = [s for s in faster_splits(run) if s[2] <= now * (1 - ADVISED_SAVING)]
    if not better:
        return None
    said = ", ".join(f"{n} x {each} ~{duration(s)}" for n, each, s in better[:3])
    return (f"micro-batches: the step's {t.micro_batch_size * t.num_micro_batches} sequences in fewer, larger "
            f"micro-batches would be faster: {said}, against ~{duration(now)} as {t.num_micro_batches} x "
            f"{t.micro_batch_size} (the same sequences a step; each unit is passed, and each routed expert's weights "
            "read, once per micro-batch); set train.num_micro_batches and train.micro_batch_size to use one")
