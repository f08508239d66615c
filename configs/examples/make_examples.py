"""Build the example files the configs use, so that they run as written without the Hugging Face Hub:

    python configs/examples/make_examples.py     # rewrites configs/examples/{tokenizer/, alpaca.json, model/}

- ``tokenizer/``: a byte-level BPE tokenizer (the ``tokenizers`` library) trained on the built-in
  corpus (:func:`megatrain_ray.data.builtin.builtin_documents`), with ``<|endoftext|>`` as EOS and
  padding and a ChatML chat template (``<|im_start|>`` / ``<|im_end|>``), for text-pretrain.yaml and
  the fine-tuning examples;
- ``alpaca.json``: alpaca rows made from the same grammar (an instruction, and the response that
  continues it), for alpaca-sft.yaml and lora-sft.yaml;
- ``model/``: a tiny randomly initialised Qwen2 (2 layers, hidden 32, the tokenizer's vocabulary;
  bf16 safetensors, 70 KB) standing in for the pretrained model those two fine-tune (``train.init_from``);
- ``gpt-oss/``: a tiny randomly initialised gpt-oss (2 layers, hidden 32, 4 experts, top-2) saved as the
  Hub saves gpt-oss: its routed experts as MXFP4 ``*_blocks`` / ``*_scales`` (quantized by
  :func:`megatrain_ray.model.mxfp4.quantize_mxfp4`), the rest bf16, ``quantization_config``
  mxfp4 — the stand-in base of gpt-oss-lora.yaml.

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


def build_gpt_oss(directory: str, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    from megatrain_ray.model.mxfp4 import MX_BLOCK, quantize_mxfp4

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16,
                          eos_token_id=0, bos_token_id=0, pad_token_id=0)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        w = state.pop(key).transpose(1, 2)  # [E, out, in]: the Hub's blocks run along each output row
        codes, scales = quantize_mxfp4(w.reshape(-1, w.shape[2]))
        state[key + "_blocks"] = codes.view(*w.shape[:2], w.shape[2] // MX_BLOCK, MX_BLOCK // 2)
        state[key + "_scales"] = scales.view(*w.shape[:2], w.shape[2] // MX_BLOCK)
    os.makedirs(directory, exist_ok=True)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_dict()
    hf.update(architectures=["GptOssForCausalLM"], dtype="bfloat16", quantization_config={"quant_method": "mxfp4"})
    hf.pop("transformers_version", None)  # the model's config, not the version that wrote it
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)


def main() -> None:
    hf = build_tokenizer(os.path.join(HERE, "tokenizer"))
    with open(os.path.join(HERE, "alpaca.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(row) for row in alpaca_rows()) + "\n]\n")  # a row a line
    build_model(os.path.join(HERE, "model"), len(hf))
    build_gpt_oss(os.path.join(HERE, "gpt-oss"), len(hf))
    print(f"wrote {HERE}: tokenizer ({len(hf)} ids), alpaca.json ({len(alpaca_rows())} rows), model/, gpt-oss/")


if __name__ == "__main__":
    main()
