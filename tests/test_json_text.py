"""json_text: untrusted JSON text read back as json.loads reads it, or refused with one JSONTextError line: too deep
(before any recursion), integers past Python's digit limit, NaN, Infinity and numbers too large for a float, bytes
that are no UTF-8, and any other text; loads_prefix reads the value a text starts with."""

import json
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.json_text import MAX_DEPTH, JSONTextError, loads, loads_prefix, nesting_depth

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**40, 10**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=25)


def depth_of(value) -> int:
    if isinstance(value, dict | list):
        items = value.values() if isinstance(value, dict) else value
        return 1 + max((depth_of(v) for v in items), default=0)
    return 0


@settings(max_examples=150, deadline=None)
@given(value=JSON_VALUES, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 2]))
def test_every_json_value_reads_back_as_itself_and_its_depth_is_counted(value, ensure_ascii, indent):
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)
    assert loads(text) == value and loads(text.encode("utf-8")) == value
    assert nesting_depth(text) == depth_of(value)
    assert loads_prefix(text + ' tail {"x": [') == (value, len(text))


def finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict | list):
        return all(finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return True


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from(list('[]{}",:\\ 0123456789.eE+-nulltrueNaIfiy\ud800é')), max_size=40))
def test_any_text_is_its_json_value_or_one_json_text_error(text):
    try:
        expected = ("read", json.loads(text))
    except (ValueError, RecursionError):
        expected = ("refused",)
    try:
        got = ("read", loads(text))
    except JSONTextError as e:
        assert "\n" not in str(e)
        got = ("refused",)
    if expected[0] == "read" and finite(expected[1]):
        assert got == expected
    else:  # what json.loads refuses, and NaN, Infinity, 1e999, which it reads
        assert got == ("refused",)


def test_the_depth_bound_is_checked_before_parsing_and_without_recursion():
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    for depth in (MAX_DEPTH + 1, 1000, 20_000):
        for opener, closer in (("[", "]"), ('{"a":', "}")):
            with pytest.raises(JSONTextError, match=f"nested {depth} deep, more than the {MAX_DEPTH} levels read"):
                loads(opener * depth + "1" + closer * depth)
            with pytest.raises(JSONTextError, match=f"nested {depth} deep"):
                loads_prefix(opener * depth)  # unclosed: still refused by depth, not a RecursionError
    # Brackets inside strings are text, not nesting.
    assert loads('"' + "[" * 5000 + '"') == "[" * 5000
    assert nesting_depth('["\\"[[[", {"k": ["]"]}]') == 3
    # With the bound off, the interpreter's own limit is still a JSONTextError.
    with pytest.raises(JSONTextError, match="nested too deep for the interpreter to read"):
        loads("[" * (sys.getrecursionlimit() * 20) + "]" * (sys.getrecursionlimit() * 20), max_depth=None)


def test_huge_integers_non_finite_numbers_and_bytes_that_are_no_utf8_are_refused_in_one_line():
    limit = sys.get_int_max_str_digits()
    assert loads("9" * limit) == int("9" * limit)
    with pytest.raises(JSONTextError, match=f"an integer longer than the {limit} digits read"):
        loads('{"a": ' + "1" * 5000 + "}")
    for text in ("NaN", "[Infinity]", '{"b": -Infinity}'):
        with pytest.raises(JSONTextError, match="is not a JSON value"):
            loads(text)
    for text in ("1e999", "[-1e400]", "1" * 5000 + ".5"):
        with pytest.raises(JSONTextError, match="too large for a float"):
            loads(text)
    assert math.isnan(loads("NaN", allow_nan=True)) and loads("1e999", allow_nan=True) == math.inf
    with pytest.raises(JSONTextError, match=r"not UTF-8 text \(invalid start byte at byte 1\)"):
        loads(b'"\xff"')
    with pytest.raises(JSONTextError, match=r"not JSON \(Expecting ',' delimiter at line 1 column 7\)"):
        loads('[1, 2 3]')
    with pytest.raises(JSONTextError, match="not JSON"):
        loads_prefix(" [1]")  # a value starts the text: no whitespace before it
