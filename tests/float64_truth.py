"""Parity against a float64 truth: how close an fp32 run must be to the same training done exactly.

Two fp32 implementations of the same math (ours, and transformers + torch.optim.AdamW) round
differently wherever they order a sum differently (fused q/k/v GEMMs, chunked loss, micro-batch
accumulation, attention kernels, the AdamW kernel), and training amplifies that: AdamW divides by
sqrt(v) + eps, so where a gradient is near the rounding level its update is rounding noise times
lr / eps. A fixed tolerance between the two is a guess that holds on one CPU and one library
version. Instead the reference also trains in float64 from the same init on the same batches,
standing in for exact arithmetic (its rounding is 2^29 times finer than fp32's), and ours must be
no farther from that truth than fp32 references are, within :data:`FACTOR`, plus a floor of
:data:`FLOOR_ULPS`.

transformers computes RMSNorm and RoPE in float32 on purpose, whatever the model's dtype; under
:func:`float64_only` every float32 that code asks for is float64, and any op that still produces a
narrower float fails the test, so the truth really is float64 throughout.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FACTOR = 4.0
"""Ours may be up to 4x as far from the truth as the farthest of the fp32 references a test runs (at
least two: the same reference with another attention kernel and accumulation order; more where two
share too much of their rounding, as tests/test_lora_moe.py says). Which of two correct fp32 runs
lands closer to the truth is luck of rounding: across 35 seeded runs of the parity test the two
references' distances differed by up to 13x on one tensor and 3.4x over the model, so one
reference alone is no yardstick; the farther of two is a steadier one. Against it ours was at most
2.5x on a tensor and 1.9x overall in those runs; another CPU or library version rounds like
another seed, and 4x leaves room for that. A real error (a decay missed or misplaced, a wrong
schedule step, a wrong gradient term) is orders of magnitude above fp32 rounding after a few steps."""
FLOOR_ULPS = 4.0
"""Plus 4 fp32 ulps of the quantity's scale (4 * 2^-23 * ||truth||): rounding the exact result to
fp32 alone moves it by up to half an ulp per element, and every optimizer step rounds it again, so
even a perfect fp32 run of a few steps can be that far off; the floor keeps a quantity that the
references happen to land almost exactly on (a loss before any update, a norm weight that barely
moved) from leaving ours no room. At 4.8e-7 of the quantity it decides only there (losses, norm
weights, some biases); the references' distance on a matrix after a few steps is 2-100x larger."""
EPS32 = torch.finfo(torch.float32).eps
"""2^-23: the spacing of fp32 numbers in [1, 2), so an ulp of x is at most EPS32 * |x|."""


class _Float64(TorchFunctionMode):
    """float32 read as float64 by the code run under it (``.float()``, ``.to(torch.float32)``, dtype=)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class _NoNarrowFloats(TorchDispatchMode):
    """Fails on any op (forward or backward) that produces a float tensor narrower than float64."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                raise AssertionError(f"the float64 reference ran {func} in {t.dtype}")
        return out


@contextlib.contextmanager
def float64_only():
    """Run training code (forward, backward, optimizer) in float64, failing if any op falls back to less."""
    with _Float64(), _NoNarrowFloats():
        yield


def to_float64(model):
    """An HF causal LM in float64, its RoPE frequencies recomputed in float64 (they were computed in
    float32 when it was built, and casting would keep their fp32 rounding), without activation
    checkpointing: a layer recomputed inside backward would run in the autograd engine, outside
    :func:`float64_only`'s reach, and the truth is the same without it."""
    model = model.double()
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    rotary = model.base_model.rotary_emb
    with _Float64():
        model.base_model.rotary_emb = type(rotary)(config=model.config).to(torch.float64)
    return model


def assert_as_close_to_truth(ours: dict, references: list[dict], truth: dict) -> dict[str, float]:
    """Each entry of ``ours``, and all of them together, are no farther from ``truth`` (float64)
    than FACTOR times the farther of the fp32 ``references``, plus FLOOR_ULPS of the entry's scale
    (distances are norms over each tensor; a loss is a one-element entry).

    Returns {name: ours' distance / the farther reference's}, with "overall" for the whole set.
    """
    assert all(set(ours) == set(ref) == set(truth) for ref in references)
    sums, ratios = [0.0, 0.0, 0.0], {}
    for name, t in truth.items():
        t = torch.as_tensor(t, dtype=torch.float64).detach()
        err = _distance(ours[name], t)
        ref = max(_distance(r[name], t) for r in references)
        scale = float(t.norm())
        _check(name, err, ref, scale)
        ratios[name] = err / ref if ref > 0 else 0.0 if err == 0 else float("inf")
        for i, x in enumerate((err, ref, scale)):
            sums[i] += x * x
    err, ref, scale = (x ** 0.5 for x in sums)
    _check("overall", err, ref, scale)
    ratios["overall"] = err / ref if ref > 0 else 0.0 if err == 0 else float("inf")
    return ratios


def _distance(x, truth: torch.Tensor) -> float:
    return float((torch.as_tensor(x).detach().double() - truth).norm())


def _check(name: str, err: float, ref: float, scale: float) -> None:
    bound = FACTOR * ref + FLOOR_ULPS * EPS32 * scale
    assert err <= bound, (f"{name}: ours is {err:.3e} from the float64 truth, the fp32 references up to {ref:.3e} "
                          f"(allowed {FACTOR:g} x that + {FLOOR_ULPS:g} ulps = {bound:.3e}; scale {scale:.3e})")
