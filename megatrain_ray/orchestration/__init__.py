"""Who runs where, and what happens on failure: the drivers of a training run.

- :mod:`.pipeline`: connect to Ray, spawn and wire the roles as actors, drive the steps, restart,
  clean up (``train``);
- :mod:`.local`: the same roles as threads in one process, without Ray;
- :mod:`.preflight`: the memory a run needs, checked before anything is allocated; :mod:`.store_modes`:
  the plan's bytes per parameter of each optimizer mode and LoRA base format;
- :mod:`.machine`: what this machine has (available RAM under its cgroup limits, GPU memory);
- :mod:`.metrics`: the per-step numbers a user reads (metrics.jsonl, Ray gauges);
"""
