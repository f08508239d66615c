"""The attention kernel of a run (compute.attention_backend), set around the model's calls.

The model calls ``scaled_dot_product_attention`` and never says which kernel runs it; the compute
worker picks one here for the whole step, so the model stays a pure function of its inputs.
"""

from __future__ import annotations

import contextlib

from ...errors import ConfigError

SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
"""Values of compute.attention_backend: auto leaves the choice to torch."""
CPU_BACKENDS = ("auto", "flash", "math")
"""Those the CPU has."""


def checked_backend(name: str, device: str) -> str:
    """``name`` (compute.attention_backend) where ``device`` (cpu or cuda) has that kernel, else a
    ConfigError that names those it has."""
    offered = CPU_BACKENDS if device == "cpu" else SDPA_BACKENDS
    if name not in offered:
        raise ConfigError(f"compute.attention_backend {name!r} is not available on {device}; use one of "
                          f"{', '.join(offered)}.")
    return name


def sdpa_backend(name: str):
    """A context in which scaled_dot_product_attention runs only ``name``'s kernel (auto: torch's choice).

    Set around the model calls, never inside the model (torch.compile traces the kernel chosen at
    compile time, so the setting holds for the compiled layer too).
    """
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name])
