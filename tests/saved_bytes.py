"""What a layer's forward holds for its backward, counted as the planner counts a kept graph."""

import torch


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
