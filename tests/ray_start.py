"""The test session's Ray, started within a bound that fits a busy CI machine.

``ray.init`` gives its raylet a fixed 30 s to register with the GCS; under a load of ~20 on two
cores it took longer, and every test that needs Ray errored at setup with Ray's "The current node
timed out during startup". :func:`start` waits for the raylet up to ``MEGATRAIN_TEST_RAY_START_S``
(300 s by default) instead, and past that fails in one sentence saying what was waited for, how
long, the machine's load, and what to set.
"""

import contextlib
import os
import time

import pytest

START_S = float(os.environ.get("MEGATRAIN_TEST_RAY_START_S", "300"))
"""How long the session's Ray may take to start (seconds)."""


def patient(get_node, bound_s: float, interval_s: float = 0.5):
    """``get_node`` (Ray's query for the raylet's registration, which raises RuntimeError until the raylet
    has registered) asked again until it answers or ``bound_s`` has passed since the first call."""
    def wait(*args, **kwargs):
        deadline = time.monotonic() + bound_s
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(interval_s)
    return wait


@contextlib.contextmanager
def _raylet_wait(bound_s: float):
    from ray._private import services

    plain = services.get_node
    services.get_node = patient(plain, bound_s)
    try:
        yield
    finally:
        services.get_node = plain


def start(init, bound_s: float = START_S) -> None:
    """``init()`` (the session's ``ray.init``) with the raylet waited for up to ``bound_s``; one sentence if it fails."""
    began = time.monotonic()
    try:
        with _raylet_wait(bound_s):
            init()
    except Exception as e:  # noqa: BLE001 (Ray's start-up errors are of several types)
        took = time.monotonic() - began
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        pytest.fail(f"the test session's Ray did not start within {took:.0f} s of a bound of {bound_s:.0f} s "
                    f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): {first.strip()}; set "
                    "MEGATRAIN_TEST_RAY_START_S to wait longer on a busy machine.", pytrace=False)
