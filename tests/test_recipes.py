"""The benchmark recipes (benchmarks/*.sh) run: each in its CPU smoke mode (SMOKE=1, a tiny model),
printing its table and writing its JSON; benchmarks/README.md lists every recipe and probe there is,
and names only result folders that exist. One recipe runs in the quick suite, the others in the slow
tier (each runs whole pipelines several times)."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
RECIPES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.sh")) if not p.endswith("lib.sh"))


def _smoke(recipe: str, out, *args: str, timeout: int = 420) -> str:
    """Run a recipe with SMOKE=1 on the session's Ray cluster (joined through its address, which
    saves each run the start of a private one); returns what it printed."""
    import ray

    env = {**os.environ, "SMOKE": "1", "PYTHONPATH": ROOT, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run(["bash", os.path.join(BENCH, recipe), str(out), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{recipe} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    machine = (out / "machine.txt").read_text()
    assert "commit: " in machine and "cpus: " in machine
    return proc.stdout


def _bench(out, tag: str) -> dict:
    report = json.loads((out / f"bench-{tag}.json").read_text())
    assert report["systems"]["megatrain_ray"]["step_s"] > 0
    return report


def test_every_script_parses_and_every_recipe_and_probe_is_listed():
    readme = open(os.path.join(BENCH, "README.md")).read()
    for recipe in RECIPES:
        assert subprocess.run(["bash", "-n", os.path.join(BENCH, recipe)]).returncode == 0, recipe
        assert f"`{recipe}" in readme, f"benchmarks/README.md does not list {recipe}"
    for script in glob.glob(os.path.join(BENCH, "*.py")):
        name = os.path.basename(script)
        compile(open(script).read(), script, "exec")
        if name != "__init__.py":
            assert f"`{name}" in readme, f"benchmarks/README.md does not list {name}"
    folders = set(re.findall(r"results/([\w.-]+)/", readme))
    assert folders and all(os.path.isdir(os.path.join(BENCH, "results", f)) for f in folders), folders
    for folder in glob.glob(os.path.join(BENCH, "results", "*")):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_(h200|h200x2|h100|cpu)_[\w.-]+", os.path.basename(folder)), folder
        assert os.path.isfile(os.path.join(folder, "NOTES.md")), f"{folder} has no NOTES.md"


def test_defaults_7b_smoke(ray_cluster, tmp_path):
    printed = _smoke("defaults_7b.sh", tmp_path)
    report = _bench(tmp_path, "defaults-7b")
    assert len(report["rows"]) == 3 and report["params"] > 0
    assert re.search(r"^megatrain_ray\s+[\d.]+", printed, re.M) and "TFLOPS as 6·N·T" in printed


@pytest.mark.slow
@pytest.mark.parametrize("recipe, tags", [
    ("vs_resident.sh", ["resident-tiny"]),
    ("multi_gpu.sh", ["gpus-1-2"]),
    ("largest_model.sh", ["largest-8bit"]),
    ("activation_placement.sh", ["activations-recompute", "activations-auto"]),
    ("moe.sh", ["moe-tiny"]),
    ("lora.sh", ["lora-tiny"]),
    ("qlora.sh", ["qlora-tiny"]),
    ("moe_lora.sh", ["moe-lora-tiny"]),
    ("gpt_oss.sh", ["gpt-oss-tiny-mxfp4", "glm-tiny-nf4"]),
    ("update_placement.sh", ["placement-host", "placement-device"]),
])
def test_recipe_smoke(ray_cluster, tmp_path, recipe, tags):
    printed = _smoke(recipe, tmp_path)
    for tag in tags:
        report = _bench(tmp_path, tag)
    if recipe == "vs_resident.sh":  # the same engine with and without Ray: the same losses
        systems = report["systems"]
        assert systems["megatrain_ray"]["losses"] == systems["single_process"]["losses"]
    if recipe == "moe.sh":  # and the resident transformers run beside it, and the link probe's copies
        assert json.loads((tmp_path / "resident-tiny.json").read_text())["layers"] == 1
        link = json.loads((tmp_path / "moe-link-small-moe.json").read_text())["rows"]
        assert link["sparse backward, every expert routed"]["copies"] == 1
        assert link["sparse backward, 4 of 8 experts idle"]["bytes"] < link["dense layer"]["bytes"]
    if recipe == "lora.sh":  # the resident transformers + peft run beside it, and the plan's LoRA line
        assert json.loads((tmp_path / "resident-lora-tiny.json").read_text())["layers"] == 1
        assert re.search(r"^  LoRA .* B/param", (tmp_path / "log_plan-lora-tiny.txt").read_text(), re.M)
    if recipe == "qlora.sh":  # transformers + peft + bitsandbytes 4-bit resident beside it
        resident = json.loads((tmp_path / "resident-lora-tiny-nf4.json").read_text())
        assert resident["base"] == "nf4" and resident["nf4_params"] > 0 and resident["layers"] == 1
        assert re.search(r"^tokens/s per layer: ours .*\(nf4 base\).*x$", (tmp_path / "ratio-nf4.txt").read_text(), re.M)
    if recipe == "moe_lora.sh":  # LoRA on the experts, beside transformers + peft resident: tokens/s per layer
        assert report["model"]["num_experts"] and "lora.rank=4" in report["overrides"]
        assert json.loads((tmp_path / "resident-lora-moe-tiny.json").read_text())["layers"] == 1
        assert re.search(r"^tokens/s per layer: ours .*x$", (tmp_path / "ratio.txt").read_text(), re.M)
    if recipe == "gpt_oss.sh":  # both 100B+ families' stand-ins, each over its quantized base
        for tag, fmt in (("gpt-oss-tiny-mxfp4", "mxfp4"), ("glm-tiny-nf4", "nf4")):
            assert f"lora.base_format={fmt}" in _bench(tmp_path, tag)["overrides"]
        for preset in ("gpt-oss-120b", "glm-4.5-air"):  # the real shapes' plans, as the GPU part runs them
            plan = (tmp_path / f"log_plan-{preset}.txt").read_text()
            assert "expected step time" in plan and re.search(r"^total GPU .*: ok\)$", plan, re.M), plan[-2000:]
    if recipe == "update_placement.sh":  # each placement's updates where it says, and the table with the plan's time
        host, device = (_bench(tmp_path, f"placement-{p}")["systems"]["megatrain_ray"] for p in ("host", "device"))
        assert host["update_busy_frac"] > 0 and host["device_update_busy_frac"] == 0
        assert device["device_update_busy_frac"] > 0 and device["update_busy_frac"] == 0
        table = (tmp_path / "placement.txt").read_text()
        assert re.search(r"^host\s+[\d.]+\s+[\d.]+\s+[-+][\d.]+%", table, re.M), table
        assert re.search(r"^device\s+[\d.]+\s+[\d.]+\s+[-+][\d.]+%", table, re.M), table
    assert printed.strip().splitlines()[-1].endswith("done")


@pytest.mark.slow
def test_long_context_smoke(ray_cluster, tmp_path):
    """long_context.sh's 512k part: configs/long-context-512k.yaml trained as written at a tiny shape
    (its data paths replaced by a .npy), then collected: the row says done, with the plan beside it."""
    _smoke("long_context.sh", tmp_path, "run", "512k")
    table = _smoke("long_context.sh", tmp_path, "collect")
    row = re.search(r"^512k\s+done\s+([\d.]+)\s+([\d,]+)\s.*  ~[\d.]+ m?s, ", table, re.M)
    assert row and float(row.group(1)) > 0, table
    assert "metrics.jsonl" in str(list((tmp_path / "512k" / "runs").glob("*/metrics.jsonl")))


@pytest.mark.slow
def test_side_by_side_smoke(ray_cluster, tmp_path):
    printed = _smoke("side_by_side.sh", tmp_path, "a:", "b:--set memory.buffer_depth=3")
    assert _bench(tmp_path, "b")["buffer_depth"] == 3 and _bench(tmp_path, "a")["buffer_depth"] == 2
    assert re.search(r"^a\s+[\d.]+", printed, re.M) and re.search(r"^b\s+[\d.]+", printed, re.M)


@pytest.mark.slow
def test_peers_smoke(ray_cluster, tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    printed = _smoke("peers.sh", tmp_path)
    written = glob.glob(str(tmp_path / "peers-tiny*.json"))
    assert len(written) == 1, (written, printed)
    report = json.loads(open(written[0]).read())
    assert [r["status"] for r in report["runs"]] == ["ok"], printed


@pytest.mark.slow
def test_convergence_smoke(tmp_path):
    """benchmarks/convergence.py at a tiny shape on the CPU, in one process: the corpus, the BPE,
    the initial checkpoint, two variants from the same weights and batches, the table and JSON."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "convergence.py"), "--device", "cpu", "--hidden", "64",
                           "--layers", "2", "--seq-len", "64", "--vocab", "512", "--micro-batch-size", "2",
                           "--micro-batches", "2", "--corpus-mb", "0.5", "--steps", "4", "--local",
                           "--variants", "megatrain_ray,megatrain_ray_8bit", "--ref", "megatrain_ray",
                           "--out", str(tmp_path)], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "convergence.json").read_text())
    ours, compact = report["results"]["megatrain_ray"], report["results"]["megatrain_ray_8bit"]
    assert len(ours["losses"]) == len(compact["losses"]) == 4
    # the same initial weights (rounded to the compact state's bf16 master: relative 2^-9 each) on the
    # same first batch: the first losses agree far inside that rounding's scale
    assert ours["losses"][0] == pytest.approx(compact["losses"][0], rel=2**-9)
    assert "megatrain_ray_8bit" in proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_checkpoint_cost_smoke(tmp_path):
    """benchmarks/checkpoint_cost.py at the tiny preset: a real store's checkpoint written paused and in
    the background by the run's writer, every rate measured, the 7B extrapolation, the table last."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "checkpoint_cost.py"), str(tmp_path), "--preset", "tiny",
                           "--layers", "2", "--step-s", "0.2"], env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "checkpoint_cost.json").read_text())
    assert report["preset"] == "tiny" and report["checkpoint_bytes"] > 0
    for key in ("crc32_gbs", "copy_gbs", "paused_gbs", "background_save_s"):
        assert report[key] > 0, key
    assert report["background_stall_s"] >= 0 and report["7b"]["checkpoint_bytes"] == 7.62e9 * 12
    assert not (tmp_path / "ckpt").exists()  # the checkpoints are removed after the measurement
    assert proc.stdout.strip().splitlines()[-1].startswith("write rate for <= 5% at 7B")


def test_a_resident_baseline_runs_the_most_layers_that_fit():
    """benchmarks/hf_resident.fit_layers: the count asked when it fits; else bisection by one-micro-batch
    probes of the same micro-batch shape, then the full run at the most that fit; None when none does."""
    import argparse

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.hf_resident import fit_layers

    def runner(limit):
        calls = []

        def run(args, layers):
            calls.append((layers, args.tokens // args.micro_batches, args.micro_batches, args.steps))
            if layers > limit:
                raise torch.OutOfMemoryError("out of memory")
            return {"layers": layers}
        return run, calls

    args = argparse.Namespace(layers=48, tokens=262144, micro_batches=16, steps=4)
    run, calls = runner(48)
    assert fit_layers(run, args) == {"layers": 48} and calls == [(48, 16384, 16, 4)]
    run, calls = runner(37)
    assert fit_layers(run, args) == {"layers": 37}
    assert calls[0] == (48, 16384, 16, 4) and calls[-1] == (37, 16384, 16, 4)
    probes = calls[1:-1]
    assert all(c[1:] == (16384, 1, 1) for c in probes) and len(probes) <= 6  # log2(48) probes at most
    assert {layers for layers, *_ in probes} >= {37, 38}  # the boundary was probed from both sides
    run, calls = runner(0)
    assert fit_layers(run, args) is None and all(layers < 48 for layers, *_ in calls[1:])
    assert args.layers == 48 and args.micro_batches == 16  # the caller's arguments are left as they were
