"""The 7B LM head's step time, eager vs compiled, on one CUDA GPU.

Times :func:`~megatrain_ray.engine.compute.head.head_forward_backward` (final norm, LM head, fp32
cross-entropy, forward and backward over loss chunks) at the Qwen2.5-7B head (vocabulary 152,064,
hidden 3,584, untied, bf16) over 65,536 tokens (4 micro-batches of 16 x 1,024) in chunks of 8,192,
eagerly and with the chunk loss through torch.compile as the compute worker runs it with
compute.compile on; and the same chunks' three GEMMs alone (logits, input and weight gradients), the
floor. Prints ms per head (mean of 5 after a warm-up, which compiles) and the peak memory above the
inputs, and how far the compiled loss and gradient are from the eager ones.

    python3 benchmarks/head_probe.py [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from megatrain_ray.engine.compute.head import chunk_loss_sum, head_forward_backward
from megatrain_ray.engine.compute.sequence import CompiledLayer
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.presets import preset_model

M, B, S, CHUNK = 4, 16, 1024, 8192


def timed(fn, reps):
    fn()  # warm-up (compiles)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = None  # the last call's results go before the next call (not counted in its peak)
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = preset_model("7b", layers=1)
    templates = StoreLayout.build(cfg).templates
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    wh = torch.randn(templates[2].numel, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    templates[2].bind(wh)["norm.weight"].fill_(1.0)
    hidden = [torch.randn(B, S, cfg.hidden_size, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(M)]
    labels = torch.randint(0, cfg.vocab_size, (M, B, S), device=dev, generator=g)
    embed_grad = torch.zeros(1, device=dev)  # untied: not touched

    def head(fn):
        return lambda: head_forward_backward(cfg, templates, CHUNK, wh, None, hidden, labels, M * B * S, embed_grad, fn)

    w = templates[2].bind(wh)["lm_head.weight"]
    xs = [x.view(-1, CHUNK, cfg.hidden_size) for x in hidden]

    def gemms():
        for x in xs:
            for xc in x:
                d = xc @ w.T  # the logits; their gradient has the same shape
                _ = d @ w, d.T @ xc

    rows = {"eager": head(chunk_loss_sum),
            "compiled": head(CompiledLayer(fn=chunk_loss_sum, what="LM head", backward_at_forward=True)),
            "GEMMs only": gemms}
    results = {}
    for name, fn in rows.items():
        t0 = time.perf_counter()
        ms, peak, results[name] = timed(fn, args.reps)
        print(f"{name:>10}: {ms:8.1f} ms  peak +{peak:6.2f} GiB  (first call + reps {time.perf_counter() - t0:.1f} s)",
              flush=True)
    (le, _, ge), (lc, _, gc) = results["eager"], results["compiled"]
    print(f"loss eager {float(le):.6f} compiled {float(lc):.6f}; head grad max |diff| "
          f"{float((ge - gc).abs().max()):.3g} of max {float(ge.abs().max()):.3g}")


if __name__ == "__main__":
    main()
