"""The host-memory peak counts the private pages of processes a run starts and the shared-memory
files it makes, each once."""

import pathlib
import subprocess
import sys
import time

from megatrain_ray.hostmem import HostMemoryPeak, used_bytes


def test_counts_child_private_memory_and_shm(shm_dir):
    child = "import time, numpy as np; a = np.ones(256 * 2**20 // 8); print('ready', flush=True); time.sleep(2)"
    with HostMemoryPeak(period_s=0.05, shm_dir=shm_dir) as mem:
        with open(pathlib.Path(shm_dir) / "segment", "wb") as f:
            for _ in range(64):
                f.write(b"x" * 2**20)
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        mem.sample()
        proc.wait()
    assert 64 * 2**20 <= mem.accounted_shm < 65 * 2**20
    assert mem.shm_peak == mem.accounted_shm  # the segment stayed to the end
    assert mem.accounted - mem.accounted_shm >= 256 * 2**20  # the child's array: private, resident
    assert mem.added > 0
    s = mem.summary(num_params=2**20)
    assert abs(s["host_accounted_bytes_per_param"] * 2**20 - mem.accounted) < 1e-3 * mem.accounted
    assert max(s["host_private_by_process_gib"].values()) >= 0.25


def test_baseline_waits_until_memory_stops_falling(shm_dir):
    """A previous run's memory coming back while the next starts must not hide what the next adds:
    the baseline is taken once used memory has stopped falling."""
    path = pathlib.Path(shm_dir) / "previous-run"
    with open(path, "wb") as f:
        for _ in range(512):
            f.write(b"x" * 2**20)

    def release():  # the previous run's segment goes away in pieces, over ~1 s (each more than the
        with open(path, "r+b") as f:  # 128 MiB per 0.5 s that counts as still falling)
            for size in (340, 170, 0):
                time.sleep(0.3)
                f.truncate(size * 2**20)

    import threading

    t = threading.Thread(target=release)
    t.start()
    start = time.monotonic()
    with HostMemoryPeak(period_s=0.05, shm_dir=shm_dir) as mem:
        waited = time.monotonic() - start
    t.join()
    used_after = used_bytes()
    assert waited >= 0.8  # it waited for the release...
    # ...so none of the 512 MiB is in the baseline. Compared with memory just after the release, not
    # before it: other processes of a busy machine move by ~100 MiB over the test's seconds, but hardly
    # over the instant between the baseline and this line. A baseline taken before the last piece
    # went (170 MiB) fails this.
    assert mem.baseline <= used_after + 128 * 2**20
    assert path.stat().st_size == 0  # the release did happen, during the test (system-wide memory is too noisy to show it)
