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
    ``{name}.lora_dropout`` (x's shape: 0 where dropped, 1 / (1 - p) where kept), A reads x times it."""
    a = p.get(f"{name}.lora_A.weight")
    if a is None:
        return None
    mask = p.get(f"{name}.lora_dropout")
    x = x if mask is None else x * mask
    return F.linear(F.linear(x, a), p[f"{name}.lora_B.weight"]) * p[f"{name}.lora_scaling"]


def linear(p: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    """The projection ``name`` (``self_attn.o_proj``, ...): x: [..., in] -> [..., out], with its
    ``weight`` [out, in], its ``bias`` [out] if it has one, and its adapter term where ``p`` holds one
    (:func:`low_rank`)."""
    out = F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))
    extra = low_rank(p, name, x)
    return out if extra is None else out + extra

