"""cluster.yaml passes Ray's own cluster-launcher validation and keeps the store's needs in view."""

import os

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cluster_yaml_is_valid_for_ray():
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        config = yaml.safe_load(f)
    validate_config(prepare_config(config))  # raises on schema errors
    assert config["max_workers"] == 0  # one node
    start = " ".join(config["head_start_ray_commands"])
    assert "--object-store-memory" in start and "--dashboard-host=127.0.0.1" in start
    assert any(o.startswith("--shm-size") for o in config["docker"]["run_options"])
