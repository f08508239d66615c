"""Where a mixture of experts' routed experts are in a Hugging Face checkpoint: one tensor per expert
(the Hub's form, ``mlp.experts.{e}.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``)
or a layer's experts stacked in 3-D tensors (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]: transformers 5's parameters, as a state dict saved directly
holds them). :func:`sources` maps each parameter to its tensor, or to its slice of a stacked one, so
that :mod:`megatrain_ray.io.hf_io` reads either form one expert at a time. gpt-oss's experts are
only stacked on the Hub, in a layout of their own (or MXFP4): their sources carry the conversion
into this project's layout (:mod:`megatrain_ray.io.gpt_oss`), or, into an mxfp4 base, their MXFP4
bytes as they are (:func:`write_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..config import ModelConfig
from ..model.moe import QWEN_NAMES, names
from ..model.quant_layout import MXFP4
from . import gpt_oss

Source = tuple
"""Where a parameter is in a checkpoint: (tensor name, index into it: () for the whole tensor), and
for a parameter converted from what is read, a third element: the :class:`~megatrain_ray.io.gpt_oss.Convert`."""


def sources(cfg: ModelConfig, mapping: dict[str, str], expected: Iterable[str]) -> dict[str, Source]:
    """{full HF name of each parameter the model has: where it is in a checkpoint of this weight map}:
    the tensor of that name, or, for the routed experts of a layer stored stacked (see the module
    docstring), a slice of the stacked tensor; Mixtral's router is then under ``mlp.gate.weight``.
    expected: the full HF names of the model's parameters."""
    out = {name: (name, ()) for name in expected}
    if cfg.model_type == "gpt_oss":
        gpt_oss.add_sources(cfg, mapping, out)
        return out
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
    for name, (key, index, *convert) in where.items():
        if convert:
            out.update(convert[0].shapes)
        elif not index:
            out[key] = want[name]
        elif key.endswith("gate_up_proj"):
            out[key] = (cfg.num_experts, 2 * cfg.expert_size, cfg.hidden_size)
        else:
            out[key] = (cfg.num_experts, cfg.hidden_size, cfg.expert_size)
    return out


def source_keys(source: Source) -> tuple[str, ...]:
    """Every checkpoint tensor a source reads (its own, and those its conversion reads besides)."""
    return (source[0], *(source[2].others if len(source) > 2 else ()))


def read_source(f, source: Source, read: Callable[[str, tuple], torch.Tensor] | None = None) -> torch.Tensor:
    """One parameter from an open safetensors file (``safe_open``): a whole tensor or a slice of one,
    converted where the source says; read(key, index): another tensor's slice (:func:`reader`), for
    a conversion that reads more than one."""
    key, index, *convert = source
    t = f.get_slice(key)[index] if index else f.get_tensor(key)
    return convert[0](t, read) if convert else t


def write_source(store, i: int, name: str, f, source: Source, read: Callable[[str, tuple], torch.Tensor]) -> None:
    """Set unit i's parameter ``name`` in ``store`` (a HostStore) from ``source`` in the open file ``f``:
    where the source is an MXFP4 weight and the store's record of it is mxfp4 (gpt-oss's experts into
    an mxfp4 base), the checkpoint's blocks and scales as they are (:attr:`~megatrain_ray.io.gpt_oss.Convert.packed`);
    else the parameter read and converted (:func:`read_source`), quantized as it is written for a quantized base."""
    convert = source[2] if len(source) > 2 else None
    if convert is not None and convert.packed is not None and store.base is not None \
            and store.base.record(i, name).fmt == MXFP4:
        key, index = source[:2]
        store.base.write_pieces(i, name, convert.packed(f.get_slice(key)[index], read))
    else:
        store.write(i, name, read_source(f, source, read))


def reader(directory: str, mapping: dict[str, str]) -> Callable[[str, tuple], torch.Tensor]:
    """read(key, index): a slice of any tensor of the HF directory with this weight map."""
    import os

    from safetensors import safe_open

    def read(key: str, index: tuple) -> torch.Tensor:
        with safe_open(os.path.join(directory, mapping[key]), framework="pt") as f:
            return f.get_slice(key)[index] if index else f.get_tensor(key)
    return read
