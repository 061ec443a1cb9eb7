"""The key reference: every config key's help lives in its dataclass (config_io.config_key), `grpo-jax config
--describe [SECTION]` prints it with the key's type, default and allowed values, and docs/configs.md is generated
from the same description (tools/gen_config_docs.py)."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import pathlib
import typing
from typing import Literal

import pytest

from grpo_jax.cli import EXIT_USER_ERROR, main
from grpo_jax.config_io import config_key, describe_config, describe_markdown, describe_text
from grpo_jax.run.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sections_of(cls, name: str = "") -> list[tuple[str, type]]:
    """(dotted name, dataclass) of `cls` and of every section reachable from it, by the annotations alone."""
    found = [(name, cls)]
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        for option in (hints[field.name], *typing.get_args(hints[field.name])):
            if dataclasses.is_dataclass(option):
                found += sections_of(option, f"{name}.{field.name}" if name else field.name)
    return found


def test_every_field_of_every_section_has_help():
    sections = sections_of(Config)
    assert len(sections) >= 16  # the top level, model, sampler, ..., trainer.wandb, mesh.actor, mesh.learner
    missing = [f"{name}.{field.name}".lstrip(".") + f" ({cls.__module__}.{cls.__qualname__})"
               for name, cls in sections for field in dataclasses.fields(cls) if not field.metadata.get("help")]
    assert not missing, ("config fields without help (give each one config_key(default, 'help'), then run "
                         "python tools/gen_config_docs.py): " + ", ".join(missing))


def test_config_key_refuses_a_key_without_help():
    with pytest.raises(TypeError, match="help"):
        config_key(1)


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Inner:
    depth: int = config_key(3, "How deep.")


@dataclasses.dataclass(frozen=True)
class Outer:
    count: int = config_key(2, "How many.")
    scale: float | None = config_key(None, "A scale, or none.")
    mode: Literal["fast", "slow"] = config_key("fast", "How to run.")
    flag: bool = config_key(False, "A switch.")
    colour: Colour = config_key(Colour.RED, "A colour.")
    name: str = config_key("", "A name.")
    items: tuple[str, ...] = config_key(("a", "b"), "Some items.")
    table: dict = config_key(help="A mapping.", default_factory=dict)
    inner: Inner = config_key(help="The inner section.", default_factory=Inner)
    extra: Inner | None = config_key(None, "An optional section.")


def test_describe_config_gives_each_key_its_dotted_name_type_default_allowed_values_and_help():
    top, inner, extra = describe_config(Outer)
    keys = {key.name: key for key in top.keys}
    assert list(keys) == ["count", "scale", "mode", "flag", "colour", "name", "items", "table"]
    assert (keys["count"].type, keys["count"].default, keys["count"].allowed, keys["count"].help) == \
        ("int", "2", (), "How many.")
    assert (keys["scale"].type, keys["scale"].default, keys["scale"].allowed) == ("float | None", "null", ())
    assert (keys["mode"].type, keys["mode"].default, keys["mode"].allowed) == \
        ("'fast' | 'slow'", "'fast'", ("'fast'", "'slow'"))
    assert (keys["flag"].type, keys["flag"].default, keys["flag"].allowed) == ("bool", "false", ("true", "false"))
    assert (keys["colour"].type, keys["colour"].default, keys["colour"].allowed) == \
        ("Colour", "'red'", ("'red'", "'blue'"))
    assert (keys["name"].default, keys["name"].allowed) == ("''", ())  # a str's values are not the type's to say
    assert (keys["items"].type, keys["items"].default) == ("tuple[str, ...]", "['a', 'b']")
    assert (keys["table"].type, keys["table"].default) == ("dict", "{}")
    assert (inner.name, inner.help, inner.optional, [k.name for k in inner.keys]) == \
        ("inner", "The inner section.", False, ["inner.depth"])
    assert (extra.name, extra.optional, [k.name for k in extra.keys]) == ("extra", True, ["extra.depth"])


def test_describe_text_prints_each_key_with_its_type_default_help_and_allowed_values():
    text = describe_text(describe_config(Outer))
    assert "[top level]" in text and "[inner]" in text and "[extra (optional: absent unless given)]" in text
    assert "  mode: 'fast' | 'slow' = 'fast'\n      How to run.\n      allowed: 'fast', 'slow'\n" in text
    assert "  inner.depth: int = 3\n      How deep.\n" in text


def test_describe_markdown_keeps_a_type_with_a_bar_in_its_cell():
    markdown = describe_markdown(describe_config(Outer))
    assert "| `scale` | float \\| None | null | A scale, or none. |" in markdown
    assert "## inner\n\nThe inner section.\n" in markdown


def test_config_describe_prints_one_section(capsys):
    assert main(["config", "--describe", "sampler"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[sampler]\n")
    assert "  sampler.temperature: float = 1.0\n      Sampling temperature; 0: greedy.\n" in out
    assert "sampler.inflight_updates: bool = true" in out and "allowed: true, false" in out
    assert "data." not in out and "[data]" not in out


def test_config_describe_of_a_section_includes_the_sections_in_it(capsys):
    assert main(["config", "--describe", "mesh"]) == 0
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert headers == ["[mesh]", "[mesh.actor]", "[mesh.learner]"]


def test_config_describe_without_a_section_prints_every_key(capsys):
    assert main(["config", "--describe"]) == 0
    out = capsys.readouterr().out
    for section in describe_config(Config):
        for key in section.keys:
            assert f"  {key.name}: " in out


def test_config_describe_of_an_unknown_section_is_one_line_naming_it_and_the_sections(capsys):
    assert main(["config", "--describe", "samplr"]) == EXIT_USER_ERROR == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("grpo-jax: error: --describe samplr: no such config section")
    assert "sampler" in lines[0] and "trainer.wandb" in lines[0]


def _gen_config_docs():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_configs_page_agrees_with_the_dataclasses():
    tool = _gen_config_docs()
    page = (ROOT / "docs" / "configs.md").read_text(encoding="utf-8")
    assert tool.MARKER in page, "docs/configs.md lost its generated-reference marker line"
    assert "`sampler.temperature`" in page
    assert page == tool.page_text(page), ("docs/configs.md disagrees with the config dataclasses: run "
                                          "python tools/gen_config_docs.py and commit the page")
