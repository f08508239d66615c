"""Weights on disk: Hugging Face model directories in and out, training checkpoints, evaluation.

- :mod:`.files`: the one atomic, fsynced, checksummed file writer (safetensors, JSON, whole
  directories) and the one safetensors header check;
- :mod:`.hf_io`: HF config.json / safetensors import and export, and loading a run's config with
  ``train.init_from``'s model shape; :mod:`.experts`: the two layouts of a mixture of experts'
  routed experts in such a checkpoint (per expert, or stacked in 3-D); :mod:`.locate`: where a run's
  or a checkpoint's HF-format weights are (its final/, else its newest valid checkpoint);
- :mod:`.peft_io`: LoRA adapters out, as a PEFT adapter directory and as a merged HF model;
  :mod:`.bnb_checkpoint`: a bitsandbytes 4-bit checkpoint read into an nf4 base as it is;
- :mod:`.checkpoint`: one flat, layout-independent directory per step boundary, written atomically,
  with the size and CRC-32 of every file; :mod:`.state_tensors`: which optimizer-state tensors it
  holds (fp32 moments per parameter, the compact state per unit);
- :mod:`.writer`: the one writer of checkpoints (the sink's in the background, the store's on an
  interrupt);
- :mod:`.resume`: which checkpoint ``--resume`` means (a run's newest valid one) and its run config;
- :mod:`.evaluate`: loss and perplexity of saved weights, one unit in memory at a time.
"""
