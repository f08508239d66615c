"""The test session's Ray start (tests/ray_start.py): the raylet waited for past Ray's fixed 30 s,
up to the session's bound, and one sentence when even that is exceeded."""

import pytest
from ray._private import services

import ray_start


def _registers_after(calls: int, seen: list):
    """Ray's query for the raylet's registration as a slow raylet answers it: RuntimeError ``calls`` times."""
    def get_node(gcs_address, node_id):
        seen.append((gcs_address, node_id))
        if len(seen) <= calls:
            raise RuntimeError(f"node {node_id} not found")
        return {"NodeID": node_id}
    return get_node


def test_the_raylet_is_waited_for_until_it_registers(monkeypatch):
    seen = []
    slow = _registers_after(3, seen)
    monkeypatch.setattr(services, "get_node", slow)
    answers = []
    # What ray.init's node start calls once per 0.1 s for 30 s at most: here one call waits it out.
    ray_start.start(lambda: answers.append(services.get_node("gcs:1", "n1")), bound_s=60)
    assert answers == [{"NodeID": "n1"}] and len(seen) == 4
    assert services.get_node is slow  # the function it wrapped, again afterwards


def test_past_its_bound_the_session_ray_fails_in_one_sentence(monkeypatch):
    seen = []
    monkeypatch.setattr(services, "get_node", _registers_after(10**9, seen))

    def init():
        services.get_node("gcs:1", "n1")

    with pytest.raises(pytest.fail.Exception) as info:
        ray_start.start(init, bound_s=0)
    message = str(info.value)
    assert message.startswith("the test session's Ray did not start within 0 s of a bound of 0 s (load average ")
    assert message.endswith("node n1 not found; set MEGATRAIN_TEST_RAY_START_S to wait longer on a busy machine.")
    assert "\n" not in message
