"""megatrain_ray beside other ways to train the same model, in one run: ``megatrain-ray bench`` plus
the comparisons a benchmark recipe needs.

    python benchmarks/compare.py --preset 7b --steps 6 --baseline-compiled --out OUT
    python benchmarks/compare.py --preset 7b --steps 4 --peers deepspeed,fsdp2 --out OUT
    python benchmarks/compare.py --preset tiny --steps 3 --single-process --set compute.device=cpu --out OUT

Every option of ``megatrain-ray bench`` (:mod:`megatrain_ray.bench`), and, in the same table and
JSON (``OUT/bench-<name>.json``): the same model trained GPU-resident (:mod:`benchmarks.reference`:
fp32 parameters, bf16 autocast, per-layer recompute, fused AdamW on the GPU; ``--baseline``
eager, ``--baseline-compiled`` with the decoder layer compiled as ours is) where it fits, the
same engine without Ray (``--single-process``), the DeepSpeed ZeRO-3 / FSDP2 offload peers of
:mod:`benchmarks.peers` (``--peers``, presets only) and, on a GPU, a bf16 GEMM whose rate is the
MFU's denominator. ``--check`` first trains a small model 24 steps against GPU-resident PyTorch
(:mod:`benchmarks.gpu_check`) and stops if it does not track it; ``--probe`` times one layer (eager
and compiled) and the CPU AdamW variants (:mod:`benchmarks.probes`).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray import bench  # noqa: E402
from megatrain_ray.config import usable_cpus  # noqa: E402
from megatrain_ray.errors import ConfigError, PipelineError  # noqa: E402
from megatrain_ray.model.layout import StoreLayout  # noqa: E402
from megatrain_ray.model.presets import preset_model  # noqa: E402


def run_single_process(cfg) -> dict:
    """The same engine and run in one process, without Ray (:mod:`megatrain_ray.orchestration.local`)."""
    from megatrain_ray.orchestration.local import train_local

    rows = train_local(cfg, torch.cuda.device_count())
    for r in rows:
        r["update_busy_s"] = r.get("update_busy_s", 0.0)
    return bench.summarize(rows)


def run_resident(cfg, steps: int, compiled: bool = False) -> dict:
    """The same model trained GPU-resident: fp32 params, bf16 autocast, per-layer recompute, fused AdamW.

    Tries the run's micro-batches first, then splits each into 4 and 16 smaller ones (same tokens
    per step) while the GPU runs out of memory; reports the split that fit, or status "oom".
    ``compiled`` runs the decoder layer through torch.compile, as our pipeline does on CUDA.
    """
    for split in (1, 4, 16):
        try:
            return {**_resident(cfg, steps, split, compiled), "micro_batch_split": split, "status": "ok"}
        except torch.cuda.OutOfMemoryError:
            pass
        gc.collect()  # the failed attempt's tensors, once its traceback is gone
        torch.cuda.empty_cache()
    return {"status": "oom", "step_s": float("nan"), "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}


def _resident(cfg, steps: int, split: int, compiled: bool) -> dict:
    from benchmarks.reference import ResidentModel, ResidentTrainer
    from megatrain_ray.data.loader import source_from_config
    from megatrain_ray.model.transformer import decoder_layer
    from megatrain_ray.orchestration.cluster import connect_ray

    torch.cuda.reset_peak_memory_stats()
    layer_fn = torch.compile(decoder_layer, dynamic=False) if compiled else decoder_layer
    model = ResidentModel.random(cfg.model, "cuda", autocast=torch.bfloat16, recompute=True, layer_fn=layer_fn)
    trainer = ResidentTrainer(model, cfg.optim, steps)
    source = source_from_config(cfg, connect=connect_ray)
    times = []
    for step in range(steps):
        batch = source.batch(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.step(step, batch, split)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, trainer
    torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[1:]), "peak_gpu_gib": peak}


def parser():
    ap = bench.parser()
    ap.prog = "python benchmarks/compare.py"
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--baseline", action="store_true", help="also train GPU-resident (must fit the GPU)")
    ap.add_argument("--baseline-compiled", action="store_true",
                    help="also train GPU-resident with the decoder layer compiled, as ours is")
    ap.add_argument("--single-process", action="store_true", help="also run the engine without Ray")
    ap.add_argument("--peers", default="", metavar="SYSTEMS",
                    help="also train with these peers (comma-separated: deepspeed, fsdp2; presets only)")
    ap.add_argument("--peer-timeout-s", type=float, default=300.0, help="time limit of each peer run")
    ap.add_argument("--check", action="store_true",
                    help="first train 24 steps of a small model against GPU-resident PyTorch and stop if it does not "
                         "track it (see benchmarks/gpu_check.py)")
    ap.add_argument("--probe", action="store_true", help="also time one layer on the GPU and AdamW on the CPU")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    b = bench.setup(args)
    if args.peers and (b.preset is None or b.model != preset_model(b.preset, args.layers)):
        raise ConfigError("--peers trains the presets' shapes only; drop --peers, or --config/--model/--set model.*.")
    with tempfile.TemporaryDirectory() as tmp:
        data = bench.random_tokens(os.path.join(tmp, "tokens.npy"), b.model.vocab_size)
        if args.check:  # the GPU path against GPU-resident PyTorch: can fail
            from benchmarks.gpu_check import run_check

            check = run_check(os.path.join(tmp, "check"))
            check.pop("refs")
            b.report["check"] = check
            failed = [k for k, ok in check["checks"].items() if not ok]
            print(f"check: 24 steps against GPU-resident PyTorch: {'ok' if check['ok'] else 'FAILED'}; ours vs the bf16 "
                  f"resident run {check['seen']}, bound {check['bound']}; failed: {failed or 'none'}", flush=True)
            if not check["ok"]:
                raise PipelineError(f"--check: the GPU path does not track GPU-resident PyTorch ({failed}); "
                                    "see bench-*.json's check.")
        if torch.cuda.is_available():
            from benchmarks.probes import gemm_tflops

            b.report["gemm_tflops"] = gemm_tflops()
        cfg = b.config(data, tmp)
        if cfg.lora.enabled and (args.baseline or args.baseline_compiled or args.peers):
            raise ConfigError("--baseline, --baseline-compiled and --peers train every parameter, so they do not "
                              f"compare with lora.rank {cfg.lora.rank}; run benchmarks/lora_resident.py beside it.")
        if args.probe:
            from benchmarks.probes import adamw_probe, layer_probe

            b.report["layer_probe"] = layer_probe(cfg, args.micro_batches)
            b.report["adamw_probe"] = adamw_probe(StoreLayout.build(cfg.model).templates[1].numel, usable_cpus())
            print("probe:", json.dumps({k: {a: round(v, 2) for a, v in p.items()}
                                        for k, p in b.report.items() if k.endswith("_probe")}), flush=True)
        systems, tokens_of = bench.run_ours(b, cfg, data, tmp)
        if args.single_process:
            systems["single_process"] = run_single_process(cfg)
        if args.baseline:
            systems["gpu_resident"] = run_resident(cfg, args.steps)
        if args.baseline_compiled:
            systems["gpu_resident_compiled"] = run_resident(cfg, args.steps, compiled=True)
        if args.peers:
            from benchmarks.peers import run_peer

            for system in args.peers.split(","):
                systems[system] = run_peer(system, b.preset, tokens=args.tokens, seq_len=args.seq_len,
                                           micro_batches=args.micro_batches, steps=args.steps, layers=args.layers,
                                           timeout_s=args.peer_timeout_s)
    return bench.finish(b, cfg, systems, tokens_of)


if __name__ == "__main__":
    from megatrain_ray.errors import MegatrainError

    try:
        raise SystemExit(main())
    except MegatrainError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
