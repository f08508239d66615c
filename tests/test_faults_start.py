"""The run's start-up has its own bound (cluster.start_timeout_s), apart from the stall floor
(cluster.actor_timeout_s): a slow start on a loaded machine is not a healthy role "not answering",
and a start-up that does not finish in time says it was start-up, naming the role."""

import os
import re

import pytest
import ray

from megatrain_ray.errors import PipelineError
from megatrain_ray.orchestration import calls
from megatrain_ray.orchestration.health import Health
from megatrain_ray.orchestration.pipeline import train
from test_faults import _cfg


def test_a_role_still_starting_is_said_to_be_starting(ray_cluster, tmp_path):
    class Starting:  # defined here: the actor's process has no tests/ on its path
        """A role whose constructor has not finished: it waits for a file that never appears."""

        def __init__(self, path: str):
            import time

            while not os.path.exists(path):
                time.sleep(0.05)

    role = ray.remote(Starting).options(num_cpus=0).remote(str(tmp_path / "never"))
    try:
        with pytest.raises(PipelineError) as info:
            Health({"store": role}, {}, timeout_s=300, start_timeout_s=0.5)
    finally:
        ray.kill(role, no_restart=True)
    message = str(info.value)
    assert re.fullmatch(r"the store actor did not finish starting within 0 s of the run's start-up \(load average "
                        r"[0-9.]+ on \d+ CPUs\); raise cluster\.start_timeout_s on a busy machine, or see its log in "
                        r"the Ray dashboard or .*\.", message), message
    assert calls.ray_logs() in message


def test_the_start_up_is_bounded_by_its_own_setting_not_the_stall_floor(ray_cluster, shm_dir, tmp_path):
    # No role starts within a millisecond; the stall floor (cluster.actor_timeout_s) is 300 s: the
    # start-up's own bound is the one that ends the run, in its own sentence.
    with pytest.raises(PipelineError) as info:
        train(_cfg(shm_dir, tmp_path, "cluster.start_timeout_s=0.001"), log=lambda line: None)
    assert str(info.value).startswith("the store actor did not finish starting within 0 s of the run's start-up "
                                      "(load average "), str(info.value)
    assert "cluster.actor_timeout_s" not in str(info.value)
    assert os.listdir(shm_dir) == []
