"""The load of a mixture of experts' routed experts as a run reports it, from a step's
``expert_tokens`` (per sparse layer, the tokens each expert received): per sparse layer its
imbalance (max / mean tokens per expert; 1 is a perfect balance, E / k the worst possible) and the
experts that received no token (idle: no gradient from the step, only their decay).

metrics.jsonl carries them beside ``expert_tokens`` (:func:`fields`), the step line on the terminal
sums them up (:func:`summary`), and the gauges and ``megatrain-ray plot`` read the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

IDLE_SHOWN = 6
"""Idle experts the step line names; more are counted."""


def imbalance(counts: Sequence[int]) -> float:
    """max / mean tokens per expert of one sparse layer (0 when it received none)."""
    return max(counts) / max(sum(counts) / len(counts), 1e-9)


def idle(counts: Sequence[int]) -> list[int]:
    """The experts of one sparse layer that received no token."""
    return [e for e, n in enumerate(counts) if n == 0]


def fields(sparse_layers: Sequence[int], expert_tokens: list[list[int]] | None) -> dict:
    """A step's row fields beside its ``expert_tokens`` (nothing for a dense model): ``expert_layers``
    (the decoder layer index of each entry), ``expert_imbalance`` and ``expert_idle`` per sparse layer."""
    if not expert_tokens:
        return {}
    return {"expert_layers": list(sparse_layers),
            "expert_imbalance": [round(imbalance(c), 4) for c in expert_tokens],
            "expert_idle": [idle(c) for c in expert_tokens]}


def summary(row: dict) -> str:
    """The step line's part on the experts ("" for a dense model): the worst layer's imbalance and the
    idle experts by layer, e.g. `` | experts: imbalance 1.84 (layer 3), idle 2 (layer 1: 5; layer 3: 0)``."""
    if "expert_imbalance" not in row:
        return ""
    layers, ratios, idles = row["expert_layers"], row["expert_imbalance"], row["expert_idle"]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    text = f" | experts: imbalance {ratios[worst]:.2f} (layer {layers[worst]})"
    count = sum(len(i) for i in idles)
    if not count:
        return text + ", none idle"
    named, shown = [], 0
    for layer, experts in zip(layers, idles):
        if experts and shown < IDLE_SHOWN:
            named.append(f"layer {layer}: {', '.join(map(str, experts[:IDLE_SHOWN - shown]))}")
            shown += len(experts[:IDLE_SHOWN - shown])
    more = ", ..." if count > shown else ""
    return text + f", idle {count} ({'; '.join(named)}{more})"
