"""Hugging Face checkpoints in and out, checked against transformers itself.

- Import, per supported architecture: a tiny random model saved with save_pretrained (several
  shards) is loaded into a real shared-memory store, and our forward (model.py, fed from the store)
  gives transformers' logits (fp32, 1e-5).
- Llama 3.1 RoPE scaling (rope_type llama3): logits equal transformers' past the pretraining length
  (and differ without the scaling); config.json of either transformers 4 or 5 form imports, exports
  and reloads; other rope types and bad rope_scaling keys are one ConfigError naming them.
- Missing tensors, foreign tensors and unsupported architectures: one ConfigError naming them.
- Round trips: import -> export without training gives bit-identical tensors; import -> train k
  steps through the real Ray pipeline -> ``megatrain-ray export`` -> transformers loads it (and its
  tokenizer) and its logits equal ours.
- Tokenizer and token ids: a byte-level run's final/ and export carry the byte-level tokenizer as a
  Hugging Face one that gives the training ids, config.json names its EOS, and transformers'
  ``generate`` stops there; an init_from model keeps its own ids. Written files are 0o666 - umask.
"""

import dataclasses
import json
import os
import subprocess
import sys

from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from artifacts import (ARCHS, dtype_kwarg, import_store, imported_logits_match, read_tensors, save_model,  # noqa: E402
                       save_tokenizer, token_ids)

from megatrain_ray.config import PrecisionSection, load_config  # noqa: E402
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io import hf_io  # noqa: E402
from megatrain_ray.io.evaluate import checkpoint_reader, forward_logits, store_reader  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.precision import resolve_precision  # noqa: E402


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_imported_logits_match_transformers(arch, tmp_path, shm_dir):
    imported_logits_match(arch, tmp_path / "hf", shm_dir)[1].close()


def test_bf16_checkpoint_is_upcast_into_fp32_master(tmp_path, shm_dir):
    model = save_model("qwen3", tmp_path / "hf")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    store = import_store(tmp_path / "bf16", shm_dir)
    try:
        ours = store.state_dict()
        for name, ref in model.state_dict().items():
            if name in ours:
                assert ours[name].dtype == torch.float32
                assert torch.equal(ours[name], ref.float()), name
    finally:
        store.close()


def test_missing_tensor_is_named(tmp_path, shm_dir):
    save_model("llama2", tmp_path / "hf", shard="10GB")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight"):
        import_store(tmp_path / "hf", shm_dir)
    assert os.listdir(shm_dir) == []  # the failed store removed its segments


def test_foreign_tensors_are_named(tmp_path, shm_dir):
    # Qwen3 weights under a config.json that says llama: the q/k norms have nowhere to go.
    save_model("qwen3", tmp_path / "hf", head_dim=16)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"q_norm\.weight.*not a supported variant"):
        import_store(tmp_path / "hf", shm_dir)


@pytest.mark.parametrize("edit,named", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"model_type": "phi3", "architectures": None}, "phi3"),
])
def test_unsupported_architecture_is_one_sentence(tmp_path, edit, named):
    save_model("llama2", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        hf_io.read_config(str(tmp_path / "hf"))
    assert named in str(err.value) and str(err.value).count(". ") == 0


# ---------------------------------------------------------------------------------------------
# RoPE scaling of Llama 3.1 / 3.2 / 3.3.

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
"""Llama 3.1's rope_scaling, with a pretraining length of 64 so that 128-token sequences go past it.

With rope_theta 5e5 and head_dim 16 the wavelengths fall in all three bands of the transform (kept,
interpolated, divided by factor)."""


def _llama31(directory):
    return save_model("llama3", directory, max_position_embeddings=512, rope_scaling=dict(LLAMA31_ROPE))


def _edit_config(directory, edit: Callable[[dict], None]) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _as_transformers5(raw: dict) -> None:
    """config.json in transformers 5's form (what its save_pretrained writes): rope_theta inside
    rope_parameters, no rope_scaling. transformers 4 writes the other form, so the tests make this one
    themselves."""
    if "rope_parameters" not in raw:
        raw["rope_parameters"] = {**(raw.pop("rope_scaling", None) or {"rope_type": "default"}),
                                  "rope_theta": raw.pop("rope_theta")}


def _as_transformers4(raw: dict) -> None:
    """config.json in transformers 4's form (as Llama 3.1's own): rope_theta beside rope_scaling."""
    rope = raw.pop("rope_parameters", None) or raw.pop("rope_scaling")
    raw["rope_theta"] = rope.pop("rope_theta", raw.get("rope_theta"))
    raw["rope_scaling"] = rope


def test_llama31_rope_scaling_logits_match_transformers(tmp_path, shm_dir):
    model = _llama31(tmp_path / "hf")
    store = import_store(tmp_path / "hf", shm_dir)
    try:
        cfg = store.spec.model
        assert cfg.rope_scaling == LLAMA31_ROPE and cfg.rope_theta == 500000.0
        ids = token_ids(seq=128)
        ours = forward_logits(cfg, store_reader(store.store), ids)
        with torch.no_grad():
            theirs = model(input_ids=ids).logits.float()
        assert theirs.std() > 0.1
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # The scaling matters here: plain RoPE on the same weights misses by ~100x the tolerance (the
        # tiny random model attends almost uniformly, so positions move its logits only a little).
        plain = forward_logits(dataclasses.replace(cfg, rope_scaling=None), store_reader(store.store), ids)
        assert (plain - theirs).abs().max() > 1e-3
    finally:
        store.close()


@pytest.mark.parametrize("form", ["transformers5", "transformers4", "run checkpoint"])
def test_llama31_rope_scaling_survives_export(tmp_path, form):
    model = _llama31(tmp_path / "hf")
    if form == "transformers5":
        _edit_config(tmp_path / "hf", _as_transformers5)
    elif form == "transformers4":
        _edit_config(tmp_path / "hf", _as_transformers4)
    elif form == "run checkpoint":  # what checkpoint.save writes: ModelConfig.to_hf_dict, no base
        cfg, _ = hf_io.read_config(str(tmp_path / "hf"))
        hf_io.write_json(str(tmp_path / "hf" / "config.json"), hf_io.hf_config(cfg, torch.float32))
    hf_io.export(str(tmp_path / "hf"), str(tmp_path / "out"))
    cfg, raw = hf_io.read_config(str(tmp_path / "out"))
    assert cfg.rope_scaling == LLAMA31_ROPE and cfg.rope_theta == 500000.0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    ids = token_ids(seq=128)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "linear"])
@pytest.mark.parametrize("form", ["transformers5", "transformers4"])
def test_unsupported_rope_type_is_one_sentence(tmp_path, rope_type, form):
    _llama31(tmp_path / "hf")
    _edit_config(tmp_path / "hf", _as_transformers5 if form == "transformers5" else _as_transformers4)
    key = "rope_parameters" if form == "transformers5" else "rope_scaling"
    _edit_config(tmp_path / "hf", lambda raw: raw[key].update(rope_type=rope_type))
    with pytest.raises(ConfigError) as err:
        hf_io.read_config(str(tmp_path / "hf"))
    if rope_type == "yarn":  # supported (gpt-oss), but not with llama3's keys: the first foreign one is named
        assert str(err.value).startswith("model.rope_scaling.high_freq_factor is not a supported key of a yarn "
                                         "rope_scaling; its keys are rope_type, factor, ")
        return
    assert str(err.value) == (f"model.rope_scaling has rope_type {rope_type!r}, which is not supported; "
                              "supported are 'llama3' (Llama 3.1 to 3.3), 'yarn' (gpt-oss) and null (plain RoPE).")


@pytest.mark.parametrize("rope,message", [
    ("{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 64}",
     None),
    ("{rope_type: llama3, factor: 0.5, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 64}",
     "model.rope_scaling.factor must be >= 1, got 0.5."),
    ("{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4}",
     "model.rope_scaling.original_max_position_embeddings must be a number, got None."),
    ("{rope_type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1, original_max_position_embeddings: 64}",
     "model.rope_scaling.high_freq_factor must exceed low_freq_factor (4), got 1."),
    ("{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 64, "
     "beta_fast: 32}",
     "model.rope_scaling.beta_fast is not a key of a llama3 rope_scaling; its keys are rope_type, factor, "
     "low_freq_factor, high_freq_factor, original_max_position_embeddings."),
    ("8", "model.rope_scaling must be a mapping (or null), got 8."),
])
def test_rope_scaling_through_set_names_the_bad_key(rope, message):
    overrides = [f"model.rope_scaling={rope}", "model.max_position_embeddings=512"]
    if message is None:
        assert load_config(None, overrides).model.rope_scaling["factor"] == 8
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


def test_import_then_export_without_training_is_bit_identical(tmp_path, shm_dir):
    model = save_model("qwen2", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    store = import_store(tmp_path / "hf", shm_dir)
    try:
        store.save_hf(str(tmp_path / "final"), shard_bytes=30_000)
    finally:
        store.close()
    summary = hf_io.export(str(tmp_path / "final"), str(tmp_path / "out"), shard_bytes=50_000)
    original, exported = read_tensors(tmp_path / "hf"), read_tensors(tmp_path / "out")
    assert set(exported) == set(original) - {"lm_head.weight"}  # tied: the head is the embedding
    for name, ref in exported.items():
        assert ref.dtype == original[name].dtype and torch.equal(ref, original[name]), name
    assert summary["shards"] > 1 and "tokenizer.json" in summary["copied"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=token_ids()).logits, model(input_ids=token_ids()).logits)


def test_export_casts_to_bf16_on_request(tmp_path):
    model = save_model("mistral", tmp_path / "hf")
    hf_io.export(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="bfloat16")
    exported = read_tensors(tmp_path / "out")
    for name, ref in model.state_dict().items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], ref.to(torch.bfloat16))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", **dtype_kwarg("auto"))
    assert loaded.dtype == torch.bfloat16


@pytest.mark.parametrize("make,named", [
    (lambda p: None, "is not a directory"),
    (lambda p: p.mkdir(), "neither a run directory"),
])
def test_export_of_a_non_checkpoint_names_it(tmp_path, make, named):
    src = tmp_path / "src"
    make(src)
    with pytest.raises(ConfigError, match=named):
        hf_io.export(str(src), str(tmp_path / "out"))


def test_export_refuses_a_non_empty_out(tmp_path):
    save_model("llama2", tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="--out .* not empty"):
        hf_io.export(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_train_export_load_in_transformers(tmp_path, ray_cluster, shm_dir):
    """import -> 3 steps through the real pipeline -> `megatrain-ray export` -> transformers."""
    hf_tok = save_tokenizer(tmp_path / "hf")
    init = save_model("qwen3", tmp_path / "hf", vocab_size=len(hf_tok), tie_word_embeddings=True)
    from megatrain_ray.orchestration.pipeline import train

    cfg = load_train_config(None, [
        f"train.init_from={tmp_path / 'hf'}", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
        "compute.device=cpu", "precision.compute_dtype=float32", "train.steps=3", "train.seq_len=16",
        "train.micro_batch_size=2", "train.num_micro_batches=1", "optim.lr=1e-2", "data.num_workers=1",
        f"data.path={_token_file(tmp_path, len(hf_tok))}",
    ])
    result = train(cfg, log=lambda line: None)
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "export", result.run_dir,
                           "--out", str(tmp_path / "export"), "--shard-size", "60000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer.json" in proc.stdout

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", **dtype_kwarg(torch.float32)).eval()
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    ids = token_ids(vocab=len(hf_tok), seq=16)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
        before = init(input_ids=ids).logits
    cfg_ours, read = checkpoint_reader(str(tmp_path / "export"))
    ours = forward_logits(cfg_ours, read, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (theirs - before).abs().max() > 1e-3  # training changed the model
    # Our logits from the run's own final weights agree too, and the tokenizer came along.
    cfg_final, read_final = checkpoint_reader(result.final_dir)
    torch.testing.assert_close(forward_logits(cfg_final, read_final, ids), theirs, rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    source = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the engineer streams the weights"
    assert type(tok) is type(source) and tok.encode(text) == source.encode(text) and len(tok.encode(text)) > 3
    # Qwen3Config saves eos_token_id null (transformers 4 leaves the key out): the export names the
    # tokenizer's EOS, so generate can stop.
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("eos_token_id") is None
    for directory in (result.final_dir, tmp_path / "export"):
        saved = json.loads(open(os.path.join(directory, "config.json")).read())
        assert saved["eos_token_id"] == source.eos_token_id == 1 and saved["bos_token_id"] is None


def _token_file(tmp_path, vocab: int) -> str:
    import numpy as np

    tokens = (np.arange(3000) * 7) % vocab
    np.save(tmp_path / "tokens.npy", tokens)
    return str(tmp_path / "tokens.npy")


def test_import_peak_memory_is_the_store_plus_one_tensor(tmp_path, shm_dir):
    """Peak RSS of importing a one-file checkpoint, measured in a fresh process (see import_memory.py)."""
    from megatrain_ray.config import ModelConfig
    from megatrain_ray.model.transformer import unit_params

    cfg = ModelConfig(model_type="llama", vocab_size=8000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.02
               for name, (unit, rel) in hf_io.expected_names(cfg).items()
               for r, shape in unit_params(cfg, unit) if r == rel}
    os.makedirs(tmp_path / "hf")
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    hf_io.write_json(str(tmp_path / "hf" / "config.json"), hf_io.hf_config(cfg, torch.float32))
    weights = sum(t.numel() * 4 for t in tensors.values())
    largest = max(t.numel() * 4 for t in tensors.values())
    del tensors
    script = os.path.join(os.path.dirname(__file__), "import_memory.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path / "hf"), shm_dir], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["baseline"]
    assert m["weights_bytes"] == weights > 100 * 2**20  # a one-file checkpoint of > 100 MiB
    assert growth < 1.2 * m["store_bytes"], m
    # Above the store itself: one tensor in flight, not a second copy of the weights.
    assert growth - m["store_bytes"] < 2 * largest + 32 * 2**20 < weights, m


def _modes(directory) -> dict[str, int]:
    return {name: os.stat(os.path.join(directory, name)).st_mode & 0o777 for name in os.listdir(directory)}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_byte_level_tokenizer_exports_as_hf_with_the_training_ids(tmp_path):
    from megatrain_ray.data.tokenizer import (BYTE_TOKENIZER_VOCAB, EOS_ID, ByteTokenizer, HFTokenizer,
                                              messages_from_row, save_byte_tokenizer)

    written = save_byte_tokenizer(str(tmp_path / "tok"))
    assert "tokenizer.json" in written
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    ours = ByteTokenizer()
    assert len(hf) == BYTE_TOKENIZER_VOCAB and hf.eos_token_id == EOS_ID and hf.bos_token_id is None
    for text in ["The engineer streams the weights.", "Héllo wörld, 😀\n\n  tabs\tand spaces ", ""]:
        ids = hf(text)["input_ids"]
        assert ids == ours.encode_document(text)[:-1].tolist()  # no BOS; EOS is ours to append
        assert hf.decode(ids + [EOS_ID], skip_special_tokens=True) == text
    # Chat: its template renders the layout the byte-level SFT data was tokenized with, mask included.
    for row, layout in [({"instruction": "Add", "input": "1+1", "output": "zwei ü", "system": "Be brief"}, "alpaca"),
                        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                                            {"from": "human", "value": "again"}, {"from": "gpt", "value": "ok"}]},
                         "sharegpt")]:
        messages = messages_from_row(row, layout)
        (a, mask_a), (b, mask_b) = HFTokenizer(str(tmp_path / "tok")).encode_chat(messages), ours.encode_chat(messages)
        assert a.tolist() == b.tolist() and mask_a.tolist() == mask_b.tolist()


def test_a_byte_level_run_exports_its_tokenizer_and_eos_and_generate_stops_there(tmp_path, shm_dir):
    """A default run's final/ (as the driver writes it) and `export` of the run: config.json names
    EOS 256, the tokenizer comes along, transformers' generate ends sequences at EOS, and every file
    is readable by others as a plain open() would make it."""
    from megatrain_ray.data.tokenizer import BYTE_LEVEL, EOS_ID

    cfg = load_config(None, [f"memory.shm_dir={shm_dir}"])
    run = tmp_path / "runs" / "r1"
    os.makedirs(run)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    precision = resolve_precision(PrecisionSection(), "cpu")
    store = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "t" + os.urandom(3).hex()), seed=0)
    try:
        store.save_hf(str(run / "final"), tokenizer=BYTE_LEVEL)
    finally:
        store.close()
    summary = hf_io.export(str(run), str(tmp_path / "out"), shard_bytes=200_000)
    assert summary["shards"] > 1 and "tokenizer.json" in summary["copied"]
    want = 0o666 & ~_umask()
    for directory in (run / "final", tmp_path / "out"):
        modes = _modes(directory)
        assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(modes)
        assert set(modes.values()) == {want}, modes
        saved = json.loads((directory / "config.json").read_text())
        assert saved["eos_token_id"] == EOS_ID and saved["bos_token_id"] is None

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert model.generation_config.eos_token_id == EOS_ID == tok.eos_token_id
    prompt = tok("The engineer", return_tensors="pt")
    torch.manual_seed(0)  # a random model samples near-uniformly over 260 ids: EOS comes up ~ every 260
    out = model.generate(**prompt, do_sample=True, max_new_tokens=60, num_return_sequences=64,
                         pad_token_id=tok.pad_token_id)
    new = out[:, prompt["input_ids"].shape[1]:]
    ended = [row for row in new.tolist() if EOS_ID in row]
    assert len(ended) >= 8  # many sequences reached EOS ...
    for row in ended:  # ... and stopped there: only padding (EOS) after it
        assert set(row[row.index(EOS_ID):]) == {EOS_ID}
    assert any(row[-1] != EOS_ID for row in new.tolist())  # the others ran to max_new_tokens


def test_an_init_from_run_keeps_the_source_token_ids(tmp_path, shm_dir):
    """Llama 2's config.json names bos 1 / eos 2: kept in final/ and in an export, whatever the tokenizer."""
    hf_tok = save_tokenizer(tmp_path / "tok")
    save_model("llama2", tmp_path / "hf", vocab_size=len(hf_tok))
    store = import_store(tmp_path / "hf", shm_dir)
    try:
        store.save_hf(str(tmp_path / "final"), tokenizer=str(tmp_path / "tok"))
    finally:
        store.close()
    hf_io.export(str(tmp_path / "final"), str(tmp_path / "out"))
    for directory in (tmp_path / "final", tmp_path / "out"):
        saved = json.loads((directory / "config.json").read_text())
        assert (saved["bos_token_id"], saved["eos_token_id"]) == (1, 2) != (None, hf_tok.eos_token_id)
        assert (directory / "tokenizer.json").is_file()


def test_a_chat_fine_tune_stops_generating_at_the_templates_end_of_turn(tmp_path, shm_dir):
    """The final weights of a run whose tokenizer has a ChatML template (Qwen's layout): the base's
    generation_config.json names only <|endoftext|>, the model ends each reply with <|im_end|>; the
    written generation_config.json (as transformers reads it) names both, so generate stops at the
    end of the turn. Without a base file, one is written with both; byte-level runs need none."""
    tok_dir, base = tmp_path / "tok", tmp_path / "base"
    hf_tok = save_tokenizer(tok_dir)
    endoftext, im_end = hf_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert endoftext != im_end
    base.mkdir()
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext, "do_sample": True}))
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", f"model.vocab_size={len(hf_tok)}"])
    precision = resolve_precision(PrecisionSection(), "cpu")
    store = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "g" + os.urandom(3).hex()), seed=0)
    try:
        hf_io.save_store(store.store, str(tmp_path / "final"), source=str(base), tokenizer=str(tok_dir))
        hf_io.save_store(store.store, str(tmp_path / "no-base"), tokenizer=str(tok_dir))
        hf_io.save_store(store.store, str(tmp_path / "bytes"), tokenizer=None)
    finally:
        store.close()
    for directory in ("final", "no-base"):
        generation = transformers.GenerationConfig.from_pretrained(tmp_path / directory)
        assert generation.eos_token_id == [endoftext, im_end], directory
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "final").do_sample is True  # the rest kept
    assert not (tmp_path / "bytes" / "generation_config.json").exists()
