"""What does a GPU-resident transformers run of the same MoE layers train at? The baseline of moe.sh.

transformers' own model class (Qwen3MoeForCausalLM, MixtralForCausalLM, ...; its experts through its
default kernel, grouped_mm on a GPU) built from a preset's shape with --layers decoder layers, every
weight and AdamW state on the GPU: fp32 master weights, trained as hf_resident.py says (bf16
autocast, checkpointing per layer, clipping, fused AdamW, random tokens; the most
layers that fit). FLOPs count active parameters (megatrain_ray.model.flops: 6·N_active·T and PaLM's), so a run
with fewer layers compares with ours per FLOP.

    python3 benchmarks/moe_resident.py --preset qwen3-30b-a3b --layers 10 --tokens 262144 --out OUT
Writes OUT/resident-<tag>.json.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hf_resident import device_peak_bytes, hf_model, main, parser, timed_steps  # noqa: E402


def _run(args, layers: int) -> dict:
    from megatrain_ray.model import flops

    cfg, model = hf_model(args.preset, layers, args.device)
    times, step_s = timed_steps(model, list(model.parameters()), args, cfg.vocab_size,
                                output_router_logits=cfg.output_router_logits)
    return {"preset": args.preset, "layers": layers, "model_type": cfg.model_type, "tokens": args.tokens,
            "seq_len": args.seq_len, "micro_batches": args.micro_batches, "step_s": step_s, "steps_s": times,
            "tokens_per_s": args.tokens / step_s, "params": flops.num_params(cfg),
            "active_params": flops.active_params(cfg), **flops.tflops(cfg, args.seq_len, args.tokens, step_s),
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "device_peak_bytes": device_peak_bytes(args), "config": dataclasses.asdict(cfg)}


if __name__ == "__main__":
    raise SystemExit(main(_run, parser(__doc__.splitlines()[0], 262144, 4096), "resident", "6·N_active·T"))
