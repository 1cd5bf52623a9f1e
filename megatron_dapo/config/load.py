"""YAML files and dotted command-line overrides into an ``ExperimentConfig``; errors name the key and say what was
expected. No module reads YAML or environment variables for its configuration on its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megatron_dapo.config.schema import ConfigError, ExperimentConfig


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> ExperimentConfig:
    """Read a YAML file (optional), apply ``a.b.c=value`` overrides and build an ``ExperimentConfig``: unknown keys
    and wrong types are errors here; the rules (ranges, cross-field, layouts) run once, in the command's gate
    (``config.plan.resolve`` for ``train``)."""
    raw = read_config_file(path) if path is not None else {}
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(ExperimentConfig, raw)


def read_config_file(path: Union[str, Path]) -> dict:
    """The raw mapping of an experiment YAML; ``ConfigError`` for a missing file, bad YAML or a non-mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of an experiment YAML")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}")
    return loaded or {}


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``dotted.key=value`` override to a raw config dict (value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected the form section.key=value")
    key, value_text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key component in {key!r}")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(value_text) if value_text.strip() != "" else None


# YAML keys that are Python keywords, and the dataclass fields that hold them.
FIELD_OF_KEY = {"async": "async_"}
KEY_OF_FIELD = {v: k for k, v in FIELD_OF_KEY.items()}


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a raw mapping, checking names and types recursively."""
    label = where or "<top level>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a section (mapping), got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {KEY_OF_FIELD.get(f.name, f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in fields:
            nearest = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise ConfigError(f"unknown config key {dotted!r}{hint} Valid keys in {label}: {', '.join(sorted(fields))}")
        name = fields[key].name
        kwargs[name] = _coerce(hints[name], value, dotted)
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def fail() -> ConfigError:
        return ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")

    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        raise fail()
    if origin is Literal:
        if value in args:
            return value
        raise fail()
    if origin is list:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and args and args[0] is str:
            return [str(value)]  # a single path given where a list is expected
        if not isinstance(value, (list, tuple)):
            raise fail()
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise fail()
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):  # named sections (distillation.teacher_models)
            return {k: from_dict(args[1], v, f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                raise fail() from None
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    if tp is Any:
        return value
    raise ConfigError(f"config key {key!r}: unsupported field type {tp}")


def to_dict(cfg: Any) -> dict:
    """Plain-dict view (for saving the resolved config next to checkpoints and logs), under the YAML keys."""
    raw = dataclasses.asdict(cfg)
    return {KEY_OF_FIELD.get(k, k): v for k, v in raw.items()} if isinstance(raw, dict) else raw
