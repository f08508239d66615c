"""Measure the peak resident memory of importing an HF checkpoint into a host store (run as a script).

    python tests/import_memory.py HF_DIR SHM_DIR  ->  one JSON line

Imports happen first, then the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``), so
the peak reported is that of creating the store and loading the checkpoint into it, above the
baseline: the store's own pages (they are faulted in at creation), plus whatever the import adds.
"""

import json
import os
import sys

import torch  # noqa: F401  (imported before the baseline)
from safetensors import safe_open  # noqa: F401

from megatrain_ray.config import PrecisionSection
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.io import hf_io
from megatrain_ray.model.precision import resolve_precision


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main(hf_dir: str, shm_dir: str) -> None:
    cfg, _ = hf_io.read_config(hf_dir)
    spec = StoreSpec(cfg, resolve_precision(PrecisionSection(), "cpu"), shm_dir, os.getpid(), "mem")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    baseline = status_kib("VmRSS")
    store = ParameterStore(spec, seed=0, init_from=hf_dir)
    peak = status_kib("VmHWM")
    try:
        print(json.dumps({"baseline": baseline * 1024, "peak": peak * 1024, "store_bytes": spec.nbytes(),
                          "weights_bytes": sum(t.param_count for t in store.store.layout.templates) * 4}))
    finally:
        store.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
