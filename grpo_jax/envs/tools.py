"""Tools: plain Python functions an environment offers the model, described by the JSON schema chat templates list.

`Tool.from_function(fn)` reads the schema from fn's type hints and its Google-style docstring: the docstring's
text before its first section is the description, each line of its `Args:` section describes one parameter.
The schema is OpenAI's function format, as transformers' `get_json_schema` writes it (the same dict for the
types below, which the tests check):

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {
        "type": "object", "properties": {name: {"type": ..., "description": ...}}, "required": [...]}}}

Types: str, int, float, bool, list, list[X], dict, dict[str, X], Literal[...] of JSON scalars, and `X | None`
(Optional[X]: "nullable"). A parameter with a default is not required. Anything else (a missing hint, *args,
another union, a class of your own), a function without a docstring, or a parameter the docstring does not
describe is refused when the tool is made (ToolDefinitionError, naming the function, the parameter and the fix).

`call(arguments)` / `await run(arguments)`: the model's arguments are checked against the parameters (names,
required ones, types; an int is a number, a bool is not an int) before the function runs. A refused call, a
ToolError the function raises, and any other exception it raises (a division by zero from the model's
arguments) are all a ToolError, whose message the environment sends back to the model as the tool's result:
the episode goes on. A result is sent as text: a str as it is, anything else as JSON.

An error message that echoes the model's value writes it as ASCII JSON (`ensure_ascii`: a lone surrogate the
model escaped, `"\\ud800"`, stays those six characters, which any tokenizer encodes) cut to ECHO_CHARS. The checks
walk a value only as deep as the parameter's type hint; the renderers read arguments at most json_text.MAX_DEPTH
deep, and a deeper value handed to call() directly is echoed by its type alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

_SCALAR_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_JSON_SCALARS = (str, int, float, bool, type(None))
_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^()]*\))?\s*:\s*(.*)$")
ECHO_CHARS = 200  # of the model's value, in an error message


class ToolError(Exception):
    """A tool call that failed: refused arguments, or the function's own failure. The message is what the model
    reads as the tool's result."""


class ToolDefinitionError(TypeError):
    """A function that cannot be a tool; the message names the function, the parameter and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One call the model asked for: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


def is_int(value) -> bool:
    """An int, not a bool (which Python counts as one): tool arguments and the environments' kwargs."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalar_check(tp: type) -> Callable[[Any], bool]:
    if tp is bool:
        return lambda v: isinstance(v, bool)
    if tp is int:
        return is_int
    if tp is float:  # JSON has one number type: 3 is a fine float
        return is_number
    return lambda v: isinstance(v, str)


def _type_schema(hint, where: str) -> tuple[dict, Callable[[Any], bool]]:
    """The JSON schema of a type hint and a check that a JSON value fits it; ToolDefinitionError otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALAR_TYPES:
        return {"type": _SCALAR_TYPES[hint]}, _scalar_check(hint)
    if hint is list or (origin is list and not args):
        return {"type": "array"}, lambda v: isinstance(v, list)
    if origin is list:
        items, items_ok = _type_schema(args[0], where)
        return {"type": "array", "items": items}, lambda v: isinstance(v, list) and all(items_ok(x) for x in v)
    if hint is dict or (origin is dict and not args):
        return {"type": "object"}, lambda v: isinstance(v, dict)
    if origin is dict:
        if args[0] is not str:
            raise ToolDefinitionError(f"{where}: {_hint_name(hint)}: JSON objects have string keys; use dict[str, ...]")
        values, values_ok = _type_schema(args[1], where)
        return ({"type": "object", "additionalProperties": values},
                lambda v: isinstance(v, dict) and all(values_ok(x) for x in v.values()))
    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        if len(others) != 1:
            raise ToolDefinitionError(f"{where}: {_hint_name(hint)}: of unions only X | None is supported; give the "
                                      "parameter one type")
        schema, ok = _type_schema(others[0], where)
        return {**schema, "nullable": True}, lambda v: v is None or ok(v)
    if origin is Literal:
        if not args or any(type(a) not in _JSON_SCALARS for a in args):
            raise ToolDefinitionError(f"{where}: {_hint_name(hint)}: a Literal's values must be str, int, float, "
                                      "bool or None")
        kinds = list(dict.fromkeys({**_SCALAR_TYPES, type(None): "null"}[type(a)] for a in args))
        # `True in (1,)` holds in Python: the value's type must match one of the equal choices too
        return ({"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)},
                lambda v: any(v == a and type(v) is type(a) for a in args))
    raise ToolDefinitionError(f"{where}: type {_hint_name(hint)} is not supported; use str, int, float, bool, "
                              "list[...], dict[str, ...], Literal[...] or X | None")


def _hint_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _describe(schema: dict) -> str:
    """A schema as the words an error message uses: 'integer', 'array of string', 'one of "a", "b"'."""
    if "enum" in schema:
        text = "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    elif schema["type"] == "array" and "items" in schema:
        text = f"array of {_describe(schema['items'])}"
    elif schema["type"] == "object" and "additionalProperties" in schema:
        text = f"object of {_describe(schema['additionalProperties'])}"
    else:
        text = schema["type"]
    return text + " or null" if schema.get("nullable") else text


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's description (its text before the first section) and its `Args:` lines as
    {parameter: description}; a description may continue on lines indented deeper than its name."""
    lines = inspect.cleandoc(doc).splitlines()
    sections = [i for i, line in enumerate(lines) if _SECTION.match(line)]
    description = "\n".join(lines[:sections[0]] if sections else lines).strip()
    described: dict[str, str] = {}
    for start in sections:
        if _SECTION.match(lines[start]).group(1) not in ("Args", "Arguments"):
            continue
        end = next((i for i in sections if i > start), len(lines))
        block = [line for line in lines[start + 1:end] if line.strip()]
        indent = min((len(line) - len(line.lstrip()) for line in block), default=0)
        name = None
        for line in block:
            entry = _ARG_LINE.match(line[indent:]) if len(line) - len(line.lstrip()) == indent else None
            if entry:
                name = entry.group(1)
                described[name] = entry.group(2).strip()
            elif name is not None:
                described[name] = (described[name] + " " + line.strip()).strip()
    return description, described


def echo(value: Any) -> str:
    """The model's value as an error message shows it: ASCII JSON, at most ECHO_CHARS characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):  # not JSON, a huge int, nested past the stack
        return f"a value of type {type(value).__name__}"
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS - 3] + "..."


def _result_text(name: str, result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(f"tool {name} returned a {type(result).__name__}, which is neither a str nor JSON ({e}); "
                        "return a str") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tool:
    """A function the model may call, with its schema. Build it with Tool.from_function."""

    name: str
    description: str
    parameters: dict  # the JSON schema of the arguments object
    function: Callable
    checks: dict = dataclasses.field(repr=False)  # parameter -> check of a JSON value against its type

    @classmethod
    def from_function(cls, fn: Callable) -> Tool:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or not name or name == "<lambda>":
            raise ToolDefinitionError(f"{fn!r}: a tool is a named function (def), with type hints and a docstring")
        doc = inspect.getdoc(fn)
        if not doc:
            raise ToolDefinitionError(f"tool {name}: no docstring; write one: its first lines are the description "
                                      "the model reads, its Args: section describes each parameter")
        description, described = parse_docstring(doc)
        if not description:
            raise ToolDefinitionError(f"tool {name}: the docstring has no description before its sections; start it "
                                      "with what the tool does")
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # noqa: BLE001 - a hint naming something undefined: report it, whatever it raised
            raise ToolDefinitionError(f"tool {name}: cannot read its type hints ({type(e).__name__}: {e})") from e
        properties, required, checks = {}, [], {}
        for param in inspect.signature(fn).parameters.values():
            where = f"tool {name}, parameter {param.name}"
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                raise ToolDefinitionError(f"{where}: the model passes arguments by name; use a plain parameter "
                                          "instead of *args, **kwargs or a positional-only one")
            if param.name not in hints:
                raise ToolDefinitionError(f"{where}: no type hint; annotate it (str, int, float, bool, list[...], "
                                          "dict[str, ...], Literal[...] or X | None)")
            if param.name not in described:
                raise ToolDefinitionError(f"{where}: not described in the docstring; add a line "
                                          f"'{param.name}: what it is' under Args:")
            schema, checks[param.name] = _type_schema(hints[param.name], where)
            properties[param.name] = {**schema, "description": described[param.name]}
            if param.default is param.empty:
                required.append(param.name)
        unknown = sorted(set(described) - set(properties))
        if unknown:
            raise ToolDefinitionError(f"tool {name}: the docstring's Args: describes {', '.join(unknown)}, which "
                                      f"{name}() does not take; fix the name or remove the line")
        parameters = {"type": "object", "properties": properties}
        if required:
            parameters["required"] = required
        return cls(name=name, description=description, parameters=parameters, function=fn, checks=checks)

    @property
    def schema(self) -> dict:
        """The tool as chat templates take it (`tools=[...]`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check_arguments(self, arguments: Any) -> None:
        """ToolError unless `arguments` is an object of the tool's parameters, each of its type, none missing."""
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: the arguments must be a JSON object, got {echo(arguments)}")
        allowed = self.parameters["properties"]
        for key, value in arguments.items():
            if key not in allowed:
                raise ToolError(f"{self.name}: unknown argument {str(key)[:ECHO_CHARS]!r} (its arguments: "
                                f"{', '.join(allowed) or 'none'})")
            if not self.checks[key](value):
                raise ToolError(f"{self.name}: argument {key!r} must be {_describe(allowed[key])}, got {echo(value)}")
        missing = [key for key in self.parameters.get("required", ()) if key not in arguments]
        if missing:
            raise ToolError(f"{self.name}: missing argument {', '.join(repr(k) for k in missing)}")

    def call(self, arguments: Any) -> str:
        """Run a plain (not async) tool function on the model's arguments: its result as text, or ToolError."""
        if inspect.iscoroutinefunction(self.function):
            raise TypeError(f"tool {self.name} is an async function: await tool.run(arguments)")
        self.check_arguments(arguments)
        try:
            result = self.function(**arguments)
        except ToolError:
            raise
        except Exception as e:  # noqa: BLE001 - the model's arguments can make any tool fail: it reads why
            raise ToolError(f"{self.name} raised {type(e).__name__}: {e}") from e
        return _result_text(self.name, result)

    async def run(self, arguments: Any) -> str:
        """call() for an event loop: an async function is awaited, a plain one runs in a worker thread (so that a
        slow tool does not stall the other episodes on the loop)."""
        self.check_arguments(arguments)
        try:
            if inspect.iscoroutinefunction(self.function):
                result = await self.function(**arguments)
            else:
                result = await asyncio.to_thread(self.function, **arguments)
        except ToolError:
            raise
        except Exception as e:  # noqa: BLE001 - as in call()
            raise ToolError(f"{self.name} raised {type(e).__name__}: {e}") from e
        return _result_text(self.name, result)
