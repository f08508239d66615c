"""The engine: the roles that train one model streamed one unit at a time, as plain classes.

- :mod:`.store`, :mod:`.shm`: the host parameter / optimizer store in shared-memory segments;
  :mod:`.quantized`: a LoRA run's quantized base in it, and its dequantization on the device;
- :mod:`.tickets`: the small messages between roles, and the fetch and update orders;
- :mod:`.prefetch`: the prefetcher (which unit goes into which device slot, when);
- :mod:`.compute`, :mod:`.device`, :mod:`.activations`: the compute worker, its CPU / CUDA backends,
  and where the layer inputs kept for the backward live;
- :mod:`.sink`, :mod:`.optim`, :mod:`.adamw_native`: the gradient sink, AdamW on the host and its
  one-pass C kernel, the learning-rate schedule and clipping; :mod:`.compact`: the compact optimizer
  state (8-bit moments, bf16 master, stochastic rounding) and its torch reference.

The whole model resident on one device, the reference the engine is checked against, is outside
the package: ``benchmarks/reference.py`` (the tests and the benchmark harness use it).

Who runs these classes, as Ray actors or as threads, is :mod:`megatrain_ray.orchestration`'s
business. The engine reads weights and checkpoints through :mod:`megatrain_ray.io`.
"""
