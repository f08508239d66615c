"""How much GPU memory does one tiled layer's recompute-backward take at long context, against what
the plan counts (``tiled_backward_bytes``, the "one layer's working set" row)?

One Qwen2.5-7B layer (bf16, the MLP in 16,384-token chunks, compiled as the compute worker runs it,
then eager) recomputed and differentiated from one sequence of each length: the peak torch
allocated above the layer's input, output gradient, weights and fp32 gradient buffer, against the
figure (plus the layer's bf16 weight gradients, which the plan's row adds to it), at 131,072 / 262,144 / 524,288 / 1,048,576 tokens (a length whose step does not fit is
reported as out of memory). Writes OUT/layer_backward.json and prints a table.

    python3 benchmarks/layer_backward_probe.py OUT          # on a CUDA GPU, from the repository root (~6 min, compiles included)
    python3 benchmarks/layer_backward_probe.py OUT --smoke  # the CPU, a tiny layer, eager (no memory figures)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.engine.compute.sequence import CompiledLayer, LayerRunner, tiled_backward_bytes  # noqa: E402
from megatrain_ray.model import transformer as M  # noqa: E402
from megatrain_ray.model.layout import LayerTemplate  # noqa: E402
from megatrain_ray.model.presets import preset_model  # noqa: E402

out = sys.argv[1]
smoke = "--smoke" in sys.argv
os.makedirs(out, exist_ok=True)
device = "cpu" if smoke else "cuda"
cfg = (load_config(None, ["model.hidden_size=64", "model.intermediate_size=176", "model.num_attention_heads=4",
                          "model.num_key_value_heads=2"]).model if smoke else preset_model("7b", layers=1))
chunk, lengths = (128, (512, 1024)) if smoke else (16384, (131072, 262144, 524288, 1048576))
t = LayerTemplate.build(cfg, "layers.0")
flat = (torch.randn(t.numel, device=device) * 0.02).to(torch.bfloat16)
rows = []
for compiled in ((False,) if smoke else (True, False)):
    runner = LayerRunner(chunk, (lambda fn: CompiledLayer(fn=fn)) if compiled else None)
    for s in lengths:
        row = {"tokens": s, "compiled": compiled, "weight_grad_bytes": t.numel * 2,  # bf16, before its fp32 sum
               "counted_bytes": tiled_backward_bytes(cfg, s, chunk, 2, compiled, device)}
        try:
            x, dy = (torch.randn(1, s, cfg.hidden_size, device=device, dtype=torch.bfloat16) for _ in range(2))
            rope = M.rope_cache(cfg, s, torch.device(device), torch.bfloat16)
            grad = torch.zeros(t.numel, device=device)
            leaves = {n: w.detach().requires_grad_(True) for n, w in t.bind(flat, fused=True).items()}
            if not smoke:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            runner.backward(leaves, t.bind(grad, fused=True), x, dy, (rope, None), cfg)
            if not smoke:
                torch.cuda.synchronize()
                row["measured_bytes"] = torch.cuda.max_memory_allocated() - base
        except torch.OutOfMemoryError as e:
            row["error"] = str(e).split(".")[0]
        x = dy = rope = grad = leaves = None
        rows.append(row)
        measured = row.get("measured_bytes")
        print(f"{'compiled' if compiled else 'eager':8s} {s:>9,} tokens: counted {row['counted_bytes'] / 2**30:6.2f} GiB"
              + (f", measured {measured / 2**30:6.2f} GiB "
                 f"({measured / (row['counted_bytes'] + row['weight_grad_bytes']):.3f} of it with the weight gradients)"
                 if measured
                 else f", {row.get('error', 'no measurement on the CPU')}"), flush=True)
with open(os.path.join(out, "layer_backward.json"), "w") as f:
    json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name() if not smoke else "cpu",
               "mlp_chunk_size": chunk, "rows": rows}, f, indent=1)
