"""Typed configuration of a training run: dataclasses, YAML loading, ``--set`` overrides, validation.

A run is described by one :class:`TrainConfig` with its sections: what is trained (``model``,
``optim``, ``train``, ``data``, ``lora``) and how the run executes (``precision``, ``compute``,
``memory``, ``parallel``, ``cluster``, ``experimental``). YAML files mirror that nesting; ``--set section.key=value``
overrides one field. Model fields carry Hugging Face ``config.json`` names, so an HF config maps onto
:class:`ModelConfig` directly (:meth:`ModelConfig.from_hf_dict`).

Every check raises :class:`~megatrain_ray.errors.ConfigError` with one sentence that names the key.
Every section is a frozen dataclass: a loaded config is never changed afterwards; code that needs
another setting builds a new value with ``dataclasses.replace`` (the loader does so with
``train.init_from``'s model, ``train --resume`` with the run directory).

- :mod:`.model`: :class:`ModelConfig` and its HF config.json mapping;
- :mod:`.sections`: optim, train and data, :func:`lr_at` and :class:`TrainConfig`;
- :mod:`.execution`: precision, compute, memory, parallel, cluster and experimental;
- :mod:`.moved`: the former ``runtime`` keys' new places, their sentences, the upgrade of saved configs;
- :mod:`.lora`: :class:`LoraSection`, low-rank adapters on a frozen base;
- :mod:`.load`: dicts, YAML files and ``--set`` overrides into a validated :class:`TrainConfig`;
- :mod:`.fields`: type checks of single values and the error sentence, shared by the three.

This package is the bottom layer, so its ``__init__`` re-exports the public names: import them from
``megatrain_ray.config``.
"""

from .load import config_from_dict, load_config, parse_override
from .lora import EXPERT_TARGETS, LORA_TARGETS, LoraSection
from .families import ARCHITECTURES, LLAMA3_ROPE_KEYS, MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES
from .model import ModelConfig
from .execution import (EXECUTION_SECTIONS, ClusterSection, ComputeSection, ExperimentalSection, MemorySection, ParallelSection,
                        PrecisionSection, describe_resident)
from .sections import (AUTO_BUFFER_DEPTH, AUTO_LOSS_CHUNK_SIZE, DataSection, OptimConfig, TrainConfig,
                       TrainSection, lr_at, unwritable, usable_cpus)

__all__ = ["ARCHITECTURES", "EXECUTION_SECTIONS", "AUTO_BUFFER_DEPTH", "AUTO_LOSS_CHUNK_SIZE", "LLAMA3_ROPE_KEYS",
           "EXPERT_TARGETS", "LORA_TARGETS", "MOE_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "ClusterSection", "ComputeSection", "DataSection",
           "ExperimentalSection", "LoraSection", "MemorySection", "ModelConfig", "OptimConfig", "ParallelSection",
           "PrecisionSection", "TrainConfig", "TrainSection",
           "config_from_dict", "describe_resident", "load_config", "lr_at", "parse_override", "unwritable", "usable_cpus"]
