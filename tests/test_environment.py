"""Environments: EnvConfig's validation and the factory named by import path (one-line errors), the default step
that runs tool calls (every failure an error message for the model, counted), StepResult's and reward()'s
contracts, the docs' calculator example run as written, and a package that imports no JAX."""

import asyncio
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_jax.config_io import ConfigError, build_config
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.environment import EnvConfig, Environment, StepResult, make_environment, reward_parts
from grpo_jax.envs.render import make_renderer
from grpo_jax.envs.tools import Tool

DOCS = Path(__file__).resolve().parent.parent / "docs" / "environments.md"
MODULE = "my_user_envs"
USER_ENVS = textwrap.dedent('''
    """A user's environments module, as it would sit on PYTHONPATH."""
    from grpo_jax.envs.environment import Environment
    from grpo_jax.envs.tools import Tool


    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: What to shout.
        """
        return text.upper()


    class Shouter(Environment):
        tools = [Tool.from_function(shout)]

        def __init__(self, greeting="hi"):
            self.greeting = greeting

        async def reset(self, row, seed):
            return [{"role": "user", "content": self.greeting}]

        async def reward(self):
            return 1.0


    def make(greeting="hi"):
        return Shouter(greeting)


    def not_an_env():
        return {"role": "user"}


    def broken():
        raise RuntimeError("no licence server")


    class PlainTools(Shouter):
        tools = [shout]


    class TwinTools(Shouter):
        tools = [Tool.from_function(shout), Tool.from_function(shout)]
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(USER_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop(MODULE, None)


def test_env_config_problems_name_the_key_the_value_and_the_fix(user_module):
    assert EnvConfig(name=f"{MODULE}:make").validate() == []
    problems = EnvConfig(name="", max_turns=0, max_total_tokens=True, concurrency=-1, step_timeout_s=float("nan"),
                         kwargs=[1]).validate()
    assert problems == [
        "name='': name a built-in environment (gsm8k_python, countdown_multiturn, fetch_code) or a factory of "
        "your own by import path 'package.module:factory', or an agent (env.agent)",
        "kwargs=[1]: a mapping of the factory's keyword arguments",
        "max_turns=0: must be an integer >= 1 (assistant turns per episode)",
        "max_total_tokens=True: must be an integer >= 1 (tokens one sequence may hold)",
        "concurrency=-1: must be an integer >= 1 (environment calls at once)",
        "step_timeout_s=nan: must be a number of seconds > 0"]
    assert EnvConfig(name="calculator").validate() == [
        "name='calculator': allowed countdown_multiturn, fetch_code, gsm8k_python, or a factory of your own by "
        "import path 'package.module:factory'"]
    assert EnvConfig(name="nowhere_at_all:make").validate() == [
        "name='nowhere_at_all:make': no module named nowhere_at_all (put the directory that holds it on PYTHONPATH, "
        "or install it)"]
    assert EnvConfig(name=f"{MODULE}:mkae").validate() == [f"name='{MODULE}:mkae': module {MODULE} has no attribute "
                                                           "'mkae'"]
    # Built as a config section: types from the annotations, then validate(), one line.
    with pytest.raises(ConfigError, match=r"^max_turns='4': expected an integer$"):
        build_config(EnvConfig, {"name": f"{MODULE}:make", "max_turns": "4"})
    with pytest.raises(ConfigError, match=r"^invalid config: step_timeout_s=0.0: must be a number of seconds > 0$"):
        build_config(EnvConfig, {"name": f"{MODULE}:make", "step_timeout_s": 0})
    with pytest.raises(ConfigError, match=r"^unknown config key 'max_steps'"):
        build_config(EnvConfig, {"name": f"{MODULE}:make", "max_steps": 3})


def test_make_environment_calls_the_factory_and_refuses_what_is_not_an_environment(user_module):
    env = make_environment(build_config(EnvConfig, {"name": f"{MODULE}:make", "kwargs": {"greeting": "hello"}}))
    assert isinstance(env, Environment) and asyncio.run(env.reset({}, 0)) == [{"role": "user", "content": "hello"}]
    assert make_environment(EnvConfig(name=f"{MODULE}:Shouter")).greeting == "hi"  # a class is a factory
    refusals = {
        f"{MODULE}:make": (dict(kwargs={"greting": "x"}),
                           r"^env.name='my_user_envs:make': my_user_envs:make\(\*\*kwargs\) raised TypeError: "
                           r"make\(\) got an unexpected keyword argument 'greting'; the name must be a factory "
                           r"f\(\*\*kwargs\) returning a new grpo_jax.envs.environment.Environment$"),
        f"{MODULE}:not_an_env": ({}, r"returned a dict, not an Environment; the name must be a factory"),
        f"{MODULE}:broken": ({}, r"broken\(\*\*kwargs\) raised RuntimeError: no licence server$"),
        f"{MODULE}:PlainTools": ({}, r"tools\[0\] is a function, not a Tool; make it one with "
                                 r"grpo_jax.envs.tools.Tool.from_function\(fn\)"),
        f"{MODULE}:TwinTools": ({}, r"two tools are named 'shout'; the model calls tools by name"),
        f"{MODULE}:nope": ({}, r"^invalid config: env.name='my_user_envs:nope': module my_user_envs has no attribute"),
    }
    for name, (fields, message) in refusals.items():
        with pytest.raises(ConfigError, match=message):
            make_environment(EnvConfig(name=name, **fields))


def square(x: float) -> float:
    """Square a number.

    Args:
        x: The number.
    """
    return x * x


class Squares(Environment):
    tools = [Tool.from_function(square)]

    async def reset(self, row, seed):
        return [{"role": "user", "content": "Square 3."}]

    async def reward(self):
        return 0.0


def test_the_default_step_runs_each_call_and_answers_every_failure_with_an_error():
    renderer = make_renderer("qwen2", Tokenizer.byte_level())
    env = Squares()

    def step(text):
        return asyncio.run(env.step(renderer.parse(renderer.tokenizer.encode(text) + list(renderer.end_of_turn_ids))))

    result = step('<tool_call>\n{"name": "square", "arguments": {"x": 3}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "cube", "arguments": {"x": 3}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "square", "arguments": {"y": 3}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "square", "arguments": {"x": "3"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "square", "arguments": {"x": 3}\n</tool_call>')
    assert result.messages == [
        {"role": "tool", "name": "square", "content": "9"},
        {"role": "tool", "name": "cube", "content": "Error: unknown tool 'cube' (tools: square)"},
        {"role": "tool", "name": "square", "content": "Error: square: unknown argument 'y' (its arguments: x)"},
        {"role": "tool", "name": "square", "content": 'Error: square: argument \'x\' must be number, got "3"'},
        {"role": "tool", "content": "Error: tool call 5: not JSON (Expecting ',' delimiter at line 1 column 41)"}]
    assert (result.done, result.tool_errors, result.reward) == (False, 4, None)
    only_broken = step('<tool_call>\n{"name": "square"\n</tool_call>')  # a failed call, not an answer: go on
    assert (only_broken.done, only_broken.tool_errors, len(only_broken.messages)) == (False, 1, 1)
    assert step("It is 9.") == StepResult(messages=[], done=True)


def test_step_results_and_rewards_keep_their_contract():
    with pytest.raises(ValueError, match=r"StepResult.messages\[0\]: role='assistant': allowed user, tool"):
        StepResult(messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"StepResult.messages\[1\]: content must be a str, got dict"):
        StepResult(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": {"x": 1}}])
    with pytest.raises(ValueError, match=r"StepResult.reward='1': a number, or None"):
        StepResult(messages=[], reward="1")
    with pytest.raises(ValueError, match=r"StepResult.done=1: True or False"):
        StepResult(messages=[], done=1)
    with pytest.raises(ValueError, match=r"StepResult.tool_errors=-1: an integer >= 0"):
        StepResult(messages=[], tool_errors=-1)
    assert reward_parts(1) == {"reward": 1.0} and reward_parts({"correct": 1, "format": 0.5}) == {
        "correct": 1.0, "format": 0.5}
    for bad in (True, None, {}, {"a": "1"}, {1: 1.0}):
        with pytest.raises(ValueError, match=r"reward\(\) returned .*: a number, or a non-empty dict of named"):
            reward_parts(bad)
    with pytest.raises(TypeError, match="abstract methods reset, reward"):
        Environment()


def _docs_module(first_line: str) -> str:
    """The fenced Python block of docs/environments.md that starts with `first_line`."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)
    found = [b for b in blocks if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"docs/environments.md: one ```python block starting with {first_line!r}"
    return found[0]


def totals(trajectory):
    return trajectory.turns, trajectory.tool_calls, trajectory.tool_errors, trajectory.truncated


def test_the_calculator_example_of_the_docs_runs_as_written(tmp_path, monkeypatch):
    for name in ("calculator_env", "episode"):
        (tmp_path / f"{name}.py").write_text(_docs_module(f"# {name}.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        from episode import run_episode

        config = build_config(EnvConfig, {"name": "calculator_env:CalculatorEnv", "max_turns": 4})
        renderer = make_renderer("qwen2", Tokenizer.byte_level())
        row = {"question": "What is (2 + 3) / 4?", "answer": "1.25"}

        def scripted(*texts):
            turns = iter(texts)

            def sample(ids):
                turn = renderer.tokenizer.encode(next(turns)) + list(renderer.end_of_turn_ids)
                return turn, [-0.5] * len(turn), [7] * len(turn)

            return sample

        call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%s"}}\n</tool_call>'
        trajectory, reward = asyncio.run(run_episode(make_environment(config), renderer, row, 0,
                                                     scripted(call % "(2 + 3) / 4", " 1.25"), config.max_turns))
        assert reward == {"correct": 1.0, "used_tool": 1.0}
        assert totals(trajectory) == (2, 1, 0, False)
        (segment,) = trajectory.segments
        assert renderer.tokenizer.decode(segment.tokens, skip_special_tokens=False).endswith(
            "<|im_start|>user\n<tool_response>\n1.25\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n 1.25<|im_end|>")

        trajectory, reward = asyncio.run(run_episode(make_environment(config), renderer, row, 0, scripted(
            call % "5 / 0", call % "5 +", call % "__import__('os')", "1.25 probably"), config.max_turns))
        assert reward == {"correct": 0.0, "used_tool": 1.0}
        assert totals(trajectory) == (4, 3, 3, False)
        results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        assert results == ["Error: calculate raised ZeroDivisionError: division by zero",
                           "Error: not an expression: invalid syntax",
                           "Error: only numbers, + - * / and parentheses"]

        trajectory, reward = asyncio.run(run_episode(make_environment(config), renderer, row, 0,
                                                     scripted(*[call % "1 + 1"] * 4), config.max_turns))
        assert reward == {"correct": 0.0, "used_tool": 1.0} and trajectory.truncated and trajectory.turns == 4
    finally:
        for name in ("calculator_env", "episode"):
            sys.modules.pop(name, None)


def test_the_readme_environment_runs_as_written(tmp_path, monkeypatch):
    readme = DOCS.parent.parent / "README.md"
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```", readme.read_text(), re.MULTILINE | re.DOTALL)
                if b.startswith("# secret_env.py")]
    (tmp_path / "secret_env.py").write_text(block)
    (tmp_path / "episode.py").write_text(_docs_module("# episode.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        from episode import run_episode

        env = make_environment(build_config(EnvConfig, {"name": "secret_env:SecretEnv", "max_turns": 3}))
        assert env.tools[0].schema["function"]["description"] == "The code to answer with."
        renderer = make_renderer("qwen2", Tokenizer.byte_level())
        texts = iter(['<tool_call>\n{"name": "secret", "arguments": {}}\n</tool_call>', "123"])

        def sample(ids):
            turn = renderer.tokenizer.encode(next(texts)) + list(renderer.end_of_turn_ids)
            return turn, [-0.5] * len(turn), [0] * len(turn)

        trajectory, reward = asyncio.run(run_episode(env, renderer, {"question": "The code?"}, 5123, sample, 3))
        assert reward == 1.0 and trajectory.turns == 2 and trajectory.tool_calls == 1
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["123"]
    finally:
        for name in ("secret_env", "episode"):
            sys.modules.pop(name, None)


def test_the_envs_package_imports_no_jax():
    code = ("import sys; import grpo_jax.envs.environment, grpo_jax.envs.trajectory, grpo_jax.envs.render, "
            "grpo_jax.envs.tools, grpo_jax.envs.gsm8k, grpo_jax.envs.synthetic; sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent).returncode == 0
