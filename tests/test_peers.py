"""The peer-baseline harness (benchmarks/peers.py) on the CPU: same model as the bench, clear setup
errors, the subprocess wrapper's statuses, and the FSDP2 training loop against plain torch AdamW."""

import importlib.util
import os
import statistics
import subprocess
import sys

import pytest
import torch

from benchmarks import peers
from megatrain_ray.model import flops
from megatrain_ray.model.presets import model_params, preset_model
from float64_truth import assert_as_close_to_truth, float64_only, to_float64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# the small preset cut to 2 layers; 2 micro-batches of 4 x 32 tokens
TINY = dict(preset="small", tokens=256, seq_len=32, micro_batches=2, layers=2)


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peers.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("preset,arch", [("small", "LlamaForCausalLM"), ("1b", "LlamaForCausalLM"),
                                         ("7b", "Qwen2ForCausalLM")])
def test_hf_model_is_the_bench_model(preset, arch):
    """The HF class the peers train has exactly our parameter count (built on meta: no memory), sdpa
    attention and every layer recomputed."""
    spec = peers.PeerSpec("fsdp2", preset)
    with torch.device("meta"):
        model = peers.build_model(peers.hf_config(spec), torch.float32)
    assert type(model).__name__ == arch
    assert sum(p.numel() for p in model.parameters()) == model_params(preset) == peers.num_params(spec)
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    # newer transformers mark each layer for recompute, older ones (4.45) the base model
    assert all(getattr(layer, "gradient_checkpointing", model.base_model.gradient_checkpointing)
               for layer in model.base_model.layers)
    groups = peers.param_groups(model, spec)
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and all(p.dim() < 2 for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0


def test_layer_override_changes_the_count_by_whole_layers():
    base, more = peers.PeerSpec("fsdp2", "7b"), peers.PeerSpec("fsdp2", "7b", layers=30)
    with torch.device("meta"):
        model = peers.build_model(peers.hf_config(more), torch.float32)
    assert len(model.base_model.layers) == 30
    per_layer = sum(p.numel() for p in model.base_model.layers[0].parameters())
    assert peers.num_params(more) - peers.num_params(base) == 2 * per_layer
    assert sum(p.numel() for p in model.parameters()) == peers.num_params(more)


def test_bad_token_count_is_one_sentence():
    r = _cli("--preset", "small", "--systems", "fsdp2", "--device", "cpu", "--tokens", "1000", "--seq-len", "64")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "error: --tokens (1000) must be a positive multiple of --seq-len x --micro-batches (256)."


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cli_without_cuda_says_so_before_work():
    r = _cli("--preset", "small", "--systems", "fsdp2", "--steps", "1")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: CUDA is not available to torch")
    assert "CUDA build of torch" in lines[0]


@pytest.mark.skipif(HAS_DEEPSPEED, reason="checks the message shown without DeepSpeed")
def test_missing_deepspeed_is_one_sentence_naming_the_fix(tmp_path):
    r = _cli("--preset", "small", "--systems", "fsdp2,deepspeed", "--device", "cpu", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stdout == "" and os.listdir(tmp_path) == []
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: deepspeed")
    assert "pip install deepspeed" in lines[0] and "--systems fsdp2" in lines[0]
    # the same check inside the subprocess that run_peer starts becomes the run's status
    report = peers.run_peer("deepspeed", "small", tokens=256, seq_len=32, micro_batches=2, steps=1, layers=2,
                            device="cpu", echo=False)
    assert report["returncode"] == 2 and report["status"].startswith("error: deepspeed")
    assert report["step_times"] == [] and "step_s" not in report


@pytest.mark.slow  # a peer harness in a subprocess
def test_run_peer_trains_in_a_subprocess_and_reports(tmp_path):
    log = tmp_path / "child.log"
    r = peers.run_peer("fsdp2", steps=3, device="cpu", log_path=str(log), echo=False, **TINY)
    assert r["status"] == "ok", log.read_text()[-2000:]
    assert r["returncode"] == 0 and len(r["step_times"]) == 3 and len(r["losses"]) == 3
    assert r["step_s"] == statistics.median(r["step_times"][1:])  # the warm-up step left out
    assert r["tokens_per_s"] == pytest.approx(256 / r["step_s"])
    assert r["tflops_6nt"] == pytest.approx(6 * r["params"] * 256 / r["step_s"] / 1e12)
    assert r["tflops_palm"] == pytest.approx(flops.palm_model_flops(
        preset_model("small", TINY["layers"]), TINY["seq_len"], 256) / r["step_s"] / 1e12)
    assert r["params"] == peers.num_params(peers.PeerSpec("fsdp2", **TINY))
    assert 8.0 < r["losses"][0] < 8.7  # ln(4096) = 8.32: random tokens, N(0, 0.02) weights
    assert r["host_peak_added_gib"] >= 0 and r["optimizer"].startswith("torch.optim.AdamW")
    assert "peers: fsdp2 step 2" in log.read_text()


def test_run_peer_stops_a_run_past_its_time_limit():
    r = peers.run_peer("fsdp2", steps=1000, device="cpu", timeout_s=1.0, echo=False, **TINY)
    assert r["status"] == "timeout" and r["returncode"] == -9 and "killed" in r["error"]


def test_run_peer_stops_a_run_when_host_memory_runs_out():
    """The watchdog: MemAvailable under the floor (here: any machine) kills the child, status oom."""
    r = peers.run_peer("fsdp2", steps=3, device="cpu", min_available_gib=1e6, echo=False, **TINY)
    assert r["status"] == "oom" and r["returncode"] == -9 and "host memory" in r["error"]


def test_table_shows_failed_runs_without_numbers():
    rows = [{"system": "fsdp2", "layers": 28, "params": 7.6e9, "status": "ok", "step_s": 20.0,
             "tokens_per_s": 3276.8, "tflops_6nt": 149.7, "gpu_peak_gib": 30.0, "host_peak_added_gib": 120.0},
            {"system": "deepspeed", "layers": 28, "params": 7.6e9, "status": "oom"}]
    table = peers.format_table(rows, ours_step_s=10.0).splitlines()
    assert table[0].split() == ["system", "layers", "params", "status", "s/step", "tok/s", "TF", "6NT", "GPU",
                                "GiB", "host", "GiB", "ours", "x"]
    assert table[1].split() == ["fsdp2", "28", "7.60B", "ok", "20.00", "3,277", "149.7", "30.0", "120.0", "2.00"]
    assert table[2].split() == ["deepspeed", "28", "7.60B", "oom", "-", "-", "-", "-", "-"]


def _plain_loop(spec: peers.PeerSpec, model, steps: int) -> tuple[list[float], list[float]]:
    """The FSDP2 step written out plainly, in the model's dtype: HF loss, torch.optim.AdamW (matrices
    decayed), clipping; returns per-step losses and gradient norms."""
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    batches = peers.step_tokens(spec, 4096)
    losses, norms = [], []
    for _ in range(steps):
        mb_losses = []
        for mb in next(batches):  # [4, 33]
            logits = model(input_ids=mb[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), mb[:, 1:].reshape(-1))
            (loss / spec.micro_batches).backward()
            mb_losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(sum(mb_losses) / spec.micro_batches)
    return losses, norms


def _initial_model(spec: peers.PeerSpec):
    model = peers.build_model(peers.hf_config(spec), torch.float32)
    peers.init_weights_(model, torch.device("cpu"), spec.seed)
    return model


def test_fsdp2_loop_matches_plain_torch_adamw(monkeypatch):
    """The FSDP2 path (fully_shard on every layer and the root, gloo, world size 1, fp32 on the CPU)
    trains like the same HF model with torch.optim.AdamW and clipping, written out plainly: its
    losses and weights are about as close to the plain loop run in float64 as the plain loop in fp32
    is (see float64_truth). Adam turns last-bit differences in an embedding row of a rare token, whose
    gradient is ~eps, into ~lr-sized ones, so no fixed elementwise tolerance holds everywhere. One
    fp32 reference is enough here: both run the same HF modules, rounding apart only in the clipping
    norm and the AdamW kernel, and land equally far from the truth (distance ratios ~1.0 per tensor)."""
    import torch.distributed as dist

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "unset")  # restored after the test; init_single_process_group sets them
    spec = peers.PeerSpec("fsdp2", device="cpu", steps=3, **TINY)
    spec.max_grad_norm = 0.05  # small enough that clipping acts on every step
    spec.lr = 1e-2
    peers.init_single_process_group("gloo")
    try:
        model, opt, _ = peers.build_fsdp2(spec)
        step = peers.fsdp2_step(model, opt, spec)
        batches = peers.step_tokens(spec, 4096)
        fsdp_losses = [step(next(batches)) for _ in range(3)]
        fsdp_weights = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()

    ref = _initial_model(spec)
    ref_losses, norms = _plain_loop(spec, ref, 3)
    exact = to_float64(_initial_model(spec))
    with float64_only():
        true_losses, _ = _plain_loop(spec, exact, 3)
    assert min(norms) > 0.05  # clipping was active
    steps = [f"loss of step {i}" for i in range(3)]
    assert_as_close_to_truth(dict(zip(steps, fsdp_losses)), [dict(zip(steps, ref_losses))],
                             dict(zip(steps, true_losses)))
    ref_weights = dict(ref.named_parameters())
    assert_as_close_to_truth(fsdp_weights, [ref_weights], dict(exact.named_parameters()))
    init = dict(_initial_model(spec).named_parameters())
    for name in ref_weights:
        assert not torch.equal(fsdp_weights[name], init[name]), name  # every tensor was updated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_offload_trains_on_gpu():
    r = peers.run_peer("fsdp2", steps=2, echo=False, **TINY)
    assert r["status"] == "ok" and r["gpu_peak_gib"] > 0


def test_bench_table_puts_peers_beside_ours_with_the_speedup_and_status():
    """`benchmarks/compare.py --peers`: one table; the speedup column is the peer's step time over ours, and a peer
    that ran out of memory shows its status instead of numbers."""
    from megatrain_ray.bench import format_systems

    nan = float("nan")
    table = format_systems({
        "megatrain_ray": {"step_s": 3.2, "tokens_per_s": 20480.0, "tflops_6nt": 417.2, "tflops_palm": 430.5,
                          "device_peak_gib": 28.9,
                          "host_peak_added_gib": 48.6},
        "deepspeed": {"step_s": 7.2, "tokens_per_s": 9102.2, "tflops_6nt": 185.4, "tflops_palm": 191.3,
                      "gpu_peak_gib": 32.3,
                      "host_peak_added_gib": 79.5, "status": "ok"},
        "fsdp2": {"step_s": nan, "tokens_per_s": nan, "tflops_6nt": nan, "tflops_palm": nan, "status": "oom"}}).splitlines()
    assert table[0].split() == ["system", "s/step", "tok/s", "TF", "6NT", "TF", "PaLM", "ours", "x", "GPU", "GiB",
                                "host", "GiB", "status"]
    assert table[1].split() == ["megatrain_ray", "3.200", "20,480", "417.2", "430.5", "1.00", "28.9", "48.6", "ok"]
    assert table[2].split() == ["deepspeed", "7.200", "9,102", "185.4", "191.3", "2.25", "32.3", "79.5", "ok"]
    assert table[3].split() == ["fsdp2", "-", "-", "-", "-", "-", "-", "-", "oom"]
