"""One compiled dense layer under several Inductor settings, side by side, with the kernels they make.

The compute worker runs each decoder layer through ``torch.compile``
(:class:`~megatrain_ray.engine.compute.sequence.CompiledLayer`): the GEMMs and attention are library
kernels, and everything between them is Triton code that Inductor generates. How Inductor lowers a
concatenation (SwiGLU's backward writes the fused gate/up gradient, RoPE's the fused q/k/v gradient)
and which block sizes it picks decide how fast those kernels run. Each setting below runs in a
process of its own (its own compile cache; ``concat-bw``: the ``concat`` settings for the
backward graphs alone), one Qwen2.5-7B layer, 4 micro-batches of [16, 1024]
tokens, as the compute worker runs it:

- the forward without gradients, a kept layer's forward (with its graph) and backward, and a
  recomputed layer's recompute + backward: ms each (wall time between device synchronizations, the median of 3);
- the kernels of the forward and of the two backwards, by name, with their time and calls;
- a digest of the outputs (the forward's output, the input gradients, the fp32 weight gradients),
  so that a setting which changes a single bit shows it. The first setting runs twice: where its
  two runs differ (e.g. Inductor times candidate block sizes of some kernels as it compiles, and a
  reduction summed in other blocks differs in its last bits), the digests cannot tell a setting's
  change from that variation. A setting this torch does not have is left out and named.

    python3 benchmarks/inductor_variants_probe.py OUT                     # a CUDA GPU box (~1-2 min a setting)
    python3 benchmarks/inductor_variants_probe.py OUT --variants default,concat,concat-bw
    python3 benchmarks/inductor_variants_probe.py OUT --smoke --variants default  # the CPU, a small layer

Writes OUT/inductor_variants.json, and OUT/code-<setting>.tgz: the Triton code Inductor generated.
"""

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

VARIANTS = {
    "default": {},
    "concat": {"max_complex_pointwise_cat_inputs": 1, "max_pointwise_cat_inputs": 1},
    "cdt": {"coordinate_descent_tuning": True},
    "concat+cdt": {"max_complex_pointwise_cat_inputs": 1, "max_pointwise_cat_inputs": 1,
                   "coordinate_descent_tuning": True},
    "nd-tiling": {"triton.prefer_nd_tiling": True},
}
"""torch._inductor.config settings by name: none; every concatenation as a kernel per input, each
writing its slice (never one pointwise kernel with masked loads of every input); coordinate-descent
tuning of the generated kernels' block sizes; both; kernels tiled in more than one dimension where
Inductor can (transposes)."""
BACKWARD_ONLY = {"concat-bw": "concat"}
"""Settings of :data:`VARIANTS` applied to the backward graphs alone (the forwards' as by default)."""


def backward_only(settings: dict):
    """A torch.compile backend: Inductor, with ``settings`` while it compiles a backward graph."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            with inductor_config.patch(settings):
                return compile_fx_inner(gm, example_inputs, **kwargs)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)


def has_setting(config, key: str) -> bool:
    """Whether torch._inductor.config ``config`` has the (dotted) setting ``key``: each torch version
    has its own."""
    for part in key.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def digest(*tensors: torch.Tensor) -> str:
    """The first 16 hex digits of the SHA-256 of the tensors' bytes."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def child(variant: str, out_path: str, smoke: bool) -> None:
    from torch._inductor import config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatrain_ray.engine.compute.activations import kept_backward, layer_forward_kept
    from megatrain_ray.engine.compute.sequence import CompiledLayer, LayerRunner, layer_backward
    from megatrain_ray.model import transformer as M
    from megatrain_ray.model.layout import LayerTemplate
    from megatrain_ray.model.presets import preset_model

    settings = VARIANTS[BACKWARD_ONLY.get(variant, variant)]
    missing = [key for key in settings if not has_setting(inductor_config, key)]
    settings = {key: value for key, value in settings.items() if key not in missing}
    backend = backward_only(settings) if variant in BACKWARD_ONLY else "inductor"
    for key, value in ({} if variant in BACKWARD_ONLY else settings).items():
        *path, name = key.split(".")
        owner = inductor_config
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, value)
    torch.manual_seed(0)
    device = torch.device("cpu" if smoke else "cuda")
    cfg = preset_model("small" if smoke else "7b", layers=1)
    batch, seq = (2, 64) if smoke else (16, 1024)
    t = LayerTemplate.build(cfg, "layers.0")
    flat = (torch.randn(t.numel, device=device) * 0.02).to(torch.bfloat16)
    grad = torch.zeros(t.numel, device=device)
    xs = [torch.randn(batch, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16) for _ in range(4)]
    dys = [torch.randn_like(x) * 1e-2 for x in xs]
    ctx = [(M.rope_cache(cfg, seq, device, torch.bfloat16), None)] * len(xs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runner = LayerRunner(wrap=lambda fn: CompiledLayer(backend=backend, threads=8, fn=fn))
    params, grads = t.bind(flat, fused=True), t.bind(grad, fused=True)

    def forward():
        with torch.no_grad():
            return [runner.forward(params, x, c, cfg) for x, c in zip(xs, ctx)]

    def kept_forward():
        return layer_forward_kept(runner.layer, t, flat, xs, ctx, cfg)

    def kept(graph):
        dx = [d.clone() for d in dys]
        kept_backward(graph, grads, dx)
        return dx

    def recompute():
        dx = [d.clone() for d in dys]
        layer_backward(runner, params, grads, xs, dx, ctx, cfg)
        return dx

    t0 = time.perf_counter()
    out = forward()
    grad.zero_()
    kept_dx = kept(kept_forward())
    kept_grad = grad.clone()
    grad.zero_()
    rec_dx = recompute()
    sync()
    row = {"variant": variant, "settings": settings, "not in this torch": missing,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "compile_s": round(time.perf_counter() - t0, 1),
           "digest": {"forward": digest(*out), "kept dx": digest(*kept_dx), "kept grads": digest(kept_grad),
                      "recompute dx": digest(*rec_dx), "recompute grads": digest(grad)}}
    del out, kept_dx, rec_dx, kept_grad

    def timed(setup, run) -> float:
        times = []
        for _ in range(3):
            state = setup()
            sync()
            t0 = time.perf_counter()
            run(state)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
            del state
        return round(statistics.median(times), 2)

    row["ms"] = {"forward": timed(lambda: None, lambda _: forward()),
                 "kept forward": timed(lambda: None, lambda _: kept_forward()),
                 "kept backward": timed(kept_forward, kept),
                 "recompute + backward": timed(lambda: None, lambda _: recompute())}
    kernels = {}
    for part, setup, run in (("kept backward", kept_forward, kept),
                             ("recompute + backward", lambda: None, lambda _: recompute()),
                             ("forward", lambda: None, lambda _: forward())):
        state = setup()
        sync()
        with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
            run(state)
            sync()
        del state
        rows = []
        for e in prof.key_averages():
            ms = getattr(e, "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total", 0) / 1e3
            if ms > 0 and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
                rows.append({"ms": round(ms, 3), "calls": e.count, "name": e.key[:110]})
        kernels[part] = sorted(rows, key=lambda r: -r["ms"])[:14]
    row["kernels"] = kernels
    with open(out_path, "w") as f:
        json.dump(row, f)


def main() -> None:
    out_dir = sys.argv[1]
    names = (sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv
             else [*VARIANTS, *BACKWARD_ONLY])
    os.makedirs(out_dir, exist_ok=True)
    results = []
    # the first setting twice: a layer's bits may differ between processes (e.g. Inductor picks some
    # kernels' block sizes by timing them as it compiles, and a reduction summed in other blocks
    # differs in its last bits); where the first setting's two runs differ, "same bits" says nothing
    # about the settings
    for i, name in enumerate([names[0], *names]):
        label = f"{name} again" if i == 1 else name
        cache = tempfile.mkdtemp(prefix=f"inductor-{name}-")
        path = os.path.join(out_dir, f"variant-{i}.json")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, path,
                                   *(["--smoke"] if "--smoke" in sys.argv else [])], env=env,
                                  capture_output=True, text=True, timeout=400)
            error = proc.stderr[-3000:] if proc.returncode else None
        except subprocess.TimeoutExpired:
            error = "did not finish in 400 s"
        if error is None and i != 1:
            with tarfile.open(os.path.join(out_dir, f"code-{name}.tgz"), "w:gz") as tar:
                for root, _, files in os.walk(cache):
                    for f in files:
                        if f.endswith(".py") and os.path.getsize(os.path.join(root, f)) < 4 << 20:
                            tar.add(os.path.join(root, f), arcname=os.path.relpath(os.path.join(root, f), cache))
        shutil.rmtree(cache, ignore_errors=True)
        if error is not None:
            print(f"{label}: failed\n{error}")
            results.append({"variant": label, "error": error})
            continue
        with open(path) as f:
            row = {**json.load(f), "variant": label}
        os.remove(path)
        results.append(row)
        print(f"{label} ({row['device']}, compiled in {row['compile_s']} s): ms {row['ms']}")
        if row["not in this torch"]:
            print(f"    not in this torch {row['torch']}, left out: {', '.join(row['not in this torch'])}")
        print(f"    digest {row['digest']}")
        for part, ks in row["kernels"].items():
            print(f"  {part}:")
            for k in ks:
                print(f"    {k['ms']:9.3f} ms  x{k['calls']:<4d} {k['name']}")
    base = next((r for r in results if "ms" in r), None)
    if base:
        print("\nsetting          " + "".join(f"{p:>22s}" for p in base["ms"]) + "   same bits as the first")
        for r in results:
            if "ms" in r:
                same = all(r["digest"][k] == base["digest"][k] for k in base["digest"])
                print(f"{r['variant']:16s} " + "".join(f"{v:22.2f}" for v in r["ms"].values()) + f"   {same}")
        again = next((r for r in results if r["variant"] == f"{base['variant']} again" and "ms" in r), None)
        if again is not None and again["digest"] != base["digest"]:
            print(f"{base['variant']}'s two runs differ in their bits: a setting's 'False' above may be that "
                  "variation, not the setting")
    with open(os.path.join(out_dir, "inductor_variants.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        child(sys.argv[i + 1], sys.argv[i + 2], "--smoke" in sys.argv)
    else:
        main()
