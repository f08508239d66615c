"""What a run saves, and which role writes it: the final weights at the run's end and the
checkpoint an interrupt asks for, chosen once per run by the driver.

- :class:`StoreSaves` (full fine-tuning): the first node's store writes both, the final weights in
  Hugging Face's format (a checkpoint of the last step first, where no train.checkpoint_every
  boundary holds it already) and the interrupt's checkpoint, once the first compute worker has
  copied its resident units into the store (:mod:`megatrain_ray.engine.compute.resident`);
- :class:`AdapterSaves` (a LoRA run): the first compute worker writes both from its adapters
  (:mod:`megatrain_ray.engine.compute.adapters`): PEFT's adapter directory with the base merged
  into the final directory, and the adapters' checkpoint.
"""

from __future__ import annotations

import os

from ..errors import MegatrainError
from .calls import get as _get


class Saves:
    """The saves of a run: who writes its final weights and its interrupt's checkpoint, and where."""

    def __init__(self, run, roles, checkpoints, log):
        """run: the resolved run (its config, its call timeout); roles: its roles; checkpoints: the run's
        :class:`~megatrain_ray.io.checkpoint.CheckpointSettings`, or None; log: the driver's."""
        self.cfg, self.roles, self.checkpoints, self.log = run.config, roles, checkpoints, log
        self.timeout = run.call_timeout_s

    def final_dirs(self, result) -> tuple[str, ...]:
        """The directories the final save writes, each replaced whole (``result``: the run's)."""
        raise NotImplementedError

    def said(self, result) -> str:
        """Where the final save went, for the run's last line."""
        raise NotImplementedError

    def final(self, result, tokenizer: str | None) -> None:
        """Write the final weights (with ``tokenizer``, the one the data was read with)."""
        raise NotImplementedError

    def checkpoint(self, boundary: int):
        """Start the checkpoint of ``boundary`` (every step before it submitted and finished); returns
        the call's ref, whose result :meth:`path` reads."""
        raise NotImplementedError

    def path(self, saved) -> str:
        """The checkpoint's directory, from the result of :meth:`checkpoint`'s call."""
        raise NotImplementedError


class StoreSaves(Saves):
    """Full fine-tuning's saves: the store's (see the module docstring)."""

    def final_dirs(self, result) -> tuple[str, ...]:
        return (result.final_dir,)

    def said(self, result) -> str:
        return f"weights saved to {result.final_dir}"

    def final(self, result, tokenizer: str | None) -> None:
        if self.checkpoints is not None and not self.checkpoints.every:  # the weights on disk before the export
            steps = self.cfg.train.steps
            try:
                result.checkpoints.append(_get(self.roles.head.store.save_checkpoint.remote(self.checkpoints, steps),
                                               "store", self.timeout))
                self.log(f"checkpoint: step {steps} saved to {result.checkpoints[-1]}")
            except MegatrainError as e:  # it needs 3x the export's space: the export may still fit
                self.log(f"warning: {str(e).rstrip('.')}; exporting the final weights without it")
        _get(self.roles.head.store.save_hf.remote(result.final_dir, tokenizer=tokenizer), "store", self.timeout)

    def checkpoint(self, boundary: int):
        """The store's, once the compute worker has copied its resident units in; the store waits until
        the sink has applied every step before ``boundary``."""
        _get(self.roles.computes[0].sync_resident.remote(), "compute", self.timeout)
        return self.roles.head.store.save_checkpoint.remote(self.checkpoints, boundary)

    def path(self, saved) -> str:
        return saved


class AdapterSaves(Saves):
    """A LoRA run's saves: the first compute worker's adapters (see the module docstring)."""

    def final_dirs(self, result) -> tuple[str, ...]:
        return result.final_dir, self._adapter_dir(result)

    def said(self, result) -> str:
        return f"adapters saved to {self._adapter_dir(result)}, merged into {result.final_dir}"

    def final(self, result, tokenizer: str | None) -> None:
        """The adapters (PEFT's format) and the merged model, from the compute worker."""
        _get(self.roles.computes[0].lora.remote("export", self._adapter_dir(result), result.final_dir, tokenizer,
                                                self.cfg.train.init_from), "compute", self.timeout)

    def checkpoint(self, boundary: int):
        """The adapters' checkpoint, which the first compute worker writes itself once it has had
        ``boundary`` updates."""
        return self.roles.computes[0].lora.remote("checkpoint", boundary)

    def path(self, saved) -> str:
        return saved["checkpoint"]  # the compute worker's notice

    @staticmethod
    def _adapter_dir(result) -> str:
        return os.path.join(result.run_dir, "adapter")
