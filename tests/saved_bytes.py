"""What a layer's forward holds for its backward, counted as the planner counts a kept graph."""

import torch

from megatrain_ray.model import transformer as M
from megatrain_ray.model.layout import LayerTemplate


def layer_inputs(cfg, dtype: torch.dtype, b: int, s: int):
    """(leaves, x, rope) of one decoder layer of ``cfg``: its weights as leaves that need a gradient
    (random, scale 0.02), an input x [b, s, hidden] that needs one too, and the RoPE tables of s."""
    t = LayerTemplate.build(cfg, "layers.0")
    leaves = {k: v.detach().requires_grad_(True)
              for k, v in t.bind((torch.randn(t.numel) * 0.02).to(dtype), fused=True).items()}
    x = torch.randn(b, s, cfg.hidden_size, dtype=dtype).requires_grad_(True)
    return leaves, x, M.rope_cache(cfg, s, torch.device("cpu"), dtype)


def saved_bytes(layer, leaves: dict, x: torch.Tensor, rope, cfg) -> int:
    """Bytes ``layer(leaves, x, rope, cfg)`` saves for its backward (saved-tensor hooks, one count per
    storage; the weights and the RoPE tables left out), plus its input x, the leaf the backward needs."""
    skip = {v.untyped_storage().data_ptr() for v in (*leaves.values(), *rope)}
    saved = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(leaves, x, rope, cfg)
    return sum(saved.values())
