"""LoRA training through the real pipeline against HF transformers + peft + torch.optim.AdamW, on the CPU.

Tiny random Llama (untied), Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (q/k norms) models are
saved with save_pretrained; our pipeline (real Ray actors, real shared memory, fp32) trains rank-r
adapters on them for several steps with gradient accumulation, clipping (active), weight decay and
warmup + cosine, and so does the reference: a peft model whose adapters start from ours (PEFT's
initialisation, drawn by our seeds), ``torch.optim.AdamW`` over the adapters, ``clip_grad_norm_``
over them. As in tests/test_parity.py the reference also runs in float64 (the truth) and once more
in fp32 with eager attention and the micro-batches reversed; our losses and final adapters must be
about as close to the truth as the farther fp32 run (tests/float64_truth.py says how close).

Checkpoints hold the adapters and their AdamW moments (the frozen base is reloaded from where the
run took it); resuming one, or the checkpoint a Ctrl-C leaves, ends bit for bit as the run straight
through.

The base is bit-unchanged: the merged final/ is exactly the initial base with our exported adapters
merged in (every tensor an adapter does not touch bit-identical to the initial one). The adapter
directory loads with ``peft.PeftModel.from_pretrained`` and gives the merged model's logits.
"""

import dataclasses
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from artifacts import make_model, read_tensors  # noqa: E402
from float64_truth import assert_as_close_to_truth, float64_only, to_float64  # noqa: E402
from test_parity import train_steps  # noqa: E402

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.lora import AdapterLayout, dropout_keep, merged_weight, peft_name  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

STEPS = 5


class _Dropout(torch.nn.Module):
    """peft's dropout of one adapter's input, with our masks (model.lora.dropout_keep, drawn here for
    every step and micro-batch: the float64 reference draws nothing in float32): the step and
    micro-batch are the reference loop's, counted from the model's calls (``calls``: [calls so far],
    shared; the micro-batches of a step in reverse order with ``reverse``)."""

    def __init__(self, unit: str, module: str, in_features: int, cfg, calls: list[int], reverse: bool):
        super().__init__()
        self.cfg, self.calls, self.reverse = cfg, calls, reverse
        t = cfg.train
        self.keep = {(step, m): dropout_keep(unit, module, t.seed, step, m, (t.micro_batch_size, t.seq_len, in_features),
                                             cfg.lora.dropout, "cpu")
                     for step in range(t.steps) for m in range(t.num_micro_batches)}

    def forward(self, x):
        step, m = divmod(self.calls[0], self.cfg.train.num_micro_batches)
        m = self.cfg.train.num_micro_batches - 1 - m if self.reverse else m
        return x * (self.keep[step, m].to(x.dtype) / (1 - self.cfg.lora.dropout))


def _peft(base, cfg, double: bool = False, reverse: bool = False):
    """A peft model on ``base`` whose adapters are ours at initialisation (train.seed's draw), and
    with lora.dropout, whose dropout draws our masks (:class:`_Dropout`)."""
    lora = cfg.lora
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, use_rslora=lora.use_rslora, target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout, modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=lora.train_embedding and cfg.model.tie_word_embeddings))
    layout = AdapterLayout.build(cfg.model, lora)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for unit in layout.units:
            for name, t in layout.template(unit).bind(layout.init(unit, cfg.train.seed)).items():
                params[peft_name(unit, name).replace(".weight", ".default.weight")].copy_(t)
    if lora.dropout:
        calls = [0]
        model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for name, module in model.named_modules():
            if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
                unit, projection = name.split(".model.layers.")[1].split(".", 1)
                module.lora_dropout["default"] = _Dropout(f"layers.{unit}", projection, module.in_features, cfg, calls,
                                                          reverse)
    return model.double() if double else model


def _reference(model, cfg, source: BatchSource, reverse: bool = False):
    """Adapter training as peft users write it; returns per-step losses and the final adapters (and the
    tensors trained in full) by the keys of PEFT's saved adapter file."""
    trained = {n.replace(".modules_to_save.default.", ".").replace(".default.weight", ".weight"): p
               for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.endswith(("embed_tokens.weight", "lm_head.weight")) for n in trained)
    assert len(trained) == 2 * len(cfg.lora.target_modules) * cfg.model.num_hidden_layers + len(cfg.lora.modules_to_save)
    o = cfg.optim
    opt = torch.optim.AdamW(list(trained.values()), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    losses = train_steps(model, list(trained.values()), opt, cfg, source, reverse)
    return losses, {n: p.detach().clone() for n, p in trained.items()}


@pytest.mark.parametrize("arch,rank,targets,runtime", [
    ("llama2", 4, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", []),
    ("qwen2", 3, "q_proj,v_proj,down_proj", []),
    ("qwen3", 4, "k_proj,o_proj,up_proj", []),
    # the other two ways a layer's backward runs: its forward graph kept whole, and the MLP in chunks
    ("llama2", 4, "q_proj,v_proj,gate_proj,down_proj", ["memory.activations=counts", "memory.kept_layers=1", "memory.mlp_chunk_size=8"]),
    # dropout on the adapters' inputs, through the three again: the masks follow the chunks of the MLP
    ("qwen3", 4, "q_proj,k_proj,o_proj,up_proj,down_proj",
     ["lora.dropout=0.1", "memory.activations=counts", "memory.kept_layers=1", "memory.mlp_chunk_size=8"]),
    # the embedding and the LM head trained in full beside the adapters (PEFT's modules_to_save); tied too
    ("llama2", 4, "q_proj,v_proj,down_proj", ["lora.train_embedding=true", "lora.train_head=true"]),
    ("qwen2", 3, "k_proj,o_proj,gate_proj", ["lora.train_embedding=true"]),
    # two compute workers (data parallel, gloo), each with its share of the micro-batches and its copy
    # of the adapters, their gradients summed; dropout's masks drawn by each micro-batch's index in the step
    ("llama2", 4, "q_proj,v_proj,up_proj,down_proj",
     ["parallel.compute_workers=2", "train.num_micro_batches=4", "lora.dropout=0.1", "lora.train_head=true"]),
], ids=["llama2", "qwen2", "qwen3", "llama2-kept-tiled", "qwen3-dropout-kept-tiled", "llama2-full-embedding-head",
        "qwen2-tied-full-embedding", "llama2-two-workers"])
def test_lora_training_matches_peft_and_adamw(arch, rank, targets, runtime, ray_cluster, shm_dir, tmp_path):
    make_model(arch).save_pretrained(tmp_path / "init", safe_serialization=True)
    rng = np.random.default_rng(1)  # a learnable stream: a fixed cycle with 10% noise
    tokens = np.where(rng.random(4000) < 0.1, rng.integers(0, 96, size=4000), (np.arange(4000) * 7) % 96)
    np.save(tmp_path / "tokens.npy", tokens)
    cfg = load_train_config(None, [
        f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
        f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
        "compute.device=cpu", "precision.compute_dtype=float32", "memory.loss_chunk_size=24",
        f"train.steps={STEPS}", "train.seq_len=16", "train.micro_batch_size=2", "train.num_micro_batches=3",
        "train.checkpoint_every=0", "train.seed=7",
        "optim.lr=2e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2", "optim.weight_decay=0.1",
        "optim.max_grad_norm=0.05", "optim.beta2=0.99",
        f"lora.rank={rank}", "lora.alpha=8", f"lora.target_modules={targets}", *runtime,
    ])
    result = train(cfg, log=lambda line: None)

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    ref_losses, ref = _reference(_peft(make_model(arch), cfg), cfg, source)
    alt_losses, alt = _reference(_peft(make_model(arch, attn_implementation="eager"), cfg, reverse=True), cfg, source,
                                 reverse=True)
    exact = _peft(to_float64(make_model(arch)), cfg, double=True)
    with float64_only():
        true_losses, truth = _reference(exact, cfg, source)

    assert max(result.grad_norms) > cfg.optim.max_grad_norm  # clipping was active
    assert ref_losses[-1] < ref_losses[0]
    if cfg.lora.dropout:  # the masks matter: without them the losses are far from these
        plain = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, dropout=0.0))
        assert max(abs(a - b) for a, b in zip(_reference(_peft(make_model(arch), plain), plain, source)[0],
                                              ref_losses)) > 1e-4
    steps = [f"loss of step {i}" for i in range(STEPS)]
    assert_as_close_to_truth(dict(zip(steps, result.losses)), [dict(zip(steps, ref_losses)),
                             dict(zip(steps, alt_losses))], dict(zip(steps, true_losses)))
    ours = load_file(str(tmp_path / "runs" / result.run_id / "adapter" / "adapter_model.safetensors"))
    tied_copy = "base_model.model.lm_head.weight"  # a tied embedding trained in full is saved under both keys
    if cfg.lora.train_embedding and cfg.model.tie_word_embeddings:
        assert torch.equal(ours.pop(tied_copy), ours["base_model.model.model.embed_tokens.weight"])
    assert set(ours) == set(ref)
    assert_as_close_to_truth(ours, [ref, alt], truth)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 1e-3 for k, v in ours.items())  # they trained

    # The base is bit-unchanged: final/ is the initial base with exactly these adapters merged in.
    init, final = read_tensors(tmp_path / "init"), read_tensors(tmp_path / "runs" / result.run_id / "final")
    assert set(final) == set(init) - ({"lm_head.weight"} if cfg.model.tie_word_embeddings else set())
    scaling = cfg.lora.scaling
    for key, value in final.items():
        module = key.removesuffix(".weight")
        a, b = (ours.get(f"base_model.model.{module}.lora_{x}.weight") for x in "AB")
        expected = ours.get(f"base_model.model.{key}", init[key]) if a is None else merged_weight(init[key], a, b,
                                                                                                  scaling)
        assert torch.equal(value, expected), key  # the tensors trained in full as trained

    # The adapter directory is peft's: loaded on the base it gives the merged model's logits.
    loaded = peft.PeftModel.from_pretrained(make_model(arch), str(tmp_path / "runs" / result.run_id / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "runs" / result.run_id / "final")).eval()
    ids = torch.tensor(source.batch(0)["input_ids"][0])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits.float(),
                                   rtol=1e-5, atol=1e-5)
    # Nothing crossed back: every layer fetched twice a step, the embedding once (twice tied), the head once;
    # what trains in full stays on the device.
    expected = {"layers": 2 * cfg.model.num_hidden_layers, "head": 1, "embed": 2 if cfg.model.tie_word_embeddings else 1}
    expected = {k: v for k, v in expected.items()
                if not (k == "embed" and cfg.lora.train_embedding or k == "head" and cfg.lora.train_head)}
    for fetches in result.fetches:
        assert fetches == expected


def test_lora_checkpoints_hold_the_adapters_and_resume_bit_for_bit(ray_cluster, shm_dir, tmp_path):
    """Checkpoints of a LoRA run hold the adapters and their moments (no base tensor); a run resumed
    from one, and one interrupted by Ctrl-C (the interrupt's checkpoint written by the compute worker)
    and resumed, end bit for bit as the run straight through: per-step losses and grad norms, every
    checkpoint tensor, the final adapters and the merged model. With dropout on the adapters' inputs:
    its masks are a function of the seed, the step and the micro-batch, which the checkpoint's step
    and the run's config carry, so no random state is saved and a resumed step draws the same masks."""
    from conftest import interrupt_after_checkpoint

    from megatrain_ray.io import checkpoint
    from megatrain_ray.orchestration.pipeline import Interrupted

    make_model("qwen3").save_pretrained(tmp_path / "init", safe_serialization=True)
    np.save(tmp_path / "tokens.npy", (np.arange(3000) * 5) % 96)
    steps = 5

    def config(run: str):
        return load_train_config(None, [
            f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
            f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / run}", "compute.device=cpu",
            "precision.compute_dtype=float32", f"train.steps={steps}", "train.seq_len=16", "train.micro_batch_size=2",
            "train.num_micro_batches=2", "train.checkpoint_every=2", "train.keep_checkpoints=5",
            "optim.lr=1e-2", "optim.warmup_steps=1", "optim.weight_decay=0.1", "optim.max_grad_norm=0.05",
            "lora.rank=4", "lora.target_modules=q_proj,v_proj,gate_proj,down_proj", "lora.dropout=0.1"])

    straight = train(config("a"), log=lambda line: None)
    ckpts = sorted(checkpoint.step_dirs(os.path.join(straight.run_dir, "checkpoints")))
    assert [s for s, _ in ckpts] == [2, 4, 5]
    step2 = ckpts[0][1]
    held = read_tensors(step2)
    adapters = load_file(os.path.join(straight.run_dir, "adapter", "adapter_model.safetensors"))
    assert set(held) == set(adapters) | {f"{k}.{n}" for n in adapters for k in ("exp_avg", "exp_avg_sq")}
    assert checkpoint.read_meta(step2)["lora"]["rank"] == 4
    checkpoint.check_files(step2)

    resumed = train(config("b"), log=lambda line: None, resume=step2)
    lines = []
    with pytest.raises(Interrupted):
        train(config("c"), log=interrupt_after_checkpoint(2, lines))
    (interrupted,) = [ln.split(" saved to ")[1].split(" in ")[0] for ln in lines
                      if ln.startswith("checkpoint: step 3 saved")]
    again = train(config("c"), log=lambda line: None, resume=interrupted)

    for run, first in ((resumed, 2), (again, 3)):
        assert run.losses == straight.losses[first:] and run.grad_norms == straight.grad_norms[first:]
        last, expected = read_tensors(os.path.join(run.run_dir, "checkpoints", f"step-{steps:06d}")), \
            read_tensors(ckpts[-1][1])
        assert last.keys() == expected.keys() and all(torch.equal(last[k], expected[k]) for k in last)
        ours = load_file(os.path.join(run.run_dir, "adapter", "adapter_model.safetensors"))
        assert ours.keys() == adapters.keys() and all(torch.equal(ours[k], adapters[k]) for k in ours)
        final, straight_final = read_tensors(run.final_dir), read_tensors(straight.final_dir)
        assert all(torch.equal(final[k], straight_final[k]) for k in straight_final)


def test_frozen_units_compute_no_weight_gradient(shm_dir, tmp_path):
    """A LoRA step runs no weight-gradient GEMM of the frozen base (every unit's policy is frozen):
    every 2-D matrix product of the compute worker's step (forward, recompute, backward, head; the
    single-process driver runs it on this thread) is recorded by its output's shape, and none has
    the shape of a base weight ([out, in] of a projection, fused or not, the LM head), while the
    adapters' gradients ([r, in], [out, r]) are there. The same step training every parameter
    produces every base weight's shape, so the recording sees the weight gradients where they exist.
    The shapes are chosen so that no token count (a micro-batch's 32 tokens, loss chunks of 20 and
    12) is a weight dimension."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatrain_ray.model.layout import LayerTemplate
    from megatrain_ray.model.transformer import unit_names
    from megatrain_ray.orchestration.local import train_local

    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in gemms:
                self.shapes.add(tuple(out.shape))
            return out

    np.save(tmp_path / "tokens.npy", (np.arange(2000) * 5) % 96)

    def products(lora: list[str]) -> tuple[set, object]:
        cfg = load_train_config(None, [
            "model.hidden_size=48", "model.intermediate_size=80", "model.num_hidden_layers=2",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=96",
            f"data.path={tmp_path / 'tokens.npy'}", f"memory.shm_dir={shm_dir}", "compute.device=cpu",
            "precision.compute_dtype=float32", "memory.loss_chunk_size=20", "train.steps=1", "train.seq_len=16",
            "train.micro_batch_size=2", "train.num_micro_batches=2", "train.checkpoint_every=0", *lora])
        with Products() as mode:
            train_local(cfg, 0)
        return mode.shapes, cfg

    lora, cfg = products(["lora.rank=4", "lora.target_modules=q_proj,v_proj,gate_proj,down_proj"])
    full, _ = products([])

    templates = [LayerTemplate.build(cfg.model, unit) for unit in unit_names(cfg.model)]
    base = {tuple(w.shape) for t in templates for w in t.bind(torch.zeros(t.numel), fused=True).values()
            if w.dim() == 2}  # every projection, and the fused q/k/v and gate/up views
    members = {(24, 48), (80, 48)}  # k/v and gate/up: their gradients come through their fused views
    assert {(96, 48), (48, 48), (160, 48), (48, 80)} | members <= base
    assert base - members <= full  # full fine-tuning computes every weight's gradient: the recording sees them
    assert not base & lora, sorted(base & lora)
    adapters = {(4, 48), (48, 4), (24, 4), (80, 4), (4, 80)}  # dA of q/v/gate, dB of q, v, gate; dA/dB of down
    assert adapters <= lora
