"""Model files that contradict themselves are never trained on silently (real files written by
transformers): a config.json that ties the embeddings beside a separate ``lm_head.weight``."""

import json

import pytest
import torch

from megatrain_ray.errors import ConfigError
from megatrain_ray.io.hf_io import expected_names, load_train_config

transformers = pytest.importorskip("transformers")


def _llama(path, tie_in_config: bool, same_head: bool = False):
    """An untied tiny Llama saved by transformers; config.json then edited to claim ``tie_in_config``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    if same_head:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(path, safe_serialization=True)
    raw = json.loads((path / "config.json").read_text())
    raw["tie_word_embeddings"] = tie_in_config
    (path / "config.json").write_text(json.dumps(raw))
    return model


def test_a_tied_config_beside_a_separate_head_is_refused_or_trained_untied_as_asked(tmp_path):
    saved = _llama(tmp_path, tie_in_config=True)
    # What transformers does with this directory: it keeps the file's head (untied, with a warning).
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, saved.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)

    with pytest.raises(ConfigError) as info:
        load_train_config(None, [f"train.init_from={tmp_path}"])
    assert str(info.value) == (f"train.init_from's config.json ({tmp_path}) sets tie_word_embeddings: true, but its "
                               "weights hold an lm_head.weight unlike model.embed_tokens.weight; set "
                               "model.tie_word_embeddings=false to train that head (transformers loads this "
                               "directory untied too), or remove lm_head.weight from the files to tie it.")
    cfg = load_train_config(None, [f"train.init_from={tmp_path}", "model.tie_word_embeddings=false"])
    assert cfg.model.tie_word_embeddings is False
    assert "lm_head.weight" in expected_names(cfg.model)  # the file's head is a parameter that is loaded and trained


def test_a_tied_config_beside_a_copy_of_the_embedding_is_tied(tmp_path):
    _llama(tmp_path, tie_in_config=True, same_head=True)
    cfg = load_train_config(None, [f"train.init_from={tmp_path}"])
    assert cfg.model.tie_word_embeddings is True  # the copy is the embedding: nothing is lost by tying
