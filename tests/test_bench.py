"""The benchmark (``megatrain-ray bench``, and benchmarks/compare.py around it) on the CPU: the Ray
pipeline and the single-process driver of the same engine train the same steps (same losses), and the host memory it reports
accounts for the store; it benchmarks any model (a preset with ``--set model.*``, a run config, an
HF config.json), counting and feeding the final one. (``jobs/bench.py`` under ``ray job submit`` is
in test_jobs.py.)"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import compare
from megatrain_ray import bench, cli
from megatrain_ray.config import ModelConfig, load_config
from megatrain_ray.errors import ConfigError
from megatrain_ray.engine.store.host_store import StoreSpec, grad_slots_for
from megatrain_ray.model import presets
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.model.flops import fmt_count


def test_bench_tiny_on_cpu(ray_cluster, tmp_path, shm_dir, capsys):
    out = tmp_path / "out"
    rc = compare.main(["--preset", "tiny", "--layers", "2", "--tokens", "1024", "--seq-len", "128",
                       "--micro-batches", "2", "--steps", "3", "--single-process", "--out", str(out),
                       "--set", f"memory.shm_dir={shm_dir}"])
    assert rc == 0
    report = json.loads((out / "bench-tiny.json").read_text())
    ours, local = report["systems"]["megatrain_ray"], report["systems"]["single_process"]
    assert len(ours["losses"]) == 3 and ours["losses"] == local["losses"]
    assert abs(ours["losses"][0] - math.log(presets.PRESETS["tiny"]["vocab_size"])) < 0.2  # random init, random tokens
    assert report["params"] == presets.model_params("tiny", 2)
    assert (report["buffer_depth"], report["loss_chunk_size"]) == (2, 1024)  # the library's CPU defaults, as train's
    # model FLOPs in both conventions: 6·N·T, and PaLM's (6 x matmul weights + 12·L·heads·head_dim·S per token)
    shape = presets.PRESETS["tiny"]
    h, v, inter, kv = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"], \
        shape["num_key_value_heads"] * (shape["hidden_size"] // shape["num_attention_heads"])
    matmuls = 2 * (2 * h * h + 2 * h * kv + 3 * h * inter) + v * h
    attention = 12 * 2 * shape["num_attention_heads"] * (shape["hidden_size"] // shape["num_attention_heads"]) * 128
    assert ours["tflops_6nt"] * ours["step_s"] * 1e12 == pytest.approx(6 * report["params"] * 1024)
    assert ours["tflops_palm"] * ours["step_s"] * 1e12 == pytest.approx((6 * matmuls + attention) * 1024)
    assert "mfu" not in ours  # no GEMM to measure against on the CPU
    # what the defaults did with the activations (on the CPU, auto recomputes every layer), also printed
    assert ours["activations"] == ("activations (memory.activations=auto): 0 of 2 layers kept whole on the device, "
                                   "2 checkpointed there, 0 offloaded to host memory")
    # the shared memory it counts is the store, exactly (every page of it is touched at start-up);
    # sampled at each step line too, so the store is seen whatever the sampler thread's timing
    cfg = load_config(None, [f"model.{k}={v}" for k, v in presets.preset_shape("tiny", 2).items()])
    precision = resolve_precision(cfg.precision, "cpu")
    store_bytes = StoreSpec(cfg.model, precision, shm_dir, 0, "x", grad_slots=grad_slots_for(precision, 1.0)).nbytes()
    assert abs(ours["host_shm_peak_gib"] * 2**30 - store_bytes) <= 0.01 * store_bytes + 2**20
    assert ours["host_accounted_processes_gib"] > 0.1  # the driver and the Ray actors with torch loaded
    assert ours["wall_s"] > sum(r["step_s"] for r in report["rows"])
    assert os.listdir(shm_dir) == []
    printed = capsys.readouterr().out
    assert "ours, " + ours["activations"] in printed
    # progress while it runs (the run's own step lines), and the size in the unit that fits
    assert "  step     1/3 | loss" in printed
    assert f"tiny: {fmt_count(report['params'])} params (2 layers" in printed
    assert fmt_count(4_999_424) == "5.0M" and fmt_count(7.62e9) == "7.6B" and fmt_count(950) == "950"
    assert "megatrain_ray" in printed and "peak RSS + shm" in printed and "as PaLM's model FLOPs" in printed


def test_comparisons_only_through_the_benchmarks_harness(capsys):
    """The comparisons with other systems live in benchmarks/compare.py, which the package never
    imports: the user command has none of their options."""
    for option in ("--peers", "--baseline", "--single-process", "--check", "--probe"):
        with pytest.raises(SystemExit) as info:
            cli.main(["bench", "--preset", "tiny", option, *(["fsdp2"] if option == "--peers" else [])])
        assert info.value.code == 2
        assert f"unrecognized arguments: {option}" in capsys.readouterr().err
    assert {"--peers", "--baseline", "--single-process", "--check", "--probe"} <= set(
        compare.parser()._option_string_actions)


def test_preset_tiny_is_the_model_train_runs_without_arguments():
    """One meaning per name: bench's ``tiny`` is train's built-in tiny (configs/tiny.yaml's model),
    not another shape of the same name."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trains = load_config(os.path.join(repo, "configs", "tiny.yaml")).model
    assert trains == load_config(None).model
    assert dataclasses.replace(presets.preset_model("tiny"), max_position_embeddings=2048) == trains
    assert "tiny-moe" not in presets.PRESETS  # configs/tiny-moe.yaml's name; the preset of that width is small-moe


@pytest.mark.parametrize("device,expected", [("cpu", ("tiny", 1024, 64, 2)), ("cuda", ("1b", 65536, 1024, 4))])
def test_bench_defaults_follow_the_device(device, expected, tmp_path):
    """With nothing said, a GPU benchmarks the 1b preset at the Performance table's step; the CPU the
    tiny preset at train's tiny step (about a minute); what is said is kept."""
    b = bench.setup(bench.parser().parse_args(["--set", f"compute.device={device}", "--out", str(tmp_path)]))
    assert (b.preset, *b.shape[:3]) == expected and b.shape[3] == 5
    assert b.report["params"] == presets.model_params(expected[0])
    b = bench.setup(bench.parser().parse_args(["--preset", "small", "--seq-len", "32", "--set",
                                               f"compute.device={device}", "--out", str(tmp_path)]))
    assert (b.preset, *b.shape[:3]) == ("small", expected[1], 32, expected[3])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's defaults")
def test_bench_without_arguments_on_the_cpu_runs_trains_tiny_step(ray_cluster, tmp_path, shm_dir):
    out = tmp_path / "out"
    assert cli.main(["bench", "--out", str(out), "--set", f"memory.shm_dir={shm_dir}"]) == 0
    report = json.loads((out / "bench-tiny.json").read_text())
    assert report["preset"] == "tiny" and report["tokens_per_step"] == 1024
    assert (report["seq_len"], report["micro_batches"]) == (64, 2)  # the step shape, for tests/test_pace_recorded.py
    assert report["params"] == StoreLayout.build(load_config(None).model).num_params
    assert len(report["systems"]["megatrain_ray"]["losses"]) == 5


SMALL_STEP = ["--tokens", "512", "--seq-len", "64", "--micro-batches", "2", "--steps", "2"]


def test_bench_a_run_config_with_set_overrides(ray_cluster, tmp_path, shm_dir):
    """--config takes a run config's model (its train section is the bench's own: 2 steps, not 1000;
    the output is named after the file); --set model.* then changes the parameter count reported
    and the vocabulary the random tokens are drawn from (ids past it would fail the run), and
    --set overrides the config's compute device; its data section, which the bench never reads (random
    tokens), is not validated (a placeholder path as the shipped configs have). One bench run for
    all, since each run spawns the whole pipeline."""
    config = tmp_path / "my-run.yaml"
    config.write_text("model: {model_type: qwen2, hidden_size: 96, intermediate_size: 256, num_hidden_layers: 2,\n"
                      "        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 500}\n"
                      f"compute: {{device: cuda}}\nmemory: {{shm_dir: {shm_dir}}}\nprecision: {{master_dtype: bfloat16}}\n"
                      "data: {path: /path/to/corpus, tokenizer: /path/to/tokenizer}\n"
                      "train: {steps: 1000}\n")
    out = tmp_path / "out"
    assert cli.main(["bench", "--config", str(config), *SMALL_STEP, "--out", str(out), "--set", "compute.device=cpu",
                     "--set", "model.vocab_size=300", "--set", "model.num_hidden_layers=3"]) == 0
    report = json.loads((out / "bench-my-run.json").read_text())  # named after the config
    assert report["preset"] is None and report["model"]["hidden_size"] == 96
    model = load_config(str(config), skip=("data",)).model
    assert report["params"] == StoreLayout.build(dataclasses.replace(model, vocab_size=300, num_hidden_layers=3)
                                                 ).num_params != StoreLayout.build(model).num_params
    assert report["layers"] == 3 and report["model"]["vocab_size"] == 300
    losses = report["systems"]["megatrain_ray"]["losses"]
    assert len(losses) == 2  # the bench's steps, not the config's
    assert abs(losses[0] - math.log(300)) < 0.2  # uniform tokens of the final vocabulary
    assert os.listdir(shm_dir) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU-only machine")
def test_the_readme_bench_command_on_a_cpu_machine_fails_on_the_device_alone(tmp_path):
    """``megatrain-ray bench --config configs/qwen2.5-7b.yaml --out bench-out`` as the README writes it
    (a new process, as a user runs it): its placeholder data path is not read; on a machine without a
    GPU its compute.device=cuda is the one error, said before any Ray starts (no dashboard line)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "bench", "--config", "configs/qwen2.5-7b.yaml",
                           "--out", str(tmp_path / "bench-out")], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("error: compute.device is cuda but no CUDA GPU is visible; set compute.device=cpu "
                                   "or auto.")
    assert "Ray dashboard" not in proc.stdout


def test_bench_model_from_an_hf_directory_and_what_is_refused(tmp_path, capsys):
    """--model takes an HF config.json's shape (then --layers and --set); peers only run preset shapes,
    and one source of the model is asked for. Refusals exit 2 before anything runs or is written."""
    hf = ModelConfig(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000).to_hf_dict()
    directory = tmp_path / "Qwen-tiny"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf))
    cfg = bench.bench_config(bench.base_sections(None, None, str(directory), 3), 1024, 128, 2, 2, None,
                             ["model.vocab_size=700"])
    assert cfg.model == dataclasses.replace(ModelConfig.from_hf_dict(hf), num_hidden_layers=3, vocab_size=700)
    out = tmp_path / "out"
    for args in (["--model", str(directory), "--peers", "deepspeed"],
                 ["--preset", "tiny", "--set", "model.vocab_size=300", "--peers", "fsdp2"]):
        with pytest.raises(ConfigError, match="--peers trains the presets' shapes only"):
            compare.main([*args, "--out", str(out)])
    assert cli.main(["bench", "--preset", "tiny", "--model", str(directory), "--out", str(out)]) == 2
    assert "one of --preset, --config and --model" in capsys.readouterr().err
    assert not out.exists()


def test_summarize_takes_the_median_period_of_the_steps_after_the_warm_up():
    """5 steps: the first two warm up; s/step is the median of the last three periods (time between
    consecutive step ends), so one slow steady step does not move it and the warm-up never counts."""
    ends = [10.0, 13.0, 15.0, 17.5, 19.5]  # periods of steps 1..4: 3.0, 2.0, 2.5, 2.0
    rows = [{"step": i, "start": e - 1.5, "step_s": 1.5, "loss": 1.0, "fetches": {}, "tokens": 8,
             "device_peak_bytes": 0, "compute_busy_s": 1.0} for i, e in enumerate(ends)]
    out = bench.summarize(rows)
    assert out["steady_periods"] == 3
    assert out["step_s"] == 2.0  # median of 2.0, 2.5, 2.0 (step 1's 3.0 is warm-up)
    assert out["compute_busy_frac"] == 0.5
    assert bench.summarize(rows[:2])["steady_periods"] == 1


@pytest.mark.parametrize("layers", [2, 5, 40])
def test_layers_cut_a_per_layer_attention_list_with_the_model(layers):
    """--layers on gpt-oss (whose model.layer_types lists each layer's attention): the list follows the
    depth, the first layers' types cycled where the model is deeper, and the config is valid."""
    base = bench.base_sections("gpt-oss-20b", None, None, layers)
    types = base["model"]["layer_types"]
    full = presets.preset_model("gpt-oss-20b").layer_types
    assert len(types) == layers and types == [full[i % len(full)] for i in range(layers)]
    ModelConfig(**base["model"]).validate()
