"""What does a GPU-resident transformers + peft LoRA run of the same model train at? The baseline of lora.sh.

transformers' own model class built from a preset's shape with --layers decoder layers (as
moe_resident.py builds it), its weights in bf16 on the GPU, activation checkpointing per layer,
peft's LoRA (rank --rank, alpha 2 x rank, every linear layer of every decoder layer; adapters in
fp32 as peft casts them), bf16 autocast, torch.optim.AdamW (fused) over the adapters after clipping
their norm, random tokens in the step shape megatrain-ray bench uses (--tokens per step in
--micro-batches of --seq-len sequences). If it does not fit, one layer fewer is tried, down to one:
the result names the layers it ran. FLOPs are those a LoRA step runs (megatrain_ray.model.flops:
4 per frozen parameter and token, 6 per adapter parameter), so a run with fewer layers compares
with ours per FLOP.

    python3 benchmarks/lora_resident.py --preset 32b --layers 64 --tokens 65536 --out OUT
Writes OUT/resident-lora-<tag>.json.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_resident import _model, parser, run_and_write  # noqa: E402


def _run(args, layers: int) -> dict:
    import peft

    from megatrain_ray.config import LORA_TARGETS, LoraSection
    from megatrain_ray.model import flops

    device = torch.device(args.device)
    cfg, model = _model(args.preset, layers, args.device)
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    lora = LoraSection(rank=args.rank, alpha=2.0 * args.rank)
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                       target_modules=list(LORA_TARGETS)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    batch = args.tokens // args.micro_batches // args.seq_len
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batches, batch, args.seq_len), generator=gen).to(device)
    times = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for m in range(args.micro_batches):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(input_ids=ids[m], labels=ids[m])
            (out.loss / args.micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"step {step}: {times[-1]:.3f} s, loss {out.loss.item():.4f}", flush=True)
    step_s = statistics.median(times[1:] or times)  # the first step warms up
    return {"preset": args.preset, "layers": layers, "rank": args.rank, "tokens": args.tokens,
            "seq_len": args.seq_len, "micro_batches": args.micro_batches, "step_s": step_s, "steps_s": times,
            "tokens_per_s": args.tokens / step_s, "params": flops.num_params(cfg),
            "adapter_params": sum(p.numel() for p in params),
            **flops.tflops(cfg, args.seq_len, args.tokens, step_s, lora),
            "device_peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "config": dataclasses.asdict(cfg)}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0], 65536, 1024)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    tag, result = run_and_write(_run, args, "resident-lora")
    if result is None:
        return 1
    print(f"resident-lora {tag}: {result['layers']} layers, rank {args.rank}, {result['step_s']:.3f} s/step, "
          f"{result['tokens_per_s']:.0f} tokens/s, {result['tflops_6nt']:.1f} TFLOPS as LoRA's 6·N·T, "
          f"{result['tflops_palm']:.1f} PaLM")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
