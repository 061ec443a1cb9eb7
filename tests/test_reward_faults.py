"""Rewards that misbehave inside a run: one that changes its input rows, one whose values are too large for float32,
one that holds the GIL past its deadline (a regex that backtracks), and one that fails on every sample."""

import itertools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

import grpo_jax
from grpo_jax.algorithm import rewards as R
from grpo_jax.algorithm.rewards import registry
from grpo_jax.cli import EXIT_USER_ERROR, main
from grpo_jax.data.collector import Prompt
from grpo_jax.errors import ConfigError, TrainerError
from grpo_jax.rollout.actor import Actor, ActorLimits
from grpo_jax.run.metrics import MetricsWriter, read_metrics
from test_trainer import FAST, REPO, assert_every_ordinal_accounted_once, read_ledger, tiny_config

TINY = str(REPO / "configs" / "tiny_cpu.yaml")
MODULE = "misbehaving_rewards"

# Rewards by import path, for worker processes (which build a reward from its name) and for `grpo-jax train`.
MISBEHAVING = textwrap.dedent('''
    import os, subprocess, time

    def scaled(scale=1.0):
        def fn(records, completions, lengths):
            return [scale * len(c) for c in completions]
        return fn

    def caching():
        def fn(records, completions, lengths):
            for record in records:
                record["parsed"] = object()
            return [float(len(record)) for record in records]
        return fn

    def misbehaving():
        """By completion: "raise", "junk", "hang" (sleeps for minutes), "exit" (the process dies), else its length."""
        def fn(records, completions, lengths):
            c = completions[0]
            if c == "raise":
                raise ValueError("no answer in " + c)
            if c == "junk":
                return ["junk"]
            if c == "hang":
                time.sleep(600)
            if c == "exit":
                os._exit(3)
            return [float(len(c))]
        return fn

    def always_junk():
        return lambda records, completions, lengths: "not a list of numbers"

    def always_hang():
        def fn(records, completions, lengths):
            time.sleep(600)
        return fn

    def starts_programs(output, pids):
        """By completion: "hang" starts a program writing to the pipe `output` and waits for it (a hung verifier),
        "spawn" starts one and returns; else its length. Each program's pid goes to the file `pids`."""
        def fn(records, completions, lengths):
            c = completions[0]
            if c in ("hang", "spawn"):
                with open(output, "wb") as out:
                    program = subprocess.Popen(["sleep", "300"], stdout=out)
                with open(pids, "a") as f:
                    f.write(f"{program.pid}\\n")
                if c == "hang":
                    program.wait()
                return [1.0]
            return [float(len(c))]
        return fn
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / f"{MODULE}.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.setattr(registry, "REWARDS", dict(R.REWARDS))  # the registry get_reward reads
    monkeypatch.setattr(R, "REWARDS", registry.REWARDS)
    yield lib
    sys.modules.pop(MODULE, None)


@pytest.fixture
def python_rewards(monkeypatch):
    """Reward functions registered meanwhile (grpo_jax.train(rewards=...), REWARDS[...] = ...) are forgotten."""
    monkeypatch.setattr(registry, "REWARDS", dict(R.REWARDS))  # the registry get_reward reads
    monkeypatch.setattr(R, "REWARDS", registry.REWARDS)


def by_letter(values):
    """A factory for REWARDS whose function gives a completion that starts with the i-th letter values[i]."""
    def factory():
        return lambda records, completions, lengths: [values[ord(c[0]) - ord("a")] for c in completions]
    return factory


LETTERS = list("abcdefgh")


def wait_until_scored(suite, completions, seconds=60):
    """Score until no sample fails: worker processes take a while to start on a busy machine (a call that
    finds its process still starting fails, and the process goes on starting)."""
    deadline = time.monotonic() + seconds
    while suite.score([{}] * len(completions), completions).failed.any():
        assert time.monotonic() < deadline, "the reward's worker processes did not start"


def reward_workers() -> list[int]:
    """The pids of this process's children that are reward worker processes."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"_serve_in_worker" in cmdline:
            pids.append(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------
# The actor's group finishing, without a model: a static generate's result for `prompts` groups of G samples.


class FakeCollector:
    def __init__(self, handout_size):
        self.handout_size = handout_size
        self.dropped, self.finished = [], []

    def mark_dropped(self, ordinal, reason, detail=None):
        self.dropped.append((ordinal, reason, detail))

    def mark_finished(self, ordinal):
        self.finished.append(ordinal)


class FakeBuffer:
    def __init__(self):
        self.groups, self.released, self.error = [], 0, None

    def put(self, group):
        self.groups.append(group)

    def release(self, n):
        self.released += n

    def close(self, error=None):
        self.error = error


class LetterTokenizer:
    def decode(self, tokens):
        return "".join(chr(ord("a") + int(t)) for t in tokens)


def bare_actor(tmp_path, suite, *overrides, prompts_per_step=2):
    config = tiny_config(tmp_path, "grpo.group_size=4", f"grpo.prompts_per_step={prompts_per_step}", *overrides)
    sampler = types.SimpleNamespace(state={"w": jnp.zeros(1)})
    limits = ActorLimits(max_steps=config.trainer.max_steps,
                         reward_error_handouts=config.trainer.reward_error_handouts)
    return Actor(config.grpo, limits, sampler, LetterTokenizer(), FakeCollector(prompts_per_step), FakeBuffer(),
                 suite, base_key=None)


def finish_handout(actor, first_ordinal, completions):
    """Finish one handout of len(completions) // G groups whose samples decode to `completions`."""
    g = actor.grpo.group_size
    n = len(completions)
    width = max(len(c) for c in completions)
    tokens = np.zeros((n, width), np.int32)
    for j, c in enumerate(completions):
        tokens[j, :len(c)] = [ord(ch) - ord("a") for ch in c]
    result = types.SimpleNamespace(tokens=tokens, lengths=np.array([len(c) for c in completions]),
                                   logprobs=np.zeros((n, width), np.float32), finish_reasons=["stop"] * n)
    prompts = [Prompt(first_ordinal + i, {"row": {"answer": "1"}, "prompt_ids": [1, 2]}) for i in range(n // g)]
    actor._finish_static(prompts, result, version=0, first=0)


# ----------------------------------------------------------------------------------------------------
# 5. A reward that changes its input row.


def test_each_reward_call_gets_its_own_copy_of_the_rows(user_module):
    seen = []

    def caching_factory():
        def fn(records, completions, lengths):
            seen.append(sorted(records[0]))
            for record in records:
                record["parsed"] = object()
            return [1.0] * len(completions)
        return fn

    R.REWARDS["caching"] = caching_factory
    row = {"answer": "1"}
    records = [row] * 4  # the G samples of a group share their row, as in the actor
    with R.RewardSuite([("caching", 1.0), {"name": "caching", "label": "again"},
                        {"name": f"{MODULE}:caching", "isolation": "process"}], timeout_s=30) as suite:
        result = suite.score(records, ["a", "b", "c", "d"])
    assert not result.failed.any(), result.errors
    assert row == {"answer": "1"} and all(r is row for r in records)  # what the replay buffer checkpoints
    assert seen == [["answer"]] * 8  # neither function saw the other's (or its own earlier calls') cache
    np.testing.assert_allclose(result.per_function[f"{MODULE}:caching"], [2.0] * 4)  # its copy had the cache


def test_a_reward_that_changes_its_rows_or_returns_1e39_trains_and_checkpoints(tmp_path, python_rewards):
    calls = itertools.count()

    def caching_and_huge(records, completions, lengths):
        for record in records:
            record["parsed"] = object()  # a user's cache of a parsed answer: no checkpoint can hold it
        # 1e39 (finite in float64, inf in float32) on every fourth call: most groups keep 2 scored samples or more.
        return [1e39 if next(calls) % 4 == 0 else float(n) for n in lengths]

    history = grpo_jax.train(TINY, rewards=[(caching_and_huge, 1.0)], run_dir=tmp_path,
                             overrides=FAST + ["trainer.max_steps=2", "checkpoint.every_steps=1"])
    assert [m["step"] for m in history] == [1, 2]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
    assert all(np.isfinite(m["loss"]) and m["reward/max"] < 1e38 for m in history)
    label = R.register_function(caching_and_huge)
    rates = [m[f"reward/{label}/failure_rate"] for m in history]
    rates = [rate for rate in rates if not np.isnan(rate)]  # NaN: nothing scored between two steps
    assert rates and all(0 <= rate <= 1 for rate in rates) and max(rates) > 0, rates
    assert_every_ordinal_accounted_once(tmp_path)


# ----------------------------------------------------------------------------------------------------
# 10. A finite but huge reward.


def test_a_reward_beyond_float32_fails_those_samples_naming_the_reward(python_rewards):
    R.REWARDS["huge"] = by_letter([1e39, 1.0, -1e39, 3e38])
    R.REWARDS["big"] = by_letter([1e38, 2e38, 1.0, 1.0])
    R.REWARDS["small"] = lambda: (lambda records, completions, lengths: [0.5] * len(completions))

    result = R.RewardSuite([("huge", 1.0), ("small", 1.0)], timeout_s=5).score([{}] * 4, LETTERS[:4])
    assert result.failed.tolist() == [True, False, True, False]
    np.testing.assert_allclose(result.rewards, [0.0, 1.5, 0.0, 3e38 + 0.5])
    assert np.isnan(result.per_function["huge"][[0, 2]]).all() and not np.isnan(result.per_function["small"]).any()
    assert result.errors == [("huge: 2 values too large for float32, in which rewards are trained (e.g. 1e+39 x weight "
                              "1): the weighted values and their total must stay within +-3.4e+38")]

    # The weight makes 1e38 too large; two terms of 2e38 make a total too large, charged to the larger.
    suite = R.RewardSuite([("big", 10.0), ("small", 1.0), {"name": "big", "label": "twice", "weight": 1.0}],
                          timeout_s=5)
    result = suite.score([{}] * 4, LETTERS[:4])
    assert result.failed.tolist() == [True, True, False, False]
    assert result.errors[0].startswith("big: 2 values too large for float32") and "x weight 10" in result.errors[0]
    assert "twice" not in result.function_errors
    metrics = suite.metrics()
    assert metrics["reward/big/failure_rate"] == 0.5 and metrics["reward/twice/failure_rate"] == 0.0
    assert metrics["reward/failure_rate"] == 0.5


def test_a_group_whose_rewards_overflow_float32_statistics_is_dropped(tmp_path, python_rewards):
    # 3e38 fits float32, but the group's sum (and so its mean) does not: its advantages would be NaN.
    R.REWARDS["near_max"] = by_letter([3e38, 2e38, 3e38, 1.0, 0.0, 1.0, 2.0, 3.0])
    with R.RewardSuite([("near_max", 1.0)], timeout_s=5) as suite:
        actor = bare_actor(tmp_path, suite)
        finish_handout(actor, 0, LETTERS)
    (ordinal, reason, detail), = actor.collector.dropped
    assert (ordinal, reason) == (0, "reward_error")
    assert detail == "the group's rewards (1 .. 3e+38) are too large for float32 advantages"
    assert [g.ordinal for g in actor.buffer.groups] == [1]
    assert np.isfinite(actor.buffer.groups[0].advantages).all()


# ----------------------------------------------------------------------------------------------------
# 13. A reward that holds the GIL.


def test_a_backtracking_regex_is_stopped_at_the_deadline_while_other_threads_run():
    # The pattern comes from the config: `format` runs it in worker processes, killed at the deadline.
    suite = R.RewardSuite([{"name": "format", "kwargs": {"pattern": r"^(a+)+$"}}], timeout_s=1.0)
    assert suite.specs[0].runs_in == "process"
    ticks, stop = [], threading.Event()

    def ticker():  # stands for the learner, the run lock's heartbeat, any other Python thread
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.02)

    try:
        wait_until_scored(suite, ["aaaa"] * 4)  # the workers are up
        thread = threading.Thread(target=ticker, daemon=True)
        thread.start()
        start = time.monotonic()
        result = suite.score([{}] * 3, ["a" * 28 + "b", "aaa", "b"])  # 2^28 ways to split the a's
        seconds = time.monotonic() - start
        time.sleep(0.2)
        stop.set()
        thread.join()
        pids = [w.process.pid for w in suite._pools[0]._live]
    finally:
        suite.close()
    gaps = np.diff([t for t in ticks if t >= start - 0.05])
    assert seconds < 1.5, seconds
    assert gaps.max() < 0.5, gaps.max()
    assert result.failed.tolist() == [True, False, False] and result.rewards.tolist() == [0.0, 1.0, 0.0]
    assert result.errors == [("format: timed out after 1.0s with 1 of 3 samples not scored; a call still running at "
                              "the deadline has its worker process killed and replaced")]
    assert len(pids) == 4 and not any(alive(pid) for pid in pids)  # close() ended (and reaped) them
    with pytest.raises(RuntimeError, match="closed"):
        suite.score([{}], ["a"])


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which init has yet to reap, has ended)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def writers_closed(reader: int, seconds: float) -> bool:
    """Whether every writer of the FIFO open (non-blocking) as `reader` closes it within `seconds`."""
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        try:
            if os.read(reader, 1 << 16) == b"":
                return True
        except BlockingIOError:  # a writer still holds it
            time.sleep(0.02)
    return False


def test_the_programs_a_reward_call_started_end_with_its_worker_process(tmp_path, user_module):
    # A verifier that hangs holding an output pipe: killed with the call at the deadline, not reparented to init
    # holding the pipe for minutes. And one started by a call that returned is killed by close().
    output, pids = tmp_path / "output", tmp_path / "pids"
    os.mkfifo(output)
    reader = os.open(output, os.O_RDONLY | os.O_NONBLOCK)  # first, so the reward's open for writing does not block
    spec = {"name": f"{MODULE}:starts_programs", "kwargs": {"output": str(output), "pids": str(pids)},
            "isolation": "process"}
    started = []
    try:
        with R.RewardSuite([spec], timeout_s=1.0, workers=1) as suite:
            wait_until_scored(suite, ["ab"])
            result = suite.score([{}], ["hang"])
            assert result.failed.tolist() == [True]
            started = [int(pid) for pid in pids.read_text().split()]
            assert writers_closed(reader, seconds=5.0), "the hung call's program still holds its output pipe"
            assert not running(started[0])
            start = time.monotonic()
            wait_until_scored(suite, ["abc"])  # the replacement worker scores the next call, undelayed
            assert time.monotonic() - start < 5.0
            assert suite.score([{}], ["spawn"]).failed.tolist() == [False]
            started = [int(pid) for pid in pids.read_text().split()]
            assert running(started[1])
        assert writers_closed(reader, seconds=5.0) and not running(started[1])
    finally:
        os.close(reader)
        for pid in started:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


STARTS_A_PROGRAM_AND_ENDS = textwrap.dedent('''
    import sys, threading, time
    from grpo_jax.algorithm.rewards import RewardSuite
    suite = RewardSuite([{"name": "MODULE:starts_programs", "kwargs": {"output": sys.argv[2], "pids": sys.argv[3]},
                          "isolation": "process"}], timeout_s=30.0, workers=1)
    assert not suite.score([{}], ["spawn"]).failed.any()
    print(next(iter(suite._pools[0]._live)).process.pid, flush=True)
    sys.stdin.readline()  # the test has seen the program run
    if sys.argv[1] == "killed":  # in a call that hangs, so the worker does not see its requests pipe end
        threading.Thread(target=suite.score, args=([{}], ["hang"]), daemon=True).start()
        time.sleep(300)
    # else the interpreter exits without close()
''').replace("MODULE", MODULE)


def test_reward_workers_and_their_programs_end_at_interpreter_exit_and_when_the_trainer_is_killed(tmp_path,
                                                                                                  user_module):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_module), str(REPO)])}
    for how in ("exits", "killed"):
        output, pids = tmp_path / f"output-{how}", tmp_path / f"pids-{how}"
        output.write_bytes(b"")
        trainer = subprocess.Popen([sys.executable, "-c", STARTS_A_PROGRAM_AND_ENDS, how, str(output), str(pids)],
                                   env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        left = []
        try:
            worker = int(trainer.stdout.readline())
            left = [worker, int(pids.read_text())]
            assert running(left[1])
            trainer.stdin.write("\n")
            trainer.stdin.flush()
            if how == "killed":
                while len(pids.read_text().split()) < 2:  # the hung call's program started
                    time.sleep(0.02)
                left.append(int(pids.read_text().split()[1]))
                trainer.kill()  # no exit handler runs: the worker notices its parent is gone
            assert trainer.wait(timeout=30) == (0 if how == "exits" else -signal.SIGKILL)
            give_up = time.monotonic() + 2 + 3 * R._PARENT_POLL_S
            while any(running(pid) for pid in left) and time.monotonic() < give_up:
                time.sleep(0.02)
            assert [pid for pid in left if running(pid)] == [], how
        finally:
            trainer.kill()
            trainer.stdin.close()
            trainer.stdout.close()
            for pid in left:
                if running(pid):
                    os.kill(pid, signal.SIGKILL)


def test_a_worker_started_while_the_pool_closes_is_gone_when_close_returns(monkeypatch):
    """A call killed at its deadline starts its replacement on the call's thread; a close() meanwhile (the trainer
    stopping) must not return before that process is killed too (a run that stopped left one behind)."""
    from grpo_jax.algorithm.rewards import suite as rewards_suite

    real = rewards_suite._WorkerProcess
    spawned, release = threading.Event(), threading.Event()

    def slow_start(spec):
        worker = real(spec)  # the process exists ...
        spawned.set()
        release.wait(10)  # ... and close() runs before the pool hears of it
        return worker

    pool = rewards_suite._ProcessPool(R.RewardSpec.parse({"name": "format", "isolation": "process"}), "probe", 1)
    monkeypatch.setattr(rewards_suite, "_WorkerProcess", slow_start)
    starter = threading.Thread(target=pool._start)
    starter.start()
    assert spawned.wait(10)
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # waiting for the start under way
    release.set()
    closer.join(10)
    starter.join(10)
    assert not closer.is_alive() and reward_workers() == []


def test_where_rewards_run():
    assert R.RewardSpec("format").runs_in == "thread"  # its own pattern: no config regex
    assert R.RewardSpec("format", kwargs={"pattern": "x"}).runs_in == "process"
    assert R.RewardSpec("format", kwargs={"pattern": "x"}, isolation="thread").runs_in == "thread"
    assert R.RewardSpec("gsm8k", isolation="process").runs_in == "process"
    assert R.RewardSpec.parse({"name": "pkg.mod:factory", "isolation": "process"}).runs_in == "process"
    with pytest.raises(ValueError, match=r"isolation='processes': allowed thread, process"):
        R.RewardSpec.parse({"name": "format", "isolation": "processes"})
    with pytest.raises(ValueError, match=r"isolation=process builds the reward again in a worker process.*a Python "
                                         r"function passed to grpo_jax.train runs on threads"):
        R.RewardSpec("my_notebook.score", isolation="process")


def test_a_reward_in_worker_processes_fails_only_the_samples_it_fails(user_module):
    spec = {"name": f"{MODULE}:misbehaving", "isolation": "process"}
    with R.RewardSuite([spec, (f"{MODULE}:scaled", 1.0, {"scale": 2.0})], timeout_s=2.0, workers=2) as suite:
        pool = suite._pools[0]
        wait_until_scored(suite, ["ab", "abc"])
        suite.metrics()
        start = time.monotonic()
        result = suite.score([{}] * 6, ["ok", "raise", "junk", "hang", "four", "exit"])
        assert time.monotonic() - start < 3.0
        assert result.failed.tolist() == [False, True, True, True, False, True]
        np.testing.assert_allclose(result.rewards, [2 + 4, 0, 0, 0, 4 + 8, 0])
        timed_out = ("timed out after 2.0s with 1 of 6 samples not scored; a call still running at the deadline has "
                     "its worker process killed and replaced; ")
        failures = "|".join(re.escape(f) for f in ("raised ValueError: no answer in raise", "its worker process died "
                                                   "(exit code 3)", "bad output: could not convert string to float: "
                                                   "'junk'"))  # in whichever order the two workers met them
        assert re.fullmatch(rf"{re.escape(timed_out)}({failures}) \(1 of 6 samples\); 2 more failed otherwise, "
                            rf"e\.g\. ({failures})", result.function_errors[f"{MODULE}:misbehaving"])
        assert "scaled" not in " ".join(result.errors)
        give_up = time.monotonic() + 10  # the hung call's thread kills its process at the deadline, as score() returns
        while pool.replaced < 2 and time.monotonic() < give_up:
            time.sleep(0.01)
        assert pool.replaced == 2  # the one that hung and the one that died
        assert suite.metrics()["reward/failure_rate"] == 4 / 6
        # The replacements score the later calls; a death is reported as such.
        wait_until_scored(suite, ["ab", "abc"])
        result = suite.score([{}] * 3, ["ab", "abc", "exit"])
        assert result.failed.tolist() == [False, False, True]
        died = "its worker process died (exit code 3) (1 of 3 samples)"
        assert result.function_errors[f"{MODULE}:misbehaving"] == died
        pids = [w.process.pid for w in pool._live]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


# ----------------------------------------------------------------------------------------------------
# 14. A reward that fails on every sample stops the run.


def test_a_reward_that_always_returns_junk_stops_the_actor_within_the_handouts(tmp_path, python_rewards):
    R.REWARDS["junk"] = lambda: (lambda records, completions, lengths: [None] * len(completions))
    with R.RewardSuite([("format", 0.5), ("junk", 1.0)], timeout_s=5) as suite:
        actor = bare_actor(tmp_path, suite, "trainer.reward_error_handouts=3")
        for handout in range(3):
            assert actor.buffer.error is None
            finish_handout(actor, 2 * handout, ["ab"] * 8)
    assert [reason for _, reason, _ in actor.collector.dropped] == ["reward_error"] * 6
    assert actor.collector.dropped[0][2] == "junk: 8 non-finite values"
    error = actor.buffer.error
    assert isinstance(error, TrainerError) and actor.error is error and actor._stop.is_set()
    assert str(error) == (
        "stopped: none of the last 6 prompts could be trained, because the rewards failed on their samples (a group "
        "needs 2 scored samples); last error: junk: 8 non-finite values; fix the reward (each drop's detail in "
        "events.jsonl says how it failed), or raise trainer.reward_error_handouts (now 3 handouts of 2 prompts; 0: "
        "never stop for this)")


def test_a_reward_that_always_hangs_stops_the_actor(tmp_path, python_rewards):
    release = threading.Event()

    def hanging():
        def fn(records, completions, lengths):
            release.wait()
            return [1.0] * len(completions)
        return fn

    R.REWARDS["hanging"] = hanging
    try:
        with R.RewardSuite([("hanging", 1.0)], timeout_s=0.2) as suite:
            actor = bare_actor(tmp_path, suite, "trainer.reward_error_handouts=2")
            finish_handout(actor, 0, ["ab"] * 8)
            assert actor.buffer.error is None
            finish_handout(actor, 2, ["ab"] * 8)
    finally:
        release.set()
    assert "hanging: timed out after 0.2s with 8 of 8 samples not scored" in str(actor.buffer.error)
    assert "reward_error_handouts (now 2 handouts of 2 prompts" in str(actor.buffer.error)


def test_a_reward_that_fails_sometimes_never_stops_the_run(tmp_path, python_rewards):
    R.REWARDS["sometimes"] = by_letter([None, 1.0, 2.0, 3.0, None, None, None, 1.0])  # the second group fails
    with R.RewardSuite([("sometimes", 1.0)], timeout_s=5) as suite:
        actor = bare_actor(tmp_path, suite, "trainer.reward_error_handouts=1")
        for handout in range(5):
            finish_handout(actor, 2 * handout, LETTERS)
        assert suite.metrics()["reward/sometimes/failure_rate"] == 0.5
    assert actor.buffer.error is None and not actor._stop.is_set()
    assert [ordinal for ordinal, _, _ in actor.collector.dropped] == [1, 3, 5, 7, 9]
    assert len(actor.buffer.groups) == 5


def test_reward_error_handouts_zero_never_stops(tmp_path, python_rewards):
    R.REWARDS["junk"] = lambda: (lambda records, completions, lengths: ["x"] * len(completions))
    with R.RewardSuite([("junk", 1.0)], timeout_s=5) as suite:
        actor = bare_actor(tmp_path, suite, "trainer.reward_error_handouts=0")
        for handout in range(4):
            finish_handout(actor, 2 * handout, ["ab"] * 8)
    assert actor.buffer.error is None and len(actor.collector.dropped) == 8
    with pytest.raises(ConfigError, match=r"reward_error_handouts=-1: must be >= 0"):
        tiny_config(tmp_path, "trainer.reward_error_handouts=-1")


def test_grpo_jax_train_with_a_reward_that_always_fails_stops_in_one_line(tmp_path, capsys, user_module):
    run_dir = tmp_path / "run"
    code = main(["train", TINY, *FAST, f'rewards=[{{name: "{MODULE}:always_junk"}}]', "trainer.reward_error_handouts=2",
                 "--run-dir", str(run_dir)])
    assert code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("grpo-jax: error: stopped: none of the last ")
    assert ("raise trainer.reward_error_handouts (now 2 handouts of 4 prompts" in err[-1]
            and f"last error: {MODULE}:always_junk: bad output: could not convert string to float: 'not a list of "
                "numbers'" in err[-1]), err[-1]
    assert not any("Traceback" in line for line in err), "\n".join(err)
    drops = [line for line in read_ledger(run_dir) if line["event"] == "drop"]
    assert {line["reason"] for line in drops} == {"reward_error"}
    assert 8 <= len(drops) <= 8 + 4  # the handouts, and at most the rest of a chunk the engine finished with them
    assert not [line for line in read_ledger(run_dir) if line["event"] == "train"]


def test_a_run_whose_reward_always_hangs_in_worker_processes_stops_and_leaves_none(tmp_path, user_module):
    assert reward_workers() == []
    stopped = (rf"stopped: none of the last \d+ prompts could be trained, .*last error: {MODULE}:always_hang: timed "
               r"out after 0.5s with \d+ of \d+ samples not scored; a call still running at the deadline has its "
               r"worker process killed")
    with pytest.raises(TrainerError, match=stopped):
        grpo_jax.train(TINY, rewards=[{"name": f"{MODULE}:always_hang", "isolation": "process"}], run_dir=tmp_path,
                       overrides=FAST + ["trainer.reward_timeout_s=0.5", "trainer.reward_error_handouts=2"])
    assert reward_workers() == []  # Trainer.close() closed the suite: its worker processes are gone
    drops = [line for line in read_ledger(tmp_path) if line["event"] == "drop"]
    assert 8 <= len(drops) <= 8 + 4 and {line["reason"] for line in drops} == {"reward_error"}


# ----------------------------------------------------------------------------------------------------
# Failure rates in the progress bar.


def test_the_progress_bar_shows_which_rewards_fail(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=3, progress=True, tensorboard=False)
    row = {"step": 1, "reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "staleness/mean": 0.0, "staleness/max": 0,
           "time/step_s": 1.0, "tokens_per_s": 1.0, "reward/failure_rate": 0.25,
           "reward/format/failure_rate": 0.25, "reward/gsm8k/failure_rate": 0.0,
           "reward/pkg.mod:verify/failure_rate": 0.031, "reward/quiet/failure_rate": float("nan")}
    writer.write(row)
    assert writer._bar.postfix.endswith("failed=format 25%,pkg.mod:verify 3%"), writer._bar.postfix
    writer.write({**row, "step": 2, "reward/format/failure_rate": 0.0, "reward/pkg.mod:verify/failure_rate": 0.0})
    assert "failed" not in writer._bar.postfix
    writer.close()
    assert read_metrics(tmp_path)[0]["reward/quiet/failure_rate"] is None
