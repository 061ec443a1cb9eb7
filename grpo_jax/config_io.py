"""Typed configs: dataclasses filled from YAML plus dotted command-line overrides.

Everything a user can get wrong is refused here, before any compute, with one message that names the
key, the value and what is allowed. Each config dataclass may define `validate() -> list[str]` for rules
that involve values (ranges, divisibility); type checking is generic and driven by the annotations.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
import typing
from typing import Any

import yaml

from grpo_jax.errors import ConfigError, RunDirError  # noqa: F401 - ConfigError: raised here, importable from here


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp, key: str) -> Any:
    """Check `value` against annotation `tp` and return it converted (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        others = [option for option in options if option is not type(None)]
        if len(others) == 1:  # `X | None` given a value: X's own error (a section's bad key) says what is wrong
            return _convert(value, others[0], key)
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: allowed values are {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping of {tp.__name__} fields")
        return _build(tp, value, key)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        (item_tp, *rest) = typing.get_args(tp) or (Any,)
        items = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if tuple in (origin, tp) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-6 as a string (it wants 1.0e-6); accept the usual float spellings.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    raise ConfigError(f"{key}: unsupported config annotation {_type_name(tp)}")


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}' (allowed in {prefix or 'the top level'}: "
                              f"{', '.join(sorted(fields))})")
        kwargs[name] = _convert(value, hints[name], key)
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        problems = obj.validate()
        if problems:
            where = f"{prefix}." if prefix else ""
            raise ConfigError("invalid config: " + "; ".join(where + p for p in problems))
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=1e-6' -> (['optim', 'lr'], 1e-06); the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. optim.lr=1e-6")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: the key must be dotted names, e.g. model.dtype")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def merge_overrides(values: dict, overrides: list[str]) -> dict:
    merged = dict(values)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is not a section")
            else:
                child = dict(child)
            node[part] = child
            node = child
        node[path[-1]] = value
    return merged


def load_config(cls, path: str | pathlib.Path | None, overrides: list[str] = ()):
    """Build `cls` from a YAML file (or defaults when path is None) with dotted overrides applied."""
    return build_config(cls, read_config_file(path) if path is not None else {}, overrides)


def read_config_file(path: str | pathlib.Path) -> dict:
    """The mapping a YAML config file holds, unchecked."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return values


def build_config(cls, values: dict, overrides: list[str] = ()):
    """Build `cls` from a mapping shaped like the YAML file, with dotted overrides applied, checked as
    load_config checks a file."""
    return _build(cls, merge_overrides(values, list(overrides)))


def config_to_dict(obj) -> dict:
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(obj))


def save_config(obj, path: str | pathlib.Path) -> None:
    """Write the config as YAML, whole or not at all (a full disk leaves the previous file, not half of it):
    RunDirError naming the file when it cannot be written."""
    path = pathlib.Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(yaml.safe_dump(config_to_dict(obj), sort_keys=False))
        os.replace(partial, path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise RunDirError(f"cannot write {path} ({e.strerror or e}): free space (or fix the mount) and run the "
                          "same command again") from e
