"""From plain values to typed config dataclasses: type checks of one value against a field's
annotation, one section built from a mapping, and the error sentence that names the key.

Shared by the sections' ``validate`` methods, by :meth:`ModelConfig.from_hf_dict` and by the loader.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from ..errors import ConfigError


def require(ok: bool, key: str, what: str) -> None:
    """Raise ``ConfigError("<key> <what>.")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} {what}.")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check/convert one YAML value against a field annotation (str, int, float, bool, optionals,
    tuple[str, ...], list of one of those)."""
    hint = annotation if not isinstance(annotation, str) else eval(annotation, vars(typing), {})  # noqa: S307
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}.")
        return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{key} may not be empty (null).")
    if typing.get_origin(hint) is tuple:  # tuple[str, ...]: a list, or one comma-separated string
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if isinstance(items, int) and args[0] is int:  # tuple[int, ...]: one number is a list of one
            items = [items]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key} must be a list (or a comma-separated string), got {value!r}.")
        if args[0] is int:  # "3,5" from --set
            items = [int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v for v in items]
        return tuple(coerce(v, args[0], key) for v in items)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}.")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}.")
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}.")
    if base is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}.")
    return value


def section_from_dict(cls: type, data: Any, prefix: str) -> Any:
    """One dataclass section from a mapping; unknown keys and ill-typed values are errors naming
    ``prefix.key``. Not validated (the caller runs ``validate``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix} must be a mapping of keys to values, got {data!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{prefix}.{key} is not a known key; known keys of {prefix}: "
                              f"{', '.join(sorted(fields))}.")
        kwargs[key] = coerce(value, fields[key].type, f"{prefix}.{key}")
    return cls(**kwargs)
