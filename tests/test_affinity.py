"""CPU placement near the GPU (megatrain_ray.engine.affinity): the topology read from a sysfs tree,
the plan on synthetic machines (two sockets, GPUs sharing a socket, an unknown topology, a
taskset-restricted process, a box too small to split), and pinning applied for real to every
thread of this process (then undone)."""

import os
import threading

import pytest
import torch

from megatrain_ray.engine import affinity
from megatrain_ray.engine.affinity import format_cpulist, local_cpus, parse_cpulist, pci_address, pick_cpus


def test_cpu_lists_and_pci_addresses():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert parse_cpulist(format_cpulist(range(0, 64, 2))) == list(range(0, 64, 2))
    assert pci_address("00000000:18:00.0") == "0000:18:00.0"
    assert pci_address("0000:9A:00.0\n") == "0000:9a:00.0"
    assert pci_address("3b:00.0") == "0000:3b:00.0"


def test_local_cpus_from_a_sysfs_tree(tmp_path):
    gpu = tmp_path / "bus" / "pci" / "devices" / "0000:9a:00.0"
    gpu.mkdir(parents=True)
    (gpu / "local_cpulist").write_text("16-31,48-63\n")
    (gpu / "numa_node").write_text("1\n")
    assert local_cpus("0000:9a:00.0", str(tmp_path)) == (1, [*range(16, 32), *range(48, 64)])
    (gpu / "numa_node").write_text("-1\n")  # a one-node box, or a firmware that does not say
    assert local_cpus("0000:9a:00.0", str(tmp_path))[0] is None
    assert local_cpus("0000:18:00.0", str(tmp_path)) == (None, None)  # no such device
    assert local_cpus(None, str(tmp_path)) == (None, None)  # no GPU


def test_plan_on_two_sockets_puts_each_worker_near_its_gpu_and_adamw_on_the_rest():
    socket0, socket1 = list(range(0, 16)), list(range(16, 32))
    picks, rest = pick_cpus([socket0, socket1], list(range(32)), per_worker=2)
    assert picks == [[0, 1], [16, 17]]
    assert rest == [c for c in range(32) if c not in (0, 1, 16, 17)]


def test_plan_with_gpus_on_one_socket_gives_disjoint_cpus():
    socket0 = list(range(0, 16))
    picks, rest = pick_cpus([socket0, socket0, socket0], list(range(32)))  # 4 each by default
    assert picks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert set(rest) == set(range(12, 32))


def test_plan_respects_the_usable_cpus_and_unknown_topologies():
    picks, rest = pick_cpus([list(range(16)), None], [6, 7, 8, 9, 20, 21], 2)  # taskset 6-9,20-21
    assert picks == [[6, 7], None] and rest == [8, 9, 20, 21]
    assert pick_cpus([None, None], list(range(8))) == ([None, None], None)  # nothing known: nothing pinned
    assert pick_cpus([[0, 1]], [0, 1]) == ([[0, 1]], None)  # no CPU left for AdamW: it stays unpinned
    picks, rest = pick_cpus([[0, 1, 2], [0, 1, 2]], list(range(4)), 2)  # the second worker gets what is left
    assert picks == [[0, 1], [2]] and rest == [3]


def test_pin_process_moves_every_thread_for_real():
    """On this machine: a thread already running, the calling thread and a thread started later all
    end up on the chosen CPU; the original affinity is restored afterwards."""
    before = os.sched_getaffinity(0)
    target = [min(before)]
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)
    early.start()
    tids = {}
    try:
        assert affinity.pin_process(target) >= 2
        started = threading.Event()

        def late_thread():
            tids["late"] = threading.get_native_id()
            started.set()
            stop.wait()

        threading.Thread(target=late_thread, daemon=True).start()
        assert started.wait(10)
        for tid in (early.native_id, threading.get_native_id(), tids["late"]):
            assert os.sched_getaffinity(tid) == set(target)
    finally:
        stop.set()
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), before)
            except ProcessLookupError:
                pass
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_has_a_pci_address_and_local_cpus():
    pci = affinity.gpu_pci_address(0)
    assert pci is not None and os.path.isdir(f"/sys/bus/pci/devices/{pci}"), pci
    node, cpus = local_cpus(pci)
    assert cpus and set(cpus) <= set(range(os.cpu_count())), (pci, node, cpus)


def test_the_cpus_left_to_adamw_are_counted_as_the_pinning_picks_them(monkeypatch):
    """What the plan counts AdamW's threads from (Facts.adamw_cpus): the CPUs pick_cpus leaves after each
    worker's 4 near its GPU, on the usable CPUs; None where no GPU's neighbours are known."""
    usable = set(range(16))
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: usable)
    monkeypatch.setattr(affinity, "gpu_pci_address", lambda index: f"0000:{index:02x}:00.0")
    near = {"0000:00:00.0": list(range(8)), "0000:01:00.0": list(range(8, 16))}
    monkeypatch.setattr(affinity, "local_cpus", lambda pci: (0, near.get(pci)))
    assert affinity.adamw_cpus_near(1) == 12
    assert affinity.adamw_cpus_near(2) == 8
    usable = set(range(4, 16))  # the process may not run on CPUs 0-3: worker 0 takes 4-7
    assert affinity.adamw_cpus_near(1) == 8
    monkeypatch.setattr(affinity, "local_cpus", lambda pci: (None, None))
    assert affinity.adamw_cpus_near(1) is None
