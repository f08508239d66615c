"""The example files of configs/examples, which let the configs run as written without the Hugging
Face Hub: they are what configs/examples/make_examples.py builds (a byte-level BPE trained with the
``tokenizers`` library on the built-in corpus, alpaca rows of the same grammar, a tiny Qwen2 stand-in
for a pretrained model), and every config that fits a CPU plans as written, no path to replace.
(The runs themselves: tests/test_configs.py.)"""

import importlib.util
import json
import os

import pytest

transformers = pytest.importorskip("transformers")

from megatrain_ray import cli  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "configs", "examples")
AS_WRITTEN = ["tiny", "tiny-moe", "text-pretrain", "alpaca-sft", "lora-sft"]
"""The configs sized for any machine; the others are sized for an H200 and read your long documents."""


def _maker():
    spec = importlib.util.spec_from_file_location("make_examples", os.path.join(EXAMPLES, "make_examples.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_examples_are_what_the_script_builds(tmp_path):
    make = _maker()
    hf = make.build_tokenizer(str(tmp_path / "tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tokenizer" / name).read_text() == open(os.path.join(EXAMPLES, "tokenizer", name)).read()
    assert json.load(open(os.path.join(EXAMPLES, "alpaca.json"))) == make.alpaca_rows()
    committed = transformers.AutoTokenizer.from_pretrained(os.path.join(EXAMPLES, "tokenizer"))
    assert len(committed) == len(hf) == make.VOCAB and committed.eos_token == "<|endoftext|>"
    ids = committed.apply_chat_template([{"role": "user", "content": "The optimizer updates the loss."}],
                                        add_generation_prompt=True)
    assert committed.decode(ids) == "<|im_start|>user\nThe optimizer updates the loss.<|im_end|>\n<|im_start|>assistant\n"
    model = json.load(open(os.path.join(EXAMPLES, "model", "config.json")))
    assert model["vocab_size"] == len(hf) and model["eos_token_id"] == committed.eos_token_id
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(EXAMPLES) for f in fs)
    assert size < 200_000  # what is committed stays small


@pytest.mark.parametrize("name", AS_WRITTEN)
def test_the_config_plans_as_written(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' example paths are taken from the repository, as the README runs them
    cfg = load_train_config(os.path.join("configs", f"{name}.yaml"))
    for path in (cfg.data.path, cfg.data.tokenizer, cfg.train.init_from):
        assert path is None or path.startswith("configs/examples/"), path
    assert cli.main(["plan", "--config", os.path.join("configs", f"{name}.yaml"), "--device", "cpu"]) == 0, \
        capsys.readouterr().err
    assert "huggingface-cli" not in open(os.path.join(ROOT, "configs", f"{name}.yaml")).read()
