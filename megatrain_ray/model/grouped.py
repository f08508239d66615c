"""The grouped GEMM of a mixture of experts: rows sorted by expert (:func:`dispatch`), each expert's
contiguous rows through its own weights (:func:`grouped_linear`: one grouped GEMM on a GPU where torch
has one, else a GEMM per expert), and the experts' low-rank adapters the same way
(:func:`grouped_low_rank`). Architecture only, as :mod:`megatrain_ray.model.moe` uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Params = dict[str, torch.Tensor]


def _grouped_mm():
    """torch's grouped GEMM: ``torch.nn.functional.grouped_mm`` (torch 2.10+), else ``torch._grouped_mm``, else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs x: [T, in] against w: [E, out, in] here: CUDA, bf16, a GPU it
    supports (compute capability 8.0+ from torch 2.9 on, 9.x before), 16-byte aligned rows and starts."""
    if not (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and _grouped_mm() is not None):
        return False
    major = torch.cuda.get_device_capability(x.device)[0]
    recent = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)
    return ((major >= 8) if recent else major == 9) and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0 \
        and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0


@torch.compiler.disable
def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert through their expert's linear map. x: [T, in] (the rows of expert 0,
    then 1, ...), w: [E, out, in], counts: [E] int64 (rows per expert, summing to T) -> [T, out].

    One grouped GEMM where :func:`grouped_kernel` says so; else one GEMM per expert over its rows
    (this needs the counts on the host: the CPU path). Never compiled (one kernel, nothing to fuse):
    a compiled layer calls it eagerly, so its weights' several shapes (the experts' and their
    adapters') cost no recompiles, and the forward and the backward's recompute run the same kernels."""
    if grouped_kernel(x, w):
        return _grouped_mm()(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    pieces = x.split(counts.tolist())
    return torch.cat([F.linear(piece, w[e]) for e, piece in enumerate(pieces)])


def dispatch(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts: [N, k] int64 -> (order [N*k]: the (token, slot) pairs sorted by expert, stably;
    inverse [N*k]: its inverse permutation; counts [E] int64: pairs per expert)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, inverse, counts  # integer sums: exact in any order; a fixed shape, no host sync


def grouped_low_rank(p: Params, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
    """The routed experts' adapter term of their stacked parameter ``name`` (``mlp.experts.gate_up_proj``),
    where ``p`` holds one (``{name}.lora_A.weight`` A: [E, r, in], ``{name}.lora_B.weight`` B:
    [E, out, r], ``{name}.lora_scaling``: a 0-d tensor), else None: each row of expert e gets
    scaling * B_e (A_e x), PEFT's W_e + scaling * B_e A_e applied without forming it. x: [T, in] grouped
    by expert as :func:`grouped_linear` takes it, counts: [E] -> [T, out]. Two grouped GEMMs through
    rank r, with no loop over experts where :func:`grouped_kernel` holds (on a GPU in bf16 that asks
    r to be a multiple of 8, as the GEMMs' 16-byte rows do; else one GEMM per expert); an expert
    without a token has zero rows, so its adapter's gradient is exactly zero."""
    a = p.get(f"{name}.lora_A.weight")
    if a is None:
        return None
    ax = grouped_linear(x, a, counts) * p[f"{name}.lora_scaling"]  # [T, r]: the scaling on the rank-r product
    return grouped_linear(ax, p[f"{name}.lora_B.weight"], counts)
