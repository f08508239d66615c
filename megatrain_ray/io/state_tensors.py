"""Which optimizer-state tensors a training checkpoint holds for a store, under which names.

fp32 moments are saved per parameter under ``exp_avg.<HF name>`` / ``exp_avg_sq.<HF name>``, so they
load into any later layout of the model. The compact state (optim.state 8bit,
:mod:`megatrain_ray.engine.compact`) is saved per unit, as the flat codes ``exp_avg.<unit>`` (uint8)
and block scales ``exp_avg_scale.<unit>`` (fp32), since its quantization blocks span the parameters
of a unit: it reloads bit for bit into the same model's layout (a changed layout fails the shape
check with the tensor named).
"""

from __future__ import annotations

from ..model.transformer import hf_name

OPTIM_KINDS = ("exp_avg", "exp_avg_sq")
COMPACT_KINDS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
"""Per-unit tensors of the compact optimizer state (optim.state 8bit)."""


def optim_state_name(store) -> str:
    """meta.json's precision.optim_state: float32, or 8bit for the compact state."""
    return "8bit" if store.spec.precision.compact else "float32"


def state_kinds(store) -> tuple[str, ...]:
    """The store kinds a checkpoint's optimizer files hold."""
    return COMPACT_KINDS if store.spec.precision.compact else OPTIM_KINDS


def state_block(store, kind: str, i: int):
    """Unit i's flat block of one of :func:`state_kinds` (a view into the store)."""
    return store.scale_block(kind, i) if kind.endswith("_scale") else store.block(kind, i)


def optim_entries(store, units=None) -> list[tuple[str, str, int, str | None]]:
    """(checkpoint name, kind, unit index, parameter name or None for the unit's whole block) of every
    optimizer-state tensor of a HostStore, unit by unit in ``units`` (default: the layout's order)."""
    layout = store.layout
    units = range(len(layout.units)) if units is None else units
    if store.spec.precision.compact:
        return [(f"{kind}.{layout.units[i]}", kind, i, None) for i in units for kind in COMPACT_KINDS]
    return [(f"{kind}.{hf_name(layout.units[i], name)}", kind, i, name)
            for i in units for name, _, _ in layout.templates[i].params for kind in OPTIM_KINDS]


def optim_tensors_of(store) -> list:
    """(checkpoint name, view into the store) of every optimizer-state tensor of a HostStore (see the
    module docstring)."""
    return [(key, state_block(store, kind, i) if name is None else store.params(kind, i)[name])
            for key, kind, i, name in optim_entries(store)]
