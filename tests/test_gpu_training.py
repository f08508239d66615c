"""The CUDA path over a real training run: 24 steps under Ray against GPU-resident PyTorch runs.

Our pipeline (real Ray actors, store, prefetcher, compiled layer on the GPU, gradient sink with
AdamW and clipping, 3 micro-batches) trains a small Llama from an HF checkpoint on a learnable token
stream; :mod:`benchmarks.gpu_check` trains the same weights on the same batches GPU-resident and
states the tolerance and its argument: our distance to the bf16 resident run must stay within twice
the largest of three yardsticks (the same resident run with another bf16 summation order, with the
decoder layer compiled as ours runs it, and in fp32), for the final weights, the per-step losses
and the per-step grad norms. History, on the H200: with the fp32 yardstick alone our grad norms came
to 1.9x it while weights and losses stayed within 1x; with the summation-order one added, the norm
still came to 2.2x the larger (0.50 vs 0.23 and 0.17) — until the compiled-layer yardstick showed
that compiling alone moves the grad norm by 0.38: the fused kernels' roundings, which ours has and
the eager resident run has not, had not been sampled. With ``precision.grad_dtype=float32`` the same
bound holds, and with ``memory.resident=embed_head`` (the embedding and head updated on the GPU by
torch's fused AdamW, the rest on the host: the same formula, other roundings). ``megatrain-ray bench --check`` runs the same comparison. Skipped without CUDA.
"""

import pytest
import torch

from benchmarks import gpu_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu-training"))


@pytest.fixture(scope="module")
def references(directory, ray_cluster):
    return gpu_check.references(gpu_check.check_config(directory))


@pytest.mark.parametrize("setting", ["precision.grad_dtype=auto", "precision.grad_dtype=float32",
                                     "memory.resident=embed_head"])
def test_streamed_training_tracks_the_gpu_resident_run(setting, directory, references, ray_cluster):
    report = gpu_check.run_check(directory, references, [setting])
    print(f"{setting}: ours vs bf16 resident {report['seen']}; yardsticks {report['yardsticks']}; "
          f"weights moved {report['moved']:.3g}")
    print("  ours     loss " + " ".join(f"{x:.3f}" for x in report["losses"]))
    print("  resident loss " + " ".join(f"{x:.3f}" for x in report["resident_losses"]))
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, f"{failed}: seen {report['seen']}, bound {report['bound']}, moved {report['moved']:.3g}"
