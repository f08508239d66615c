"""LoRA over a quantized base (lora.base_format) through the real pipeline against QLoRA as peft users run it.

The base is a tiny random Llama / Qwen3 saved with save_pretrained. Ours stores it quantized (NF4
with double quantization, or int8) and trains rank-r adapters on it on the CPU in fp32; the
reference is transformers' model loaded with bitsandbytes' 4-bit quantization (``BitsAndBytesConfig``:
nf4, double quantization, fp32 compute; bitsandbytes' ``Linear4bit`` runs on its CPU backend here)
with peft's adapters, trained by ``torch.optim.AdamW``. The store's dequantized weights are that
model's, bit for bit, so the training is the same math on the same base: the float64 truth is
transformers + peft on the model whose projections are replaced by those dequantized weights, the
second fp32 reference the same in fp32 with eager attention and the micro-batches reversed, and
ours must be as close to the truth as tests/float64_truth.py says.

int8 (LLM.int8()'s storage) is checked as a base of the same dequantized weights: bitsandbytes'
``Linear8bitLt`` also quantizes the activations in its matmul, which a frozen base dequantized into
the compute dtype does not, so the reference of a run over an int8 base is our own run over an
unquantized base holding bitsandbytes' dequantized weights (``int8_vectorwise_dequant``), which it
must equal bit for bit (losses and adapters): the quantized store changes nothing but the weights,
and LoRA over an unquantized base is peft's (tests/test_lora_training.py).

The merged export is the adapters merged into the dequantized base (as peft's ``merge_and_unload``
does on a bitsandbytes base), and the adapter directory loads on the bitsandbytes model with
``PeftModel.from_pretrained`` and gives the merged model's logits. (The bitsandbytes model runs in
training mode throughout: in eval mode on a CPU with AVX-512 bf16 its ``Linear4bit`` switches to a
bf16 inference kernel, another arithmetic than QLoRA training's.)
"""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402

from artifacts import make_model, read_tensors  # noqa: E402
from float64_truth import assert_as_close_to_truth, float64_only, to_float64  # noqa: E402
from test_lora_training import _peft, _reference  # noqa: E402

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config, read_config  # noqa: E402
from megatrain_ray.model.lora import merged_weight  # noqa: E402
from megatrain_ray.model.quant_layout import QuantLayout, quantized  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

STEPS = 4
SHAPE = dict(intermediate_size=128)
"""Rows of whole 64-blocks: bitsandbytes' AVX-512 CPU dequantization mis-indexes other shapes (tests/test_quant.py)."""


def _dequantized(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' dequantized ``w`` (quantized in its own dtype, as transformers quantizes a loaded weight)."""
    if fmt == "nf4":
        packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        return F.dequantize_4bit(packed, state)
    codes, stats, _ = F.int8_vectorwise_quant(w.clone())
    return F.int8_vectorwise_dequant(codes, stats).to(w.dtype)


def _replaced(arch: str, fmt: str, **kw):
    """The tiny model with every projection weight of its layers replaced by bitsandbytes' dequantized one."""
    model = make_model(arch, **SHAPE, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and quantized("layers.0", name.split(".", 3)[3], tuple(p.shape)):
                p.copy_(_dequantized(fmt, p.detach()))
    return model


def _bnb_4bit(directory):
    """transformers' model of ``directory`` loaded in bitsandbytes' 4-bit (nf4, double quantization, fp32 compute)."""
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), quantization_config=q, device_map="cpu",
                                                              dtype=torch.float32)
    return model.train()  # in eval mode its CPU backend repacks the weights for a bf16 inference kernel


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_the_store_holds_bitsandbytes_weights(fmt, shm_dir, tmp_path):
    """The quantized store's dequantized weights are bitsandbytes' (and the 4-bit model's), bit for bit;
    the rest is the checkpoint's as it is; its bytes are the format's."""
    make_model("qwen3", **SHAPE).save_pretrained(tmp_path / "init", safe_serialization=True)
    cfg, _ = read_config(str(tmp_path / "init"))
    run = load_train_config(None, [f"train.init_from={tmp_path / 'init'}", "lora.rank=2", f"lora.base_format={fmt}",
                                   "compute.device=cpu", "precision.compute_dtype=float32"])
    from megatrain_ray.model.precision import resolve_precision

    spec = StoreSpec.of_run(run, resolve_precision(run.precision, "cpu"), "cpu", os.getpid(), "q" + os.urandom(3).hex())
    spec = StoreSpec(spec.model, spec.precision, shm_dir, spec.owner_pid, spec.run_id, lora=spec.lora)
    store = ParameterStore(spec, seed=0, init_from=str(tmp_path / "init"))
    try:
        ours, init = store.state_dict(), read_tensors(tmp_path / "init")
        replaced = _replaced("qwen3", fmt).state_dict()
        bnb = _bnb_4bit(tmp_path / "init") if fmt == "nf4" else None
        modules = dict(bnb.named_modules()) if bnb is not None else {}
        n_quantized = 0
        for key, value in ours.items():
            assert torch.equal(value, replaced.get(key, init.get(key))), key
            if not torch.equal(value, init[key]):
                n_quantized += 1
                if bnb is not None:
                    w = modules[key.removesuffix(".weight")].weight
                    assert torch.equal(value, F.dequantize_4bit(w.data, w.quant_state)), key
        assert n_quantized == 7 * cfg.num_hidden_layers
        layer_params = sum(t.param_count for t in store.store.layout.templates[1:-1])
        layer_bytes = sum(u.nbytes for u in store.store.base.layout.units[1:-1])
        assert layer_bytes / layer_params < (0.7 if fmt == "nf4" else 1.3)  # norms stay fp32 in this tiny model
    finally:
        store.close()


@pytest.mark.parametrize("arch,fmt,targets", [
    ("llama2", "nf4", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    ("qwen3", "nf4", "q_proj,v_proj,down_proj"),
])
def test_qlora_training_matches_peft_bitsandbytes_and_adamw(arch, fmt, targets, ray_cluster, shm_dir, tmp_path):
    make_model(arch, **SHAPE).save_pretrained(tmp_path / "init", safe_serialization=True)
    rng = np.random.default_rng(1)  # a learnable stream: a fixed cycle with 10% noise
    tokens = np.where(rng.random(4000) < 0.1, rng.integers(0, 96, size=4000), (np.arange(4000) * 7) % 96)
    np.save(tmp_path / "tokens.npy", tokens)
    cfg = load_train_config(None, [
        f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
        f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
        "compute.device=cpu", "precision.compute_dtype=float32", "memory.loss_chunk_size=24",
        f"train.steps={STEPS}", "train.seq_len=16", "train.micro_batch_size=2", "train.num_micro_batches=2",
        "train.checkpoint_every=0", "train.seed=7",
        "optim.lr=2e-2", "optim.min_lr=1e-3", "optim.warmup_steps=1", "optim.weight_decay=0.1",
        "optim.max_grad_norm=0.05", "optim.beta2=0.99",
        "lora.rank=4", "lora.alpha=8", f"lora.target_modules={targets}", f"lora.base_format={fmt}",
    ])
    result = train(cfg, log=lambda line: None)

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    base = _bnb_4bit(tmp_path / "init") if fmt == "nf4" else _replaced(arch, fmt)
    ref_losses, ref = _reference(_peft(base, cfg), cfg, source)
    alt_losses, alt = _reference(_peft(_replaced(arch, fmt, attn_implementation="eager"), cfg, reverse=True), cfg,
                                 source, reverse=True)
    exact = _peft(to_float64(_replaced(arch, fmt)), cfg, double=True)
    with float64_only():
        true_losses, truth = _reference(exact, cfg, source)
    plain_losses, _ = _reference(_peft(make_model(arch, **SHAPE), cfg), cfg, source)

    assert ref_losses[-1] < ref_losses[0]
    assert abs(plain_losses[0] - true_losses[0]) > 1e-5  # the quantization matters (fp32 rounding: ~1e-6 here)
    steps = [f"loss of step {i}" for i in range(STEPS)]
    assert_as_close_to_truth(dict(zip(steps, result.losses)), [dict(zip(steps, ref_losses)),
                             dict(zip(steps, alt_losses))], dict(zip(steps, true_losses)))
    run = tmp_path / "runs" / result.run_id
    ours = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert set(ours) == set(ref)
    assert_as_close_to_truth(ours, [ref, alt], truth)

    # final/: the adapters merged into the dequantized base, every other tensor the checkpoint's.
    init, final, deq = read_tensors(tmp_path / "init"), read_tensors(run / "final"), _replaced(arch, fmt).state_dict()
    for key, value in final.items():
        module = key.removesuffix(".weight")
        a, b = (ours.get(f"base_model.model.{module}.lora_{x}.weight") for x in "AB")
        base_w = deq.get(key, init[key])
        assert torch.equal(value, base_w if a is None else merged_weight(base_w, a, b, cfg.lora.scaling)), key
    if fmt == "nf4":  # the adapter directory is peft's: on the bitsandbytes base it gives the merged model's logits
        loaded = peft.PeftModel.from_pretrained(_bnb_4bit(tmp_path / "init"), str(run / "adapter"))
        loaded.train()  # the fp32 dequantizing path (no dropout in these models)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(run / "final")).eval()
        ids = torch.tensor(source.batch(0)["input_ids"][0])
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits.float(),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,fmt", [("llama2", "int8"), ("qwen3", "nf4")])
def test_a_quantized_base_trains_as_an_unquantized_base_of_its_weights(arch, fmt, ray_cluster, shm_dir, tmp_path):
    make_model(arch, **SHAPE).save_pretrained(tmp_path / "init", safe_serialization=True)
    _replaced(arch, fmt).save_pretrained(tmp_path / "replaced", safe_serialization=True)
    rng = np.random.default_rng(2)
    np.save(tmp_path / "tokens.npy", rng.integers(0, 96, size=4000))
    results = {}
    for name, fmt_of_run in (("init", fmt), ("replaced", "compute")):
        cfg = load_train_config(None, [
            f"train.init_from={tmp_path / name}", f"data.path={tmp_path / 'tokens.npy'}",
            f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / ('runs-' + name)}",
            "compute.device=cpu", "precision.compute_dtype=float32", "train.steps=3", "train.seq_len=16",
            "train.micro_batch_size=2", "train.num_micro_batches=2", "train.checkpoint_every=0", "optim.lr=1e-2",
            "lora.rank=4", "lora.alpha=8", "lora.target_modules=q_proj,o_proj,up_proj,down_proj",
            f"lora.base_format={fmt_of_run}",
        ])
        r = train(cfg, log=lambda line: None)
        results[name] = (r.losses, load_file(os.path.join(r.run_dir, "adapter", "adapter_model.safetensors")), r)
    (ours, ours_a, run), (ref, ref_a, _) = results["init"], results["replaced"]
    assert ours == ref
    assert set(ours_a) == set(ref_a) and all(torch.equal(ours_a[k], ref_a[k]) for k in ref_a)
    # each layer crossed the link as its quantized bytes; the embedding and head as their fp32 ones
    nbytes = QuantLayout.build(run_cfg_model(tmp_path / "init"), fmt, torch.float32).units[1].nbytes
    assert {n for lane, label, _, _, n in run.timeline if lane == "h2d" and label == "layers.0"} == {nbytes}


def run_cfg_model(directory):
    return read_config(str(directory))[0]


def _store(directory, shm_dir, fmt: str = "nf4"):
    from megatrain_ray.model.precision import resolve_precision

    run = load_train_config(None, [f"train.init_from={directory}", "lora.rank=2", f"lora.base_format={fmt}",
                                   "compute.device=cpu", "precision.compute_dtype=float32"])
    spec = StoreSpec.of_run(run, resolve_precision(run.precision, "cpu"), "cpu", os.getpid(), "q" + os.urandom(3).hex())
    spec = StoreSpec(spec.model, spec.precision, shm_dir, spec.owner_pid, spec.run_id, lora=spec.lora)
    return run, ParameterStore(spec, seed=0, init_from=str(directory))


def test_a_bitsandbytes_checkpoint_is_read_as_it_is(shm_dir, tmp_path):
    """transformers' save_pretrained of its bitsandbytes 4-bit model is read into an nf4 base byte for byte as
    the unquantized checkpoint is quantized (both by bitsandbytes' CPU backend here); the merged export of a
    run from it is unquantized (no quantization_config); another lora.base_format is refused in one sentence."""
    from megatrain_ray.errors import ConfigError
    from megatrain_ray.io import bnb_checkpoint
    from megatrain_ray.orchestration.preflight import check_init_from

    make_model("llama2", **SHAPE).save_pretrained(tmp_path / "init", safe_serialization=True)
    _bnb_4bit(tmp_path / "init").save_pretrained(tmp_path / "q4", safe_serialization=True)
    assert bnb_checkpoint.quantization(str(tmp_path / "q4")) and not bnb_checkpoint.quantization(str(tmp_path / "init"))
    stores = []
    try:
        for d in ("init", "q4"):
            run, store = _store(tmp_path / d, shm_dir)
            stores.append(store)
            check_init_from(run)
        a, b = (s.store.arrays["master"] for s in stores)
        assert torch.equal(a, b)
    finally:
        for s in stores:
            s.close()
    # a run from it: the same losses as from the unquantized checkpoint (the same bytes), an unquantized final/
    np.save(tmp_path / "tokens.npy", np.random.default_rng(3).integers(0, 96, size=2000))
    losses = {}
    for d in ("init", "q4"):
        cfg = load_train_config(None, [
            f"train.init_from={tmp_path / d}", f"data.path={tmp_path / 'tokens.npy'}", f"memory.shm_dir={shm_dir}",
            f"train.run_dir={tmp_path / ('runs-' + d)}", "compute.device=cpu", "precision.compute_dtype=float32",
            "train.steps=2", "train.seq_len=16", "train.micro_batch_size=2", "train.num_micro_batches=1",
            "train.checkpoint_every=0", "lora.rank=2", "lora.base_format=nf4"])
        result = train(cfg, log=lambda line: None)
        losses[d] = result.losses
    assert losses["q4"] == losses["init"]
    final = json.load(open(os.path.join(result.final_dir, "config.json")))
    assert "quantization_config" not in final and final["architectures"] == ["LlamaForCausalLM"]
    for fmt, match in (("compute", "lora.base_format=nf4"), ("int8", "lora.base_format=nf4")):
        run = load_train_config(None, [f"train.init_from={tmp_path / 'q4'}", "lora.rank=2", f"lora.base_format={fmt}"])
        with pytest.raises(ConfigError, match=match):
            check_init_from(run)


def test_a_run_over_an_nf4_base_resumes_bit_for_bit(ray_cluster, shm_dir, tmp_path):
    """Its checkpoints hold the adapters alone (the nf4 base is quantized again from train.init_from, the same
    bytes); resumed from one it ends as the run straight through, and carries lora.base_format along."""
    from megatrain_ray.io import checkpoint

    make_model("qwen3", **SHAPE).save_pretrained(tmp_path / "init", safe_serialization=True)
    np.save(tmp_path / "tokens.npy", (np.arange(3000) * 5) % 96)

    def config(run: str):
        return load_train_config(None, [
            f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}", f"memory.shm_dir={shm_dir}",
            f"train.run_dir={tmp_path / run}", "compute.device=cpu", "precision.compute_dtype=float32",
            "train.steps=4", "train.seq_len=16", "train.micro_batch_size=2", "train.num_micro_batches=2",
            "train.checkpoint_every=2", "optim.lr=1e-2", "lora.rank=4", "lora.base_format=nf4"])

    straight = train(config("a"), log=lambda line: None)
    step2 = dict(checkpoint.step_dirs(os.path.join(straight.run_dir, "checkpoints")))[2]
    assert checkpoint.read_meta(step2)["lora"]["base_format"] == "nf4"
    resumed = train(config("b"), log=lambda line: None, resume=step2)
    assert resumed.losses == straight.losses[2:] and resumed.grad_norms == straight.grad_norms[2:]
    final, straight_final = read_tensors(resumed.final_dir), read_tensors(straight.final_dir)
    assert final.keys() == straight_final.keys() and all(torch.equal(final[k], straight_final[k]) for k in final)
