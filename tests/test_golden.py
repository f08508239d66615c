"""Golden losses: the default run must reproduce the per-step losses stored in tests/golden/.

The run is the built-in configuration (``load_config(None)``: the default model shape, the built-in
corpus) for 8 steps on the CPU in fp32, through the single-process driver
(:func:`megatrain_ray.orchestration.local.train_local`: the same store, prefetcher, compute worker
and sink as a Ray run, without Ray). Threads are pinned to one (torch's and the AdamW kernel's),
so that no reduction order depends on the machine's core count.

The file holds one entry per machine it was recorded on (torch version, torch's CPU kernel level,
CPU model: what picks the GEMM kernels, and so the rounding). On a machine with an entry every
loss must be equal bit for bit: a change that does not touch the math (a refactor, a new layout, a
faster kernel that computes the same thing) leaves them so. On another machine the same math
rounds differently, so there the losses must be within :data:`CROSS_MACHINE_ULPS` of an entry's.

When the math changes on purpose (a new default, a different summation order, a fix), regenerate
the file and say so in the commit message:

    PYTHONPATH=. python tests/test_golden.py          # rewrites it with this machine's entry only
    PYTHONPATH=. python tests/test_golden.py --add    # adds (or replaces) this machine's entry

and review the diff of the losses: they should move a little (a different rounding) or as the change
intends, never jump.
"""

import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.orchestration.local import train_local  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_default.json")
STEPS = 8
OVERRIDES = [f"train.steps={STEPS}", "compute.device=cpu", "parallel.optimizer_threads=1"]
CROSS_MACHINE_ULPS = 16
"""On a machine without an entry, each loss may differ from an entry's by 16 fp32 ulps of the loss
(16 * 2^-23 * |loss|, 1.9e-6 of it). Another GEMM kernel orders the same sums differently; over
these 8 steps that moved the losses by at most 1 ulp (2.2e-7 of the loss: an AMD EPYC, AVX512,
against the file's first entry, same torch). The smallest deliberate changes of the math tried move
them 7x beyond the band or more: lr x 1.001 by 1.9e-5 of the loss at step 1 and 2e-4 by step 7,
AdamW eps 1e-8 -> 1e-7 by 1.4e-5 or more from step 1 on; a wrong gradient or update term moves
them by far more."""
EPS32 = torch.finfo(torch.float32).eps


def run_losses(shm_dir: str) -> list[float]:
    """The per-step training losses of the golden run (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = train_local(load_config(None, [*OVERRIDES, f"memory.shm_dir={shm_dir}"]), 0)
    finally:
        torch.set_num_threads(threads)
    return [row["loss"] for row in rows]


def machine() -> dict:
    """What decides the rounding of the golden run here: torch, its CPU kernel level, the CPU model."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": model}


def _differences(golden: list[float], got: list[float]) -> str:
    return "\n".join(f"  step {i}: golden {g!r}, got {x!r}" for i, (g, x) in enumerate(zip(golden, got)) if g != x)


def test_default_run_reproduces_the_golden_losses(shm_dir):
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert golden["overrides"] == OVERRIDES, "the golden file was made with other overrides: regenerate it"
    got = run_losses(shm_dir)
    here = machine()
    same = [entry for entry in golden["machines"] if entry["machine"] == here]
    if same:
        assert got == same[0]["losses"], (
            f"losses differ from {GOLDEN}, recorded on this machine ({here}):\n"
            + _differences(same[0]["losses"], got))
        return
    entries = sorted(golden["machines"], key=lambda entry: entry["machine"]["torch"] != here["torch"])
    for entry in entries:
        if all(abs(x - g) <= CROSS_MACHINE_ULPS * EPS32 * abs(g) for g, x in zip(entry["losses"], got)):
            return
    raise AssertionError(
        f"losses differ by more than {CROSS_MACHINE_ULPS} ulps from every entry of {GOLDEN} "
        f"(this machine, {here}, has none; the nearest is {entries[0]['machine']}):\n"
        + _differences(entries[0]["losses"], got))


def _write(add: bool) -> None:
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=base, prefix="megatrain-golden-") as shm_dir:
        losses = run_losses(shm_dir)
    here = machine()
    entries = []
    if add and os.path.exists(GOLDEN):
        with open(GOLDEN) as f:
            entries = [entry for entry in json.load(f)["machines"] if entry["machine"] != here]
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
        json.dump({"overrides": OVERRIDES, "machines": [*entries, {"machine": here, "losses": losses}]}, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN} ({here}): {losses}")


if __name__ == "__main__":
    _write(add="--add" in sys.argv[1:])
