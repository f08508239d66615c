"""The precision policy, stated once and applied by the store, the compute worker and the sink.

- **Master weights** live in host RAM in ``precision.master_dtype``: float32 by default, or
  bfloat16 to save host memory (the update is then computed in fp32 on an O(one unit) temporary
  and rounded back stochastically: unbiased, so updates below half a bf16 ulp of a weight still
  move it on average, the compensation that costs no bytes; see :mod:`megatrain_ray.engine.compact`).
- **AdamW states** (``exp_avg``, ``exp_avg_sq``) are float32 in host RAM; with ``optim.state: 8bit``
  they are block-quantized 8-bit codes and the master weights are bfloat16, both rounded
  stochastically (:mod:`megatrain_ray.engine.compact`): 2 + 2 bytes per parameter, plus the gradient
  (2 with clipping, a ring of unit slots without), i.e. 6 and 4 bytes per parameter in bf16 compute.
- **Streamed weights and activations** use the compute dtype: bfloat16 on CUDA, float32 on the CPU
  (``precision.compute_dtype`` overrides). When it differs from the master dtype the store keeps a
  second, compute-dtype copy of every unit (the *stream* copy) that the sink refreshes after each
  update, so the link carries compute-dtype bytes; when equal, the master block is streamed.
- **Gradients** are accumulated over micro-batches in float32 on the device; their squared norm
  (hence the clipping factor) is taken there in float32, and they cross the link and wait for the
  update in ``precision.grad_dtype``: by default the compute dtype (in the unit's stream block when
  there is one: no host bytes of their own), or float32 (exact gradients, twice the device-to-host
  bytes in bf16 runs and 4 more host bytes per parameter with clipping). The update upcasts them to
  float32 chunk by chunk. A bf16 gradient is rounded once per step, after the fp32 accumulation:
  a relative error of at most 2^-9 per element, unbiased across elements, where AdamW's update
  m / sqrt(v) is itself insensitive to a common scale.
- **Loss**: logits are upcast to float32 before the softmax; RMSNorm normalises in float32.

Host bytes per parameter: 4 (fp32 master) + 8 (AdamW) + 2 (bf16 stream copy, which also holds the
gradient) = 14 with fp32 master and bf16 compute; 2 + 8 + 2 (bf16 gradient) = 12 with bf16 master;
4 + 8 + 4 (fp32 gradient) = 16 on the CPU in fp32, and with ``grad_dtype: float32`` in bf16 compute.
Without clipping (``optim.max_grad_norm=0``), or with the gradients held on the device until the
step's norm is known (``experimental.hold_grads``, the default on cuda: 2 bytes per parameter of device
memory instead), the last two need no whole-model gradient array, only a ring of three unit-sized
slots (see :mod:`megatrain_ray.engine.store.host_store`): 10 and 12 bytes per parameter plus O(one unit).
With ``optim.state: 8bit``: 2 + 2 = 4 bytes per parameter, plus 2 for the gradient array where it
is not held on the device (6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ComputeSection, PrecisionSection
from ..errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """Resolved dtypes of one run (see the module docstring for the policy)."""

    master: torch.dtype
    compute: torch.dtype
    optim_state: torch.dtype = torch.float32
    grad: torch.dtype | None = None
    """Dtype of the gradients on the host; None means the compute dtype."""

    def __post_init__(self) -> None:
        if self.grad is None:
            object.__setattr__(self, "grad", self.compute)

    @property
    def compact(self) -> bool:
        """Whether the moments are the compact 8-bit state (optim.state 8bit, :mod:`megatrain_ray.engine.compact`)."""
        return self.optim_state == torch.uint8

    @property
    def separate_stream_copy(self) -> bool:
        """Whether the store holds a compute-dtype copy besides the master weights."""
        return self.master != self.compute

    @property
    def grad_in_stream_block(self) -> bool:
        """Whether each unit's gradient is written into its stream block (dead between the unit's last
        fetch of a step and its update) rather than into blocks of its own."""
        return self.separate_stream_copy and self.grad == self.compute


def resolve_device(compute: ComputeSection, gpus_available: float) -> str:
    """'cpu' or 'cuda' for compute.device, failing clearly when CUDA is asked for but absent.

    ``gpus_available`` is what the Ray cluster offers (the driver itself may see no GPU).
    """
    if compute.device == "auto":
        return "cuda" if gpus_available >= 1 else "cpu"
    if compute.device == "cuda" and gpus_available < 1:
        raise ConfigError("compute.device is cuda but no CUDA GPU is visible; set compute.device=cpu or auto.")
    return compute.device


def resolve_precision(given: PrecisionSection, device: str, optim_state: str = "fp32") -> Precision:
    """The dtypes of a run; ``optim_state`` is optim.state (8bit: bf16 master and uint8 moments)."""
    compute = given.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if device == "cuda" else "float32"
    grad = compute if given.grad_dtype == "auto" else given.grad_dtype
    if optim_state == "8bit":
        return Precision(master=torch.bfloat16, compute=_DTYPES[compute], optim_state=torch.uint8, grad=_DTYPES[grad])
    return Precision(master=_DTYPES[given.master_dtype], compute=_DTYPES[compute], grad=_DTYPES[grad])
