"""The reference the streamed engine is checked against: the whole model resident on one device.

Built from the model's own functions (:mod:`megatrain_ray.model.transformer`), so it differs from the engine
only in *how* it runs, never in the math: every weight is one fp32 leaf tensor on one device, a
step runs micro-batch by micro-batch with plain autograd (optionally under autocast in bf16, and
with per-layer recompute through ``torch.utils.checkpoint``), gradients accumulate in fp32 in
``.grad``, and the update is ``torch.optim.AdamW`` after ``torch.nn.utils.clip_grad_norm_`` with the
schedule of :func:`megatrain_ray.config.lr_at`. The GPU tests, the convergence benchmark and the
GPU-resident baseline of benchmarks/compare.py all train through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from megatrain_ray.config import ModelConfig, OptimConfig, lr_at
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.transformer import (IGNORE_INDEX, Params, UnitReader, decoder_layer, forward_hidden, token_loss_sum,
                                 unit_names)


class ResidentModel:
    """Every unit's weights as fp32 leaf tensors on ``device``; see the module docstring.

    ``autocast``: None (run in fp32) or the autocast dtype (bf16 on CUDA, as the engine computes);
    ``recompute``: checkpoint each decoder layer (recompute its forward in the backward, as the
    engine does; needed to fit large models); ``layer_fn``: the decoder layer, or its compiled form.
    """

    def __init__(self, cfg: ModelConfig, units: list[Params], device: torch.device | str,
                 autocast: torch.dtype | None = None, recompute: bool = False,
                 layer_fn: Callable = decoder_layer):
        self.cfg = cfg
        self.device = torch.device(device)
        self.units = [{k: v.detach().to(self.device, torch.float32).requires_grad_(True) for k, v in u.items()}
                      for u in units]
        self.autocast = autocast
        self.recompute = recompute
        self.layer_fn = layer_fn

    @classmethod
    def from_reader(cls, cfg: ModelConfig, read: UnitReader, device, **kwargs) -> "ResidentModel":
        """From a unit reader (an HF checkpoint: :func:`megatrain_ray.io.evaluate.checkpoint_reader`)."""
        return cls(cfg, [read(unit) for unit in StoreLayout.build(cfg).units], device, **kwargs)

    @classmethod
    def random(cls, cfg: ModelConfig, device, seed: int = 0, **kwargs) -> "ResidentModel":
        """Normal(0, initializer_range) matrices, unit norms, zero biases, drawn on ``device``."""
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        units = []
        for t in StoreLayout.build(cfg).templates:
            p = {}
            for name, shape, _ in t.params:
                if len(shape) >= 2:
                    p[name] = torch.randn(shape, device=device, generator=gen) * cfg.initializer_range
                else:
                    p[name] = (torch.ones if name.endswith("norm.weight") else torch.zeros)(shape, device=device)
            units.append(p)
        return cls(cfg, units, device, **kwargs)

    def parameters(self) -> list[torch.Tensor]:
        return [p for u in self.units for p in u.values()]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """unit name -> {param name -> leaf} flattened to ``unit/param`` keys."""
        names = StoreLayout.build(self.cfg).units
        return {f"{names[i]}/{k}": v for i, u in enumerate(self.units) for k, v in u.items()}

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def loss_backward(self, ids: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> float:
        """ids, labels: [B, S] int64 on the device. Adds d(loss)/d(weights) into ``.grad``, where the
        loss is the summed cross-entropy of the counted labels over ``n_tokens`` (the step's count);
        returns that loss."""
        loss = self._loss(ids, labels, n_tokens)
        loss.backward()
        return float(loss.detach())

    @torch.no_grad()
    def mean_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        """ids, labels: [B, S] int64 on the device -> mean cross-entropy over the counted labels."""
        return float(self._loss(ids, labels, max(1, int((labels != IGNORE_INDEX).sum()))))

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        cfg, units, names = self.cfg, self.units, unit_names(self.cfg)

        def layer(u, x, rope, cfg):
            if self.recompute and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(self.layer_fn, u, x, rope, cfg, use_reentrant=False)
            return self.layer_fn(u, x, rope, cfg)

        with self._autocast():
            h, w = forward_hidden(cfg, lambda unit: units[names.index(unit)], ids, layer, self.autocast)
            return token_loss_sum(h.reshape(-1, cfg.hidden_size), w, labels.reshape(-1)) / n_tokens


class ResidentTrainer:
    """``torch.optim.AdamW`` over a :class:`ResidentModel`, with our param groups and schedule.

    Matrices get weight decay; norms and biases only with ``optim.decay_norms_and_biases``, as the
    engine does (:mod:`megatrain_ray.model.layout`).
    """

    def __init__(self, model: ResidentModel, optim: OptimConfig, total_steps: int, fused: bool | None = None):
        self.model, self.optim, self.total_steps = model, optim, total_steps
        params = model.parameters()
        decay_all = optim.decay_norms_and_biases
        decay = [p for p in params if p.dim() >= 2 or decay_all]
        rest = [p for p in params if not (p.dim() >= 2 or decay_all)]
        groups = [{"params": decay, "weight_decay": optim.weight_decay}]
        if rest:
            groups.append({"params": rest, "weight_decay": 0.0})
        if fused is None:
            fused = model.device.type == "cuda"
        self.opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                     fused=fused)

    def step(self, step: int, batch: dict, split: int = 1) -> tuple[float, float]:
        """One optimizer step on ``batch`` (input_ids, labels: [M, B, S]); each micro-batch may be cut
        into ``split`` smaller ones (the same tokens, less activation memory). Returns (loss, the
        gradient norm before clipping)."""
        dev = self.model.device
        ids = torch.as_tensor(batch["input_ids"], dtype=torch.long, device=dev)
        labels = torch.as_tensor(batch["labels"], dtype=torch.long, device=dev)
        seq = ids.shape[-1]
        ids, labels = ids.reshape(ids.shape[0] * split, -1, seq), labels.reshape(labels.shape[0] * split, -1, seq)
        n_tokens = max(1, int((labels != IGNORE_INDEX).sum()))
        loss = sum(self.model.loss_backward(ids[m], labels[m], n_tokens) for m in range(ids.shape[0]))
        params = self.model.parameters()
        max_norm = self.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.optim, step, self.total_steps)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss, float(norm)
