"""Weights on disk: Hugging Face model directories in and out, training checkpoints, evaluation.

- :mod:`.hf_io`: HF config.json / safetensors import and export, and loading a run's config with
  ``runtime.init_from``'s model shape;
- :mod:`.checkpoint`: one flat, layout-independent directory per step boundary, written atomically;
- :mod:`.evaluate`: loss and perplexity of saved weights, one unit in memory at a time.
"""
