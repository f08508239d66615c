"""Peak host memory of a benchmark run, measured two ways while it runs.

- ``added``: the machine's used memory (MemTotal - MemAvailable) at its peak, minus what was used
  before the run. It sees everything, pinned driver allocations included, but also whatever else
  the machine did meanwhile; so the baseline is taken once used memory has stopped falling (a
  previous run's processes can take many seconds to give theirs back).
- ``accounted``: at its peak, the private resident memory (RSS less its file-backed and shared
  pages) of this process and every process it started (Ray's GCS, raylet and workers are its
  descendants), plus the bytes the shared-memory directory gained (the parameter store's
  segments and Ray's object store). Each page is counted once, so this is "peak RSS + shared
  memory", with a breakdown by process. Pinned buffers from the CUDA driver are not in any RSS;
  ``added`` has them.
"""

from __future__ import annotations

import os
import threading
import time

import psutil


def used_bytes() -> int:
    """MemTotal - MemAvailable (counts /dev/shm and every process)."""
    vm = psutil.virtual_memory()
    return vm.total - vm.available


def settled_used_bytes(limit_s: float, step_s: float = 0.5, tolerance: int = 128 * 2**20, calm: int = 2) -> int:
    """:func:`used_bytes` once it has stopped falling by more than ``tolerance`` per ``step_s`` for
    ``calm`` steps in a row (one quiet step can be a release delayed on a busy machine), waiting at
    most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    used, quiet = used_bytes(), 0
    while time.monotonic() < deadline:
        time.sleep(step_s)
        now = used_bytes()
        quiet = quiet + 1 if now > used - tolerance else 0
        used = now
        if quiet >= calm:
            return now
    return used


def shm_bytes(directory: str = "/dev/shm") -> int:
    """Bytes allocated (not the nominal sizes) by the files in ``directory``."""
    total = 0
    try:
        with os.scandir(directory) as it:
            for entry in it:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass  # removed while we looked
    except OSError:
        pass
    return total


def private_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` that are neither file-backed nor shared memory (RssAnon)."""
    info = proc.memory_info()
    return max(0, info.rss - getattr(info, "shared", 0))


def process_tree(root: psutil.Process | None = None) -> list[psutil.Process]:
    root = root or psutil.Process()
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


class HostMemoryPeak:
    """Samples host memory in a thread while a run is inside ``with``; see the module docstring.

    Attributes after the block: ``added`` (bytes), ``accounted`` (bytes), ``accounted_shm`` (the
    shared-memory part of it), ``by_process`` ({process name: private bytes} at that peak) and
    ``shm_peak`` (the most the shared-memory directory gained at any sample: with a small store,
    the accounted peak can fall after the store is gone, when processes alone weigh more).
    """

    def __init__(self, period_s: float = 0.25, shm_dir: str = "/dev/shm", settle_s: float = 60.0):
        self.period_s, self.shm_dir, self.settle_s = period_s, shm_dir, settle_s
        self.accounted, self.accounted_shm, self.by_process, self.shm_peak = 0, 0, {}, 0
        self._lock = threading.Lock()  # the thread's samples and the caller's, one at a time

    def __enter__(self):
        self.baseline = self.peak = settled_used_bytes(self.settle_s)
        self.shm_baseline = shm_bytes(self.shm_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="host-memory-peak")
        self._thread.start()
        return self

    def sample(self) -> None:
        """Take one sample now (the thread calls this every ``period_s``)."""
        with self._lock:
            self._sample_once()

    def _sample_once(self) -> None:
        self.peak = max(self.peak, used_bytes())
        shm = max(0, shm_bytes(self.shm_dir) - self.shm_baseline)
        self.shm_peak = max(self.shm_peak, shm)
        per = {}
        for proc in process_tree():
            try:
                name = proc.name()
                per[name] = per.get(name, 0) + private_rss(proc)
            except psutil.Error:
                pass  # exited while we looked
        total = shm + sum(per.values())
        if total > self.accounted:
            self.accounted, self.accounted_shm, self.by_process = total, shm, per

    def _sample(self):
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def added(self) -> int:
        return self.peak - self.baseline

    def summary(self, num_params: int) -> dict:
        """The JSON fields a benchmark records (GiB, and bytes per parameter of ``num_params``)."""
        top = sorted(self.by_process.items(), key=lambda kv: -kv[1])[:12]
        return {"host_peak_added_gib": self.added / 2**30,
                "host_bytes_per_param": self.added / num_params,
                "host_accounted_gib": self.accounted / 2**30,
                "host_accounted_bytes_per_param": self.accounted / num_params,
                "host_accounted_shm_gib": self.accounted_shm / 2**30,
                "host_shm_peak_gib": self.shm_peak / 2**30,
                "host_accounted_processes_gib": (self.accounted - self.accounted_shm) / 2**30,
                "host_private_by_process_gib": {k: round(v / 2**30, 3) for k, v in top}}
