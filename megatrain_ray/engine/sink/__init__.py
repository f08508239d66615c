"""The sink role: :mod:`.gradient_sink` takes each step's gradient tickets, the norm, the clipping
factor and each unit's update.

- :mod:`.step_gradients`: when each unit's update runs and with which factor;
- :mod:`.updates`: the host optimizer protocol and its implementations (exact, split, compact);
- :mod:`.shards`: an optimizer sharded over several sinks;
- :mod:`.checkpointing`: the checkpoint the sink writes at a boundary.
"""
