"""The float64 AdamW truth the GPU update tests hold kernels to (tests/adamw_truth.py): the host's
native kernel and torch's fused CPU kernel both land within its fp32 bounds, their first moments
differ by far more than ulps of themselves (why a relative tolerance between two kernels cannot
serve), and a kernel that is wrong by one step, a missed decay or an unapplied clipping factor is out."""

import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.engine.optim import AdamWRunner, adamw_unit, decay_ranges

from adamw_truth import AdamWTruth

N, DECAY, STEPS = 40_000, 30_000, 3


def _run(kernel, cfg, **wrong):
    """STEPS steps of ``kernel`` ("native" or "fused") on one unit of N elements (the first DECAY
    decayed) from the same draw, beside its float64 truth; ``wrong``: step_offset, no_decay, no_clip."""
    o = cfg.optim
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(N, generator=gen) * 0.02
    truth = AdamWTruth(master, decay_ranges(N, DECAY, o), o.beta1, o.beta2, o.eps)
    m, v = torch.zeros(N), torch.zeros(N)
    runner = AdamWRunner(2)
    try:
        for step in range(STEPS):
            grad = torch.randn(N, generator=gen)
            coef, lr = 0.004, 1e-3 * (step + 1)
            truth.step(grad, coef, lr)
            args = (master, grad.clone(), m, v, None, 0 if wrong.get("no_decay") else DECAY,
                    step + 1 + wrong.get("step_offset", 0), lr, o)
            scale = 1.0 if wrong.get("no_clip") else coef
            if kernel == "native":
                runner.update(*args, grad_scale=scale)
            else:
                adamw_unit(*args, grad_scale=scale, pieces=False)
    finally:
        runner.close()
    return truth, master, m, v


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["optim.weight_decay=0.1", "compute.device=cpu"])


def test_both_fp32_kernels_land_within_the_bounds_and_apart_by_more_than_ulps_of_the_moment(cfg):
    states = {}
    for kernel in ("native", "fused"):
        truth, *state = _run(kernel, cfg)
        shares = truth.assert_close(*state, kernel)
        assert all(0 < s <= 1 for s in shares.values()), shares  # each rounds somewhere, within its bound
        states[kernel] = state
    m_native, m_fused = states["native"][1], states["fused"][1]
    rel = ((m_native - m_fused).abs() / m_native.abs().clamp_min(1e-30)).max()
    assert rel > 2**-16  # where a moment cancels, two correct kernels differ by > 8 ulps of it


@pytest.mark.parametrize("wrong", [{"step_offset": 1}, {"no_decay": True}, {"no_clip": True}])
def test_a_wrong_kernel_is_out_of_the_bounds(cfg, wrong):
    truth, *state = _run("native", cfg, **wrong)
    with pytest.raises(AssertionError, match="farther from the float64 truth"):
        truth.assert_close(*state, str(wrong))
