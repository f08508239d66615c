"""Probes of one machine's ceilings for the benchmark: a bf16 GEMM, one decoder layer as the
compute worker runs it (eager and compiled), and the CPU AdamW kernels at one layer's size.
"""

from __future__ import annotations

import time

import torch


def cuda_ms(fn, reps: int = 3, warmup: int = 1) -> float:
    """Milliseconds of one call of ``fn`` on the GPU: the mean of ``reps`` calls between two CUDA
    events, after ``warmup`` calls (compiles, caches)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gemm_tflops(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / (cuda_ms(lambda: a @ b, reps, warmup=3) / 1e3) / 1e12


def layer_probe(cfg, micro_batches: int) -> dict:
    """One decoder layer at the run's shape, on the GPU: ms for the forward and the recompute +
    backward of all micro-batches, as the compute worker runs them (views of a flat slot, gradients
    into a flat fp32 buffer), eager and compiled; the same for a layer kept whole (forward with its
    graph, backward without recompute) with the bytes per token its graph holds (against
    :func:`~megatrain_ray.engine.compute.activations.kept_bytes_per_token`); eager forward + backward under
    each SDPA backend."""
    from megatrain_ray.engine.compute.activations import kept_backward, kept_bytes_per_token, layer_forward_kept
    from megatrain_ray.engine.compute.attention import sdpa_backend
    from megatrain_ray.engine.compute.sequence import CompiledLayer, LayerRunner, layer_backward
    from megatrain_ray.model import transformer as M
    from megatrain_ray.model.layout import LayerTemplate

    mc = cfg.model
    t = LayerTemplate.build(mc, "layers.0")
    flat = (torch.randn(t.numel, device="cuda") * 0.02).to(torch.bfloat16)
    grad = torch.zeros(t.numel, device="cuda")
    mb = cfg.train.micro_batch_size
    xs = [torch.randn(mb, cfg.train.seq_len, mc.hidden_size, device="cuda", dtype=torch.bfloat16)
          for _ in range(micro_batches)]
    rope = M.rope_cache(mc, cfg.train.seq_len, torch.device("cuda"), torch.bfloat16)

    def fwd(runner):
        with torch.no_grad():
            for x in xs:
                runner.layer(t.bind(flat, fused=True), x, rope, mc)

    def bwd(runner):
        layer_backward(runner, t.bind(flat, fused=True), t.bind(grad, fused=True), xs,
                       [torch.ones_like(x) for x in xs], [(rope, None)] * len(xs), mc)

    from torch._inductor import config as inductor_config

    # as the compute worker compiles it (its partitioner settings), the compiler's threads left as they are
    compiled = LayerRunner(wrap=lambda fn: CompiledLayer(threads=inductor_config.compile_threads, fn=fn))
    eager = LayerRunner()
    start = time.perf_counter()
    fwd(compiled)
    bwd(compiled)
    out = {"compile_s": time.perf_counter() - start}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        out[f"fwd_{name}_ms"] = cuda_ms(lambda: fwd(runner))
        out[f"bwd_{name}_ms"] = cuda_ms(lambda: bwd(runner))
    from torch.profiler import ProfilerActivity, profile

    tokens = mb * cfg.train.seq_len * micro_batches

    def kept(fn):  # a kept layer: the forward with its graph, then the backward without a recompute
        graph = layer_forward_kept(fn, t, flat, xs, [(rope, None)] * len(xs), mc)
        kept_backward(graph, t.bind(grad, fused=True), [torch.ones_like(x) for x in xs])

    out["kept_bytes_per_token_formula_eager"] = kept_bytes_per_token(mc, 2)
    out["kept_bytes_per_token_formula_compiled"] = kept_bytes_per_token(mc, 2, compiled=True)
    for name, fn in (("eager", M.decoder_layer), ("compiled", compiled.layer)):
        out[f"kept_fwd_bwd_{name}_ms"] = cuda_ms(lambda: kept(fn))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graph = layer_forward_kept(fn, t, flat, xs, [(rope, None)] * len(xs), mc)
        torch.cuda.synchronize()
        # what the graph holds beyond its weight copy: saved tensors + outputs (= inputs, in the formula)
        out[f"kept_bytes_per_token_{name}"] = (torch.cuda.memory_allocated() - before - t.numel * 2) / tokens
        del graph
    for backend in ("flash", "cudnn", "efficient", "math"):  # eager: a compiled graph keeps its first kernel
        try:
            with sdpa_backend(backend):
                out[f"fwd_bwd_eager_{backend}_ms"] = cuda_ms(lambda: (fwd(eager), bwd(eager)))
        except RuntimeError:  # no such kernel for this shape / GPU / build
            out[f"fwd_bwd_eager_{backend}_ms"] = float("nan")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bwd(compiled)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    torch.cuda.empty_cache()  # this process's cached blocks would be GPU memory the run's planner cannot use
    flops = 2 * t.param_count * cfg.train.seq_len * mb * micro_batches
    out["fwd_gemm_floor_ms"] = flops / 790e12 * 1e3
    down = 2 * mc.hidden_size * mc.intermediate_size * cfg.train.seq_len * mb * micro_batches
    out["bwd_gemm_floor_ms"] = (3 * flops - down) / 790e12 * 1e3  # the recompute stops before the down projection
    return out


def adamw_probe(numel: int, threads: int) -> dict:
    """CPU rates (G params/s) of torch's fused AdamW alone (fp32 gradient, all threads on one op) and
    of our per-unit update (bf16 gradient in, clip factor, stream copy out) with torch's kernels and
    with the native one-pass kernel on an :class:`~megatrain_ray.engine.optim.AdamWRunner` pool of n threads."""
    from megatrain_ray.config import OptimConfig
    from megatrain_ray.engine import optim

    torch.set_num_threads(threads)
    p, m, v = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    g16 = torch.randn(numel).to(torch.bfloat16)
    g32, stream = g16.float(), torch.empty(numel, dtype=torch.bfloat16)
    step, cfg = torch.tensor(1.0), OptimConfig()

    def rate(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return numel / (time.perf_counter() - t0) / 1e9

    out = {"fused_fp32_gps": rate(lambda: torch._fused_adamw_(
        [p], [g32], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
        amsgrad=False, maximize=False))}
    out["unit_torch_gps"] = rate(lambda: optim.adamw_unit(p, g16, m, v, stream, numel, 1, 1e-4, cfg, 0.5))
    for n in sorted({threads // 2, threads - 4, threads - 2, threads}):
        runner = optim.AdamWRunner(n)
        if runner.kernel is not None:
            out[f"unit_native_t{n}_gps"] = rate(lambda: runner.update(p, g16, m, v, stream, numel, 1, 1e-4, cfg, 0.5))
        runner.close()
    return out
