"""Typed configs: dataclasses filled from YAML plus dotted command-line overrides.

Everything a user can get wrong is refused here, before any compute, with one message that names the
key, the value and what is allowed. Each config dataclass may define `validate() -> list[str]` for rules
that involve values (ranges, divisibility); type checking is generic and driven by the annotations.

Each key's help is its field's metadata (config_key); describe_config reads it with the key's type and
default, for `grpo-jax config --describe` (describe_text) and docs/configs.md (describe_markdown).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import textwrap
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


# ----------------------------------------------------------------------------- the key reference


def config_key(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Any = dataclasses.MISSING):
    """A config field with its help, what `grpo-jax config --describe` and docs/configs.md print for it:
    `temperature: float = config_key(1.0, "0: greedy")`; a mutable default or a section by
    `config_key(help=..., default_factory=...)`."""
    if not help:
        raise TypeError("config_key: every config key needs its help text")
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One config key as the reference prints it."""

    name: str  # dotted, e.g. sampler.temperature
    type: str  # the annotation, readable: int, float | None, 'a' | 'b'
    default: str  # as YAML reads it back: 1.0, true, null, 'float32'
    allowed: tuple[str, ...]  # the values the type allows (Literal, bool, enum); () where the type does not say
    help: str


@dataclasses.dataclass(frozen=True)
class SectionDoc:
    """One config dataclass: its dotted name ("" for the top level), the help of the field holding it, whether
    it is absent unless given (`X | None = None`), and its keys (those that are not sections themselves)."""

    name: str
    help: str
    optional: bool
    keys: tuple[KeyDoc, ...]


def _value_text(value: Any) -> str:
    """A value spelled as in a YAML config (strings quoted, so '' shows)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _value_text(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _options(tp) -> tuple:
    """The members of a union annotation (X | None -> X, NoneType); any other annotation alone."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _readable_type(tp) -> str:
    if len(_options(tp)) > 1:
        return " | ".join(_readable_type(option) for option in _options(tp))
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(_value_text(v) for v in typing.get_args(tp))
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _allowed(tp) -> tuple[str, ...]:
    """The values `tp` allows when it names them all (Literal, bool, an enum, None beside them); else ()."""
    allowed = []
    for option in _options(tp):
        if option is type(None):
            allowed.append("null")
        elif typing.get_origin(option) is typing.Literal:
            allowed += [_value_text(v) for v in typing.get_args(option)]
        elif option is bool:
            allowed += ["true", "false"]
        elif isinstance(option, type) and issubclass(option, enum.Enum):
            allowed += [_value_text(member) for member in option]
        else:
            return ()
    return tuple(allowed)


def _section_class(tp):
    """The dataclass a field's annotation holds (a section: `X` or `X | None`), else None."""
    found = [option for option in _options(tp) if dataclasses.is_dataclass(option)]
    return found[0] if found else None


def describe_config(cls, name: str = "", help: str = "", optional: bool = False) -> list[SectionDoc]:
    """`cls` and the sections in it, each with its keys (dotted names below `name`, type, default, allowed values,
    help), in field order: a section's own keys first, then its sections, each followed by the ones in it."""
    hints = typing.get_type_hints(cls)
    keys, nested = [], []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        dotted = f"{name}.{field.name}" if name else field.name
        tp, text = hints[field.name], field.metadata.get("help", "")
        section = _section_class(tp)
        if section is not None:
            nested += describe_config(section, dotted, text, optional=type(None) in _options(tp))
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        keys.append(KeyDoc(dotted, _readable_type(tp), "(required)" if default is dataclasses.MISSING
                           else _value_text(default), _allowed(tp), text))
    return [SectionDoc(name, help, optional, tuple(keys)), *nested]


def _section_title(section: SectionDoc) -> str:
    return section.name or "top level"


def describe_text(sections: list[SectionDoc], width: int = 100) -> str:
    """Plain text, as `grpo-jax config --describe` prints it: per section its name and help, then per key
    `name: type = default`, its help and allowed values indented below."""
    lines = []
    for section in sections:
        if lines:
            lines.append("")
        title = _section_title(section) + (" (optional: absent unless given)" if section.optional else "")
        lines.append(f"[{title}]")
        if section.help:
            lines += textwrap.wrap(section.help, width, initial_indent="  ", subsequent_indent="  ")
        for key in section.keys:
            lines.append(f"  {key.name}: {key.type} = {key.default}")
            lines += textwrap.wrap(key.help, width, initial_indent="      ", subsequent_indent="      ")
            if key.allowed:
                lines.append(f"      allowed: {', '.join(key.allowed)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: its '|' kept from splitting the row, '*' and '<' from becoming markup."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def describe_markdown(sections: list[SectionDoc]) -> str:
    """Markdown, as docs/configs.md holds it below its introduction: per section a heading, its help and a table
    of its keys."""
    out = []
    for section in sections:
        out.append(f"## {section.name or 'Top level'}\n")
        about = section.help + (" Absent unless given (default null)." if section.optional else "")
        if about.strip():
            out.append(_cell(about.strip()) + "\n")
        out.append("| Key | Type | Default | Help |\n| --- | --- | --- | --- |")
        for key in section.keys:
            help_text = key.help + (f" Allowed: {', '.join(key.allowed)}." if key.allowed else "")
            out.append(f"| `{key.name}` | {_cell(key.type)} | {_cell(key.default)} | {_cell(help_text)} |")
        out.append("")
    return "\n".join(out)
