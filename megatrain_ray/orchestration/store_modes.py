"""The plan's comparison of store modes: host-store bytes per parameter of each optimizer mode and of
a LoRA run's frozen base in each lora.base_format, and about the largest model of the run's shape
whose store fits the host RAM left for it (:func:`mode_notes`, lines of ``megatrain-ray plan``)."""

from __future__ import annotations

import dataclasses

from ..config import LoraSection, TrainConfig
from ..config.lora import BASE_FORMATS, mxfp4_refusal
from ..engine.store.host_store import StoreSpec
from ..model import flops
from ..model.layout import StoreLayout
from ..model.precision import resolve_precision
from ..model.quant_layout import bytes_per_param as quant_bytes_per_param
from .device_memory import fmt

MODES = (("fp32", "float32", "exact AdamW, fp32 master (optim.state fp32)"),
         ("fp32", "bfloat16", "bf16 master (precision.master_dtype bfloat16)"),
         ("8bit", "bfloat16", "compact (optim.state 8bit)"))
"""(optim.state, precision.master_dtype, label) of the optimizer modes the plan compares."""


def bytes_per_param(cfg: TrainConfig, device: str, state: str, master_dtype: str,
                    resident: tuple[int, ...] = ()) -> float:
    """Host-store bytes per parameter of ``cfg``'s model in one optimizer mode, with the run's clipping
    and ``resident`` units (a gradient ring of unit slots counts as O(one unit), not per parameter)."""
    given = dataclasses.replace(cfg.precision, master_dtype=master_dtype)
    precision = resolve_precision(given, device, state)
    spec = StoreSpec.of_run(dataclasses.replace(cfg, precision=given), precision, device, 0, "plan", resident)
    ring = spec.numel("grad") * spec.dtype("grad").itemsize if spec.grad_slots else 0
    return (spec.nbytes() - ring) / StoreLayout.build(cfg.model).num_params


def mode_notes(cfg: TrainConfig, device: str, budget: int, resident: tuple[int, ...] = ()) -> list[str]:
    """One line per optimizer mode: its bytes per parameter and about the largest model whose store fits
    ``budget`` (the host RAM left once everything but the store is counted), at this model's shape, and
    the LoRA mode's in each lora.base_format the model takes (a frozen base; the rank does not change
    the store; mxfp4 for a mixture of experts alone)."""
    clip = "with clipping" if cfg.optim.max_grad_norm > 0 else "without clipping"
    lines = [f"optimizer modes ({clip}, {device}): host-store bytes per parameter and the largest model "
             f"whose store fits the {fmt(max(0, budget))} of host RAM left for it"]
    for state, master, label in MODES:
        per = bytes_per_param(dataclasses.replace(cfg, lora=LoraSection()), device, state, master, resident)
        fits = int(max(0, budget) / per)
        lines.append(f"  {label:<46}{per:6.2f} B/param  -> {flops.fmt_count(fits)} parameters{_layers_note(cfg.model, fits)}")
    lora = cfg.lora if cfg.lora.enabled else LoraSection(rank=16)  # its store does not depend on the rank
    precision = resolve_precision(cfg.precision, device, cfg.optim.state)
    for base in BASE_FORMATS:  # the frozen base in each storage format (lora.base_format; embedding, head raw)
        if base == "mxfp4" and mxfp4_refusal(cfg.model):  # a dense model has no routed experts to quantize
            continue
        run = dataclasses.replace(cfg, lora=dataclasses.replace(lora, base_format=base))
        per = bytes_per_param(run, device, cfg.optim.state, cfg.precision.master_dtype)
        layers = _base_layers(run, device, max(0, budget))
        label = f"LoRA (lora.rank > 0: a frozen base, {base})"
        fits = _of_layers(flops.num_params, cfg.model, layers)
        in_layers = (f", {quant_bytes_per_param(cfg.model, base, precision.compute)[0]:.3f} B/param in the layers"
                     if base != "compute" else "")
        lines.append(f"  {label:<46}{per:6.2f} B/param  -> {flops.fmt_count(fits if layers else 0)} parameters "
                     f"({layers} layer(s) of this shape{in_layers})")
    return lines


def _base_layers(cfg: TrainConfig, device: str, budget: int) -> int:
    """Decoder layers of ``cfg``'s model shape whose LoRA base store (its lora.base_format) fits ``budget`` bytes."""
    precision = resolve_precision(cfg.precision, device, cfg.optim.state)

    def store(n: int) -> int:
        model = dataclasses.replace(cfg.model, num_hidden_layers=n, mlp_only_layers=[])
        return StoreSpec.of_run(dataclasses.replace(cfg, model=model), precision, device, 0, "plan").nbytes()

    one, two = store(1), store(2)
    return max(0, (budget - (2 * one - two)) // (two - one))


def _of_layers(count, model, layers: int) -> int:
    """``count`` (a function of a model config: its parameters, its active ones) of ``model``'s shape
    with ``layers`` decoder layers of its kind, extrapolated from one and two layers (the count is
    affine in the layers; counting a model of 10^5 layers itself would take minutes)."""
    one, two = (count(dataclasses.replace(model, num_hidden_layers=n, mlp_only_layers=[])) for n in (1, 2))
    return one + (layers - 1) * (two - one)


def _dense_layers(model, fits: int) -> int:
    """Decoder layers of ``model``'s shape (its embedding and head included) that ``fits`` parameters hold."""
    one, two = (_of_layers(flops.num_params, model, n) for n in (1, 2))
    return max(0, (fits - (2 * one - two)) // (two - one))


def _layers_note(model, fits: int) -> str:
    """The layers of this shape that ``fits`` parameters hold (:func:`_dense_layers`), and a mixture of
    experts' active parameters in them."""
    layers = _dense_layers(model, fits)
    if not model.is_moe:
        return f" ({layers} layer(s) of this shape)"
    active = _of_layers(flops.active_params, model, layers)
    return f" ({layers} layer(s) of this shape: {flops.fmt_count(active)} active)" if layers else ""
