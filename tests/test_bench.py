"""The benchmark (``megatrain-ray bench``) on the CPU: the Ray pipeline and the single-process
driver of the same engine train the same steps (same losses), and the host memory it reports
accounts for the store. (``jobs/bench.py`` under ``ray job submit`` is in test_jobs.py.)"""

import json
import math
import os

import pytest

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.store import StoreSpec, grad_slots_for
from megatrain_ray.model import presets
from megatrain_ray.model.precision import resolve_precision


def test_bench_tiny_on_cpu(ray_cluster, tmp_path, shm_dir, capsys):
    out = tmp_path / "out"
    rc = cli.main(["bench", "--preset", "tiny", "--layers", "2", "--tokens", "1024", "--seq-len", "128",
                   "--micro-batches", "2", "--steps", "3", "--single-process", "--out", str(out),
                   "--set", f"runtime.shm_dir={shm_dir}"])
    assert rc == 0
    report = json.loads((out / "bench-tiny.json").read_text())
    ours, local = report["systems"]["megatrain_ray"], report["systems"]["single_process"]
    assert len(ours["losses"]) == 3 and ours["losses"] == local["losses"]
    assert abs(ours["losses"][0] - math.log(presets.PRESETS["tiny"]["vocab_size"])) < 0.2  # random init, random tokens
    assert report["params"] == presets.model_params("tiny", 2)
    # model FLOPs: 6·N·T, and with the attention matrix 12·L·heads·head_dim·S per token on top
    shape = presets.PRESETS["tiny"]
    attention = 12 * 2 * shape["num_attention_heads"] * (shape["hidden_size"] // shape["num_attention_heads"]) * 128
    assert ours["model_tflops"] * ours["step_s"] * 1e12 == pytest.approx(6 * report["params"] * 1024)
    assert ours["model_tflops_with_attention"] / ours["model_tflops"] == pytest.approx(
        (6 * report["params"] + attention) / (6 * report["params"]))
    assert "mfu" not in ours  # no GEMM to measure against on the CPU
    # the shared memory it counts is the store, exactly (every page of it is touched at start-up)
    cfg = load_config(None, [f"model.{k}={v}" for k, v in presets.preset_shape("tiny", 2).items()])
    precision = resolve_precision(cfg.runtime, "cpu")
    store_bytes = StoreSpec(cfg.model, precision, shm_dir, 0, "x", grad_slots_for(precision, 1.0)).nbytes()
    assert abs(ours["host_accounted_shm_gib"] * 2**30 - store_bytes) <= 0.01 * store_bytes + 2**20
    assert ours["host_accounted_processes_gib"] > 0.1  # the driver and the Ray actors with torch loaded
    assert ours["wall_s"] > sum(r["step_s"] for r in report["rows"])
    assert os.listdir(shm_dir) == []
    printed = capsys.readouterr().out
    assert "megatrain_ray" in printed and "peak RSS + shm" in printed and "counting attention" in printed


def test_bench_peers_only_through_the_benchmarks_harness(capsys):
    """The DeepSpeed / FSDP2 harness lives in benchmarks/, which the package never imports: the user
    command refuses --peers with the script to run instead, before any work."""
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--preset", "tiny", "--peers", "fsdp2"])
    assert info.value.code == 2
    assert "benchmarks/peers.py bench" in capsys.readouterr().err
