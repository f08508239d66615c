"""How each decoder layer runs in a step, chosen once per run from the resolved activation placement
and the layer's kind: its forward over the step's micro-batches, what it leaves for its backward,
and that backward.

- :class:`Recomputed`: the layer's inputs are its checkpoint (on the device, offloaded to host
  memory, or none for a recompute span's layer: :meth:`~megatrain_ray.engine.compute.activations.ActivationStore.put`
  places them as the placement says); the backward recomputes the layer from them
  (:func:`~megatrain_ray.engine.compute.sequence.layer_backward`).
- :class:`RecomputedSparse`: a sparse (mixture-of-experts) layer, recomputed the same way, whose
  forward also records its router statistics and whose backward takes the load-balancing loss's
  gradient.
- :class:`Kept`: the forward's whole autograd graph stays for the backward
  (:func:`~megatrain_ray.engine.compute.activations.layer_forward_kept`), which differentiates it;
  :class:`KeptSparse` the same for a sparse layer, its router's probability sums kept with it for
  the load-balancing loss's gradient.

The compute worker's loops ask each layer's pass, never the placement or the layer's kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .activations import KEEP, ActivationStore, graph_backward, kept_backward, layer_forward_kept
from ..experts import ExpertTraffic
from .routing import StepRouting
from .sequence import LayerRunner, MicroBatches, layer_backward, routed_backward


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights for a call: its template, its flat weights in their device slot,
    its adapters (a LoRA run's, resident; {} without), whether its own weights are frozen (its
    unit's policy trains none: no gradient is computed for them), and the adapters' dropout masks of
    a training micro-batch (None: no dropout; see :func:`~megatrain_ray.model.lora.dropout_masks`)."""

    template: Any
    flat: torch.Tensor
    adapters: dict[str, torch.Tensor]
    frozen: bool
    dropout: Callable[[int], dict[str, torch.Tensor]] | None = None

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The layer's parameters by name (fused projection views included), its adapters beside them
        (no dropout: a validation batch's)."""
        return {**self.template.bind(self.flat, fused=True), **self.adapters}

    def training(self, params: dict[str, torch.Tensor]) -> Callable[[int], dict[str, torch.Tensor]]:
        """``params`` for training micro-batch m: as they are, or with that micro-batch's dropout masks."""
        return (lambda m: params) if self.dropout is None else (lambda m: {**params, **self.dropout(m)})


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
        return self.again(s, layer, w, xs)

    def leave(self, s: StepLayers, layer: int, xs: list[torch.Tensor]) -> None:
        """What the backward starts from, once the forward is done with its inputs xs: the checkpoint."""
        s.acts.put(layer, xs)

    def again(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forward run again within a recompute span (its outputs, the next layer's inputs)."""
        p = w.training(w.params)
        return [s.runner.forward(p(m), x, s.mb.ctx_of(layer)[m], s.cfg) for m, x in enumerate(xs)]

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], inputs,
                 dx: list[torch.Tensor]) -> None:
        """From the layer's checkpoint ``inputs`` (M x [B, S, H]) and output gradients dx (replaced by
        the input gradients), the gradients of what trains added into ``grads``."""
        layer_backward(s.runner, w.params, grads, inputs, dx, s.mb.ctx_of(layer), s.cfg, w.dropout)


class RecomputedSparse(Recomputed):
    """A sparse layer: recomputed, with its router statistics (see the module docstring)."""

    def forward(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        p = w.training(w.params)
        ys, stats = zip(*(s.runner.forward_routed(p(m), x, s.mb.routed_ctx_of(layer)[m], s.cfg) for m, x in enumerate(xs)))
        s.routing.record(layer, list(stats))
        if s.traffic is not None:  # the later fetches of its weights move only the experts it chose
            s.traffic.record(s.step, layer, s.routing.counts(layer))
        return list(ys)

    def again(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Its forward again, with the experts the first forward chose; the statistics are the first's."""
        p = w.training(w.params)
        return [s.runner.forward_routed(p(m), x, s.mb.routed_ctx_of(layer)[m], s.cfg, s.routing.chosen(layer, m))[0]
                for m, x in enumerate(xs)]

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], inputs,
                 dx: list[torch.Tensor]) -> None:
        """The recompute sends each token to the experts the forward chose: those whose weights came."""
        routed_backward(s.runner, w.params, grads, inputs, dx, s.mb.routed_ctx_of(layer), s.cfg, s.routing, layer, w.dropout)


class Kept:
    """The forward's graph kept whole for the backward (see the module docstring)."""

    def forward(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        graph = layer_forward_kept(s.runner.layer, w.template, w.flat, xs, s.mb.ctx_of(layer), s.cfg, w.adapters, w.frozen,
                                   w.dropout)
        s.acts.keep(layer, graph)
        return [y.detach() for y in graph.outputs]

    def leave(self, s: StepLayers, layer: int, xs: list[torch.Tensor]) -> None:
        """Nothing more: the kept graph holds its inputs."""

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], graph,
                 dx: list[torch.Tensor]) -> None:
        """Its weights came again only to keep the fetch order: the graph saved those it used."""
        kept_backward(graph, grads, dx)


class KeptSparse(Kept):
    """A sparse layer's forward graph kept whole, its router's probability sums with it: the backward
    takes the load-balancing loss's gradient through them, as :class:`RecomputedSparse`'s recompute does."""

    def forward(self, s: StepLayers, layer: int, w: LayerWeights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        graph = layer_forward_kept(s.runner.routed, w.template, w.flat, xs, s.mb.routed_ctx_of(layer), s.cfg, w.adapters,
                                   w.frozen, w.dropout)
        ys, stats = zip(*graph.outputs)
        graph.outputs = [(y, st.prob_sum) for y, st in zip(ys, stats)]  # what the backward differentiates
        s.routing.record(layer, [replace(st, prob_sum=st.prob_sum.detach()) for st in stats])
        if s.traffic is not None:
            s.traffic.record(s.step, layer, s.routing.counts(layer))
        s.acts.keep(layer, graph)
        return [y.detach() for y in ys]

    def backward(self, s: StepLayers, layer: int, w: LayerWeights, grads: dict[str, torch.Tensor], graph,
                 dx: list[torch.Tensor]) -> None:
        for m in range(len(dx)):
            y, prob_sum = graph.outputs[m]
            dprobs = s.routing.prob_grad(m)
            outputs, douts = ([y], [dx[m]]) if dprobs is None else ([y, prob_sum], [dx[m], dprobs])
            dx[m] = graph_backward(graph.leaves, graph.inputs[m], outputs, douts, grads)
            graph.inputs[m] = graph.outputs[m] = None


def layer_passes(cfg, modes: tuple[str, ...]) -> tuple[Recomputed | Kept, ...]:
    """Each decoder layer's pass under the activation placement ``modes``
    (:func:`~megatrain_ray.engine.compute.activations.layer_modes`) and its kind (dense or sparse)."""
    def of(layer: int, mode: str):
        if mode == KEEP:
            return KeptSparse() if cfg.is_sparse(layer) else Kept()
        return RecomputedSparse() if cfg.is_sparse(layer) else Recomputed()

    return tuple(of(layer, mode) for layer, mode in enumerate(modes))
