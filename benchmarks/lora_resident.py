"""What does a GPU-resident transformers + peft LoRA run of the same model train at? The baseline of lora.sh.

transformers' own model class built from a preset's shape with --layers decoder layers, its weights
in bf16 on the GPU, peft's LoRA (rank --rank, alpha 2 x rank, every linear layer of every decoder
layer or those --targets names, and on a mixture of experts every routed expert through PEFT's
``target_parameters``, as megatrain_ray.io.peft_io writes them), trained as hf_resident.py says (bf16 autocast,
checkpointing per layer, AdamW over the adapters after clipping their norm, random tokens; one layer
fewer until it fits). FLOPs are those a LoRA step runs (megatrain_ray.model.flops: 4 per frozen
parameter and token, 6 per adapter parameter), so a run with fewer layers compares with ours per FLOP.

    python3 benchmarks/lora_resident.py --preset 32b --layers 64 --tokens 65536 --out OUT
    python3 benchmarks/lora_resident.py --preset qwen3-30b-a3b --layers 12 --tokens 262144 --seq-len 4096 \
        --micro-batches 16 --targets q_proj,k_proj,v_proj,o_proj --out OUT
Writes OUT/resident-lora-<tag>.json.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hf_resident import device_peak_bytes, hf_model, main, parser, timed_steps  # noqa: E402


def _run(args, layers: int) -> dict:
    import peft

    from megatrain_ray.config import LORA_TARGETS, LoraSection
    from megatrain_ray.model import flops

    from megatrain_ray.io.peft_io import target_modules, target_parameters

    cfg, model = hf_model(args.preset, layers, args.device)
    model.to(torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32)
    lora = LoraSection(rank=args.rank, alpha=2.0 * args.rank,
                       target_modules=tuple(args.targets.split(",")) if args.targets else LORA_TARGETS)
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                       target_modules=target_modules(cfg, lora) or None,
                                                       target_parameters=target_parameters(cfg, lora) or None))
    params = [p for p in model.parameters() if p.requires_grad]
    times, step_s = timed_steps(model, params, args, cfg.vocab_size, output_router_logits=cfg.output_router_logits)
    return {"preset": args.preset, "layers": layers, "rank": args.rank, "tokens": args.tokens,
            "seq_len": args.seq_len, "micro_batches": args.micro_batches, "step_s": step_s, "steps_s": times,
            "tokens_per_s": args.tokens / step_s, "layer_tokens_per_s": args.tokens * layers / step_s,
            "target_modules": list(lora.target_modules), "target_experts": list(lora.target_experts),
            "params": flops.num_params(cfg),
            "adapter_params": sum(p.numel() for p in params),
            **flops.tflops(cfg, args.seq_len, args.tokens, step_s, lora),
            "device_peak_bytes": device_peak_bytes(args), "config": dataclasses.asdict(cfg)}


if __name__ == "__main__":
    ap = parser(__doc__.splitlines()[0], 65536, 1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=None,
                    help="lora.target_modules, comma-separated (default: every linear layer); a mixture of experts' "
                         "routed experts carry adapters on both fused parameters (PEFT's target_parameters)")
    raise SystemExit(main(_run, ap, "resident-lora", "LoRA's 6·N·T"))
