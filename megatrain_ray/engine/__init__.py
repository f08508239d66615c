"""The engine: the roles that train one model streamed one unit at a time, as plain classes.

A folder per role:

- :mod:`.store`: the host parameter / optimizer store in shared-memory segments, and a frozen
  base's quantized formats;
- :mod:`.prefetch`: the prefetcher (which unit goes into which device slot, when);
- :mod:`.compute`: the compute worker, its CPU / CUDA backends, each layer's pass, resident units
  and adapters, the gradient sender;
- :mod:`.sink`: the gradient sink, the host optimizer protocol, sharding and checkpoints.

Beside them, what several roles share: :mod:`.tickets` (the small messages between roles),
:mod:`.schedule` (the fetch and update orders), :mod:`.policy` and :mod:`.settings` (each unit's
policy, each role's settings from the resolved run), :mod:`.optim`, :mod:`.adamw_native` and
:mod:`.compact` (AdamW, its one-pass C kernel, the learning-rate schedule and clipping; the compact
8-bit state), :mod:`.experts` (a sparse layer's expert traffic), :mod:`.grad_reduce` (data-parallel
sums) and :mod:`.affinity` (CPU placement of role threads).

The whole model resident on one device, the reference the engine is checked against, is outside
the package: ``benchmarks/reference.py`` (the tests and the benchmark harness use it).

Who runs these classes, as Ray actors or as threads, is :mod:`megatrain_ray.orchestration`'s
business. The engine reads weights and checkpoints through :mod:`megatrain_ray.io`.
"""
