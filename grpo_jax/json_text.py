"""JSON text from outside the program (a dataset row, a tool call a model sampled) read without ever raising anything
but `JSONTextError`.

`loads(text, max_depth=MAX_DEPTH)` is `json.loads` with every way untrusted text can make it fail turned into one
`JSONTextError` (a ValueError) whose message is one line: malformed text, a value nested deeper than `max_depth`
(checked before parsing, so a row nested thousands deep is refused without recursing), an integer with more digits
than Python converts (`sys.get_int_max_str_digits`), and the interpreter's own RecursionError where the depth check
was turned off. NaN and Infinity are refused unless `allow_nan`, and so is a number too large for a float (`1e999`,
which json.loads reads as infinity): they are not JSON numbers, and an argument that holds one poisons every
statistic it reaches (datasets written by pandas do hold them). The result is plain JSON (dicts, lists, str, int,
float, bool, None) nested at most `max_depth` deep, so that code walking it recursively cannot exhaust the stack.

`loads_prefix(text)` reads the one JSON value `text` starts with and says where it ends (json's raw_decode), for
formats where more text follows a value (a Llama 3 tool call, the compact renderer's `k=v` arguments); the depth
bound covers the whole text.

Pure Python, no JAX: the data pipeline and the environments' renderers both use it.
"""

from __future__ import annotations

import json
import math
import sys

MAX_DEPTH = 100  # deeper than any real dataset row or tool call; far below the interpreter's recursion limit


class JSONTextError(ValueError):
    """Text that is not one JSON value this program will read; the message is one line."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { in `text`, outside strings (0 for a scalar). Linear, no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _refuse_constant(name: str):
    raise JSONTextError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONTextError(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is too large for a float")
    return value


def _decoder(allow_nan: bool) -> json.JSONDecoder:
    return json.JSONDecoder() if allow_nan else json.JSONDecoder(parse_constant=_refuse_constant,
                                                                 parse_float=_finite_float)


_STRICT, _LENIENT = _decoder(allow_nan=False), _decoder(allow_nan=True)


def _text(text: str | bytes, max_depth: int | None) -> str:
    if isinstance(text, bytes | bytearray):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONTextError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    # Nesting cannot be deeper than the number of openers: most texts need no scan.
    if max_depth is not None and text.count("[") + text.count("{") > max_depth:
        depth = nesting_depth(text)
        if depth > max_depth:
            raise JSONTextError(f"nested {depth} deep, more than the {max_depth} levels read")
    return text


def _decode(decode, text: str):
    try:
        return decode(text)
    except JSONTextError:
        raise
    except json.JSONDecodeError as e:
        raise JSONTextError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise JSONTextError("nested too deep for the interpreter to read") from None
    except ValueError:  # the only ValueError json raises past JSONDecodeError: int()'s digit limit
        raise JSONTextError(f"an integer longer than the {sys.get_int_max_str_digits()} digits read") from None


def loads(text: str | bytes, max_depth: int | None = MAX_DEPTH, allow_nan: bool = False):
    """The JSON value `text` holds, or JSONTextError naming why not (see the module docstring)."""
    text = _text(text, max_depth)
    return _decode((_LENIENT if allow_nan else _STRICT).decode, text)


def loads_prefix(text: str, max_depth: int | None = MAX_DEPTH, allow_nan: bool = False) -> tuple[object, int]:
    """(value, end): the JSON value `text` starts with (no whitespace before it) and the index just past it; what
    follows is the caller's. JSONTextError as loads, the depth bound applied to the whole text."""
    text = _text(text, max_depth)
    return _decode((_LENIENT if allow_nan else _STRICT).raw_decode, text)
