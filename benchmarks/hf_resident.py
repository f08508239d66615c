"""transformers' own model trained GPU-resident: what the resident baselines (moe_resident.py,
lora_resident.py) share.

The model is transformers' class for a preset's shape cut to a number of decoder layers, with
activation checkpointing per layer; a step is every micro-batch's forward and backward under bf16
autocast, the gradients clipped to 1.0, then torch.optim.AdamW (fused on a GPU), on random tokens in
the step shape megatrain-ray bench uses (--tokens per step in --micro-batches of --seq-len
sequences). If it does not fit, the most layers that fit are searched (:func:`fit_layers`): the result
names the layers it ran. A baseline gives :func:`main` its ``run(args, layers) -> result``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time

import torch


def hf_model(preset: str, layers: int, device: str):
    """(model config, transformers model in fp32) of ``preset`` with ``layers`` decoder layers."""
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


def timed_steps(model, params: list, args, vocab_size: int, **forward) -> tuple[list[float], float]:
    """Train ``args.steps`` steps of ``model`` over ``params`` (clipped to 1.0, AdamW lr 1e-4, weight
    decay 0.1) on random tokens; (the seconds of each step, the median after the first: the warm-up)."""
    device = torch.device(args.device)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    batch = args.tokens // args.micro_batches // args.seq_len
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab_size, (args.micro_batches, batch, args.seq_len), generator=gen).to(device)
    times = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for m in range(args.micro_batches):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(input_ids=ids[m], labels=ids[m], **forward)
            (out.loss / args.micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"step {step}: {times[-1]:.3f} s, loss {out.loss.item():.4f}", flush=True)
    return times, statistics.median(times[1:] or times)


def device_peak_bytes(args) -> int | None:
    return torch.cuda.max_memory_allocated() if torch.device(args.device).type == "cuda" else None


def fit_layers(run, args) -> dict | None:
    """``run(args, layers)`` with ``args.layers`` decoder layers; where the GPU runs out of memory, the
    most layers that fit are searched by bisection, each count probed by one step of one micro-batch
    of the same shape (the same model, optimizer and micro-batch: the same peak), and ``run`` is given
    that count; None when not one layer fits."""
    try:
        return run(args, args.layers)
    except torch.OutOfMemoryError:
        print(f"{args.layers} layers do not fit the GPU; searching the most that do", flush=True)
    _release()
    probe = copy.copy(args)
    probe.tokens, probe.micro_batches, probe.steps = args.tokens // args.micro_batches, 1, 1
    fits, fails = 0, args.layers
    while fails - fits > 1:
        layers = (fits + fails) // 2
        try:
            run(probe, layers)
            fits = layers
        except torch.OutOfMemoryError:
            fails = layers
        print(f"{layers} layers {'fit' if fits == layers else 'do not fit'} the GPU", flush=True)
        _release()
    if not fits:
        print("not one layer fits the GPU")
        return None
    return run(args, fits)


def _release() -> None:
    """Free a failed attempt's model and states, once its traceback is gone."""
    gc.collect()
    torch.cuda.empty_cache()


def parser(description: str, tokens: int, seq_len: int) -> argparse.ArgumentParser:
    """The options of a resident baseline: the preset, the layers to try first, the step's shape
    (``tokens`` and ``seq_len`` by default), the device, the tag and output folder."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to try first (where they do not fit, the most that do)")
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=".")
    return ap


def main(run, ap: argparse.ArgumentParser, prefix: str, convention: str) -> int:
    """A baseline's command: parse the command line with ``ap``, run :func:`fit_layers`, write the result as
    OUT/<prefix>-<tag>.json and print its line (``<prefix> <tag>: ... TFLOPS as <convention>``);
    1 when not one layer fits."""
    args = ap.parse_args()
    tag = args.tag or f"{args.preset}-{args.tokens}"
    result = fit_layers(run, args)
    if result is None:
        return 1
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{prefix}-{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    rank = f", rank {result['rank']}" if "rank" in result else ""
    print(f"{prefix} {tag}: {result['layers']} layers{rank}, {result['step_s']:.3f} s/step, "
          f"{result['tokens_per_s']:.0f} tokens/s, {result['tflops_6nt']:.1f} TFLOPS as {convention}, "
          f"{result['tflops_palm']:.1f} PaLM")
    return 0
