"""A step's routing in a mixture of experts: the tokens each expert received and the router's
load-balancing loss, gathered layer by layer as the compute worker runs the forward, and the loss's
gradient handed to each sparse layer's backward.

The loss of a step (ModelConfig.output_router_logits on) is the cross-entropy, mean over the step's
counted tokens, plus router_aux_loss_coef x the mean over the step's micro-batches of each
micro-batch's load-balancing loss (:func:`megatrain_ray.model.moe.aux_loss` over all sparse layers
of that micro-batch, as transformers computes it per forward call given the attention mask: padding
of padded rows is left out): what a gradient-accumulating
run of transformers computes when it divides each micro-batch's loss by the number of
micro-batches. Its gradient reaches sparse layer l of micro-batch m only through l's router
probabilities: the gradient of l's probability sums [E] is
coef / M x E x f_m / rows_m (:meth:`StepRouting.prob_grad`), f_m the micro-batch's expert counts
over every sparse layer, known once the forward is done, before the first backward.

Also the counts themselves, per sparse layer and expert, summed over this worker's micro-batches:
what metrics.jsonl reports as ``expert_tokens``; and the experts each token was sent to, which the
layer's recompute (its backward, a recompute span's forward) is given rather than choosing again
(:func:`~megatrain_ray.model.moe.route`): a recompute whose last bits differ from the forward's (a
compiled training graph fuses otherwise than the no-grad one) could otherwise send a token whose
top-k is a near tie to another expert, whose weights the later fetches did not bring.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...config import ModelConfig
from ...model.moe import RouterStats, aux_loss_of_layer


class StepRouting:
    """The router statistics of one step's forward, by unit and micro-batch."""

    def __init__(self, cfg: ModelConfig, step_micro_batches: int):
        """step_micro_batches: micro-batches of the whole step (every worker's), the M of the mean."""
        self.cfg = cfg
        self.scale = cfg.router_aux_loss_coef / step_micro_batches if cfg.output_router_logits else 0.0
        self.stats: dict[int, list[RouterStats]] = {}
        """Each sparse layer's statistics, by decoder layer."""
        self.experts: dict[int, list[torch.Tensor]] = {}
        """Each sparse layer's choice per micro-batch: [N, k] in the narrowest integer type that holds E."""
        self.aux: torch.Tensor | None = None
        """The step's load-balancing loss as :meth:`with_aux` added it (None: none)."""

    def record(self, layer: int, stats: list[RouterStats]) -> None:
        """The forward's statistics of sparse layer ``layer``, one per micro-batch (no graph)."""
        narrow = torch.uint8 if self.cfg.num_experts <= 256 else torch.int16
        self.experts[layer] = [s.experts.to(narrow) for s in stats]
        self.stats[layer] = [replace(s, experts=None) for s in stats]

    def chosen(self, layer: int, m: int) -> torch.Tensor:
        """The experts the forward of sparse layer ``layer`` sent micro-batch m's tokens to: [N, k] int64."""
        return self.experts[layer][m].long()

    def _totals(self, m: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        """Micro-batch m's assignments of counted tokens over every sparse layer [E], and its rows
        (counted tokens x layers: padding left out, as transformers given the attention mask)."""
        layers = [per_mb[m] for per_mb in self.stats.values()]
        return torch.stack([s.assigned for s in layers]).sum(0), sum(s.rows for s in layers)

    def aux_loss(self) -> torch.Tensor | None:
        """This worker's share of the step's coef x mean load-balancing loss (scalar), None when off."""
        if not self.scale or not self.stats:
            return None
        total = 0.0
        for m in range(len(next(iter(self.stats.values())))):
            counts, rows = self._totals(m)
            total = total + sum(aux_loss_of_layer(per_mb[m], counts, rows, self.cfg.num_experts)
                                for per_mb in self.stats.values())
        return self.scale * total

    def with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (scalar) with this worker's share of the load-balancing loss added (:meth:`aux_loss`),
        or ``loss`` itself where there is none (no sparse layer, or the loss off)."""
        self.aux = self.aux_loss()
        return loss if self.aux is None else loss + self.aux

    def report(self) -> dict:
        """The step's ``expert_tokens`` (:meth:`expert_tokens`) and ``aux_loss`` (what :meth:`with_aux`
        added, 0.0 for none) for its result; {} for a model without sparse layers."""
        if not self.stats:
            return {}
        return {"expert_tokens": self.expert_tokens(), "aux_loss": 0.0 if self.aux is None else float(self.aux)}

    def prob_grad(self, m: int) -> torch.Tensor | None:
        """The loss's gradient with respect to any sparse layer's probability sums [E] in micro-batch
        m (the same for every layer), None when the loss has no auxiliary term."""
        if not self.scale:
            return None
        counts, rows = self._totals(m)
        return self.scale * self.cfg.num_experts * counts / (rows * rows)

    def counts(self, layer: int) -> torch.Tensor:
        """Tokens each expert of sparse layer ``layer`` received in this step on this worker: [E] fp32."""
        return torch.stack([s.counts for s in self.stats[layer]]).sum(0)

    def expert_tokens(self) -> list[list[int]]:
        """Tokens each expert received in this step on this worker, per sparse layer (in layer order)."""
        return [self.counts(layer).long().tolist() for layer in sorted(self.stats)]
