"""How each decoder layer runs in a step, chosen once per run from the resolved activation placement
and the layer's kind: its forward over the step's micro-batches, what it leaves for its backward,
and that backward.

- :class:`Recomputed`: the layer's inputs are its checkpoint (on the device, offloaded to host
  memory, or none for a recompute span's layer: :meth:`~megatrain_ray.engine.activations.ActivationStore.put`
  places them as the placement says); the backward recomputes the layer from them
  (:func:`~megatrain_ray.engine.sequence.layer_backward`).
- :class:`Routed`: a sparse (mixture-of-experts) layer, recomputed the same way, whose forward also
  records its router statistics and whose backward takes the load-balancing loss's gradient.
- :class:`Kept`: the forward's whole autograd graph stays for the backward
  (:func:`~megatrain_ray.engine.activations.layer_forward_kept`), which differentiates it; the
  planner keeps only dense layers whole.

The compute worker's loops ask each layer's pass, never the placement or the layer's kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .activations import KEEP, ActivationStore, kept_backward, layer_forward_kept
from .experts import ExpertTraffic
from .routing import StepRouting
from .sequence import LayerRunner, MicroBatches, layer_backward, routed_backward


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights for a call: its template, its flat weights in their device slot,
    its adapters (a LoRA run's, resident; {} without) and whether its own weights are frozen (its
    unit's policy trains none: no gradient is computed for them)."""

    template: Any
    flat: torch.Tensor
    adapters: dict[str, torch.Tensor]
    frozen: bool

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The layer's parameters by name (fused projection views included), its adapters beside them."""
        return {**self.template.bind(self.flat, fused=True), **self.adapters}


@dataclass(frozen=True)
class StepLayers:
    """What every decoder layer of one step shares."""

    runner: LayerRunner
    cfg: Any
    mb: MicroBatches
    acts: ActivationStore
    routing: StepRouting
    traffic: ExpertTraffic | None = None
    """The worker's record of its sparse layers' routing (:mod:`megatrain_ray.engine.experts`)."""
    step: int = 0


class Recomputed:
    """Checkpointed inputs, recomputed in the backward (see the module docstring)."""

    def forward(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """xs: M x [B, S, H] -> the layer's outputs (no graph)."""
        return [s.runner.forward(w.params, x, s.mb.ctx[m], s.cfg) for m, x in enumerate(xs)]

    def leave(self, s: StepLayers, layer: int, xs: list[torch.Tensor]) -> None:
        """What the backward starts from, once the forward is done with its inputs xs: the checkpoint."""
        s.acts.put(layer, xs)

    def again(self, s: StepLayers, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forward run again within a recompute span (its outputs, the next layer's inputs)."""
        return [s.runner.forward(w.params, x, s.mb.ctx[m], s.cfg) for m, x in enumerate(xs)]

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], inputs,
                 dx: list[torch.Tensor]) -> None:
        """From the layer's checkpoint ``inputs`` (M x [B, S, H]) and output gradients dx (replaced by
        the input gradients), the gradients of what trains added into ``grads``."""
        layer_backward(s.runner, w.params, grads, inputs, dx, s.mb.ctx, s.cfg)


class Routed(Recomputed):
    """A sparse layer: recomputed, with its router statistics (see the module docstring)."""

    def forward(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        ys, stats = zip(*(s.runner.forward_routed(w.params, x, s.mb.ctx[m], s.cfg) for m, x in enumerate(xs)))
        s.routing.record(layer, list(stats))
        if s.traffic is not None:  # the later fetches of its weights move only the experts it chose
            s.traffic.record(s.step, layer, s.routing.counts(layer))
        return list(ys)

    def again(self, s: StepLayers, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Its forward again; the statistics are the first forward's."""
        return [s.runner.forward_routed(w.params, x, s.mb.ctx[m], s.cfg)[0] for m, x in enumerate(xs)]

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], inputs,
                 dx: list[torch.Tensor]) -> None:
        counts = routed_backward(s.runner, w.params, grads, inputs, dx, s.mb.ctx, s.cfg, s.routing)
        if s.traffic is not None:  # its weights came without the experts the forward did not choose
            s.traffic.check(s.step, layer, counts)


class Kept:
    """The forward's graph kept whole for the backward (see the module docstring)."""

    def forward(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        graph = layer_forward_kept(s.runner.layer, w.template, w.flat, xs, s.mb.ctx, s.cfg, w.adapters, w.frozen)
        s.acts.keep(layer, graph)
        return [y.detach() for y in graph.outputs]

    def leave(self, s: StepLayers, layer: int, xs: list[torch.Tensor]) -> None:
        """Nothing more: the kept graph holds its inputs."""

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], graph,
                 dx: list[torch.Tensor]) -> None:
        """Its weights came again only to keep the fetch order: the graph saved those it used."""
        kept_backward(graph, grads, dx)


def layer_passes(cfg, modes: tuple[str, ...]) -> tuple[Recomputed | Kept, ...]:
    """Each decoder layer's pass under the activation placement ``modes``
    (:func:`~megatrain_ray.engine.activations.layer_modes`)."""
    kept = [layer for layer, mode in enumerate(modes) if mode == KEEP and cfg.is_sparse(layer)]
    if kept:
        raise ConfigError(f"memory.activations keeps the graph of layer {kept[0]}, a sparse (mixture-of-experts) "
                          "layer, whole; a sparse layer is always recomputed from its checkpoint: keep fewer layers.")
    return tuple(Kept() if mode == KEEP else Routed() if cfg.is_sparse(layer) else Recomputed()
                 for layer, mode in enumerate(modes))
