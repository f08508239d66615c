"""Does the streamed GPU path train what PyTorch trains? A run of ours against GPU-resident runs.

Our pipeline (real Ray actors, the compiled layer, AdamW with clipping, several micro-batches)
trains a small model from an HF checkpoint; :class:`~benchmarks.reference.ResidentTrainer`
trains the same weights on the same batches GPU-resident four times: R (fp32 weights, bf16
autocast, fp32 gradients, torch AdamW: the reference), R2 (R with every micro-batch cut in two: only
the summation order of the bf16 GEMMs changes), RC (R with the decoder layer compiled, as ours runs
it: only the fused kernels' roundings change) and F (R in fp32).

The tolerance: ours differs from R only by bf16 roundings (the gradient crossing to the host in
bf16, the compiled layer's fused kernels, the chunked loss, summation orders). Over a run the
training dynamics amplify any such difference to one common scale, which R2, RC and F sample; ours must
stay within twice the larger of their distances to R (twice: two samples of that noise differ by as
much), for the final weights (relative L2 over all of them), the per-step losses and the per-step
gradient norms (largest difference over the run). A real error (clipping skipped, a stale or wrong
unit, a lost micro-batch) moves the run far more. Used by ``tests/test_gpu_training.py`` and
``python benchmarks/compare.py --check``.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file

from megatrain_ray.config import TrainConfig
from megatrain_ray.data.loader import source_from_config
from benchmarks.reference import ResidentModel, ResidentTrainer
from megatrain_ray.io.evaluate import checkpoint_reader
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.transformer import hf_name
from megatrain_ray.orchestration.cluster import connect_ray

METRICS = ("weights", "loss", "norm")


def resident_run(cfg: TrainConfig, autocast: torch.dtype | None, split: int = 1,
                 compiled: bool = False) -> tuple[list, list, dict]:
    """(losses, grad norms, final weights by HF name) of cfg trained GPU-resident from train.init_from."""
    from megatrain_ray.model.transformer import decoder_layer

    layer_fn = torch.compile(decoder_layer, dynamic=False) if compiled else decoder_layer
    model = ResidentModel.from_reader(cfg.model, checkpoint_reader(cfg.train.init_from)[1], "cuda",
                                      autocast=autocast, layer_fn=layer_fn)
    trainer = ResidentTrainer(model, cfg.optim, cfg.train.steps)
    source = source_from_config(cfg, log=lambda line: None, connect=connect_ray)
    losses, norms = zip(*(trainer.step(step, source.batch(step), split) for step in range(cfg.train.steps)))
    names = StoreLayout.build(cfg.model).units
    weights = {hf_name(names[i], k): v.detach().float().cpu() for i, u in enumerate(model.units) for k, v in u.items()}
    return list(losses), list(norms), weights


def references(cfg: TrainConfig) -> dict[str, tuple]:
    """R, R2, RC and F (see the module docstring) of cfg."""
    return {"bf16": resident_run(cfg, torch.bfloat16), "bf16-split": resident_run(cfg, torch.bfloat16, split=2),
            "bf16-compiled": resident_run(cfg, torch.bfloat16, compiled=True), "fp32": resident_run(cfg, None)}


def final_weights(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        out.update({k: v.float() for k, v in load_file(path).items()})
    return out


def distance(a: dict, b: dict) -> float:
    """Relative L2 distance of two weight sets over all tensors of ``b``."""
    return (sum(float((a[k] - v).norm() ** 2) for k, v in b.items()) / sum(float(v.norm() ** 2) for v in b.values())) ** 0.5


def largest(xs, ys) -> float:
    return max(abs(x - y) for x, y in zip(xs, ys))


def compare(cfg: TrainConfig, losses: list[float], norms: list[float], weights: dict, refs: dict) -> dict:
    """Our run (per-step losses and grad norms, final weights) against ``refs`` (:func:`references`):
    the distances, the yardsticks, the bound, how far the weights moved, and whether it passes."""
    r_loss, r_norm, r_w = refs["bf16"]

    def distances(loss, norm, w) -> dict:
        return {"weights": distance(w, r_w), "loss": largest(loss, r_loss), "norm": largest(norm, r_norm)}

    yardsticks = {name: distances(*refs[name]) for name in ("bf16-split", "bf16-compiled", "fp32")}
    bound = {k: 2 * max(y[k] for y in yardsticks.values()) for k in METRICS}
    seen = distances(losses, norms, weights)
    init = {hf_name(u, k): v for u in StoreLayout.build(cfg.model).units
            for k, v in checkpoint_reader(cfg.train.init_from)[1](u).items()}
    moved = distance(init, r_w)
    checks = {"clipping active": max(norms) > cfg.optim.max_grad_norm > 0,
              "loss fell by 10x its tolerance": losses[0] - losses[-1] > 10 * bound["loss"],
              "weights moved 5x their tolerance": moved > 5 * bound["weights"],
              "same tensors": set(weights) == set(r_w),
              **{f"{k} within the bound": seen[k] <= bound[k] for k in METRICS}}
    return {"seen": seen, "yardsticks": yardsticks, "bound": bound, "moved": moved, "checks": checks,
            "ok": all(checks.values()), "losses": losses, "resident_losses": r_loss}


MODEL = ["model.vocab_size=512", "model.hidden_size=256", "model.intermediate_size=704", "model.num_hidden_layers=4",
         "model.num_attention_heads=8", "model.num_key_value_heads=2", "model.max_position_embeddings=256"]
"""The check's model: a small Llama, wide enough for the GPU's bf16 GEMMs to round as at scale."""


def check_config(directory: str, steps: int = 24, extra: list[str] = ()) -> TrainConfig:
    """The check's run under ``directory``: initial weights (our random init, saved as an HF
    checkpoint) and a learnable token stream (a fixed cycle with 10% noise), made once."""
    import numpy as np

    from megatrain_ray.config import load_config
    from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
    from megatrain_ray.io.hf_io import load_train_config
    from megatrain_ray.model.precision import resolve_precision

    init, tokens = os.path.join(directory, "init"), os.path.join(directory, "tokens.npy")
    if not os.path.isdir(init):
        cfg = load_config(None, MODEL)
        spec = StoreSpec(cfg.model, resolve_precision(cfg.precision, "cpu", cfg.optim.state), cfg.memory.shm_dir, os.getpid(),
                         "check-init")
        store = ParameterStore(spec, seed=0)
        try:
            store.save_hf(init)
        finally:
            store.close()
        rng = np.random.default_rng(1)
        np.save(tokens, np.where(rng.random(200_000) < 0.1, rng.integers(0, 512, size=200_000),
                                 (np.arange(200_000) * 7) % 512))
    return load_train_config(None, [
        f"train.init_from={init}", f"data.path={tokens}", f"train.run_dir={os.path.join(directory, 'runs')}",
        "compute.device=cuda", "train.checkpoint_every=0", f"train.steps={steps}", "train.seq_len=128",
        "train.micro_batch_size=4", "train.num_micro_batches=3", "optim.lr=3e-3", "optim.min_lr=3e-4",
        "optim.warmup_steps=4", "optim.weight_decay=0.1", "optim.max_grad_norm=1.0", *extra])


def run_check(directory: str, refs: dict | None = None, extra: list[str] = (), log=lambda line: None) -> dict:
    """Train the check's run through the pipeline and compare it (see :func:`compare`); ``refs``:
    the resident runs of an earlier call with the same ``directory``, else they are run here."""
    from megatrain_ray.orchestration.pipeline import train

    cfg = check_config(directory, extra=extra)
    refs = refs if refs is not None else references(cfg)
    result = train(cfg, log=log)
    return {**compare(cfg, result.losses, result.grad_norms, final_weights(result.final_dir), refs), "refs": refs}
