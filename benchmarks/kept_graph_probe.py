"""How many bytes does a kept layer graph hold under each partitioner, on one CUDA GPU?

One compiled Qwen2.5-7B layer kept whole for 4 micro-batches of [4, 4096] tokens (64k, bf16),
partitioned with CompiledLayer's lean settings, with torch's own, and with
activation_memory_budget=0.9 (which should save what lean does): bytes per token the kept graph
holds (torch.cuda memory, against kept_bytes_per_token), the forward's and the whole step's peak
above it, GEMMs and attention forwards in the backward graph, and kept forward + backward ms.

    python3 benchmarks/kept_graph_probe.py    # on a CUDA GPU, from the repository root
"""

import os
import sys

import torch
from torch._functorch import config as functorch_config
from torch._inductor import compile_fx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.probes import cuda_ms  # noqa: E402
from megatrain_ray.engine.compute.activations import kept_backward, kept_bytes_per_token, layer_forward_kept  # noqa: E402
from megatrain_ray.engine.compute.sequence import CompiledLayer  # noqa: E402
from megatrain_ray.model import transformer as M  # noqa: E402
from megatrain_ray.model.layout import LayerTemplate  # noqa: E402
from megatrain_ray.model.presets import preset_model  # noqa: E402

partition, backward_ops = compile_fx.min_cut_rematerialization_partition, []


def counted(*args, **kwargs):  # the backward graph's GEMMs and attention forwards (recomputes)
    fw, bw = partition(*args, **kwargs)
    ops = [str(n.target) for n in bw.graph.nodes if n.op == "call_function"]
    backward_ops.append((sum(op.split(".")[1] in ("mm", "addmm", "bmm") for op in ops if op.startswith("aten.")),
                         [op for op in ops if "attention" in op and "backward" not in op]))
    return fw, bw


compile_fx.min_cut_rematerialization_partition = counted
if hasattr(functorch_config, "enable_autograd_cache"):  # each variant partitioned here, and counted, every run
    functorch_config.enable_autograd_cache = False
cfg = preset_model("7b", layers=1)
t = LayerTemplate.build(cfg, "layers.0")
flat = (torch.randn(t.numel, device="cuda") * 0.02).to(torch.bfloat16)
grads = t.bind(torch.zeros(t.numel, device="cuda"), fused=True)
xs = [torch.randn(4, 4096, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
dys = [torch.ones_like(x) for x in xs]
contexts = [(M.rope_cache(cfg, 4096, torch.device("cuda"), torch.bfloat16), None)] * len(xs)
tokens, weights = sum(x.shape[0] * x.shape[1] for x in xs), t.numel * 2
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {tokens} tokens")
for name, setting, lean in (("lean", "lean", True), ("torch default", None, False),
                            ("budget 0.9", {"activation_memory_budget": 0.9}, True)):
    torch._dynamo.reset()
    layer = CompiledLayer(partitioner=setting, threads=8)

    def kept(layer=layer):
        kept_backward(layer_forward_kept(layer, t, flat, xs, contexts, cfg), grads, list(dys))

    backward_ops.clear()
    kept()  # compiles
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = layer_forward_kept(layer, t, flat, xs, contexts, cfg)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base - weights) / tokens  # saved tensors + outputs (~ inputs)
    fwd_peak = (torch.cuda.max_memory_allocated() - base - weights) / tokens
    kept_backward(graph, grads, list(dys))
    step_peak = (torch.cuda.max_memory_allocated() - base - weights) / tokens
    del graph
    kept_ms = cuda_ms(kept, reps=3, warmup=0)
    print(f"{name:14s} kept {held:9.1f} B/token (formula {kept_bytes_per_token(cfg, 2, compiled=True, lean=lean)}), "
          f"fwd peak {fwd_peak:9.1f}, fwd+bwd peak {step_peak:9.1f}; kept fwd+bwd {kept_ms:7.1f} ms; "
          f"backward graph: (GEMMs, attention forwards) {backward_ops}; failure {layer.failure}", flush=True)
