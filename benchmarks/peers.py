"""Peer baselines: the bench's model trained by DeepSpeed ZeRO-3 offload and by FSDP2 CPU offload.

    python benchmarks/peers.py --preset 3b,7b --systems deepspeed,fsdp2 --steps 3 --out OUT
    python benchmarks/peers.py --preset 7b --sweep-layers 12,20,28 --tokens 16384 --steps 2 --out OUT
    python benchmarks/compare.py --preset 7b --steps 4 --peers deepspeed,fsdp2 --out OUT   # beside ours, one table

What users would run instead of megatrain_ray, set up as their documentation says and measured the
way :mod:`megatrain_ray.bench` measures us: the same shapes (``megatrain_ray.model.presets``, optionally with
another layer count), random init, the same tokens per step (micro_batches x micro_batch_size x
seq_len, accumulated over micro-batches), per-layer recompute, AdamW (lr 1e-4, betas (0.9, 0.95),
eps 1e-8, weight decay on matrices only, megatrain_ray's default) and global-norm clipping at 1.0.

- ``deepspeed``: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` to pinned CPU memory,
  DeepSpeedCPUAdam (``torch.optim.AdamW`` on the CPU with ``--ds-torch-adam``), bf16 on. The model
  is built under ``deepspeed.zero.Init`` so each parameter goes to pinned host memory as soon as
  its module exists. Bucket sizes are the values the HF Trainer's "auto" fills in.
- ``fsdp2``: ``fully_shard`` on every decoder layer and on the root, one GPU,
  ``CPUOffloadPolicy(pin_memory=True)``; fp32 parameters on the CPU, gathered to the GPU in bf16,
  gradients reduced in fp32 and kept on the CPU, where ``torch.optim.AdamW`` (fused) updates them.

Both use the Hugging Face class of the preset (Qwen2ForCausalLM / LlamaForCausalLM, sdpa attention,
no KV cache, ``activation_checkpointing`` non-reentrant) and the loss as users write it: full
logits, cross-entropy in fp32. Weights: matrices N(0, 0.02), norms 1, biases 0, drawn on the
GPU (fast, no second host copy). Tokens: ``np.random.default_rng(0)`` integers over the vocab.

Each system runs in a subprocess of its own (``--system``), so a crash or an out-of-memory kill
leaves the caller alive and host memory is measured per system (MemTotal - MemAvailable, peak
minus start, as the bench does). The parent kills the child when the machine is about to run out of
host memory (status ``oom``) or past its time limit (``timeout``, with the steps done so far).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.config import ModelConfig  # noqa: E402
from megatrain_ray.errors import MegatrainError  # noqa: E402
from megatrain_ray.io.files import write_json  # noqa: E402
from megatrain_ray.model import flops as model_flops  # noqa: E402
from megatrain_ray.model.presets import PRESETS, model_params, preset_model, preset_shape  # noqa: E402
from megatrain_ray.hostmem import HostMemoryPeak  # noqa: E402

SYSTEMS = ("deepspeed", "fsdp2")
EXIT_SETUP_ERROR = 2


class PeerSetupError(MegatrainError):
    """A peer cannot start here (missing package, no CUDA, no compiler); the message names the fix."""


@dataclass
class PeerSpec:
    """One peer run: which system trains which shape, with how many tokens per step."""

    system: str
    """``deepspeed`` or ``fsdp2``."""
    preset: str
    """A key of ``megatrain_ray.model.presets.PRESETS``."""
    tokens: int = 65536
    """Tokens per optimizer step (= micro_batches x micro_batch_size x seq_len)."""
    seq_len: int = 1024
    """Tokens per sequence."""
    micro_batches: int = 4
    """Micro-batches per step, accumulated before one AdamW update."""
    steps: int = 3
    """Optimizer steps; the first is warm-up and is left out of step_s."""
    layers: int | None = None
    """Override of the preset's num_hidden_layers (size sweep); None keeps it."""
    lr: float = 1e-4
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices only (norms and biases get none), as megatrain_ray does by
    default (``optim.decay_norms_and_biases: false``)."""
    max_grad_norm: float = 1.0
    ds_torch_adam: bool = False
    """DeepSpeed only: torch.optim.AdamW on the CPU instead of DeepSpeedCPUAdam (no op compile)."""
    device: str = "cuda"
    """``cuda``; ``cpu`` runs the same code without offload in fp32 (tests, smoke runs)."""
    seed: int = 0

    @property
    def micro_batch_size(self) -> int:
        return self.tokens // (self.seq_len * self.micro_batches)

    @property
    def shape(self) -> dict:
        """The preset's HF config fields, with the layer override applied."""
        return preset_shape(self.preset, self.layers)

    def validate(self) -> None:
        if self.system not in SYSTEMS:
            raise PeerSetupError(f"--system must be one of {', '.join(SYSTEMS)}, got {self.system!r}.")
        if self.preset not in PRESETS:
            raise PeerSetupError(f"--preset must be one of {', '.join(sorted(PRESETS))}, got {self.preset!r}.")
        if self.micro_batch_size < 1 or self.tokens % (self.seq_len * self.micro_batches):
            raise PeerSetupError(f"--tokens ({self.tokens}) must be a positive multiple of --seq-len x "
                                 f"--micro-batches ({self.seq_len * self.micro_batches}).")
        if self.layers is not None and self.layers < 1:
            raise PeerSetupError(f"--layers must be positive, got {self.layers}.")
        if self.steps < 1:
            raise PeerSetupError(f"--steps must be positive, got {self.steps}.")


def num_params(spec: PeerSpec) -> int:
    """Parameter count of the model the spec trains (our layout's count; the HF model's is equal)."""
    return model_params(spec.preset, spec.layers)


# ---------------------------------------------------------------------------------------------
# Environment checks: each failure is one sentence naming the fix, raised before any work.

def check_environment(system: str, device: str = "cuda", ds_torch_adam: bool = False) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise PeerSetupError(f"CUDA is not available to torch {torch.__version__}; run the peers on a machine with "
                             "an NVIDIA GPU and a CUDA build of torch.")
    if system == "fsdp2":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError:
            raise PeerSetupError(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2); "
                                 "install torch >= 2.6.") from None
        return
    missing = [name for name in ("deepspeed", "hjson", "pydantic") if importlib.util.find_spec(name) is None]
    if missing:
        raise PeerSetupError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; install "
                             "DeepSpeed (pip install deepspeed, or offline: pip install --no-index --no-deps "
                             "--target /tmp/site .whl/*.whl and put /tmp/site on PYTHONPATH), or run only "
                             "--systems fsdp2.")
    if ds_torch_adam:
        return
    include = sysconfig.get_paths()["include"]
    needs = [("ninja", shutil.which("ninja")), ("a C++ compiler (c++)", shutil.which("c++") or shutil.which("g++")),
             (f"Python.h in {include} (python3-dev)", os.path.exists(os.path.join(include, "Python.h")))]
    absent = [name for name, ok in needs if not ok]
    if absent:
        raise PeerSetupError(f"DeepSpeedCPUAdam compiles at start and needs {', '.join(absent)}; install "
                             f"{'it' if len(absent) == 1 else 'them'}, or pass --ds-torch-adam to use torch's "
                             "AdamW on the CPU instead.")


def init_single_process_group(backend: str) -> None:
    """World size 1 on this host: rank 0, a free local port, the env vars DeepSpeed also reads."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group(backend, rank=0, world_size=1)


# ---------------------------------------------------------------------------------------------
# The model, its weights, its data and its loss: shared by both systems.

def hf_config(spec: PeerSpec):
    """The transformers config of the spec's shape (HF field names, as ModelConfig writes them)."""
    import transformers

    mc = ModelConfig(**spec.shape, max_position_embeddings=max(32768, spec.seq_len))
    mc.validate()
    cfg = transformers.AutoConfig.for_model(**mc.to_hf_dict())
    cfg.use_cache = False
    return cfg


def build_model(cfg, dtype: torch.dtype):
    """The HF causal LM for ``cfg`` (sdpa attention), every decoder layer recomputed in backward."""
    import transformers

    # transformers 4.56 renamed torch_dtype to dtype (5 still takes the old name, with a warning)
    new = tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (4, 56)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                          **{"dtype" if new else "torch_dtype": dtype})
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    model.config.use_cache = False
    return model


def _import_model_code(cfg) -> None:
    """Import the model's modules (and torch._dynamo, which transformers pulls in lazily) now: imported
    for the first time inside ``zero.Init``, whose patched tensor constructors break dynamo's import."""
    import torch._dynamo  # noqa: F401
    import transformers

    transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    for name in ("transformers.generation.utils", "transformers.masking_utils"):
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def _shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape in ds_shape


def param_groups(model, spec: PeerSpec) -> list[dict]:
    """AdamW groups: weight decay on matrices, none on norms and biases (megatrain_ray's default)."""
    decay = [p for p in model.parameters() if len(_shape(p)) >= 2]
    rest = [p for p in model.parameters() if len(_shape(p)) < 2]
    return [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}]


def init_value(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Matrices N(0, 0.02), norm weights 1, biases 0 (the bench's GPU-resident baseline's rule)."""
    if len(shape) >= 2:
        return torch.randn(shape, generator=gen, device=device).mul_(0.02)
    return torch.ones(shape, device=device) if "norm" in name else torch.zeros(shape, device=device)


def init_weights_(model, device: torch.device, seed: int) -> None:
    """Fill every parameter in place; values are drawn on ``device`` and copied into the parameter's
    own storage (an FSDP2 shard is the whole tensor at world size 1), so no second host copy exists."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p.data
            local.copy_(init_value(name, tuple(p.shape), gen, device))


def step_tokens(spec: PeerSpec, vocab: int):
    """Per step: int64 tokens [micro_batches, micro_batch_size, seq_len + 1] (inputs and shifted labels)."""
    rng = np.random.default_rng(spec.seed)
    while True:
        yield torch.from_numpy(rng.integers(0, vocab, size=(spec.micro_batches, spec.micro_batch_size,
                                                            spec.seq_len + 1), dtype=np.int64))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch; tokens [batch, seq_len + 1]."""
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits  # [batch, seq_len, vocab]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


# ---------------------------------------------------------------------------------------------
# FSDP2.

def build_fsdp2(spec: PeerSpec):
    """(model, AdamW, optimizer name). Needs the process group. On CUDA: fp32 shards in pinned host
    memory, bf16 compute, fp32 gradient reduction; on the CPU: fp32 throughout, no offload."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    device = torch.device(spec.device)
    cfg = hf_config(spec)
    with torch.device("meta"):
        model = build_model(cfg, torch.float32)
    cuda = device.type == "cuda"
    kw = dict(mesh=init_device_mesh(device.type, (1,)),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if cuda else MixedPrecisionPolicy(),
              offload_policy=CPUOffloadPolicy(pin_memory=True) if cuda else OffloadPolicy())
    for layer in model.base_model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu" if cuda else device)
    init_weights_(model, device, spec.seed)
    rotary = model.base_model.rotary_emb  # its inv_freq buffer was meta, then garbage: rebuild it
    with torch.device(device):
        model.base_model.rotary_emb = type(rotary)(config=model.config)
    model.train()
    groups = param_groups(model, spec)
    try:
        opt, name = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=True), "fused"
    except (RuntimeError, ValueError):
        opt, name = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True), "foreach"
    return model, opt, f"torch.optim.AdamW ({name}, CPU)" if cuda else f"torch.optim.AdamW ({name})"


def fsdp2_step(model, opt, spec: PeerSpec):
    """A function training one step on tokens [micro_batches, batch, seq_len + 1]; returns the mean loss."""
    device = torch.device(spec.device)

    def step(tokens: torch.Tensor) -> float:
        losses = []
        for mb in tokens:
            loss = lm_loss(model, mb.to(device, non_blocking=True))
            (loss / spec.micro_batches).backward()
            losses.append(loss.detach())
        if spec.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item()

    return step


# ---------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 offload.

def deepspeed_config(spec: PeerSpec, hidden_size: int) -> dict:
    """ZeRO-3, parameters and optimizer offloaded to pinned CPU memory; buckets as HF's "auto" sets them."""
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.micro_batches,
        "gradient_clipping": spec.max_grad_norm,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": spec.weight_decay,
                                                  **({"torch_adam": True} if spec.ds_torch_adam else {})}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(spec: PeerSpec):
    """(engine, optimizer name). Needs the process group."""
    import deepspeed

    cfg = hf_config(spec)
    ds_config = deepspeed_config(spec, cfg.hidden_size)
    _import_model_code(cfg)
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=ds_config):
        model = build_model(cfg, torch.bfloat16)
    device = torch.device(spec.device)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # gather one parameter at a time, fill, re-partition
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(init_value(name, tuple(p.shape), gen, p.device))
    model.train()
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, spec),
                                             config=ds_config)
    inner = getattr(opt, "optimizer", opt)  # the ZeRO-3 wrapper holds the CPU optimizer
    return engine, type(inner).__module__.split(".")[0] + "." + type(inner).__name__


def deepspeed_step(engine, spec: PeerSpec):
    device = torch.device(spec.device)

    def step(tokens: torch.Tensor) -> float:
        losses = []
        for mb in tokens:
            loss = lm_loss(engine, mb.to(device, non_blocking=True))
            engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            engine.step()  # the optimizer (clipping included) runs at the accumulation boundary
            losses.append(loss.detach())
        return torch.stack(losses).float().mean().item()

    return step


# ---------------------------------------------------------------------------------------------
# One system in this process.

def _jit_env(spec: PeerSpec) -> None:
    """The accelerator DeepSpeed uses, named rather than guessed, and the GPU its JIT ops build for
    (they build under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, once per machine)."""
    os.environ.setdefault("DS_ACCELERATOR", spec.device)
    if spec.device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")


def train_peer(spec: PeerSpec, report: dict, on_step=lambda report: None) -> dict:
    """Train ``spec`` in this process, filling ``report`` (init_s, step_times, losses, ...) as it goes."""
    spec.validate()
    check_environment(spec.system, spec.device, spec.ds_torch_adam)
    cuda = spec.device == "cuda"
    if spec.system == "deepspeed":
        _jit_env(spec)
    if cuda:
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    import torch.distributed as dist

    init_single_process_group("nccl" if cuda else "gloo")
    try:
        t0 = time.perf_counter()
        if spec.system == "deepspeed":
            engine, report["optimizer"] = build_deepspeed(spec)
            step = deepspeed_step(engine, spec)
        else:
            model, opt, report["optimizer"] = build_fsdp2(spec)
            step = fsdp2_step(model, opt, spec)
        report["init_s"] = time.perf_counter() - t0
        print(f"peers: {spec.system} built in {report['init_s']:.1f} s, optimizer {report['optimizer']}", flush=True)
        on_step(report)
        batches = step_tokens(spec, spec.shape["vocab_size"])
        for i in range(spec.steps):
            tokens = next(batches)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(tokens)
            if cuda:
                torch.cuda.synchronize()
            report["step_times"].append(time.perf_counter() - t)
            report["losses"].append(loss)
            if cuda:
                report["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(f"peers: {spec.system} step {i} {report['step_times'][-1]:.2f} s loss {loss:.4f}", flush=True)
            on_step(report)
    finally:
        dist.destroy_process_group()
    return report


def summarize(report: dict) -> dict:
    """step_s = median of the steps after the first; tokens/s and model TFLOPS from it, in both
    conventions of megatrain_ray.model.flops (tflops_6nt: 6·N·T; tflops_palm: PaLM's, with attention)."""
    times = report.get("step_times") or []
    if times:
        report["step_s"] = statistics.median(times[1:] or times)
        report["tokens_per_s"] = report["tokens_per_step"] / report["step_s"]
        report.update(model_flops.tflops(preset_model(report["preset"], report["layers"]), report["seq_len"],
                                         report["tokens_per_step"], report["step_s"]))
    return report


def new_report(spec: PeerSpec) -> dict:
    return {"system": spec.system, "preset": spec.preset, "layers": spec.shape["num_hidden_layers"],
            "params": num_params(spec), "tokens_per_step": spec.tokens, "seq_len": spec.seq_len,
            "micro_batches": spec.micro_batches, "micro_batch_size": spec.micro_batch_size,
            "weight_decay": spec.weight_decay,
            "status": "running", "step_times": [], "losses": [], "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if spec.device == "cuda" and torch.cuda.is_available() else "cpu"}


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def child_main(spec: PeerSpec, json_path: str) -> int:
    """The subprocess: train, writing the report to ``json_path`` after init and after every step."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # if the kernel must kill something for memory, let it be this run
    except OSError:
        pass
    report = new_report(spec)
    rc = 0
    with HostMemoryPeak() as mem:
        def save(r: dict) -> None:
            r["host_peak_added_gib"] = mem.added / 2**30
            r["host_accounted_gib"] = mem.accounted / 2**30
            write_json(json_path, summarize(r))

        try:
            train_peer(spec, report, save)
            report["status"] = "ok"
        except PeerSetupError as e:
            report["status"], rc = f"error: {e}", EXIT_SETUP_ERROR
        except BaseException as e:  # noqa: BLE001 - every failure becomes a status line
            import traceback

            traceback.print_exc()
            line = (str(e).strip().splitlines() or [""])[0][:300]
            report["status"] = "oom" if _is_oom(e) else f"error: {type(e).__name__}: {line}"
            if "cpu_adam" in str(e) and not spec.ds_torch_adam:  # the JIT build of DeepSpeedCPUAdam failed
                report["status"] = (f"error: the DeepSpeedCPUAdam op did not build ({line[:160]}); see the log, "
                                    "or rerun with --ds-torch-adam")
            report["error"] = f"{type(e).__name__}: {line}"
            rc = 1
        if spec.system == "deepspeed" and "deepspeed" in sys.modules:
            report["deepspeed"] = getattr(sys.modules["deepspeed"], "__version__", "?")
    save(report)
    return rc


# ---------------------------------------------------------------------------------------------
# The parent: one subprocess per system, watched for memory and time.

def _mem_available() -> int:
    return psutil.virtual_memory().available


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it runs in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_peer(system: str, preset: str, *, tokens: int = 65536, seq_len: int = 1024, micro_batches: int = 4,
             steps: int = 3, layers: int | None = None, timeout_s: float = 300.0, ds_torch_adam: bool = False,
             device: str = "cuda", log_path: str | None = None, min_available_gib: float = 2.0,
             weight_decay: float = 0.1, echo: bool = True) -> dict:
    """Train one system in a subprocess and return its report; status ``ok``, ``oom`` (CUDA or host
    out of memory, killed by the kernel, or stopped here when MemAvailable fell under
    ``min_available_gib``), ``timeout`` (steps done so far kept) or ``error: <one line>``."""
    spec = PeerSpec(system, preset, tokens, seq_len, micro_batches, steps, layers, weight_decay=weight_decay,
                    ds_torch_adam=ds_torch_adam, device=device)
    spec.validate()
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "report.json")
        log_path = log_path or os.path.join(tmp, "child.log")
        cmd = [sys.executable, os.path.abspath(__file__), "--system", system, "--preset", preset,
               "--tokens", str(tokens), "--seq-len", str(seq_len), "--micro-batches", str(micro_batches),
               "--steps", str(steps), "--device", device, "--weight-decay", repr(weight_decay), "--json", json_path]
        cmd += ["--layers", str(layers)] if layers is not None else []
        cmd += ["--ds-torch-adam"] if ds_torch_adam else []
        available_before = _mem_available()
        start = time.monotonic()
        killed = None
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, bufsize=1)

            def pump() -> None:
                for line in proc.stdout:
                    log.write(line)
                    if echo and line.startswith("peers:"):
                        print(line, end="", flush=True)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            while proc.poll() is None:
                if _mem_available() < min_available_gib * 2**30:
                    killed = "oom"
                    _kill(proc)
                elif time.monotonic() - start > timeout_s:
                    killed = "timeout"
                    _kill(proc)
                time.sleep(0.2)
            reader.join(timeout=10)
        report = {}
        if os.path.exists(json_path):
            with open(json_path) as f:
                report = json.load(f)
        report = {**new_report(spec), **report, "wall_s": time.monotonic() - start, "returncode": proc.returncode}
        if killed == "oom":
            report["status"] = "oom"
            report["error"] = f"host memory nearly exhausted (MemAvailable < {min_available_gib:g} GiB); killed"
        elif killed == "timeout":
            report["status"] = "timeout"
            report["error"] = f"still running after {timeout_s:.0f} s; killed"
        elif proc.returncode == -signal.SIGKILL:
            report["status"] = "oom"
            report["error"] = "killed by signal 9 (the kernel's out-of-memory killer)"
        elif proc.returncode != 0 and report.get("status") in ("running", "ok"):
            with open(log_path) as f:
                tail = [line.strip() for line in f if line.strip()][-1:] or [""]
            report["status"] = f"error: exit status {proc.returncode}: {tail[0][:200]}"
        if report["status"] != "ok" and echo:
            print(f"peers: {system} {preset} ended with {report['status']} (log: {log_path})", flush=True)
        _wait_for_memory(available_before)
        return summarize(report)


def _wait_for_memory(available_before: int, limit_s: float = 60.0) -> None:
    """Let the kernel take back a dead child's (pinned) memory before the next run measures its own."""
    end = time.monotonic() + limit_s
    while _mem_available() < available_before - 2**30 and time.monotonic() < end:
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# Command line.

def _ours(path: str | None, tokens: int) -> float | None:
    """megatrain_ray's step_s from a bench-<preset>.json run at the same tokens per step, if there is one."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        bench = json.load(f)
    if bench.get("tokens_per_step") != tokens:
        print(f"peers: {path} was run at {bench.get('tokens_per_step')} tokens/step, not {tokens}: no ratio")
        return None
    return bench.get("systems", {}).get("megatrain_ray", {}).get("step_s")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def format_table(rows: list[dict], ours_step_s: float | None = None) -> str:
    head = f"{'system':<11}{'layers':>7}{'params':>8}{'status':>10}{'s/step':>9}{'tok/s':>9}{'TF 6NT':>8}" \
           f"{'GPU GiB':>9}{'host GiB':>10}" + (f"{'ours x':>8}" if ours_step_s else "")
    lines = [head]
    for r in rows:
        ok = "step_s" in r
        num = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        status = r["status"] if len(r["status"]) <= 9 else r["status"][:9]
        lines.append(f"{r['system']:<11}{r['layers']:>7}{_size(r['params']):>8}{status:>10}"
                     f"{num('step_s', '9.2f'):>9}{num('tokens_per_s', '9,.0f'):>9}{num('tflops_6nt', '8.1f'):>8}"
                     f"{num('gpu_peak_gib', '9.1f'):>9}{num('host_peak_added_gib', '10.1f'):>10}"
                     + (f"{r['step_s'] / ours_step_s:>8.2f}" if ours_step_s and ok else ""))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/peers.py", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="7b", help=f"one or more of {', '.join(sorted(PRESETS))}, comma-separated")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    ap.add_argument("--system", choices=SYSTEMS, help="run one system in this process (what the table mode spawns)")
    ap.add_argument("--json", help="with --system: write the report here")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per optimizer step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is left out of s/step")
    ap.add_argument("--layers", type=int, help="override the preset's num_hidden_layers")
    ap.add_argument("--sweep-layers", help="comma-separated layer counts: per system, the largest that trains")
    ap.add_argument("--timeout-s", type=float, default=270.0, help="per-system limit, then status timeout")
    ap.add_argument("--budget-s", type=float, help="stop starting systems once this much wall time has passed")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    ap.add_argument("--ds-torch-adam", action="store_true", help="DeepSpeed with torch.optim.AdamW, not DeepSpeedCPUAdam")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    ap.add_argument("--ours", help="bench-<preset>.json of megatrain_ray for the ratio column "
                                   "(default: OUT/bench-<preset>.json when present)")
    ap.add_argument("--out", default=".", help="directory for peers-<preset>.json and the child logs")
    return ap


def _run_all(args, plan: list[tuple[str, str, int | None]]) -> list[dict]:
    """Run (system, preset, layers) in order within the budget; a system that failed at some layer count
    is not tried at larger ones."""
    start, rows, stopped = time.monotonic(), [], set()
    for system, preset, layers in plan:
        left = (args.budget_s - (time.monotonic() - start)) if args.budget_s else args.timeout_s
        spec = PeerSpec(system, preset, args.tokens, args.seq_len, args.micro_batches, args.steps, layers)
        if (system, preset) in stopped or left < 30:
            why = "skipped" if left >= 30 else "skipped (budget)"
            rows.append(summarize({**new_report(spec), "status": why}))
            continue
        tag = f"{system}-{preset}" + (f"-L{layers}" if layers else "")
        print(f"peers: {tag}: starting (limit {min(args.timeout_s, left):.0f} s)", flush=True)
        r = run_peer(system, preset, tokens=args.tokens, seq_len=args.seq_len, micro_batches=args.micro_batches,
                     steps=args.steps, layers=layers, timeout_s=min(args.timeout_s, left),
                     ds_torch_adam=args.ds_torch_adam, device=args.device, weight_decay=args.weight_decay,
                     log_path=os.path.join(args.out, f"peers-{tag}.log"))
        rows.append(r)
        if layers is not None and r["status"] != "ok":
            stopped.add((system, preset))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.system:
            if not args.json:
                raise PeerSetupError("--system needs --json PATH for its report.")
            spec = PeerSpec(args.system, args.preset, args.tokens, args.seq_len, args.micro_batches, args.steps,
                            args.layers, weight_decay=args.weight_decay, ds_torch_adam=args.ds_torch_adam,
                            device=args.device)
            return child_main(spec, args.json)
        systems = [s for s in args.systems.split(",") if s]
        presets = [p for p in args.preset.split(",") if p]
        layer_counts = [int(x) for x in args.sweep_layers.split(",")] if args.sweep_layers else [args.layers]
        for system in systems:
            for preset in presets:
                PeerSpec(system, preset, args.tokens, args.seq_len, args.micro_batches, args.steps,
                         layer_counts[0]).validate()
            check_environment(system, args.device, args.ds_torch_adam)
    except PeerSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SETUP_ERROR
    os.makedirs(args.out, exist_ok=True)
    for preset in presets:
        plan = [(s, preset, n) for s in systems for n in sorted(layer_counts, key=lambda n: n or 0)]
        rows = _run_all(args, plan)
        ours = _ours(args.ours or os.path.join(args.out, f"bench-{preset}.json"), args.tokens)
        subset = "" if sorted(systems) == sorted(SYSTEMS) else "-" + "-".join(systems)  # runs split by system
        name = f"peers-{'sweep-' if args.sweep_layers else ''}{preset}{subset}.json"
        report = {"preset": preset, "tokens_per_step": args.tokens, "seq_len": args.seq_len,
                  "micro_batches": args.micro_batches, "steps": args.steps, "ours_step_s": ours, "runs": rows}
        if args.sweep_layers:
            report["largest_trained"] = {s: max((r["layers"] for r in rows if r["system"] == s and r["status"] == "ok"),
                                                default=None) for s in systems}
        write_json(os.path.join(args.out, name), report)
        print(f"\n{preset}: {args.tokens} tokens/step, {args.steps} steps (first left out), "
              f"{rows[0]['device'] if rows else ''}" + ("; 'ours x' = peer s/step over megatrain_ray's" if ours else ""))
        print(format_table(rows, ours))
        if args.sweep_layers:
            for s, n in report["largest_trained"].items():
                print(f"largest that trained with {s}: " + (f"{n} layers ({_size(num_params(PeerSpec(s, preset, layers=n)))} params)"
                                                              if n else "none of those tried"))
        for r in rows:
            if r.get("error"):
                print(f"  {r['system']} L{r['layers']}: {r['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
