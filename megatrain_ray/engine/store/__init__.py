"""The host store role: the parameter and optimizer store in shared-memory segments.

- :mod:`.host_store`: :class:`~.host_store.HostStore` (flat per-kind arrays, versions, the
  checkpoints' copy) and its :class:`~.host_store.StoreSpec`;
- :mod:`.shm`, :mod:`.reaper`: the segments and their removal when their owner is gone;
- :mod:`.init_weights`: a new model's random weights, drawn into the store;
- :mod:`.quantized`: a frozen base held quantized (int8, nf4, mxfp4) and its dequantization on the
  device where the compute worker uses it.
"""
