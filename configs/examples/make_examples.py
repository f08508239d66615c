"""Build the example files the configs use, so that they run as written without the Hugging Face Hub:

    python configs/examples/make_examples.py     # rewrites configs/examples/{tokenizer/, alpaca.json, model/}

- ``tokenizer/``: a byte-level BPE tokenizer (the ``tokenizers`` library) trained on the built-in
  corpus (:func:`megatrain_ray.data.builtin.builtin_documents`), with ``<|endoftext|>`` as EOS and
  padding and a ChatML chat template (``<|im_start|>`` / ``<|im_end|>``), for text-pretrain.yaml and
  the fine-tuning examples;
- ``alpaca.json``: alpaca rows made from the same grammar (an instruction, and the response that
  continues it), for alpaca-sft.yaml and lora-sft.yaml;
- ``model/``: a tiny randomly initialised Qwen2 (2 layers, hidden 32, the tokenizer's vocabulary;
  bf16 safetensors, 70 KB) standing in for the pretrained model those two fine-tune (``train.init_from``).

The tokenizer and the rows are deterministic: tests/test_examples.py checks that the committed ones
are what this script builds, and that every config in configs/ plans as written.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from megatrain_ray.data.builtin import builtin_documents  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
VOCAB = 384
"""The BPE's vocabulary (its 256 byte symbols, the specials, and merges up to this size)."""
ROWS = 120
"""Alpaca rows written."""


def documents() -> list[str]:
    return builtin_documents("train") + builtin_documents("val")


def build_tokenizer(directory: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents() + ["user assistant system"], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(directory)
    return hf


def alpaca_rows() -> list[dict[str, str]]:
    """Each row: the first sentences of a document as the instruction's text, its next sentence the output."""
    rows = []
    for i, doc in enumerate(documents()[:ROWS]):
        sentences = [s.strip() + "." for s in doc.split(".") if s.strip()]
        if len(sentences) < 2:
            continue
        rows.append({"instruction": "Write the sentence that comes next.", "input": " ".join(sentences[:-1]),
                     "output": sentences[-1]} if i % 2 else
                    {"instruction": f"Continue: {sentences[0]}", "input": "", "output": " ".join(sentences[1:])})
    return rows


def build_model(directory: str, vocab_size: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


def main() -> None:
    hf = build_tokenizer(os.path.join(HERE, "tokenizer"))
    with open(os.path.join(HERE, "alpaca.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(row) for row in alpaca_rows()) + "\n]\n")  # a row a line
    build_model(os.path.join(HERE, "model"), len(hf))
    print(f"wrote {HERE}: tokenizer ({len(hf)} ids), alpaca.json ({len(alpaca_rows())} rows), model/")


if __name__ == "__main__":
    main()
