"""Tools: the JSON schema from type hints and Google-style docstrings (the same as transformers' get_json_schema
writes), functions that cannot be tools refused in one line, and calls whose arguments are checked before the
function runs, every failure a ToolError for the model to read."""

import asyncio
import functools
import re
import threading
from typing import Literal, Optional

import pytest
from transformers.utils import get_json_schema

from grpo_jax.envs.tools import ECHO_CHARS, Tool, ToolDefinitionError, ToolError, echo, parse_docstring


def everything(query: str, count: int, scale: float, exact: bool, ids: list[int], weights: dict[str, float],
               tags: list, extra: dict, mode: Literal["fast", "slow"] = "fast",
               note: Optional[str] = None,  # noqa: UP045 - typing's spelling is a tool's type too
               limit: int | None = 10, level: Literal[1, 2, "max"] | None = None):
    """Search the catalogue.

    Two paragraphs of description: this is the second.

    Args:
        query: What to look for.
        count (int): How many results,
            at most.
        scale: A factor.
        exact: Whether to match exactly.
        ids: Items to include.
        weights: A weight per field.
        tags: Anything listed.
        extra: Anything keyed.
        mode: How hard to look.
        note: A remark, or nothing.
        limit: The most to return.
        level: How deep.

    Returns:
        The matches, one per line.
    """
    return f"{query} x{count}"


def test_the_schema_is_what_transformers_get_json_schema_writes():
    tool = Tool.from_function(everything)
    assert tool.schema == get_json_schema(everything)
    assert tool.description == "Search the catalogue.\n\nTwo paragraphs of description: this is the second."
    parameters = tool.parameters
    assert parameters["required"] == ["query", "count", "scale", "exact", "ids", "weights", "tags", "extra"]
    assert parameters["properties"]["count"] == {"type": "integer", "description": "How many results, at most."}
    assert parameters["properties"]["note"] == {"type": "string", "nullable": True,
                                                "description": "A remark, or nothing."}
    assert parameters["properties"]["level"] == {"type": ["integer", "string"], "enum": [1, 2, "max"],
                                                 "nullable": True, "description": "How deep."}
    assert parameters["properties"]["weights"]["additionalProperties"] == {"type": "number"}


class Calculator:
    def scaled(self, x: float, factor: float = 2.0) -> float:
        """Multiply by the calculator's factor.

        Args:
            x: The number.
            factor: By how much.
        """
        return x * factor


def test_a_bound_method_is_a_tool_without_its_self():
    tool = Tool.from_function(Calculator().scaled)
    assert tool.name == "scaled" and list(tool.parameters["properties"]) == ["x", "factor"]
    assert tool.parameters["required"] == ["x"] and tool.call({"x": 1.5}) == "3.0"


def test_parse_docstring_reads_descriptions_and_args_only():
    description, args = parse_docstring("""Do it.

        Args:
            a: First,
              continued.
            b (list[int]): Second.
        Raises:
            c: not an argument.
        """)
    assert (description, args) == ("Do it.", {"a": "First, continued.", "b": "Second."})


def _no_doc(x: int):
    return x


def _no_hint(x):
    """Doc.

    Args:
        x: A thing.
    """


def _star(*values: int):
    """Doc.

    Args:
        values: Things.
    """


def _positional(x: int, /):
    """Doc.

    Args:
        x: A thing.
    """


def _union(x: int | str):
    """Doc.

    Args:
        x: A thing.
    """


def _int_keys(x: dict[int, str]):
    """Doc.

    Args:
        x: A thing.
    """


def _custom(x: Calculator):
    """Doc.

    Args:
        x: A thing.
    """


def _tuple(x: tuple[int, int]):
    """Doc.

    Args:
        x: A thing.
    """


def _undescribed(x: int, y: int):
    """Doc.

    Args:
        x: A thing.
    """


def _misnamed(x: int):
    """Doc.

    Args:
        x: A thing.
        z: Not a parameter.
    """


def _only_sections(x: int):
    """Args:
        x: A thing.
    """


def _bad_literal(x: Literal[b"raw"]):
    """Doc.

    Args:
        x: A thing.
    """


def _undefined_hint(x: "Nowhere"):  # noqa: F821 - the name is undefined on purpose
    """Doc.

    Args:
        x: A thing.
    """


@pytest.mark.parametrize(("fn", "message"), [
    (_no_doc, "tool _no_doc: no docstring; write one"),
    (lambda x: x, "a tool is a named function"),
    (_no_hint, "tool _no_hint, parameter x: no type hint; annotate it"),
    (_star, "tool _star, parameter values: the model passes arguments by name"),
    (_positional, "parameter x: the model passes arguments by name"),
    (_union, r"parameter x: int \| str: of unions only X \| None is supported"),
    (_int_keys, r"dict\[int, str\]: JSON objects have string keys"),
    (_custom, r"parameter x: type Calculator is not supported; use str, int"),
    (_tuple, r"type tuple\[int, int\] is not supported"),
    (_undescribed, "tool _undescribed, parameter y: not described in the docstring; add a line 'y: what it is'"),
    (_misnamed, r"the docstring's Args: describes z, which _misnamed\(\) does not take"),
    (_only_sections, "tool _only_sections: the docstring has no description"),
    (_bad_literal, "a Literal's values must be str, int, float, bool or None"),
    (_undefined_hint, "tool _undefined_hint: cannot read its type hints"),
])
def test_functions_that_cannot_be_tools_are_refused_naming_the_fix(fn, message):
    with pytest.raises(ToolDefinitionError, match=message):
        Tool.from_function(fn)


def test_arguments_are_checked_before_the_function_runs():
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        return "ok"

    tool = Tool.from_function(everything)
    tool = Tool(name=tool.name, description=tool.description, parameters=tool.parameters, function=record,
                checks=tool.checks)
    good = {"query": "q", "count": 3, "scale": 2, "exact": False, "ids": [1, 2], "weights": {"a": 0.5},
            "tags": ["x", 1], "extra": {}}
    assert tool.call(good) == "ok" and tool.call({**good, "mode": "slow", "note": None, "level": "max"}) == "ok"
    refusals = {
        "the arguments must be a JSON object, got [1]": [1],
        "unknown argument 'qeury' (its arguments: query, count,": {**good, "qeury": "q"},
        "missing argument 'count', 'scale'": {"query": "q", "exact": True, "ids": [], "weights": {}, "tags": [],
                                              "extra": {}},
        "argument 'count' must be integer, got 2.5": {**good, "count": 2.5},
        "argument 'count' must be integer, got true": {**good, "count": True},
        "argument 'scale' must be number, got \"2\"": {**good, "scale": "2"},
        "argument 'exact' must be boolean, got 0": {**good, "exact": 0},
        "argument 'ids' must be array of integer, got [1, \"2\"]": {**good, "ids": [1, "2"]},
        "argument 'weights' must be object of number, got {\"a\": null}": {**good, "weights": {"a": None}},
        "argument 'mode' must be one of \"fast\", \"slow\", got \"medium\"": {**good, "mode": "medium"},
        "argument 'limit' must be integer or null, got \"10\"": {**good, "limit": "10"},
        "argument 'level' must be one of 1, 2, \"max\" or null, got true": {**good, "level": True},
        "argument 'query' must be string, got null": {**good, "query": None},
    }
    for message, arguments in refusals.items():
        with pytest.raises(ToolError, match="^everything: " + re.escape(message)):
            tool.call(arguments)
    assert len(calls) == 2  # only the good calls ran


def divide(a: float, b: float):
    """Divide.

    Args:
        a: The dividend.
        b: The divisor.
    """
    if b == 0 and a == 0:
        raise ToolError("0 / 0 is undefined")
    return {"quotient": a / b, "thread": threading.current_thread().name}


def test_failures_are_tool_errors_and_results_are_text():
    tool = Tool.from_function(divide)
    with pytest.raises(ToolError, match="^0 / 0 is undefined$"):
        tool.call({"a": 0, "b": 0})
    with pytest.raises(ToolError, match="^divide raised ZeroDivisionError: division by zero$") as caught:
        tool.call({"a": 1, "b": 0})
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert tool.call({"a": 1, "b": 4}) == '{"quotient": 0.25, "thread": "MainThread"}'

    def unserializable(x: int):
        """Return something JSON has no form for.

        Args:
            x: Anything.
        """
        return {1, 2}

    with pytest.raises(TypeError, match="tool unserializable returned a set, which is neither a str nor JSON"):
        Tool.from_function(unserializable).call({"x": 1})


def test_run_awaits_async_tools_and_sends_plain_ones_to_a_worker_thread():
    async def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: Where.
        """
        await asyncio.sleep(0)
        if not url.startswith("https://"):
            raise ValueError("only https")
        return "<html>"

    tool = Tool.from_function(fetch)

    async def main():
        out = [await tool.run({"url": "https://example.org"})]
        with pytest.raises(ToolError, match="^fetch raised ValueError: only https$"):
            await tool.run({"url": "ftp://x"})
        with pytest.raises(ToolError, match="^fetch: missing argument 'url'$"):
            await tool.run({})
        out.append(await Tool.from_function(divide).run({"a": 1, "b": 2}))
        with pytest.raises(ToolError, match="^divide raised ZeroDivisionError"):
            await Tool.from_function(divide).run({"a": 1, "b": 0})
        return out

    page, quotient = asyncio.run(main())
    assert page == "<html>" and '"quotient": 0.5' in quotient and "MainThread" not in quotient
    with pytest.raises(TypeError, match="tool fetch is an async function: await tool.run"):
        tool.call({"url": "https://example.org"})


def test_an_echoed_value_is_ascii_json_cut_short_and_no_value_makes_the_check_raise_anything_else():
    """The model's value in a refusal is ASCII JSON (a lone surrogate it escaped stays an escape, which any
    tokenizer encodes), at most ECHO_CHARS long; a value nested past the interpreter's stack, handed to call()
    directly, is still a ToolError naming its type."""
    tool = Tool.from_function(divide)
    refusals = {
        'argument \'a\' must be number, got ["\\ud800"]': ["\ud800"],
        'argument \'a\' must be number, got "\\u4e8c\\ud83d\\ude00"': "二😀",
        "argument 'a' must be number, got a value of type list": functools.reduce(lambda inner, _: [inner],
                                                                                  range(100_000), []),
    }
    for message, value in refusals.items():
        with pytest.raises(ToolError) as refused:
            tool.call({"a": value, "b": 1})
        assert str(refused.value) == "divide: " + message
        str(refused.value).encode("ascii")
    with pytest.raises(ToolError) as refused:
        tool.call({"a": "x" * 100_000, "b": 1})
    assert len(str(refused.value)) < ECHO_CHARS + 60 and str(refused.value).endswith('xxx...')
    with pytest.raises(ToolError, match=r"^divide: unknown argument '\\udfff'"):
        tool.call({"a": 1, "b": 1, "\udfff": 0})
    assert echo({1, 2}) == "a value of type set" and echo(10 ** 5000) == "a value of type int"
