"""Golden losses: the default run must reproduce the per-step losses stored in tests/golden/.

The run is the built-in configuration (``load_config(None)``: the default model shape, the built-in
corpus) for 8 steps on the CPU in fp32, through the single-process driver
(:func:`megatrain_ray.orchestration.local.train_local`: the same store, prefetcher, compute worker
and sink as a Ray run, without Ray). Threads are pinned to one (torch's and the AdamW kernel's),
so that no reduction order depends on the machine's core count.

A change that does not touch the math (a refactor, a new layout, a faster kernel that computes the
same thing) must leave every loss bit-for-bit equal. When the math changes on purpose (a new
default, a different summation order, a fix), regenerate the file and say so in the commit message:

    PYTHONPATH=. python tests/test_golden.py        # rewrites tests/golden/tiny_default.json

and review the diff of the losses: they should move a little (a different rounding) or as the change
intends, never jump. A different torch version or CPU (other GEMM kernels) may also change the last
bits; the file records the torch version it was made with.
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
OVERRIDES = [f"train.steps={STEPS}", "runtime.device=cpu", "runtime.optimizer_threads=1"]


def run_losses(shm_dir: str) -> list[float]:
    """The per-step training losses of the golden run (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = train_local(load_config(None, [*OVERRIDES, f"runtime.shm_dir={shm_dir}"]), 0)
    finally:
        torch.set_num_threads(threads)
    return [row["loss"] for row in rows]


def test_default_run_reproduces_the_golden_losses(shm_dir):
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert golden["overrides"] == OVERRIDES, "the golden file was made with other overrides: regenerate it"
    got = run_losses(shm_dir)
    assert got == golden["losses"], (
        f"losses differ from {GOLDEN} (made with torch {golden['torch']}, this is {torch.__version__}):\n"
        + "\n".join(f"  step {i}: golden {g!r}, got {x!r}" for i, (g, x) in enumerate(zip(golden["losses"], got))
                    if g != x))


def _write() -> None:
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=base, prefix="megatrain-golden-") as shm_dir:
        losses = run_losses(shm_dir)
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
        json.dump({"overrides": OVERRIDES, "torch": torch.__version__, "machine": platform.machine(),
                   "losses": losses}, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN}: {losses}")


if __name__ == "__main__":
    _write()
