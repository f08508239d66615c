"""What does a GPU-resident transformers run of the same MoE layers train at? The baseline of moe.sh.

transformers' own model class (Qwen3MoeForCausalLM, MixtralForCausalLM, ...; its experts through its
default kernel, grouped_mm on a GPU) built from a preset's shape with --layers decoder layers, every
weight and AdamW state on the GPU: fp32 master weights, bf16 autocast, activation checkpointing per
layer, torch.optim.AdamW (fused) after clipping, random tokens in the step shape megatrain-ray bench
uses (--tokens per step in --micro-batches of --seq-len sequences). If the model does not fit, one
layer fewer is tried, down to one: the result names the layers it ran. FLOPs count active
parameters (megatrain_ray.model.flops: 6·N_active·T and PaLM's), so a run with fewer layers compares
with ours per FLOP.

    python3 benchmarks/moe_resident.py --preset qwen3-30b-a3b --layers 10 --tokens 262144 --out OUT
Writes OUT/resident-<tag>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

import torch


def _model(preset: str, layers: int, device: str):
    import transformers

    from megatrain_ray.config import ARCHITECTURES
    from megatrain_ray.model.presets import preset_model

    cfg = preset_model(preset, layers)
    hf = cfg.to_hf_dict()
    config_cls = transformers.AutoConfig.for_model(cfg.model_type).__class__
    config = config_cls(**{k: v for k, v in hf.items() if k != "architectures"})
    model_cls = getattr(transformers, ARCHITECTURES[cfg.model_type])
    with torch.device(device):
        model = model_cls(config).float()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return cfg, model


def _run(args, layers: int) -> dict:
    from megatrain_ray.model import flops

    device = torch.device(args.device)
    cfg, model = _model(args.preset, layers, args.device)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    per_mb = args.tokens // args.micro_batches
    batch = per_mb // args.seq_len
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batches, batch, args.seq_len), generator=gen).to(device)
    times = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for m in range(args.micro_batches):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(input_ids=ids[m], labels=ids[m], output_router_logits=cfg.output_router_logits)
            (out.loss / args.micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"step {step}: {times[-1]:.3f} s, loss {out.loss.item():.4f}", flush=True)
    step_s = statistics.median(times[1:] or times)  # the first step warms up
    tflops = flops.tflops(cfg, args.seq_len, args.tokens, step_s)
    return {"preset": args.preset, "layers": layers, "model_type": cfg.model_type, "tokens": args.tokens,
            "seq_len": args.seq_len, "micro_batches": args.micro_batches, "step_s": step_s, "steps_s": times,
            "tokens_per_s": args.tokens / step_s, "params": flops.num_params(cfg),
            "active_params": flops.active_params(cfg), **tflops,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "device_peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "config": dataclasses.asdict(cfg)}


def fit_layers(run, args) -> dict | None:
    """``run(args, layers)`` with ``args.layers`` decoder layers, then one fewer while the GPU runs out of
    memory, down to one; the first result, or None when not one layer fits."""
    for layers in range(args.layers, 0, -1):
        try:
            return run(args, layers)
        except torch.OutOfMemoryError:
            print(f"{layers} layers do not fit the GPU; trying {layers - 1}", flush=True)
        gc.collect()  # the failed attempt's model and states, once its traceback is gone
        torch.cuda.empty_cache()
    print("not one layer fits the GPU")
    return None


def parser(description: str, tokens: int, seq_len: int) -> argparse.ArgumentParser:
    """The options of a resident baseline: the preset, the layers to try first, the step's shape
    (``tokens`` and ``seq_len`` by default), the device, the tag and output folder."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to try first (then fewer until it fits)")
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=".")
    return ap


def run_and_write(run, args, prefix: str) -> tuple[str, dict | None]:
    """(tag, result) of :func:`fit_layers`, the result written as OUT/<prefix>-<tag>.json."""
    tag = args.tag or f"{args.preset}-{args.tokens}"
    result = fit_layers(run, args)
    if result is not None:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{prefix}-{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return tag, result


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0], 262144, 4096).parse_args(argv)
    tag, result = run_and_write(_run, args, "resident")
    if result is None:
        return 1
    print(f"resident {tag}: {result['layers']} layers, {result['step_s']:.3f} s/step, "
          f"{result['tokens_per_s']:.0f} tokens/s, {result['tflops_6nt']:.1f} TFLOPS as 6·N_active·T, "
          f"{result['tflops_palm']:.1f} PaLM")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
