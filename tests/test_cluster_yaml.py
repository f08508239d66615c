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


def test_multinode_cluster_yaml_is_valid_for_ray():
    """The several-node example: Ray's schema accepts it, and it brings up as many nodes as it says
    parallel.nodes may ask for, each with the store's /dev/shm and pinning limits."""
    with open(os.path.join(ROOT, "cluster-multinode.yaml")) as f:
        config = yaml.safe_load(f)
    validate_config(prepare_config(config))
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["min_workers"] == workers["max_workers"] == config["max_workers"] == 1
    assert any(o.startswith("--shm-size") for o in config["docker"]["run_options"])
    assert "--ulimit memlock=-1" in config["docker"]["run_options"]
    assert any("ray start --address=" in c for c in config["worker_start_ray_commands"])
