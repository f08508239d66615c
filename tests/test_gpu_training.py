"""The CUDA path over a real training run: 24 steps under Ray against GPU-resident PyTorch runs.

Our pipeline (real Ray actors, store, prefetcher, compiled layer on the GPU, gradient sink with
AdamW and clipping, 3 micro-batches) trains a small Llama from an HF checkpoint on a learnable token
stream; :mod:`megatrain_ray.gpu_check` trains the same weights on the same batches GPU-resident and
states the tolerance and its argument: our distance to the bf16 resident run must stay within twice
the larger of two yardsticks (the same resident run with another bf16 summation order, and in
fp32), for the final weights, the per-step losses and the per-step grad norms. (A first version
allowed the fp32 yardstick alone; on the H200 our gradient norms came to 1.9x that one sample while
weights and losses stayed within 1x, and the summation-order yardstick alone moved the norm by 1.5x
it: one sample does not measure the spread.) With ``runtime.grad_dtype=float32`` the same bound
holds. ``megatrain-ray bench --check`` runs the same comparison. Skipped without CUDA.
"""

import pytest
import torch

from megatrain_ray import gpu_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu-training"))


@pytest.fixture(scope="module")
def references(directory, ray_cluster):
    return gpu_check.references(gpu_check.check_config(directory))


@pytest.mark.parametrize("grad_dtype", ["auto", "float32"])
def test_streamed_training_tracks_the_gpu_resident_run(grad_dtype, directory, references, ray_cluster):
    report = gpu_check.run_check(directory, references, [f"runtime.grad_dtype={grad_dtype}"])
    print(f"grad_dtype={grad_dtype}: ours vs bf16 resident {report['seen']}; yardsticks {report['yardsticks']}; "
          f"weights moved {report['moved']:.3g}")
    print("  ours     loss " + " ".join(f"{x:.3f}" for x in report["losses"]))
    print("  resident loss " + " ".join(f"{x:.3f}" for x in report["resident_losses"]))
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, f"{failed}: seen {report['seen']}, bound {report['bound']}, moved {report['moved']:.3g}"
