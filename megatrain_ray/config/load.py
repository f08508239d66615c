"""Building a :class:`TrainConfig` from a nested dict, a YAML file and ``--set section.key=value``
overrides. Reads no model files: a config whose ``train.init_from`` names a Hugging Face
directory goes through :func:`megatrain_ray.io.hf_io.load_train_config`, which reads its config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import yaml

from ..errors import ConfigError
from ..yaml_strict import StrictLoader
from .fields import section_from_dict
from .model import ModelConfig
from .moved import refuse_runtime, upgrade_saved
from .sections import TrainConfig

_SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
INPUT_PATHS = (("data", "path"), ("data", "val_path"), ("data", "tokenizer"), ("train", "init_from"))
"""The keys that name files a run reads. A relative one written in a config file is read from the
current directory, or, when nothing is there, from the config file's directory
(:func:`beside_the_file`): configs/ names its example files so, and runs from any directory."""


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build (without validating) a TrainConfig from a nested dict; unknown keys are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"the configuration must be a mapping of sections, got {type(data).__name__}.")
    kwargs = {}
    for name, value in data.items():
        if name == "runtime":
            refuse_runtime(value)
        if name not in _SECTIONS:
            raise ConfigError(f"{name} is not a known section; use one of {', '.join(_SECTIONS)}.")
        kwargs[name] = section_from_dict(_SECTIONS[name], {} if value is None else value, name)
    return TrainConfig(**kwargs)


def beside_the_file(loaded: dict[str, Any], path: str) -> None:
    """Make each relative INPUT_PATHS value of a loaded config file that names nothing from the
    current directory, but names a file or directory from the file's own directory, that one (an
    absolute path); every other value is left as written (a missing one is refused later, as written)."""
    here = os.path.dirname(os.path.abspath(path))
    for section, key in INPUT_PATHS:
        values = loaded.get(section)
        value = values.get(key) if isinstance(values, dict) else None
        if isinstance(value, str) and not os.path.isabs(value) and not os.path.exists(value) \
                and os.path.exists(os.path.join(here, value)):
            values[key] = os.path.join(here, value)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} must look like section.key=value.")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {key!r} must name section.key, e.g. optim.lr.")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return parts, value


def load_config(path: str | None = None, overrides: list[str] = (), base: dict | None = None,
                model_from: Callable[[str, dict], ModelConfig] | None = None,
                skip: tuple[str, ...] = ()) -> TrainConfig:
    """Load a YAML file (or start from ``base``), apply ``--set`` overrides, validate; returns a new,
    frozen TrainConfig.

    ``skip``: sections of the file left out (their defaults apply), for a caller that uses none of
    their settings: the benchmark's data section (it trains on random tokens). ``base`` is a run
    config the program saved (a checkpoint's, a run's config.json); one saved with the former
    ``runtime`` section is upgraded (:func:`megatrain_ray.config.moved.upgrade_saved`).

    When ``train.init_from`` names an HF model directory, its config.json defines the model shape:
    ``model_from(init_from, given)`` reads it and checks ``given`` (the model.* values the configuration
    sets) against it. This module reads no model files, so a config with
    train.init_from is loaded through :func:`megatrain_ray.io.hf_io.load_train_config`, which
    passes it; without ``model_from`` such a config is an error.
    """
    data: dict[str, Any] = upgrade_saved(json.loads(json.dumps(base))) if base else {}
    if path is not None:
        if os.path.isdir(path):
            raise ConfigError(f"config file {path!r} is a directory; pass a YAML file (e.g. configs/tiny.yaml).")
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist.")
        try:
            with open(path) as f:
                loaded = yaml.load(f, Loader=StrictLoader)  # safe_load, refusing duplicate keys
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            raise ConfigError(f"config file {path!r} is not valid YAML{where}.") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, "
                              f"got {type(loaded).__name__}.")
        beside_the_file(loaded or {}, path)
        for name, section in (loaded or {}).items():
            if name in skip:
                continue
            if isinstance(section, dict) and isinstance(data.get(name), dict):
                data[name] = {**data[name], **section}
            else:
                data[name] = section
    for text in overrides:
        (section, key), value = parse_override(text)
        current = data.get(section)
        if current is None:
            current = data[section] = {}
        if not isinstance(current, dict):
            raise ConfigError(f"{section} must be a mapping of keys to values.")
        current[key] = value
    cfg = config_from_dict(data)
    if cfg.train.init_from is not None:
        cfg.train.validate()
        if model_from is None:
            raise ConfigError("train.init_from needs its config.json read for the model shape; load this "
                              "configuration with megatrain_ray.io.hf_io.load_train_config.")
        given = {k: getattr(cfg.model, k) for k, v in (data.get("model") or {}).items() if v is not None}
        cfg = dataclasses.replace(cfg, model=model_from(cfg.train.init_from, given))  # given: the model.* set, to check
    return cfg.validate()
