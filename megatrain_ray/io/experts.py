"""Where a mixture of experts' routed experts are in a Hugging Face checkpoint: one tensor per expert
(the Hub's form, ``mlp.experts.{e}.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``)
or a layer's experts stacked in 3-D tensors (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]: transformers 5's parameters, as a state dict saved directly
holds them). :func:`sources` maps each parameter to its tensor, or to its slice of a stacked one, so
that :mod:`megatrain_ray.io.hf_io` reads either form one expert at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..config import ModelConfig
from ..model.moe import QWEN_NAMES, names

Source = tuple[str, tuple]
"""Where a parameter is in a checkpoint: (tensor name, index into it: () for the whole tensor)."""


def sources(cfg: ModelConfig, mapping: dict[str, str], expected: Iterable[str]) -> dict[str, Source]:
    """{full HF name of each parameter the model has: where it is in a checkpoint of this weight map}:
    the tensor of that name, or, for the routed experts of a layer stored stacked (see the module
    docstring), a slice of the stacked tensor; Mixtral's router is then under ``mlp.gate.weight``.
    expected: the full HF names of the model's parameters."""
    out = {name: (name, ()) for name in expected}
    n, i_size = names(cfg), cfg.expert_size
    for layer in cfg.sparse_layers:
        prefix = f"model.layers.{layer}."
        gate_up, down = (prefix + s for s in QWEN_NAMES.stacked)
        if prefix + n.expert(0)[0] in mapping or gate_up not in mapping:
            continue
        for e in range(cfg.num_experts):
            g, u, d = (prefix + s for s in n.expert(e))
            out[g], out[u], out[d] = (gate_up, (e, slice(0, i_size))), (gate_up, (e, slice(i_size, 2 * i_size))), \
                (down, (e,))
        if prefix + n.router not in mapping:
            out[prefix + n.router] = (prefix + QWEN_NAMES.router, ())
    return out


def source_shapes(cfg: ModelConfig, where: dict[str, Source], want: dict[str, tuple[int, ...]]
                  ) -> dict[str, tuple[int, ...]]:
    """{checkpoint tensor name: the shape ``cfg`` implies for it} of the tensors ``where`` reads;
    want: {full HF name: shape} of the model's parameters."""
    out = {}
    for name, (key, index) in where.items():
        if not index:
            out[key] = want[name]
        elif key.endswith("gate_up_proj"):
            out[key] = (cfg.num_experts, 2 * cfg.expert_size, cfg.hidden_size)
        else:
            out[key] = (cfg.num_experts, cfg.hidden_size, cfg.expert_size)
    return out


def read_source(f, source: Source) -> torch.Tensor:
    """One parameter from an open safetensors file (``safe_open``): a whole tensor or a slice of one."""
    key, index = source
    return f.get_slice(key)[index] if index else f.get_tensor(key)
