"""What does a GPU-resident transformers + peft LoRA run of the same model train at? The baseline of lora.sh.

transformers' own model class built from a preset's shape with --layers decoder layers, its weights
in bf16 on the GPU, peft's LoRA (rank --rank, alpha 2 x rank, every linear layer of every decoder
layer or those --targets names, and on a mixture of experts every routed expert through PEFT's
``target_parameters``, as megatrain_ray.io.peft_io writes them), trained as hf_resident.py says (bf16 autocast,
checkpointing per layer, AdamW over the adapters after clipping their norm, random tokens; the most
layers that fit). FLOPs are those a LoRA step runs (megatrain_ray.model.flops: 4 per frozen
parameter and token, 6 per adapter parameter), so a run with fewer layers compares with ours per FLOP.
With --base nf4 the base is bitsandbytes' 4-bit one (QLoRA) as transformers loads it: its nn.Linear
layers in NF4, a mixture of experts' fused experts still bf16 (transformers quantizes no 3-D expert
tensor); peft's prepare_model_for_kbit_training is not applied (it would cast those experts to fp32).

    python3 benchmarks/lora_resident.py --preset 32b --layers 64 --tokens 65536 --out OUT
    python3 benchmarks/lora_resident.py --preset qwen3-30b-a3b --layers 12 --tokens 262144 --seq-len 4096 \
        --micro-batches 16 --targets q_proj,k_proj,v_proj,o_proj --out OUT [--base nf4]
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
    quantized = _nf4_linears(model, args.device) if args.base == "nf4" else 0
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
            "base": args.base, "nf4_params": quantized,
            "params": flops.num_params(cfg),
            "adapter_params": sum(p.numel() for p in params),
            **flops.tflops(cfg, args.seq_len, args.tokens, step_s, lora),
            "device_peak_bytes": device_peak_bytes(args), "config": dataclasses.asdict(cfg)}


def _nf4_linears(model, device: str) -> int:
    """The base as transformers' bitsandbytes 4-bit load makes it (``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16)``): every
    ``nn.Linear`` but the LM head replaced by bitsandbytes' ``Linear4bit`` holding its weight in NF4 with
    double quantization, quantized by bitsandbytes as it moves to ``device``; parameters that are no
    ``nn.Linear`` (a mixture of experts' fused 3-D experts, its routers) stay in the compute dtype, as
    transformers leaves them. Returns the parameters quantized."""
    import bitsandbytes as bnb

    quantized = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child_name == "lm_head":
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.cpu(), requires_grad=False)
            setattr(module, child_name, q.to(device))
            quantized += child.weight.numel()
    return quantized


if __name__ == "__main__":
    ap = parser(__doc__.splitlines()[0], 65536, 1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=None,
                    help="lora.target_modules, comma-separated (default: every linear layer); a mixture of experts' "
                         "routed experts carry adapters on both fused parameters (PEFT's target_parameters)")
    ap.add_argument("--base", choices=("bf16", "nf4"), default="bf16",
                    help="the frozen base: bf16, or bitsandbytes' NF4 as transformers' 4-bit load makes it "
                         "(its nn.Linear layers; a mixture of experts' fused experts stay bf16)")
    raise SystemExit(main(_run, ap, "resident-lora", "LoRA's 6·N·T"))
