"""The compute role: the worker that runs each step's layers on its device.

- :mod:`.compute_worker`: :class:`~.compute_worker.ComputeWorker`, one loop over the step's units;
- :mod:`.device`: its CPU and CUDA backends (slots, copy streams, the step's timeline);
- :mod:`.passes`, :mod:`.sequence`, :mod:`.activations`, :mod:`.attention`, :mod:`.routing`: each
  decoder layer's pass (kept, recomputed, routed) and where its inputs wait for the backward;
- :mod:`.head`, :mod:`.embed_grad`: the loss head and the embedding's gradient;
- :mod:`.resident`, :mod:`.adapters`: units and LoRA adapters that live on the device, with their
  device-side AdamW (an empty set of each where a run has none);
- :mod:`.device_updates`: streamed units updated on the device (optim.placement), their state copied
  in and written back (an empty set where a run has none);
- :mod:`.slot_weights`: a streamed unit's weights in its device slot, as fetched or dequantized;
- :mod:`.grad_out`: the gradient sender (one per unit policy) toward the sink;
- :mod:`.worker_group`: data-parallel workers' reduction group (a group of one for a worker alone).
"""
