"""The model, as a pure description: what is computed, never how it is streamed or run.

- :mod:`.transformer`: the decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral, and the
  mixtures of experts) as stateless functions of (weights, inputs), and the HF names of its units' tensors;
- :mod:`.moe`: the mixture-of-experts MLP (router, top-k, grouped expert GEMMs, shared expert) and
  the load-balancing loss, as pure functions;
- :mod:`.layout`: where each unit's tensors sit in one flat buffer (shared by the store and the
  compute templates);
- :mod:`.lora`: low-rank adapters beside the projections (names, shapes, PEFT's initialisation,
  binding next to a unit's weights, merging);
- :mod:`.quant`, :mod:`.mxfp4`, :mod:`.quant_layout`: a LoRA run's quantized base (NF4, int8 as
  bitsandbytes stores them; MXFP4 as gpt-oss's checkpoints do): the arithmetic as torch ops, and each
  unit's bytes in the store;
- :mod:`.precision`: the precision policy (master, compute, gradient and stream dtypes), stated once;
- :mod:`.presets`: named model shapes (tiny, 1b, 3b, 7b);
- :mod:`.flops`: the model's training FLOPs in the two conventions we report (6·N·T and PaLM's),
  with a mixture of experts' active parameters.

Uses only :mod:`megatrain_ray.config` and :mod:`megatrain_ray.errors`.
"""
