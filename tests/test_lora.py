"""LoRA adapters against the trusted reference: transformers + peft, on tiny random CPU fp32 models.

- The lora config section: PEFT's defaults, targets by HF name (a list or comma-separated), every
  bad value one ConfigError naming its key.
- Initialisation as PEFT's: A Kaiming-uniform (bound 1/sqrt(in), the bound PEFT's own adapters
  reach), B zero, so fresh adapters leave the logits unchanged (up to the order of a norm's sum);
  reproducible per seed, different for another.
- Forward: our model with adapters bound beside the base weights (fused q/k/v and gate/up views or
  not) gives peft's logits on Llama, Llama with biases, Qwen2 and Qwen3, with every projection or a
  subset targeted and rsLoRA scaling (fp32, the 1e-5 of the dense import test); the adapters'
  share of the logits is far above that.
- Export: the PEFT adapter directory loads with ``PeftModel.from_pretrained`` on the HF base (no key
  missing or unexpected, the embedding / LM head trained in full included, tied too) and gives our
  logits; the merged HF directory loads with ``AutoModelForCausalLM`` alone and gives them too.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from artifacts import make_model, save_tokenizer  # noqa: E402

from megatrain_ray.config import LORA_TARGETS, LoraSection, load_config  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io import hf_io, peft_io  # noqa: E402
from megatrain_ray.io.evaluate import forward_logits  # noqa: E402
from megatrain_ray.model.layout import LayerTemplate  # noqa: E402
from megatrain_ray.model.lora import AdapterLayout, peft_name  # noqa: E402
from megatrain_ray.model.transformer import hf_name, unit_names  # noqa: E402

ATOL = RTOL = 1e-5
"""fp32 logits of two implementations of the same forward (the dense import test's tolerance)."""


# ---------------------------------------------------------------------------------------------
# Config.

def test_lora_section_defaults_are_peft_and_off():
    cfg = load_config(None, [])
    assert not cfg.lora.enabled and cfg.lora.rank == 0
    assert cfg.lora.target_modules == LORA_TARGETS
    lc = peft.LoraConfig()
    assert (cfg.lora.alpha, cfg.lora.dropout, cfg.lora.use_rslora) == (lc.lora_alpha, lc.lora_dropout, lc.use_rslora)
    on = load_config(None, ["lora.rank=16", "lora.alpha=32", "lora.target_modules=q_proj, v_proj"]).lora
    assert (on.rank, on.scaling, on.target_modules) == (16, 2.0, ("q_proj", "v_proj"))
    assert load_config(None, ["lora.rank=16", "lora.use_rslora=true", "lora.alpha=8"]).lora.scaling == 2.0
    assert load_config(None, ["lora.rank=4", "lora.target_modules=[down_proj]"]).lora.target_modules == ("down_proj",)


@pytest.mark.parametrize("override,key", [
    ("lora.rank=-1", "lora.rank"),
    ("lora.alpha=0", "lora.alpha"),
    ("lora.dropout=1", "lora.dropout"),
    ("lora.dropout=-0.1", "lora.dropout"),
    ("lora.target_modules=q_proj,qkv", "lora.target_modules"),
    ("lora.target_modules=[]", "lora.target_modules"),
    ("lora.target_modules=q_proj,q_proj", "lora.target_modules"),
    ("lora.target_modules=3", "lora.target_modules"),
    ("lora.train_embedding=true", "lora.train_embedding"),
    ("lora.ranks=4", "lora.ranks"),
])
def test_bad_lora_values_name_the_key(override, key):
    extra = [] if override.startswith(("lora.train", "lora.rank=")) else ["lora.rank=4"]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override, *extra])


def test_train_head_of_a_tied_model_names_train_embedding():
    with pytest.raises(ConfigError, match=r"lora\.train_head .*lora\.train_embedding"):
        load_config(None, ["lora.rank=4", "lora.train_head=true", "model.tie_word_embeddings=true"])


# ---------------------------------------------------------------------------------------------
# Our forward with adapters, and peft's.

def _peft_model(arch: str, lora: LoraSection, seed: int = 0):
    """(base HF model, the same with peft adapters whose B is random, so the adapters matter)."""
    base = make_model(arch, seed)
    model = peft.get_peft_model(make_model(arch, seed), peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, use_rslora=lora.use_rslora, target_modules=list(lora.target_modules),
        modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=lora.train_embedding and base.config.tie_word_embeddings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return base, model.eval()


def _adapters_of(model, cfg, lora: LoraSection) -> dict[str, torch.Tensor]:
    """peft's adapters, read by peft's own parameter names, into our flat adapter buffers."""
    layout = AdapterLayout.build(cfg, lora)
    theirs = dict(model.named_parameters())
    out = {}
    for unit, template in zip(layout.units, layout.templates):
        out[unit] = torch.zeros(template.numel)
        for name, view in template.bind(out[unit]).items():
            view.copy_(theirs[peft_name(unit, name).replace(".weight", ".default.weight")].detach())
    return out


def _reader(directory, lora: LoraSection, adapters: dict[str, torch.Tensor], fused: bool,
            full: dict[str, torch.Tensor] | None = None):
    """Our unit reader: each unit's base weights from an HF directory in a flat buffer (bound with or
    without the fused projection views), its adapters bound beside them."""
    cfg, _ = hf_io.read_config(str(directory))
    mapping = hf_io.check_weights(cfg, str(directory), "the test model")
    layout = AdapterLayout.build(cfg, lora)

    def read(unit):
        template = LayerTemplate.build(cfg, unit)
        flat = torch.zeros(template.numel)
        for name, t in hf_io.read_unit(str(directory), mapping, cfg, unit).items():
            key = hf_name(unit, name)
            template.bind(flat)[name].copy_((full or {}).get(key, t))
        params = template.bind(flat, fused=fused)
        return {**params, **layout.bind(unit, adapters[unit])} if unit in layout.units else params
    return cfg, read


def _ids(batch=2, seq=20):
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(3))


CASES = [("llama2", LoraSection(rank=4, alpha=8.0)),
         ("llama-bias", LoraSection(rank=3, alpha=5.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))),
         ("qwen2", LoraSection(rank=4, alpha=16.0, use_rslora=True)),
         ("qwen3", LoraSection(rank=8, alpha=8.0, target_modules=("k_proj", "gate_proj", "up_proj")))]


@pytest.mark.parametrize("arch,lora", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_forward_with_adapters_matches_peft(arch, lora, fused, tmp_path):
    base, model = _peft_model(arch, lora)
    base.save_pretrained(tmp_path / "base")
    cfg, read = _reader(tmp_path / "base", lora, _adapters_of(model, hf_io.read_config(str(tmp_path / "base"))[0],
                                                              lora), fused)
    ids = _ids()
    ours = forward_logits(cfg, read, ids)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits.float()
        plain = base(input_ids=ids).logits.float()
    assert (theirs - plain).abs().max() > 1e3 * ATOL  # the adapters matter
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_init_is_peft_and_leaves_the_logits_unchanged(tmp_path):
    lora = LoraSection(rank=4)
    base, model = _peft_model("qwen3", lora)
    base.save_pretrained(tmp_path / "base")
    cfg = hf_io.read_config(str(tmp_path / "base"))[0]
    layout = AdapterLayout.build(cfg, lora)
    assert layout.units == tuple(unit_names(cfg)[1:-1])
    fresh = {u: layout.init(u, seed=0) for u in layout.units}
    assert all(torch.equal(fresh[u], layout.init(u, seed=0)) for u in layout.units)  # reproducible
    assert not torch.equal(fresh["layers.0"], layout.init("layers.0", seed=1))
    theirs = dict(peft.get_peft_model(make_model("qwen3"), peft.LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
                  .named_parameters())
    for unit in layout.units:
        for name, t in layout.bind(unit, fresh[unit]).items():
            if name.endswith("lora_scaling"):
                continue
            peft_t = theirs[peft_name(unit, name).replace(".weight", ".default.weight")]
            assert t.shape == peft_t.shape
            if ".lora_B." in name:
                assert not t.any() and not peft_t.any()
            else:  # Kaiming-uniform with a = sqrt(5): uniform in +-1/sqrt(in); both fill it
                bound = t.shape[1] ** -0.5
                assert t.abs().max() <= bound and peft_t.abs().max() <= bound
                assert t.abs().max() > 0.9 * bound and t.std() > 0.5 * bound / 3 ** 0.5
    cfg, read = _reader(tmp_path / "base", lora, fresh, fused=True)
    ids = _ids()
    with torch.no_grad():
        plain = base(input_ids=ids).logits.float()
    _, read_plain = _reader(tmp_path / "base", LoraSection(), {}, fused=True)
    # B = 0 adds exact zeros; only the layout of q/k/v (split views or sums) may reorder a norm's sum
    torch.testing.assert_close(forward_logits(cfg, read, ids), forward_logits(cfg, read_plain, ids),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(forward_logits(cfg, read, ids), plain, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Export: a PEFT adapter directory, and the merged model.

@pytest.mark.parametrize("arch,full", [("llama2", ()), ("llama2", ("embedding", "head")), ("qwen2", ("embedding",))])
def test_adapter_directory_loads_with_peft(arch, full, tmp_path):
    lora = LoraSection(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"),
                       train_embedding="embedding" in full, train_head="head" in full)
    base, model = _peft_model(arch, lora)
    base.save_pretrained(tmp_path / "base")
    cfg = hf_io.read_config(str(tmp_path / "base"))[0]
    adapters = _adapters_of(model, cfg, lora)
    g = torch.Generator().manual_seed(5)  # the parts trained in full, as training left them
    trained = {n: base.state_dict()[n] + 0.1 * torch.randn(base.state_dict()[n].shape, generator=g)
               for n in peft_io.full_names(cfg, lora)}
    assert len(trained) == len(full)
    summary = peft_io.save_adapters(str(tmp_path / "adapter"), cfg, lora, adapters, trained, str(tmp_path / "base"))
    # the base's generation_config.json beside them (transformers' save_pretrained wrote one)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "generation_config.json"]
    tied = lora.train_embedding and cfg.tie_word_embeddings  # saved under the head's key too, as peft does
    assert summary["tensors"] == 2 * 2 * len(lora.target_modules) + len(trained) + tied

    loaded = peft.PeftModel.from_pretrained(make_model(arch), str(tmp_path / "adapter")).eval()
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].lora_alpha == 8.0
    assert _adapters_of(loaded, cfg, lora).keys() == adapters.keys()
    for unit, flat in _adapters_of(loaded, cfg, lora).items():
        assert torch.equal(flat, adapters[unit])
    _, read = _reader(tmp_path / "base", lora, adapters, fused=True, full=trained)
    ids = _ids()
    ours = forward_logits(cfg, read, ids)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    if full:  # the parts trained in full took part (else these logits would be the adapters' alone)
        with torch.no_grad():
            assert (theirs - model(input_ids=ids).logits.float()).abs().max() > 1e3 * ATOL
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(tmp_path / "base")

    # Merged: a plain HF model, equal to the base with the adapters (and full parts) applied.
    mapping = hf_io.check_weights(cfg, str(tmp_path / "base"), "the test model")
    files = peft_io.save_merged(str(tmp_path / "merged"), cfg, lora, adapters,
                                lambda unit, name: hf_io.read_unit(str(tmp_path / "base"), mapping, cfg, unit)[name],
                                torch.float32, trained, source=str(tmp_path / "base"))
    assert files
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits.float(), theirs, rtol=RTOL, atol=ATOL)
        reference = loaded.merge_and_unload()
    for key, value in reference.state_dict().items():
        if key in merged.state_dict():
            torch.testing.assert_close(merged.state_dict()[key], value, rtol=1e-6, atol=1e-6)


def test_exported_lora_models_stop_generating_at_the_chat_end_of_turn(tmp_path):
    """A base whose generation_config.json names only <|endoftext|> (as Qwen's bases do) and a run
    whose tokenizer's chat template ends a turn with <|im_end|>: the merged model's
    generation_config.json and the adapter directory's name both, so greedy ``generate`` stops after
    the <|im_end|> this base always predicts (its layers add nothing to the embedding, every row of
    which is the LM head's <|im_end|> row), where the base's own configuration runs on to the limit."""
    hf_tok = save_tokenizer(tmp_path / "tok")
    endoftext, im_end = hf_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    base = make_model("llama2", vocab_size=len(hf_tok))
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.zero_()
            elif name.endswith("norm.weight") or "embed_tokens" in name:
                p.fill_(1.0)
        base.lm_head.weight[im_end] = 1.0
    base.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    cfg = hf_io.read_config(str(tmp_path / "base"))[0]
    lora = LoraSection(rank=4, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    layout = AdapterLayout.build(cfg, lora)
    adapters = {u: layout.init(u, seed=0) for u in layout.units}  # B = 0: the base's predictions
    mapping = hf_io.check_weights(cfg, str(tmp_path / "base"), "the test model")
    peft_io.save_merged(str(tmp_path / "merged"), cfg, lora, adapters,
                        lambda unit, name: hf_io.read_unit(str(tmp_path / "base"), mapping, cfg, unit)[name],
                        torch.float32, source=str(tmp_path / "base"), tokenizer=str(tmp_path / "tok"))
    peft_io.save_adapters(str(tmp_path / "adapter"), cfg, lora, adapters, base_model=str(tmp_path / "base"),
                          tokenizer=str(tmp_path / "tok"))

    text = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]])
    limit = 8
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "adapter")
    assert generation.eos_token_id == [endoftext, im_end]
    runs = {"merged": (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), None),
            "adapter": (peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(tmp_path / "adapter")),
                generation)}
    for what, (model, config) in runs.items():
        out = model.eval().generate(prompt, generation_config=config, max_new_tokens=limit, do_sample=False,
                                    pad_token_id=endoftext)
        assert out[0, prompt.shape[1]:].tolist() == [im_end], what
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    out = plain.generate(prompt, max_new_tokens=limit, do_sample=False, pad_token_id=endoftext)
    assert out[0, prompt.shape[1]:].tolist() == [im_end] * limit  # the base's own configuration does not stop


# ---------------------------------------------------------------------------------------------
# The plan of a LoRA run.

def test_plan_of_a_lora_run_counts_a_frozen_base_and_the_adapters_on_the_gpu(capsys):
    """At the Qwen2.5-32B shape: the store is the base in bf16 alone (2 B/param, no moments or
    gradients), the GPU holds the adapters with their AdamW state (16 B each + a bf16 copy) and no
    embedding/head gradient, checkpoints are the adapters', the LoRA mode's line says how large a
    base the host holds; the step's FLOPs are 4 per frozen parameter and token."""
    from megatrain_ray import cli
    from megatrain_ray.model import flops
    from megatrain_ray.model.presets import preset_shape

    shape = [f"model.{k}={v}" for k, v in preset_shape("32b").items()]
    sets = [*shape, "lora.rank=16", "lora.alpha=32", "train.seq_len=1024", "train.micro_batch_size=4",
            "train.num_micro_batches=16"]
    capsys.readouterr()
    cli.main(["plan", "--device", "cuda", "--gpu-memory", "141", *sum((["--set", s] for s in sets), [])])
    out = capsys.readouterr().out
    cfg = load_config(None, sets)
    n, adapters = flops.num_params(cfg.model), AdapterLayout.build(cfg.model, cfg.lora).num_params
    assert adapters == 64 * 16 * (2 * (5120 + 5120) + 2 * (5120 + 1024) + 3 * (5120 + 27648))
    assert "134.2M adapter parameters, the base frozen" in out.splitlines()[0] and "master bfloat16" in out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    store = [line for line in out.splitlines() if line.startswith("master weights (bfloat16)")]
    assert len(store) == 1 and not any(line.startswith(("AdamW", "exp_avg", "gradient")) for line in out.splitlines())
    assert f"{n * 2 / 2**30:.1f} GiB" in store[0]
    (gpu,) = [line for line in rows if line.startswith("LoRA adapters (rank 16, 134,217,728 parameters)")]
    assert f"{adapters * 18 / 2**30:.1f} GiB" in rows[gpu] and "embedding + head gradients" not in out
    assert f"checkpoints: {adapters * 12 / 2**30:.1f} GiB each" in out
    mode, int8, nf4 = [line for line in out.splitlines() if line.startswith("  LoRA")]  # each lora.base_format
    assert " 2.00 B/param" in mode and "layer(s) of this shape" in mode and "compute)" in mode
    assert "int8)" in int8 and "nf4)" in nf4 and "B/param in the layers" in nf4
    six, palm = flops.lora_flops(cfg.model, cfg.lora, 1024, 65536)
    assert six == (4 * n + 6 * adapters) * 65536 and palm < flops.palm_model_flops(cfg.model, 1024, 65536)
    assert f"6NT: {six / 1e15:.1f} PFLOP" in out


def test_plan_counts_the_embedding_and_head_trained_in_full_on_the_gpu(capsys):
    """lora.train_embedding / train_head: the plan's GPU rows hold each matrix trained in full with its
    fp32 master, moments and gradient and a bf16 copy (18 B per parameter), and the resolved run
    keeps both on the device (neither fetched), every other unit frozen; with lora.dropout, a
    micro-batch's masks."""
    from megatrain_ray import cli
    from megatrain_ray.orchestration import preflight

    sets = ["lora.rank=8", "lora.train_embedding=true", "lora.train_head=true", "train.seq_len=128", "lora.dropout=0.1"]
    capsys.readouterr()
    cli.main(["plan", "--device", "cuda", "--gpu-memory", "80", *sum((["--set", s] for s in sets), [])])
    out = capsys.readouterr().out
    cfg = load_config(None, sets).model
    (row,) = [line for line in out.splitlines() if line.startswith("embed and head trained in full")]
    assert row.endswith(preflight.fmt(2 * cfg.vocab_size * cfg.hidden_size * 18))
    assert "resident on the device: embed, head" in out
    # dropout: one micro-batch's masks in bf16, as large as each adapted projection's input
    tokens, inputs = 128 * load_config(None, sets).train.micro_batch_size, (
        5 * cfg.hidden_size + cfg.num_attention_heads * cfg.head_size + cfg.intermediate_size)
    (row,) = [line for line in out.splitlines() if line.startswith("adapter dropout masks of one micro-batch")]
    assert row.endswith(preflight.fmt(tokens * inputs * 2))
    assert "weights resident, gradient device, optimizer device" in out
