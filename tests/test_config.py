"""Configuration loading and validation: bad input fails early with a ConfigError naming the key.

No Ray here: everything goes through ``load_config(path, overrides)`` (``load_train_config`` where
train.init_from's config.json defines the model) and ``ModelConfig.from_hf_dict``. A loaded config is
frozen: the loader's own changes (init_from's model, the run directory of a resume) are new values.
"""

import dataclasses
import json

import pytest
import transformers

from megatrain_ray.config import ModelConfig, OptimConfig, TrainSection, load_config
from megatrain_ray.errors import ConfigError
from megatrain_ray.io.hf_io import load_train_config


def _error(path=None, overrides=(), load=load_config) -> str:
    """The message of the ConfigError that ``load`` (load_config) raises for this input."""
    with pytest.raises(ConfigError) as info:
        load(path, list(overrides))
    return str(info.value)


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------
# Unknown names and wrong types.

def test_unknown_section_is_named(tmp_path):
    msg = _error(_write(tmp_path, "c.yaml", "optimizer:\n  lr: 0.1\n"))
    assert "optimizer" in msg
    assert "not a known section" in msg


def test_unknown_key_is_named_with_its_section(tmp_path):
    msg = _error(_write(tmp_path, "c.yaml", "optim:\n  lrr: 0.1\n"))
    assert "optim.lrr" in msg
    assert "not a known key" in msg
    # The message lists the valid keys so the typo can be fixed.
    assert "lr" in msg.split("known keys of optim:")[1]


def test_unknown_key_through_set_is_named():
    msg = _error(overrides=["optim.lrr=0.1"])
    assert "optim.lrr" in msg


def test_string_for_int_is_rejected(tmp_path):
    msg = _error(_write(tmp_path, "c.yaml", "train:\n  steps: many\n"))
    assert "train.steps" in msg
    assert "integer" in msg
    assert "'many'" in msg


def test_string_for_int_through_set_is_rejected():
    msg = _error(overrides=["model.hidden_size=wide"])
    assert "model.hidden_size" in msg
    assert "integer" in msg


def test_number_for_bool_is_rejected(tmp_path):
    msg = _error(_write(tmp_path, "c.yaml", "model:\n  tie_word_embeddings: 1\n"))
    assert "model.tie_word_embeddings" in msg
    assert "true or false" in msg


def test_bool_for_int_is_rejected():
    msg = _error(overrides=["train.steps=true"])
    assert "train.steps" in msg


def test_non_numeric_string_for_float_is_rejected():
    msg = _error(overrides=["optim.lr=fast"])
    assert "optim.lr" in msg
    assert "number" in msg


def test_null_for_required_value_is_rejected():
    msg = _error(overrides=["optim.lr="])
    assert "optim.lr" in msg
    assert "empty" in msg


# ---------------------------------------------------------------------------------------------
# Value rules.

def test_heads_must_divide_hidden_size():
    msg = _error(overrides=["model.hidden_size=64", "model.num_attention_heads=5"])
    assert "model.num_attention_heads" in msg
    assert "model.hidden_size (64)" in msg
    assert "got 5" in msg


def test_kv_heads_must_divide_heads():
    msg = _error(overrides=["model.num_attention_heads=4", "model.num_key_value_heads=3"])
    assert "model.num_key_value_heads" in msg
    assert "got 3" in msg


@pytest.mark.parametrize("value", ["0", "-0.001"])
def test_lr_must_be_positive(value):
    msg = _error(overrides=[f"optim.lr={value}"])
    assert msg.startswith("optim.lr ")
    assert "positive" in msg


def test_negative_weight_decay_is_rejected():
    msg = _error(overrides=["optim.weight_decay=-0.1"])
    assert "optim.weight_decay" in msg
    assert "-0.1" in msg


def test_decay_of_norms_and_biases_is_off_unless_asked():
    assert load_config(None).optim.decay_norms_and_biases is False
    assert load_config(None, ["optim.decay_norms_and_biases=true"]).optim.decay_norms_and_biases is True
    msg = _error(overrides=["optim.decay_norms_and_biases=1"])
    assert msg == "optim.decay_norms_and_biases must be true or false, got 1."


def test_zero_steps_is_rejected():
    msg = _error(overrides=["train.steps=0"])
    assert "train.steps" in msg
    assert "positive" in msg


def test_seq_len_above_max_position_embeddings_is_rejected():
    msg = _error(overrides=["model.max_position_embeddings=128", "train.seq_len=129"])
    assert "train.seq_len" in msg
    assert "(129)" in msg and "(128)" in msg


def test_seq_len_equal_to_max_position_embeddings_is_fine():
    cfg = load_config(None, ["model.max_position_embeddings=128", "train.seq_len=128"])
    assert cfg.train.seq_len == 128


@pytest.mark.parametrize("depth", [1, 0])
def test_buffer_depth_below_two_is_rejected(depth):
    msg = _error(overrides=[f"memory.buffer_depth={depth}"])
    assert "memory.buffer_depth" in msg
    assert ">= 2" in msg


def test_missing_data_file_is_rejected(tmp_path):
    missing = tmp_path / "nope.txt"
    msg = _error(overrides=[f"data.path={missing}"])
    assert "data.path" in msg
    assert "nope.txt" in msg


def test_data_file_with_wrong_extension_is_rejected(tmp_path):
    path = _write(tmp_path, "corpus.csv", "a,b,c\n")
    msg = _error(overrides=[f"data.path={path}"])
    assert "data.path" in msg
    assert ".txt or .npy" in msg
    assert "corpus.csv" in msg


def test_existing_txt_data_file_is_accepted(tmp_path):
    path = _write(tmp_path, "corpus.txt", "hello world\n")
    assert load_config(None, [f"data.path={path}"]).data.path == path


# ---------------------------------------------------------------------------------------------
# Files and --set syntax.

def test_malformed_yaml_says_so(tmp_path):
    path = _write(tmp_path, "bad.yaml", "optim:\n  lr: [0.1, 0.2\ntrain:\n  steps: 3\n")
    msg = _error(path)
    assert "not valid YAML" in msg
    assert "bad.yaml" in msg


def test_yaml_list_is_rejected(tmp_path):
    path = _write(tmp_path, "list.yaml", "- optim\n- train\n")
    msg = _error(path)
    assert "list.yaml" in msg
    assert "mapping" in msg and "list" in msg


def test_missing_config_file_is_rejected(tmp_path):
    msg = _error(str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in msg
    assert "does not exist" in msg


def test_set_without_equals_is_rejected():
    msg = _error(overrides=["optim.lr"])
    assert "--set 'optim.lr'" in msg
    assert "section.key=value" in msg


@pytest.mark.parametrize("text,key", [("lr=0.1", "lr"), ("optim.lr.x=0.1", "optim.lr.x"), (".lr=0.1", ".lr")])
def test_set_with_bad_key_path_is_rejected(text, key):
    msg = _error(overrides=[text])
    assert f"--set {key!r}" in msg
    assert "section.key" in msg


def test_set_with_unknown_section_is_named():
    msg = _error(overrides=["foo.bar=1"])
    assert msg.startswith("foo ")
    assert "not a known section" in msg


# ---------------------------------------------------------------------------------------------
# train.init_from (Hugging Face config.json).

def test_init_from_without_config_json_is_rejected(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    msg = _error(overrides=[f"train.init_from={empty}"], load=load_train_config)
    assert "train.init_from" in msg
    assert "config.json" in msg


def test_init_from_is_read_by_io_not_by_the_config_layer(tmp_path):
    """config.load_config reads no model files: with train.init_from it names the loader that does."""
    (tmp_path / "config.json").write_text("{}")
    msg = _error(overrides=[f"train.init_from={tmp_path}"])
    assert "train.init_from" in msg and "load_train_config" in msg


def test_init_from_unsupported_model_type_is_rejected(tmp_path):
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    hf = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300).to_dict()
    assert hf["model_type"] == "gpt2"
    (model_dir / "config.json").write_text(json.dumps(hf))
    msg = _error(overrides=[f"train.init_from={model_dir}"], load=load_train_config)
    assert "model_type" in msg
    assert "'gpt2'" in msg


def test_init_from_config_json_defines_the_model(tmp_path):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    hf = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256).to_dict()
    (model_dir / "config.json").write_text(json.dumps(hf))
    # model.* values that agree with the checkpoint are accepted; one that does not is refused, not dropped.
    cfg = load_train_config(None, [f"train.init_from={model_dir}", "model.hidden_size=32", "train.seq_len=32"])
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.vocab_size) == (32, 3, 300)
    msg = _error(overrides=[f"train.init_from={model_dir}", "model.hidden_size=128"], load=load_train_config)
    assert msg == (f"model.hidden_size (128) disagrees with train.init_from's config.json ({model_dir}: 32), which "
                   "defines the model; remove model.hidden_size from the configuration, or point train.init_from at "
                   "the model meant.")
    assert cfg.model.num_key_value_heads == 2
    assert cfg.model.attention_bias is False


def test_init_from_config_json_that_is_not_json_is_a_config_error(tmp_path):
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        load_train_config(None, [f"train.init_from={model_dir}"])
    assert "config.json" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Positive: YAML + overrides, and the HF mapping.

def test_yaml_sections_and_set_overrides(tmp_path):
    path = _write(tmp_path, "run.yaml", (
        "model:\n"
        "  hidden_size: 32\n"
        "  num_attention_heads: 4\n"
        "  num_key_value_heads: 2\n"
        "  intermediate_size: 96\n"
        "optim:\n"
        "  lr: 0.01\n"
        "  weight_decay: 0.1\n"
        "train:\n"
        "  steps: 10\n"
        "  seq_len: 32\n"
        "memory:\n"
        "  buffer_depth: 3\n"
    ))
    cfg = load_config(path, ["optim.lr=2e-2", "train.steps=20", "model.rope_theta=500000",
                             "precision.master_dtype=bfloat16"])
    # Overrides win over the file.
    assert cfg.optim.lr == pytest.approx(0.02)
    assert isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 20 and isinstance(cfg.train.steps, int)
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)
    assert cfg.precision.master_dtype == "bfloat16"
    # File values that were not overridden are kept.
    assert cfg.model.hidden_size == 32
    assert cfg.model.num_key_value_heads == 2
    assert cfg.model.head_size == 8
    assert cfg.optim.weight_decay == pytest.approx(0.1)
    assert cfg.train.seq_len == 32
    assert cfg.memory.buffer_depth == 3
    # Everything else keeps its default.
    assert cfg.optim.beta2 == OptimConfig().beta2
    assert cfg.train.micro_batch_size == TrainSection().micro_batch_size
    assert cfg.model.model_type == "llama"


def test_defaults_are_valid():
    cfg = load_config(None, [])
    assert cfg.train.steps == TrainSection().steps
    assert cfg.model.num_key_value_heads == cfg.model.num_attention_heads


def test_set_into_a_section_left_empty_in_yaml(tmp_path):
    path = _write(tmp_path, "run.yaml", "optim:\ntrain:\n  steps: 5\n")
    assert load_config(path).optim.lr == OptimConfig().lr  # the file alone is accepted
    cfg = load_config(path, ["optim.lr=0.01"])
    assert cfg.optim.lr == pytest.approx(0.01)
    assert cfg.train.steps == 5


def test_from_hf_dict_maps_a_real_qwen2_config():
    hf = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, rope_theta=123456.0,
                                  rms_norm_eps=1e-5, max_position_embeddings=512,
                                  tie_word_embeddings=True).to_dict()
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.model_type == "qwen2"
    assert cfg.attention_bias is True
    assert cfg.qk_norm is False
    assert cfg.rope_theta == pytest.approx(123456.0)
    assert cfg.vocab_size == 300
    assert cfg.hidden_size == 64
    assert cfg.intermediate_size == 128
    assert cfg.num_hidden_layers == 3
    assert cfg.num_attention_heads == 4
    assert cfg.num_key_value_heads == 2
    assert cfg.head_size == 16
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings is True
    # And back: the HF dict written at save time names the right architecture.
    out = cfg.to_hf_dict()
    assert out["architectures"] == ["Qwen2ForCausalLM"]
    assert out["head_dim"] == 16


def test_from_hf_dict_llama_has_no_bias_and_keeps_rope_theta():
    hf = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, rope_theta=77777.0).to_dict()
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.model_type == "llama"
    assert cfg.attention_bias is False
    assert cfg.rope_theta == pytest.approx(77777.0)
    assert cfg.num_key_value_heads == 4


def test_from_hf_dict_rejects_rope_scaling():
    hf = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}).to_dict()
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(hf)
    assert "'linear'" in str(info.value)


def test_from_hf_dict_rejects_mlp_bias():
    hf = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, mlp_bias=True).to_dict()
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(hf)
    assert "mlp_bias" in str(info.value)


def test_compile_threads_below_one_is_rejected():
    msg = _error(overrides=["compute.compile_threads=0"])
    assert "compute.compile_threads" in msg and "got 0" in msg
    assert load_config(None, []).compute.compile_threads == 1  # default: no compile worker pool


def test_buffer_depth_and_loss_chunk_default_to_the_benchmarks_settings_per_device(tmp_path):
    """Left null, memory.buffer_depth and memory.loss_chunk_size are what the benchmark runs with on
    the resolved device (3 and 8192 on cuda, 2 and 1024 on cpu); set, they win on both."""
    mem = load_config(None, []).memory
    assert (mem.buffer_depth, mem.loss_chunk_size) == (None, None)
    assert (mem.buffer_depth_on("cuda"), mem.loss_chunk_size_on("cuda")) == (3, 8192)
    assert (mem.buffer_depth_on("cpu"), mem.loss_chunk_size_on("cpu")) == (2, 1024)
    mem = load_config(None, ["memory.buffer_depth=5", "memory.loss_chunk_size=300"]).memory
    for device in ("cuda", "cpu"):
        assert (mem.buffer_depth_on(device), mem.loss_chunk_size_on(device)) == (5, 300)
    mem = load_config(_write(tmp_path, "c.yaml", "memory:\n  buffer_depth: null\n  loss_chunk_size: null\n")).memory
    assert mem.buffer_depth_on("cuda") == 3
    assert "memory.loss_chunk_size" in _error(overrides=["memory.loss_chunk_size=0"])


# ---------------------------------------------------------------------------------------------
# A loaded config is frozen; what the loader works out is a new value, the same as before.

def test_a_loaded_config_refuses_assignment_to_sections_and_fields():
    cfg = load_config(None, ["train.steps=7"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = TrainSection()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.run_dir = "elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_key_value_heads = 1  # a field the model's construction fills in
    for section in cfg.sections():  # every section, not only those above
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, dataclasses.fields(section)[0].name, None)
    assert (cfg.train.steps, cfg.train.run_dir) == (7, TrainSection().run_dir)
    assert cfg.model.num_key_value_heads == cfg.model.num_attention_heads


def test_init_from_gives_the_model_of_its_config_json_in_a_frozen_config(tmp_path):
    hf = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_train_config(None, [f"train.init_from={tmp_path}", "train.seq_len=32"])
    assert cfg.model == ModelConfig.from_hf_dict(hf) != ModelConfig()
    assert (cfg.model.model_type, cfg.model.num_key_value_heads, cfg.model.attention_bias) == ("qwen2", 2, True)
    assert cfg.train.init_from == str(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = ModelConfig()


def test_resume_continues_in_the_folder_of_the_checkpoints_run_in_a_frozen_config(tmp_path, monkeypatch):
    """Unless train.run_dir is set anew, a resumed run's train.run_dir is the folder that holds the
    checkpoint's run, whatever folder the run was started with (megatrain_ray.io.resume)."""
    from megatrain_ray.io import checkpoint
    from megatrain_ray.io.resume import resume_config

    monkeypatch.chdir(tmp_path)
    saved = load_config(None, ["train.run_dir=started-in", "train.steps=4"]).to_dict()
    step = tmp_path / "moved" / "run-1" / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    meta = {"format": checkpoint.FORMAT, "format_version": checkpoint.FORMAT_VERSION, "step": 2,
            "config": saved, "model": ModelConfig().to_hf_dict()}
    meta["meta_crc32"] = checkpoint.meta_checksum(meta)
    (step / checkpoint.META_FILE).write_text(json.dumps(meta))
    cfg, directory, _ = resume_config(str(step), None, [])
    assert directory == str(step)
    assert (cfg.train.run_dir, cfg.train.steps) == (str(tmp_path / "moved"), 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.run_dir = "started-in"
    cfg, _, _ = resume_config(str(step), None, ["train.run_dir=another"])
    assert cfg.train.run_dir == "another"
