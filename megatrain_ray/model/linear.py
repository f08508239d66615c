"""The linear map of a projection, with its low-rank adapter term where the caller bound one: the
one helper every projection of the model goes through (attention, the dense MLP, a mixture of
experts' shared expert). Pure functions of (weights, inputs); the adapters are bound by the caller
beside the base weights under PEFT's names (:mod:`megatrain_ray.model.lora`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Params = dict[str, torch.Tensor]


def low_rank(p: Params, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """The adapter term of the projection ``name``, scaling * B (A x), where ``p`` holds an adapter
    for it (``{name}.lora_A.weight`` A: [r, in], ``{name}.lora_B.weight`` B: [out, r],
    ``{name}.lora_scaling``: a 0-d tensor), else None. x: [..., in] -> [..., out]. With
    ``{name}.lora_dropout`` (x's shape: 0 where dropped, 1 / (1 - p) where kept), A reads x times it.
    The scaling multiplies the rank-r product A x, never a tensor of the output's size."""
    ax = _scaled_down(p, name, x)
    return None if ax is None else F.linear(ax, p[f"{name}.lora_B.weight"])


def _scaled_down(p: Params, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """scaling * A x (x times its dropout mask, where ``p`` holds one) of the adapter of ``name``:
    [..., in] -> [..., r]; None without an adapter."""
    a = p.get(f"{name}.lora_A.weight")
    if a is None:
        return None
    mask = p.get(f"{name}.lora_dropout")
    return F.linear(x if mask is None else x * mask, a) * p[f"{name}.lora_scaling"]


def add_low_rank(p: Params, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` [..., out] (the projection's output for x [..., in]) plus the adapter term of
    :func:`low_rank`, where ``p`` holds an adapter for ``name``; else ``out`` itself: an elementwise
    sum, as PEFT's LoRA layer adds it (a compiled layer fuses it with the work around it)."""
    extra = low_rank(p, name, x)
    return out if extra is None else out + extra


def linear(p: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    """The projection ``name`` (``self_attn.o_proj``, ...): x: [..., in] -> [..., out], with its
    ``weight`` [out, in], its ``bias`` [out] if it has one, and its adapter term where ``p`` holds one
    (:func:`add_low_rank`)."""
    return add_low_rank(p, name, x, F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias")))
