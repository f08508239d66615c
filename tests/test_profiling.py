"""train.profile_steps' parts without a run: the device summary of a Chrome trace's kernels, the
setting as a config and the command line give it, and the benchmark's s/step leaving a profiled
step out (tests/test_metrics.py profiles a step of a real run on the CPU); on a GPU, a profiled
piece of CUDA work and its kernels."""

import gzip
import json

import pytest
import torch

from megatrain_ray.bench import summarize
from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.profiling import OTHER, kind_of, profiled, records_kernels, summary
from megatrain_ray.errors import ConfigError


def _kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_the_summary_counts_busy_and_idle_device_time_over_every_stream():
    events = [_kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 1000),
              _kernel("triton_poi_fused_add_mul_0", 500, 1500, stream=21),  # overlaps the GEMM on another stream
              _kernel("flash_fwd_kernel<Flash_fwd_kernel_traits, cutlass::bfloat16_t>", 3000, 1000),
              _kernel("void at::native::vectorized_elementwise_kernel<4>", 4000, 500),  # right after: no gap
              _kernel("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", 10000, 2000),
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 800},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]
    text = summary(events)
    first = text.splitlines()[0]
    # span 0-12 ms; busy 0-2 + 3-4.5 + 10-12 = 5.5 ms; idle 6.5 ms in two gaps (2-3 and 4.5-10)
    assert "12.0 ms from its first kernel to its last, 5 kernels" in first
    assert "some kernel running 5.5 ms (45.8%), idle 6.5 ms in 2 gaps" in first
    assert "Kernels by kind (ms, summed over streams): GEMM 3.0, compiled (Triton) 1.5, attention 1.0, " \
           f"{OTHER} 0.5" in text
    assert "Copies and sets (ms, on the copy engines beside the kernels): Memcpy 0.8" in text
    gaps = text.split("Largest idle gaps")[1].splitlines()[1:3]
    assert gaps[0].split()[:2] == ["5.50", "4.5"] and "nvjet" in gaps[0]
    assert gaps[1].split()[:2] == ["1.00", "2.0"] and "flash_fwd" in gaps[1]


def test_kinds_name_attention_before_the_gemm_library_its_name_contains():
    assert kind_of("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<cutlass::bfloat16_t>") == "attention"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kind_of("cutlass3x_sm90_tensorop_s64x128x16gemm_bf16") == "GEMM"
    assert kind_of("triton_red_fused__to_copy_mul_sum_3") == "compiled (Triton)"
    assert kind_of("void at::native::reduce_kernel<512, 1>") == "reduction"
    assert kind_of("void at::native::index_elementwise_kernel") == OTHER


def test_a_cpu_trace_says_it_has_no_device_kernels():
    assert summary([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]).startswith(
        "No device kernels in this step")


@pytest.mark.parametrize("given,steps", [("3", (3,)), ("2,4", (2, 4)), ("[1, 4]", (1, 4))])
def test_profile_steps_from_the_command_line(given, steps):
    assert load_config(None, ["train.steps=4", f"train.profile_steps={given}"]).train.profile_steps == steps


@pytest.mark.parametrize("given", ["0", "5", "2,2", "x"])
def test_profile_steps_outside_the_run_are_refused(given):
    with pytest.raises(ConfigError, match=r"train.profile_steps must be"):
        load_config(None, ["train.steps=4", f"train.profile_steps={given}"])


def test_the_benchmark_leaves_a_profiled_step_out_of_its_step_time():
    rows = [{"start": 10.0 * i, "step_s": 9.0, "device_peak_bytes": 0, "loss": 1.0, "fetches": {}, "tokens": 1}
            for i in range(6)]
    assert summarize(rows)["step_s"] == 10.0
    rows[3]["step_s"], rows[3]["profile"] = 9.5, "runs/x/profile/step-4"  # slowed by the profiler
    for r in rows[4:]:  # its trace written before step 5 starts: 20 s
        r["start"] += 20.0
    out = summarize(rows)
    assert out["step_s"] == 10.0 and out["steady_periods"] == 2  # step 4's period and step 5's (30 s) left out


def test_a_gpu_worker_records_its_kernels_whatever_the_device_index():
    """The compute worker passes its backend's torch.device (cuda:0), not the name "cuda"."""
    assert records_kernels(torch.device("cuda", 0)) and records_kernels("cuda") and records_kernels("cuda:1")
    assert not records_kernels(torch.device("cpu")) and not records_kernels("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_profiled_cuda_step_names_its_kernels(tmp_path):
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    with profiled(str(tmp_path), torch.device("cuda", 0)):  # as the compute worker calls it
        for _ in range(3):
            b = torch.nn.functional.silu(a @ a)
    assert b.shape == a.shape
    with gzip.open(tmp_path / "trace.json.gz") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    assert len(kernels) >= 6
    text = (tmp_path / "kernels.txt").read_text()
    assert text.startswith("Device time of the step:") and f"{len(kernels):,} kernels" in text.splitlines()[0]
    kinds = text.splitlines()[1]
    assert "GEMM" in kinds and OTHER in kinds  # the matmuls, and silu's elementwise kernel
