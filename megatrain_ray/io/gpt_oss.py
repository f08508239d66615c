"""gpt-oss's routed experts on the Hub, and their place in this project's per-expert layout.

The Hub holds a gpt-oss layer's experts only stacked, in one of two forms:

- **bf16** (transformers' parameters, what ``save_pretrained`` of a dequantized model writes):
  ``mlp.experts.gate_up_proj`` [E, H, 2I], each expert's gate and up projections *interleaved* along
  the last dim (gate = [..., 0::2], up = [..., 1::2]) and applied as x @ W; ``gate_up_proj_bias``
  [E, 2I] interleaved the same way; ``down_proj`` [E, I, H]; ``down_proj_bias`` [E, H].
- **MXFP4** (the published checkpoints): ``gate_up_proj_blocks`` [E, 2I, H/32, 16] and
  ``down_proj_blocks`` [E, H, I/32, 16] uint8, two fp4 (e2m1) codes per byte, low nibble first;
  ``*_scales`` [E, rows, in/32] uint8, one e8m0 scale per 32 values (:mod:`megatrain_ray.model.mxfp4`);
  the biases as in the bf16 form. Dequantized, a block tensor is [E, out, in] (rows interleaved as
  above), the transpose of the bf16 form.

This project keeps each expert's gate, up and down weights [I, H], [I, H], [H, I] and biases as
tensors of their own (:data:`megatrain_ray.model.moe.GPT_OSS_NAMES`), like the other families.
:func:`add_sources` maps each of them to its slice of a stacked tensor and the conversion that
brings it into that layout (de-interleave, transpose, dequantize), so import reads one expert at a
time (:mod:`megatrain_ray.io.experts`); :func:`hub_form` does the reverse for export, one
stacked tensor at a time, in the bf16 form (which transformers loads; a LoRA run's merged export
too). :func:`interleave` is that order of the gate and up rows, also what the adapters on the
experts' gate_up_proj take in a PEFT adapter file (:mod:`megatrain_ray.io.peft_io`).

An MXFP4 expert weight is dequantized once, at import, into a store of weights (full fine-tuning,
or a LoRA base in the compute dtype, int8 or nf4); into a LoRA base stored as MXFP4 (lora.base_format
mxfp4) its blocks and scales go as they are (:attr:`Convert.packed`: our gate weight is the rows
0::2 of the expert's ``gate_up_proj_blocks`` and ``_scales``, up the rows 1::2, down its
``down_proj_blocks`` and ``_scales``), with no dequantization and no second quantization.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model.moe import GPT_OSS_NAMES
from ..model.mxfp4 import dequantize_blocks

STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
"""The Hub's bf16 tensors of a layer's experts, under ``mlp.experts.``."""


@dataclass(frozen=True)
class Convert:
    """How a parameter is made from the tensor slice a source reads (the third element of a
    :data:`~megatrain_ray.io.experts.Source`)."""

    shapes: dict[str, tuple[int, ...]]
    """{checkpoint tensor: its whole shape} of every tensor read (checked before import)."""
    fn: Callable[[torch.Tensor, Callable[[str, tuple], torch.Tensor]], torch.Tensor]
    """(the source's slice, read(other key, index)) -> the parameter."""
    others: tuple[str, ...] = ()
    """Other tensors ``fn`` reads (an MXFP4 weight's scales)."""
    packed: Callable[[torch.Tensor, Callable[[str, tuple], torch.Tensor]], tuple[torch.Tensor, ...]] | None = None
    """For an MXFP4 weight: (the source's slice, read) -> (codes [rows * in / 2], scales [rows * in / 32])
    uint8, the checkpoint's bytes as they are, what an mxfp4 record holds (see the module docstring)."""

    def __call__(self, t: torch.Tensor, read: Callable[[str, tuple], torch.Tensor]) -> torch.Tensor:
        return self.fn(t, read)


def _bf16_sources(prefix: str, cfg: ModelConfig, e: int) -> dict:
    """One expert's parameters as slices of the bf16 stacked tensors."""
    h, i, n = cfg.hidden_size, cfg.expert_size, cfg.num_experts
    gu, gub, dn, dnb = (f"{prefix}mlp.experts.{s}" for s in STACKED)
    shapes = {gu: (n, h, 2 * i), gub: (n, 2 * i), dn: (n, i, h), dnb: (n, h)}
    conv = {  # the slice read is expert e's: [H, 2I], [2I], [I, H], [H]
        "gate_w": Convert({gu: shapes[gu]}, lambda t, _: t[:, 0::2].t().contiguous()),
        "up_w": Convert({gu: shapes[gu]}, lambda t, _: t[:, 1::2].t().contiguous()),
        "down_w": Convert({dn: shapes[dn]}, lambda t, _: t.t().contiguous()),
        "gate_b": Convert({gub: shapes[gub]}, lambda t, _: t[0::2].contiguous()),
        "up_b": Convert({gub: shapes[gub]}, lambda t, _: t[1::2].contiguous()),
        "down_b": Convert({dnb: shapes[dnb]}, lambda t, _: t),
    }
    (g, u, d), (gb, ub, db) = GPT_OSS_NAMES.expert(e), GPT_OSS_NAMES.expert_bias(e)
    return {prefix + g: (gu, (e,), conv["gate_w"]), prefix + u: (gu, (e,), conv["up_w"]),
            prefix + d: (dn, (e,), conv["down_w"]), prefix + gb: (gub, (e,), conv["gate_b"]),
            prefix + ub: (gub, (e,), conv["up_b"]), prefix + db: (dnb, (e,), conv["down_b"])}


def _mxfp4(blocks: str, scales: str, shape: tuple[int, ...], e: int, rows: slice) -> Convert:
    """Expert e's weight rows ``rows`` of an MXFP4 pair: blocks [E, R, G, 16], scales [E, R, G]."""
    def fn(t, read):
        return dequantize_blocks(t[rows], read(scales, (e,))[rows])

    def packed(t, read):
        return t[rows].reshape(-1), read(scales, (e,))[rows].reshape(-1)
    return Convert({blocks: shape, scales: shape[:-1]}, fn, (scales,), packed)


def add_sources(cfg: ModelConfig, mapping: dict[str, str], out: dict) -> None:
    """Into ``out`` ({full HF name: source}), the sources of every gpt-oss layer's per-expert
    parameters: slices of the bf16 or MXFP4 stacked tensors the weight map holds (a checkpoint of
    this project's per-expert form is left as ``out`` has it)."""
    h, i, n = cfg.hidden_size, cfg.expert_size, cfg.num_experts
    for layer in cfg.sparse_layers:
        prefix = f"model.layers.{layer}."
        if prefix + GPT_OSS_NAMES.expert(0)[0] in mapping:
            continue
        for e in range(n):
            out.update(_bf16_sources(prefix, cfg, e))
        if prefix + "mlp.experts.gate_up_proj" in mapping:
            continue
        gu_b, gu_s, dn_b, dn_s = (f"{prefix}mlp.experts.{p}_{k}" for p in ("gate_up_proj", "down_proj")
                                  for k in ("blocks", "scales"))
        gu_shape, dn_shape = (n, 2 * i, h // 32, 16), (n, h, i // 32, 16)
        for e in range(n):
            g, u, d = (prefix + m for m in GPT_OSS_NAMES.expert(e))
            out[g] = (gu_b, (e,), _mxfp4(gu_b, gu_s, gu_shape, e, slice(0, None, 2)))
            out[u] = (gu_b, (e,), _mxfp4(gu_b, gu_s, gu_shape, e, slice(1, None, 2)))
            out[d] = (dn_b, (e,), _mxfp4(dn_b, dn_s, dn_shape, e, slice(None)))


def hub_form(cfg: ModelConfig, tensors: list) -> list:
    """``tensors`` (TensorSources of ``cfg``'s parameters, named by full HF name) as the Hub holds
    them: as they are, but each gpt-oss layer's per-expert tensors replaced by the Hub's four bf16
    stacked ones (see the module docstring), each built when written from its experts' tensors."""
    from .files import TensorSource

    if cfg.model_type != "gpt_oss":
        return tensors
    by_name = {t.name: t for t in tensors}
    experts = {f"model.layers.{layer}.": [] for layer in cfg.sparse_layers}
    out = []
    for t in tensors:
        prefix = t.name[:t.name.index("mlp.experts.")] if ".mlp.experts." in t.name else None
        if prefix is None:
            out.append(t)
        elif not experts[prefix]:  # the layer's first expert tensor: its four stacked ones go here
            experts[prefix].append(t)
            out += _stacked(cfg, prefix, by_name, t.dtype, TensorSource)
    return out


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t: [..., 2I, ...], along ``dim`` (>= 0) an expert's gate rows then its up rows (this project's
    order) -> the same tensor with those rows interleaved (gate 0, up 0, gate 1, ...), the Hub's order."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def _stacked(cfg: ModelConfig, prefix: str, by_name: dict, dtype: torch.dtype, source_cls) -> list:
    h, i, n = cfg.hidden_size, cfg.expert_size, cfg.num_experts

    def load(name: str) -> torch.Tensor:
        return by_name[prefix + name].load()

    def gate_up(bias: bool) -> Callable[[], torch.Tensor]:
        def build() -> torch.Tensor:
            rows = []
            for e in range(n):
                g, u, _ = GPT_OSS_NAMES.expert_bias(e) if bias else GPT_OSS_NAMES.expert(e)
                both = interleave(torch.cat((load(g), load(u))), 0)
                rows.append(both if bias else both.t())
            return torch.stack(rows).to(dtype).contiguous()
        return build

    def down(bias: bool) -> Callable[[], torch.Tensor]:
        def build() -> torch.Tensor:
            pick = GPT_OSS_NAMES.expert_bias if bias else GPT_OSS_NAMES.expert
            return torch.stack([load(pick(e)[2]) if bias else load(pick(e)[2]).t()
                                for e in range(n)]).to(dtype).contiguous()
        return build

    name = prefix + "mlp.experts."
    return [source_cls(name + "gate_up_proj", (n, h, 2 * i), dtype, gate_up(False)),
            source_cls(name + "gate_up_proj_bias", (n, 2 * i), dtype, gate_up(True)),
            source_cls(name + "down_proj", (n, i, h), dtype, down(False)),
            source_cls(name + "down_proj_bias", (n, h), dtype, down(True))]
