"""The built-in environments, named by short name: gsm8k_python on real GSM8K rows (a program in the sandbox, its
failures as tool errors, the final answer read as the gsm8k reward reads it), countdown_multiturn (the code
comes only from the tool: a policy that copies the lookups solves it, one that answers at once does not) and
fetch_code (the same in one argument-less call, through the compact renderer and the synthetic_chat tokenizer). Each
episode is scripted through the renderer and the docs' run_episode, as the engine is to run it."""

import asyncio
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from grpo_jax.config_io import ConfigError
from grpo_jax.data.pipeline import DataConfig, open_source
from grpo_jax.data.tokenizer import Tokenizer, load_tokenizer
from grpo_jax.envs import environment
from grpo_jax.envs.environment import EnvConfig, Environment, make_environment, register_environment
from grpo_jax.envs.gsm8k import Gsm8kPythonEnv
from grpo_jax.envs.render import make_renderer
from grpo_jax.envs.synthetic import CountdownMultiturnEnv, FetchCodeEnv, make_countdown_dataset, make_fetch_code_dataset
from grpo_jax.envs.tools import ToolError
from grpo_jax.sandbox import Sandbox, SandboxError
from test_environment import _docs_module

REPO = Path(__file__).resolve().parent.parent
RENDERER = make_renderer("qwen2", Tokenizer.byte_level())
_namespace: dict = {}
exec(_docs_module("# episode.py"), _namespace)  # the docs' run_episode, as written there
run_episode = _namespace["run_episode"]


def call(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def turn_ids(text: str):
    ids = RENDERER.tokenizer.encode(text) + list(RENDERER.end_of_turn_ids)
    return ids, [-0.5] * len(ids), [0] * len(ids)


def scripted(*texts):
    """A policy that writes `texts`, one assistant turn each, whatever it reads."""
    turns = iter(texts)
    return lambda ids: turn_ids(next(turns))


def episode(name, row, seed, sample, max_turns=6, **kwargs):
    env = make_environment(EnvConfig(name=name, kwargs=kwargs, max_turns=max_turns))
    trajectory, reward = asyncio.run(run_episode(env, RENDERER, row, seed, sample, max_turns))
    return env, trajectory, reward


def tool_results(trajectory):
    return [m["content"] for m in trajectory.messages if m["role"] == "tool"]


def totals(trajectory):
    return trajectory.turns, trajectory.tool_calls, trajectory.tool_errors, trajectory.truncated


def test_a_built_in_environment_is_named_by_its_short_name():
    assert EnvConfig(name="gsm8k_python").validate() == [] and EnvConfig(name="countdown_multiturn").validate() == []
    assert type(make_environment(EnvConfig(name="gsm8k_python"))) is Gsm8kPythonEnv
    assert type(make_environment(EnvConfig(name="countdown_multiturn"))) is CountdownMultiturnEnv
    assert make_environment(EnvConfig(name="grpo_jax.envs.gsm8k:Gsm8kPythonEnv")).timeout_s == 5.0  # by path too
    assert EnvConfig(name="gsm8k_pyton").validate() == [
        "name='gsm8k_pyton': allowed countdown_multiturn, fetch_code, gsm8k_python, or a factory of your own by "
        "import path 'package.module:factory'"]
    with pytest.raises(ConfigError, match=r"^env.name='gsm8k_python': gsm8k_python\(\*\*kwargs\) raised ValueError: "
                                          r"gsm8k_python: timeout_s=0: must be a number of seconds > 0"):
        make_environment(EnvConfig(name="gsm8k_python", kwargs={"timeout_s": 0}))
    with pytest.raises(ConfigError, match=r"raised TypeError: .*unexpected keyword argument 'lookup_credits'"):
        make_environment(EnvConfig(name="countdown_multiturn", kwargs={"lookup_credits": 0.5}))
    with pytest.raises(ValueError, match=r"register_environment\('my.module:Game'\): a short name without ':'"):
        register_environment("my.module:Game")


def test_a_short_name_imports_the_built_in_environments_module():
    code = ("from grpo_jax.envs.environment import EnvConfig, make_environment\n"
            "print(type(make_environment(EnvConfig(name='countdown_multiturn'))).__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.stdout == "CountdownMultiturnEnv\n", result.stderr


def test_an_environment_of_your_own_is_registered_by_short_name(monkeypatch):
    monkeypatch.setattr(environment, "ENVIRONMENTS", dict(environment.ENVIRONMENTS))

    @register_environment("echo")
    class Echo(Environment):
        def __init__(self, text="hi"):
            self.text = text

        async def reset(self, row, seed):
            return [{"role": "user", "content": self.text}]

        async def reward(self):
            return 0.0

    assert make_environment(EnvConfig(name="echo", kwargs={"text": "yo"})).text == "yo"
    assert "echo" in EnvConfig(name="ech").validate()[0]  # listed among the names allowed


# ---------------------------------------------------------------------------------------------------------------
# gsm8k_python


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir):
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()[:4]]
    assert rows[0]["question"].startswith("Janet’s ducks lay 16 eggs") and rows[0]["answer"].endswith("#### 18")
    assert rows[3]["question"].startswith("James decides to run 3 sprints") and rows[3]["answer"].endswith("#### 540")
    return rows


DUCKS_PROGRAM = "eggs = 16 - 3 - 4\nprint(eggs * 2)"


def test_gsm8k_python_a_correct_program_then_the_answer_scores_one(gsm8k_rows):
    env, trajectory, reward = episode("gsm8k_python", gsm8k_rows[0], 0, scripted(
        call("python", {"code": DUCKS_PROGRAM}), "She makes $18 a day.\n#### 18"))
    assert reward == {"correct": 1.0, "tool_errors": 0.0}
    assert tool_results(trajectory) == ["18\n"] and totals(trajectory) == (2, 1, 0, False)
    opening = trajectory.messages[:2]
    assert opening[0]["role"] == "system" and opening[1] == {"role": "user", "content": gsm8k_rows[0]["question"]}
    with pytest.raises(SandboxError, match="closed"):  # close() closed the episode's sandbox
        env.sandbox.run_python("print(1)")


def test_gsm8k_python_a_wrong_final_answer_scores_zero(gsm8k_rows):
    _, trajectory, reward = episode("gsm8k_python", gsm8k_rows[0], 0, scripted(
        call("python", {"code": DUCKS_PROGRAM}), "#### 20"))
    assert reward == {"correct": 0.0, "tool_errors": 0.0} and tool_results(trajectory) == ["18\n"]
    # The final answer is the one read, as the gsm8k reward reads it: "#### N" before the last number.
    _, _, reward = episode("gsm8k_python", gsm8k_rows[0], 0, scripted("#### 18, not 20"))
    assert reward["correct"] == 1.0
    _, _, reward = episode("gsm8k_python", gsm8k_rows[0], 0, scripted(call("python", {"code": "print(18)"})),
                           max_turns=1)  # truncated: no final answer
    assert reward["correct"] == 0.0


def test_gsm8k_python_reads_the_final_answer_from_the_content_not_the_reasoning(gsm8k_rows):
    qwen3 = make_renderer("qwen3", Tokenizer.byte_level())
    env = Gsm8kPythonEnv()
    asyncio.run(env.reset(gsm8k_rows[0], 0))
    turn = qwen3.parse(qwen3.tokenizer.encode("<think>\nIs it #### 18?\n</think>\n\nI cannot tell.")
                       + list(qwen3.end_of_turn_ids))
    assert asyncio.run(env.step(turn)).done and asyncio.run(env.reward())["correct"] == 0.0


def test_gsm8k_python_a_failing_program_is_a_tool_error_the_model_reads(gsm8k_rows):
    _, trajectory, reward = episode("gsm8k_python", gsm8k_rows[3], 0, scripted(
        call("python", {"code": "while True:\n    pass"}),
        call("python", {"code": "sprints = 3 * 3\nprint(sprints * 60 / 0)"}),
        call("python", {"code": "print(3 * 3 * 60)"}), "#### 540"), timeout_s=1, tool_error_penalty=0.25)
    timeout, division, right = tool_results(trajectory)
    assert timeout == "Error: the program failed (timeout, exit code -9)"
    assert division.startswith("Error: the program failed (error, exit code 1); stderr ends with:\n")
    assert division.endswith("ZeroDivisionError: division by zero") and 'line 2, in <module>' in division
    assert right == "540\n"
    assert reward == {"correct": 1.0, "tool_errors": -0.5} and totals(trajectory) == (4, 3, 2, False)


def test_gsm8k_python_bad_arguments_are_tool_errors_and_no_call_is_an_answer(gsm8k_rows):
    env, trajectory, reward = episode("gsm8k_python", gsm8k_rows[3], 0, scripted(
        call("python", {"cod": "print(540)"}), call("python", {"code": 540}), call("calculator", {"x": "3*3*60"}),
        "The answer is 540"), tool_error_penalty=0.1)
    assert tool_results(trajectory) == [
        "Error: python: unknown argument 'cod' (its arguments: code)",
        "Error: python: argument 'code' must be string, got 540",
        "Error: unknown tool 'calculator' (tools: python)"]
    assert reward == pytest.approx({"correct": 1.0, "tool_errors": -0.3})
    assert env.sandbox is None  # no program ran: no sandbox was made
    env, trajectory, reward = episode("gsm8k_python", gsm8k_rows[3], 0, scripted("540"))
    assert reward == {"correct": 1.0, "tool_errors": 0.0} and totals(trajectory) == (1, 0, 0, False)
    assert env.sandbox is None


def test_gsm8k_python_a_failure_of_the_sandbox_itself_fails_the_episode(gsm8k_rows):
    env = make_environment(EnvConfig(name="gsm8k_python"))
    env.sandbox = Sandbox()
    env.sandbox.close()  # refuses every run: as a sandbox that cannot start its children
    with pytest.raises(SandboxError, match="the sandbox is closed"):
        asyncio.run(run_episode(env, RENDERER, gsm8k_rows[0], 0, scripted(
            call("python", {"code": DUCKS_PROGRAM}), "#### 18"), 4))


def test_gsm8k_python_a_temporary_directory_the_sandbox_cannot_use_fails_the_episode_not_the_model(gsm8k_rows,
                                                                                                     monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tmp")  # gone, or full: the sandbox's failure
    env = make_environment(EnvConfig(name="gsm8k_python"))
    with pytest.raises(SandboxError, match="could not make the program's working directory in /nonexistent/tmp"):
        asyncio.run(run_episode(env, RENDERER, gsm8k_rows[0], 0, scripted(
            call("python", {"code": DUCKS_PROGRAM}), "#### 18"), 4))
    assert isinstance(env.sandbox_error, SandboxError)


def test_gsm8k_python_refuses_a_row_without_a_reference():
    env = Gsm8kPythonEnv()
    with pytest.raises(ValueError, match=r"row\['answer'\]='eighteen': holds no reference number; GSM8K's answers "
                                         r"end with '#### N'"):
        asyncio.run(env.reset({"question": "How many?", "answer": "eighteen"}, 0))
    with pytest.raises(ValueError, match=r"row\['question'\]=None: the question"):
        asyncio.run(env.reset({"answer": "#### 18"}, 0))


# ---------------------------------------------------------------------------------------------------------------
# countdown_multiturn


def test_countdown_rows_are_repeatable_and_checked():
    rows = make_countdown_dataset(200, seed=3, min_lookups=1, max_lookups=3)
    assert rows == make_countdown_dataset(200, seed=3, min_lookups=1, max_lookups=3)
    assert rows != make_countdown_dataset(200, seed=4, min_lookups=1, max_lookups=3)
    assert {r["lookups"] for r in rows} == {1, 2, 3} and all(re.fullmatch(r"\d\d", r["key"]) for r in rows)
    assert rows[0]["prompt"] == f"key {rows[0]['key']}, {rows[0]['lookups']} lookup" + (
        "s" if rows[0]["lookups"] > 1 else "")
    with pytest.raises(ValueError, match=r"max_lookups=11, key_digits=1: .* at most 10 lookups"):
        make_countdown_dataset(1, 0, max_lookups=11, key_digits=1)
    with pytest.raises(ValueError, match=r"row\['key'\]=52: a string of digits"):
        asyncio.run(CountdownMultiturnEnv().reset({"key": 52, "lookups": 1}, 0))


def copying_policy(ids):
    """Looks up the key in the question, then each next key the tool answers with, then answers with the code:
    what a model must learn."""
    text = RENDERER.tokenizer.decode(ids, skip_special_tokens=False)
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if not responses:
        return turn_ids(call("lookup", {"key": re.findall(r"key (\d+),", text)[-1]}))
    found = re.fullmatch(r"next (\d+), \d+ left|code (\d+)", responses[-1])
    return turn_ids(call("lookup", {"key": found[1]}) if found[1] else found[2])


def test_countdown_copying_the_lookups_scores_one():
    rows = make_countdown_dataset(30, seed=0, min_lookups=1, max_lookups=3)
    for i, row in enumerate(rows):
        env, trajectory, reward = episode("countdown_multiturn", row, i, copying_policy)
        assert reward == {"correct": 1.0, "lookups": 0.1}, (row, i)
        assert totals(trajectory) == (row["lookups"] + 1, row["lookups"], 0, False)
        answers = tool_results(trajectory)
        assert [int(a.split()[2]) for a in answers[:-1]] == list(range(row["lookups"] - 1, 0, -1))  # counting down
        assert answers[-1] == f"code {env.code}" and len(env.code) == 4


def test_countdown_a_single_turn_policy_scores_zero():
    rows = make_countdown_dataset(100, seed=1, min_lookups=1, max_lookups=2)
    scores = []
    for i, row in enumerate(rows):
        env, trajectory, reward = episode("countdown_multiturn", row, i, scripted(f"code {'5' * 4}"))
        assert trajectory.turns == 1 and reward["lookups"] == 0.0
        scores.append(reward["correct"])
        # The best answer without the tool's: the code this row had with another seed (the row is all it sees).
        _, _, reward = episode("countdown_multiturn", row, i, scripted(_last_code(row, i + 1000)))
        scores.append(reward["correct"])
    assert np.mean(scores) == 0.0


def _last_code(row, seed) -> str:
    env = CountdownMultiturnEnv()
    asyncio.run(env.reset(row, seed))
    return env.code


def test_countdown_the_answer_is_the_last_number_of_the_final_turn():
    row = {"key": "52", "lookups": 1}
    code = _last_code(row, 0)
    for answer, correct in ((code, 1.0), (f"The code is {code}.", 1.0), (f"{code} or 0000", 0.0),
                            (f"{code}0", 0.0), ("no idea", 0.0)):
        _, _, reward = episode("countdown_multiturn", row, 0, scripted(call("lookup", {"key": "52"}), answer))
        assert reward == {"correct": correct, "lookups": 0.1}, answer


def test_countdown_episodes_repeat_by_seed_and_rows_sharing_a_seed_differ():
    row, other = {"key": "52", "lookups": 2}, {"key": "53", "lookups": 2}
    assert _last_code(row, 7) == _last_code(row, 7)
    codes = {_last_code(row, seed) for seed in range(50)}
    assert len(codes) > 45  # the seed draws the code
    assert sum(_last_code(row, seed) == _last_code(other, seed) for seed in range(50)) < 3


def test_countdown_malformed_calls_are_tool_errors_and_partial_lookups_earn_partial_credit():
    row = {"prompt": "key 52, 2 lookups", "key": "52", "lookups": 2}
    env, trajectory, reward = episode("countdown_multiturn", row, 0, scripted(
        call("lookup", {"key": 52}), call("lookup", {"key": "99"}), '<tool_call>\n{"name": "lookup"\n</tool_call>',
        call("lookup", {"key": "52"}), "1234"), lookup_credit=0.5)
    assert tool_results(trajectory) == [
        "Error: lookup: argument 'key' must be string, got 52",
        "Error: no key '99'; look up the key in the question, then each next key",
        "Error: tool call 1: not JSON (Expecting ',' delimiter at line 1 column 18)",
        env.answers["52"]]
    assert re.fullmatch(r"next \d\d, 1 left", env.answers["52"])
    assert totals(trajectory) == (5, 3, 3, False)
    assert reward == {"correct": 0.0, "lookups": 0.25}  # half the chain looked up


# ---------------------------------------------------------------------------------------------------------------
# fetch_code, through the compact renderer and the synthetic_chat tokenizer: ids in, ids out

COMPACT = make_renderer("compact", load_tokenizer("synthetic_chat"))


def compact_turn(text: str):
    ids = COMPACT.tokenizer.encode(text) + list(COMPACT.end_of_turn_ids)
    return ids, [-0.5] * len(ids), [0] * len(ids)


def fetching_policy(ids):
    """What a model must learn, read off the ids: call fetch, then write the digits the tool's answer ends with."""
    tok = COMPACT.tokenizer
    tool = tok.token_to_id("<|t|>")
    if tool not in ids:
        return compact_turn("<|c|>fetch")
    start = len(ids) - ids[::-1].index(tool)  # the last tool result
    digits = [i for i in ids[start:ids.index(COMPACT.end_of_turn_ids[0], start)] if tok.decode([i]).isdigit()]
    return digits + list(COMPACT.end_of_turn_ids), [-0.5] * (len(digits) + 1), [0] * (len(digits) + 1)


def fetch_episode(row, seed, sample, max_turns=4, **kwargs):
    env = make_environment(EnvConfig(name="fetch_code", kwargs=kwargs, max_turns=max_turns))
    trajectory, reward = asyncio.run(run_episode(env, COMPACT, row, seed, lambda ids: sample(ids), max_turns))
    return env, trajectory, reward


def test_fetch_code_rows_are_repeatable_and_the_synthetic_data_source_reads_them():
    rows = make_fetch_code_dataset(100, seed=3)
    assert rows == make_fetch_code_dataset(100, seed=3) and rows != make_fetch_code_dataset(100, seed=4)
    assert all(r["prompt"] == "code?" and r["answer"] == "" and r["task"] == "fetch_code" for r in rows)
    assert len({r["id"] for r in rows}) == 100
    config = DataConfig(source="synthetic", synthetic_task="fetch_code", prompt_field="prompt", synthetic_size=100,
                        seed=3)
    assert config.validate() == [] and [open_source(config)[i] for i in range(100)] == rows
    with pytest.raises(ValueError, match=r"row\['id'\]=None: an integer >= 0"):
        asyncio.run(FetchCodeEnv().reset({"prompt": "code?"}, 0))
    with pytest.raises(ValueError, match=r"code_digits=0: an integer from 1 to 12"):
        make_environment(EnvConfig(name="fetch_code", kwargs={"code_digits": 0}))


def _code(row, seed, **kwargs) -> str:
    env = FetchCodeEnv(**kwargs)
    asyncio.run(env.reset(row, seed))
    return env.code


def test_fetch_code_reset_is_deterministic_in_the_row_and_the_seed_and_the_tool_answers_with_the_code():
    row, other = make_fetch_code_dataset(2, seed=0)
    env = FetchCodeEnv()
    assert asyncio.run(env.reset(row, 7)) == [{"role": "user", "content": "code?"}]
    assert re.fullmatch(r"\d\d", env.code) and env.code == _code(row, 7)
    assert len({_code(row, seed, code_digits=4) for seed in range(50)}) > 45  # the seed draws the code
    assert sum(_code(row, seed, code_digits=4) == _code(other, seed, code_digits=4) for seed in range(50)) < 3
    fetch, = env.tools
    assert (fetch.name, fetch.parameters, fetch.call({})) == ("fetch", {"type": "object", "properties": {}},
                                                              f"code {env.code}")
    with pytest.raises(ToolError, match="fetch: unknown argument 'key'"):
        fetch.call({"key": "1"})
    assert asyncio.run(FetchCodeEnv(system_prompt="Fetch.").reset(row, 7))[0] == {"role": "system",
                                                                                   "content": "Fetch."}


def test_fetch_code_a_perfect_episode_scores_one_in_six_sampled_tokens():
    row = make_fetch_code_dataset(1, seed=0)[0]
    env, trajectory, reward = fetch_episode(row, 5, fetching_policy)
    assert reward == pytest.approx({"correct": 0.8, "called": 0.1, "answered": 0.1}) and sum(reward.values()) == 1.0
    assert totals(trajectory) == (2, 1, 0, False)
    segment, = trajectory.segments
    tok = COMPACT.tokenizer
    assert tok.decode(segment.tokens, skip_special_tokens=False) == (
        f"<|s|>fetch()<|e|><|u|>code?<|e|><|a|><|c|>fetch<|e|><|t|>code {env.code}<|e|><|a|>{env.code}<|e|>")
    # 10 prompt tokens, 3 sampled for the call, 7 of the result and the next generation prompt, 3 for the answer
    assert len(segment.tokens) == 23 and sum(segment.loss_mask) == 3 + (2 + 1)
    assert list(segment.tokens) == tok.encode(COMPACT.render(trajectory.messages, [fetch_schema(env)], False))
    # 4 digits: 2 more sampled, 4 more in all
    env, trajectory, reward = fetch_episode(row, 5, fetching_policy, code_digits=4)
    assert (len(trajectory.segments[0].tokens), sum(trajectory.segments[0].loss_mask)) == (27, 8)
    assert reward["correct"] == pytest.approx(0.8)


def fetch_schema(env):
    return env.tools[0].schema


def test_fetch_code_without_the_call_scores_nothing_and_wrong_digits_cost_their_share():
    rows = make_fetch_code_dataset(200, seed=1)
    scores = []
    for i, row in enumerate(rows):
        _, trajectory, reward = fetch_episode(row, i, lambda ids: compact_turn("42"))
        assert trajectory.turns == 1 and reward["called"] == 0.0
        scores.append(sum(reward.values()))
    assert np.mean(scores) == 0.0  # the answer counts only once the model read fetch's: a guess earns nothing
    env = FetchCodeEnv()
    asyncio.run(env.reset(rows[0], 0))
    code = env.code
    wrong = "".join(str((int(d) + 1) % 10) for d in code)
    # the answer's last number: digits right over the code's length, less 0.5 x (length off / code length, at
    # most 1), at least 0, times 0.8; answered (0.1) for any number
    for answer, correct in ((code, 1.0), (f" {code}\n", 1.0), (wrong, 0.0), (code[0] + wrong[1], 0.5),
                            (code + "0", 0.75), (code[:1], 0.25), ("", None), (f"code {code}", 1.0),
                            (f"{code} or {wrong}", 0.0), (f"it is {code}.", 1.0)):
        policy = iter([compact_turn("<|c|>fetch"), compact_turn(answer)])
        _, trajectory, reward = fetch_episode(rows[0], 0, lambda ids: next(policy))
        expected = {"correct": 0.8 * (correct or 0.0), "called": 0.1, "answered": 0.0 if correct is None else 0.1}
        assert reward == pytest.approx(expected), answer


def test_fetch_code_number_alone_scores_only_an_answer_that_is_the_number_alone():
    row = make_fetch_code_dataset(1, seed=0)[0]
    env = FetchCodeEnv(number_alone=True)
    asyncio.run(env.reset(row, 0))
    code = env.code
    for answer, scored in ((code, True), (f" {code}\n", True), (f"code {code}", False), (f"{code}.", False),
                           (f"{code} 1", False), ("", False)):
        policy = iter([compact_turn("<|c|>fetch"), compact_turn(answer)])
        _, _, reward = fetch_episode(row, 0, lambda ids: next(policy), number_alone=True)
        expected = {"correct": 0.8 if scored else 0.0, "called": 0.1, "answered": 0.1 if scored else 0.0}
        assert reward == pytest.approx(expected), answer
    with pytest.raises(ValueError, match="number_alone='yes': true or false"):
        FetchCodeEnv(number_alone="yes")


def test_fetch_code_code_values_bound_each_digit():
    rows = make_fetch_code_dataset(50, seed=2)
    codes = set()
    for seed, row in enumerate(rows):
        env = FetchCodeEnv(code_digits=1, code_values=4)
        asyncio.run(env.reset(row, seed))
        codes.add(env.code)
    assert codes == {"0", "1", "2", "3"}
    with pytest.raises(ValueError, match="code_values=11: an integer from 2 to 10"):
        FetchCodeEnv(code_values=11)


def test_fetch_code_bad_calls_are_tool_errors_and_the_episode_goes_on():
    row = make_fetch_code_dataset(1, seed=0)[0]
    policy = iter([compact_turn("<|c|>fetch key=1"), compact_turn("<|c|>lookup"), compact_turn("<|c|>fetch()"),
                   compact_turn("<|c|>fetch")])
    env, trajectory, reward = fetch_episode(row, 0, lambda ids: next(policy, None) or fetching_policy(ids),
                                            max_turns=6, call_credit=0.2)
    assert tool_results(trajectory) == [
        "Error: fetch: unknown argument 'key' (its arguments: none)",
        "Error: unknown tool 'lookup' (tools: fetch)",
        "Error: tool call 1: expected `name k=v ...` after <|c|>, got 'fetch()'",
        f"code {env.code}"]
    assert totals(trajectory) == (5, 3, 3, False) and len(trajectory.segments) == 1
    assert reward == pytest.approx({"correct": 0.7, "called": 0.2, "answered": 0.1})
    # Calling forever: truncated at max_turns without an answer; the call credit is shared by the 3 calls.
    _, trajectory, reward = fetch_episode(row, 0, lambda ids: compact_turn("<|c|>fetch"), max_turns=3)
    assert trajectory.truncated and reward == pytest.approx({"correct": 0.0, "called": 0.1 / 3, "answered": 0.0})
