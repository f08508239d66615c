"""Shared fixtures: one real local Ray cluster for the whole test session."""

import os

import pytest
import ray


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray (8 logical CPUs, no GPU, no dashboard), shared by every test that needs it."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=8, num_gpus=0, include_dashboard=False, object_store_memory=200 * 2**20,
                 log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def shm_dir(tmp_path_factory):
    """A private directory standing in for /dev/shm, so tests can list exactly what a run left."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path_factory.getbasetemp())
    path = os.path.join(base, f"megatrain-test-{os.getpid()}-{os.urandom(4).hex()}")
    os.makedirs(path)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)
