"""Episode runner tests: episodes of fetch_code on a tiny random model through the continuation engine, token-in/
token-out (each segment's behaviour log-probs are a full forward pass's, its loss mask exactly the sampled tokens);
and environments that raise, hang, return junk or open too long fail their episode with its reason, never the
batch. With a scripted engine (each row "samples" the turns it is given): plain tools that hang, and blocking code
on the event loop, cost a thread each that is replaced, counted, and stops the run past env.concurrency; huge
messages are refused without being tokenized, and messages are rendered off the actor's thread; every reset gets
its own copy of the row."""

import asyncio
import os
import threading

import jax
import numpy as np
import pytest

from conftest import jitted_token_logprobs
from grpo_jax.data.tokenizer import SYNTHETIC_CHAT_SPECIALS, Tokenizer
from grpo_jax.envs.environment import EnvConfig, Environment, StepResult
from grpo_jax.envs.render import make_renderer
from grpo_jax.envs.synthetic import FetchCodeEnv, make_fetch_code_dataset
from grpo_jax.envs.tools import Tool
from grpo_jax.errors import TrainerError
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.rollout.continuation import ContinuationEngine, Drawn
from grpo_jax.rollout.episodes import EpisodeRunner, token_floor
from grpo_jax.rollout.sampler import SamplerConfig

ROWS = 16
SAMPLER = SamplerConfig(max_new_tokens=64, max_prompt_len=16, chunk_steps=8)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.synthetic_chat()


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_embeddings=True, max_position_embeddings=128)
    return create_model(cfg, seed=0)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    renderer = make_renderer("compact", tokenizer)
    return ContinuationEngine(model, renderer.stop_ids, tokenizer.pad_id, SAMPLER, rows=ROWS, context=128)


def _runner(engine, tokenizer, factory, **env):
    config = EnvConfig(name="fetch_code", **{"max_turns": 4, "step_timeout_s": 5.0, **env})
    return EpisodeRunner(engine, make_renderer("compact", tokenizer), config, factory,
                         max_prompt_len=SAMPLER.max_prompt_len, max_new_tokens=SAMPLER.max_new_tokens)


def _run(runner, n=ROWS, seed=0):
    rows = make_fetch_code_dataset(n, seed=seed)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))
    try:
        return runner.run(rows, list(range(n)), keys)
    finally:
        runner.close()


def test_episodes_are_token_in_token_out(engine, tokenizer, model):
    results = _run(_runner(engine, tokenizer, FetchCodeEnv))
    assert all(r.failure is None for r in results)
    assert max(r.turns for r in results) >= 2  # some episodes went on after a tool call
    segments = [s for r in results for s in r.trajectory.segments]
    width = max(len(s.tokens) for s in segments)
    tokens = np.zeros((len(segments), width), np.int32)
    mask = np.zeros(tokens.shape, bool)
    for i, s in enumerate(segments):
        tokens[i, :len(s.tokens)], mask[i, :len(s.tokens)] = s.tokens, True
    full = np.asarray(jitted_token_logprobs(model, tokens, mask)[0])
    checked = 0
    for i, s in enumerate(segments):
        sampled = np.flatnonzero(s.loss_mask)
        assert len(sampled) and sampled[0] > 0
        # the mask is exactly the sampled tokens: those with a weight version, and no environment token
        assert [t for t, v in enumerate(s.weight_versions) if v >= 0] == sampled.tolist()
        np.testing.assert_allclose(np.asarray(s.behaviour_logprobs)[sampled], full[i, sampled - 1], atol=2e-4)
        checked += len(sampled)
    assert checked > 50
    # every episode has a reward (fetch_code's parts) and its environment time counted
    assert all(np.isfinite(r.reward) and set(r.reward_parts) == {"correct", "called", "answered"} for r in results)
    assert all(r.env_seconds > 0 for r in results)


class _Failing(FetchCodeEnv):
    """fetch_code that fails in one of its calls, for some rows (row id parity), in the way `how` says."""

    def __init__(self, where: str, how: str):
        super().__init__()
        self.where, self.how = where, how

    async def _fail(self, value):
        if self.how == "raise":
            raise RuntimeError("the environment broke")
        if self.how == "hang":
            await asyncio.sleep(60)
        return "junk"

    async def reset(self, row, seed):
        messages = await super().reset(row, seed)
        self.failing = row["id"] % 2 == 0
        if self.where == "reset" and self.failing:
            return await self._fail(messages)
        if self.where == "long" and self.failing:
            return [{"role": "user", "content": "code? " * 20}]
        return messages

    async def step(self, turn):
        result = await super().step(turn)
        if self.where == "step" and self.failing:
            return await self._fail(result)
        return result

    async def reward(self):
        value = await super().reward()
        if self.where == "reward" and self.failing:
            return await self._fail(value)
        return value


@pytest.mark.parametrize(("where", "how", "reason"), [
    ("reset", "raise", "env_error"), ("reset", "junk", "env_error"), ("step", "raise", "env_error"),
    ("step", "hang", "env_timeout"), ("step", "junk", "env_error"), ("reward", "junk", "env_error"),
    ("reward", "hang", "env_timeout"), ("long", "", "context_limit"),
])
def test_a_failing_environment_fails_its_episode_only(engine, tokenizer, where, how, reason):
    runner = _runner(engine, tokenizer, lambda: _Failing(where, how), step_timeout_s=0.5)
    results = _run(runner, seed=1)
    rows = make_fetch_code_dataset(ROWS, seed=1)
    failed = [r.failure for r in results]
    assert reason in failed
    for row, result in zip(rows, results):
        if row["id"] % 2:  # the others ran as usual
            assert result.failure is None and np.isfinite(result.reward)
        elif result.failure is not None:
            assert result.failure == reason and result.detail and np.isnan(result.reward)


def test_a_factory_that_raises_fails_every_episode(engine, tokenizer):
    def broken():
        raise ValueError("no")
    results = _run(_runner(engine, tokenizer, broken), n=3)
    assert [r.failure for r in results] == ["env_error"] * 3
    assert "making the environment raised ValueError: no" in results[0].detail


def test_max_turns_truncates(engine, tokenizer):
    results = _run(_runner(engine, tokenizer, FetchCodeEnv, max_turns=1))
    assert all(r.turns == 1 for r in results)
    assert any(r.trajectory.truncated for r in results)
    assert all(r.failure is None for r in results)


# -- with a scripted engine: the environment's side of the runner, no model --


class ScriptedEngine:
    """The continuation engine's interface for EpisodeRunner; row r "samples" scripts[r][k] as its k-th turn (the last
    repeats): every token of a turn comes from one extend (its first) and one decode (the rest)."""

    def __init__(self, scripts, context=4096):
        self.scripts, self.rows, self.context, self.version, self.state = scripts, len(scripts), context, 0, None
        self.any_active = False
        self.reset()

    def reset(self):
        self.turn, self.pending = [-1] * self.rows, [[] for _ in range(self.rows)]

    def metrics(self):
        return {}

    def _drawn(self, per_row):
        tokens = np.zeros((self.rows, max(1, max(map(len, per_row)))), np.int32)
        for r, ids in enumerate(per_row):
            tokens[r, :len(ids)] = ids
        return Drawn(tokens=tokens, logprobs=np.full(tokens.shape, -1.0, np.float32),
                     count=np.array([len(t) for t in per_row], np.int32),
                     ended=np.array([len(t) > 0 and not self.pending[r] for r, t in enumerate(per_row)]), version=0)

    def extend(self, appended, restart, keys, budgets):
        first = []
        for r in range(self.rows):
            ids = []
            if appended[r] is not None:
                self.turn[r] += 1
                ids = self.scripts[r][min(self.turn[r], len(self.scripts[r]) - 1)]
            first.append(ids[:1])
            self.pending[r] = ids[1:]
        self.any_active = any(self.pending)
        return self._drawn(first)

    def decode(self):
        out, self.pending = self.pending, [[] for _ in range(self.rows)]
        self.any_active = False
        return self._drawn(out)


def _scripted_runner(tokenizer, factory, rows, **env):
    """A runner whose rows call fetch once, then answer 1 (both turns end with <|e|>)."""
    scripts = [[tokenizer.encode("<|c|>fetch<|e|>"), tokenizer.encode("1<|e|>")]] * rows
    config = EnvConfig(name="fetch_code", **{"max_turns": 3, "step_timeout_s": 0.5, "max_total_tokens": 64, **env})
    return EpisodeRunner(ScriptedEngine(scripts), make_renderer("compact", tokenizer), config, factory,
                         max_prompt_len=16, max_new_tokens=32)


def _batch(runner, n, rows=None):
    rows = rows if rows is not None else make_fetch_code_dataset(n, seed=0)
    keys = np.zeros((n, 2), np.uint32)
    return runner.run(rows, list(range(n)), keys)


class _HangingFetch(Environment):
    """Its tool `fetch` is a plain function: the first `hangs` calls (of all environments) block until released."""

    def __init__(self, hangs: int, release: threading.Event):
        self.hangs, self.release, self.calls = hangs, release, [0]

        def fetch() -> str:
            """Fetch the code."""
            self.calls[0] += 1
            if self.calls[0] <= self.hangs:
                self.release.wait()  # a request without a timeout
            return "code 1"

        self.tools = [Tool.from_function(fetch)]

    async def reset(self, row, seed):
        return [{"role": "user", "content": "code?"}]

    async def reward(self):
        return 1.0


def _hanging_factory(hangs, release):
    calls = [0]

    def make():
        env = _HangingFetch(hangs, release)
        env.calls = calls  # counted over every environment of the runner
        return env
    return make


def test_hung_plain_tools_are_replaced_counted_and_named(tokenizer):
    # As many hung calls as asyncio's default executor has threads (what the tools ran on): the later episodes
    # must not wait for them.
    hangs = min(32, (os.cpu_count() or 1) + 4)
    release = threading.Event()
    runner = _scripted_runner(tokenizer, _hanging_factory(hangs, release), hangs + 2, concurrency=32)
    try:
        first = _batch(runner, hangs + 2)
        timed_out = [r for r in first if r.failure == "env_timeout"]
        assert len(timed_out) == hangs and sum(r.failure is None for r in first) == 2
        assert "its thread in _HangingFetch.__init__.<locals>.fetch at " in timed_out[0].detail
        assert "cannot be stopped" in timed_out[0].detail
        metrics = runner.metrics()
        assert metrics["rollout/episode_stuck_threads"] == hangs
        assert metrics["rollout/episode_stuck_calls"] == hangs
        assert [r.failure for r in _batch(runner, hangs + 2)] == [None] * (hangs + 2)
    finally:
        release.set()
        runner.close()


def test_more_stuck_threads_than_env_concurrency_stop_the_run_naming_the_tool(tokenizer):
    release = threading.Event()
    runner = _scripted_runner(tokenizer, _hanging_factory(3, release), 3, concurrency=2)
    try:
        with pytest.raises(TrainerError, match=r"^stopped: 3 threads are stuck in environment calls past "
                                               r"env.step_timeout_s=0.5, more than env.concurrency=2: 3 in "
                                               r"_HangingFetch.__init__.<locals>.fetch at .*test_episodes.py:\d+"):
            _batch(runner, 3)
    finally:
        release.set()
        runner.close()


class _BlockingStep(Environment):
    """Row 0's step() runs blocking code on the event loop (until released); the others answer at once."""

    release = threading.Event()

    async def reset(self, row, seed):
        self.blocks = row["id"] == 0
        return [{"role": "user", "content": "code?"}]

    async def step(self, turn):
        if self.blocks:
            self.release.wait()
        return StepResult(messages=[{"role": "tool", "name": "fetch", "content": "code 1"}])

    async def reward(self):
        return 1.0


def test_a_step_that_blocks_the_event_loop_is_named_and_the_loop_replaced(tokenizer):
    runner = _scripted_runner(tokenizer, _BlockingStep, 3)
    rows = [{"id": i, "prompt": "code?"} for i in range(3)]
    try:
        first = _batch(runner, 3, rows)
        assert [r.failure for r in first] == ["env_timeout"] * 3  # every episode on the held loop
        assert "step() held the event loop" in first[0].detail and "test_episodes.py:" in first[0].detail
        assert "the event loop was lost: step() held it" in first[1].detail
        assert runner.metrics()["rollout/episode_loops_replaced"] == 1
        assert runner.metrics()["rollout/episode_stuck_threads"] == 1
        rows[0]["id"] = 3  # no longer blocks
        assert [r.failure for r in _batch(runner, 3, rows)] == [None] * 3
    finally:
        _BlockingStep.release.set()
        runner.close()


class _BigAnswer(Environment):
    """Row 0's step answers with `size` characters; the others with a short answer."""

    def __init__(self, size: int):
        self.size = size

    async def reset(self, row, seed):
        self.big = row["id"] == 0
        return [{"role": "user", "content": "code?"}]

    async def step(self, turn):
        text = ("code 1 " * (self.size // 7 + 1))[:self.size] if self.big else "code 1"
        return StepResult(messages=[{"role": "tool", "name": "fetch", "content": text}])

    async def reward(self):
        return 1.0


def _spied(tokenizer):
    """The tokenizer, its encode() recording the length of each text and the thread it ran on."""
    seen = []
    encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        seen.append((len(text), threading.current_thread()))
        return encode(text, *args, **kwargs)
    tokenizer.encode = spy
    return tokenizer, seen


# the word-level tokenizer claims no bound on a token's bytes; a byte-level one does (Tokenizer.min_tokens)
TOKENIZERS = {"word_level": Tokenizer.synthetic_chat,
              "byte_level": lambda: Tokenizer.byte_level(extra_special_tokens=SYNTHETIC_CHAT_SPECIALS)}


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_a_huge_environment_message_fails_its_episode_unread(kind):
    tokenizer, seen = _spied(TOKENIZERS[kind]())
    runner = _scripted_runner(tokenizer, lambda: _BigAnswer(10 << 20), 4)
    try:
        results = _batch(runner, 4, [{"id": i, "prompt": "code?"} for i in range(4)])
    finally:
        runner.close()
    assert results[0].failure == "context_limit"
    assert f"step() returned {10 << 20} characters of messages" in results[0].detail
    assert [r.failure for r in results[1:]] == [None] * 3
    assert max(length for length, _ in seen) < 1000  # nothing near the message was tokenized


def test_an_answer_that_provably_leaves_no_room_is_truncated_unread():
    # byte-level: at most 13 bytes per token, so 800 bytes are at least 61 tokens: within a 64-token sequence,
    # beyond the room after the opening and the first turn
    tokenizer, seen = _spied(TOKENIZERS["byte_level"]())
    runner = _scripted_runner(tokenizer, lambda: _BigAnswer(800), 2)
    try:
        results = _batch(runner, 2, [{"id": i, "prompt": "code?"} for i in range(2)])
    finally:
        runner.close()
    assert [r.failure for r in results] == [None, None]
    assert results[0].trajectory.truncated and results[0].turns == 1 and np.isfinite(results[0].reward)
    assert results[1].turns == 3  # its short answers were rendered: on to env.max_turns
    assert max(length for length, _ in seen) < 800
    assert runner.metrics()["rollout/episode_truncated_at_context"] == 1


def test_a_turn_longer_than_its_room_is_cut_there_and_the_episode_truncated(tokenizer):
    """Whatever the engine returns, a turn holds at most its room (here max_new_tokens=32): a tool call nested 1000
    deep, "sampled" whole, is cut at 32 tokens and the episode ends truncated, with its reward, never a sequence
    longer than the learner's rows (issue 36.5: the run stopped on one)."""
    deep = tokenizer.encode("<|c|>fetch key=" + "[" * 1000 + "<|e|>")
    runner = _scripted_runner(tokenizer, FetchCodeEnv, 2)
    runner.engine.scripts = [[deep], runner.engine.scripts[1]]
    try:
        results = _batch(runner, 2)
    finally:
        runner.close()
    assert [r.failure for r in results] == [None, None]
    cut = results[0].trajectory
    assert cut.truncated and results[0].turns == 1 and np.isfinite(results[0].reward)
    assert sum(len(s.tokens) for s in cut.segments) <= 16 + 32  # the prompt's room and the turn's
    assert [int(m) for m in cut.segments[0].loss_mask].count(1) == 32
    assert results[1].turns == 2 and not results[1].trajectory.truncated
    assert runner.metrics()["rollout/episode_cut_at_room"] == 1


def test_environment_messages_are_rendered_off_the_actor_thread():
    tokenizer, seen = _spied(Tokenizer.synthetic_chat())
    runner = _scripted_runner(tokenizer, lambda: _BigAnswer(0), 2)
    seen.clear()  # the renderer's own probe, when it was made
    try:
        results = _batch(runner, 2, [{"id": i, "prompt": "code?"} for i in range(2)])
    finally:
        runner.close()
    assert [r.turns for r in results] == [3, 3]  # openings and answers rendered
    assert seen and all(thread is not threading.main_thread() for _, thread in seen)


class _RowTaker(FetchCodeEnv):
    """Reads its row by taking fields out of it, and caches a parsed value in it."""

    async def reset(self, row, seed):
        row_id = row.pop("id")
        row["_parsed"] = {row_id}  # no JSON form: a checkpoint of the row would fail
        return await super().reset({**row, "id": row_id}, seed)


def test_each_reset_gets_its_own_copy_of_the_row(tokenizer):
    row = make_fetch_code_dataset(1, seed=0)[0]
    kept = dict(row)
    runner = _scripted_runner(tokenizer, _RowTaker, 4)
    try:
        results = _batch(runner, 4, [row] * 4)  # as the actor hands them: one dict for the G episodes of a group
    finally:
        runner.close()
    assert [r.failure for r in results] == [None] * 4
    assert row == kept


def test_token_floor_is_a_lower_bound_and_stops_past_its_limit():
    tokenizer = TOKENIZERS["byte_level"]()
    rng = np.random.default_rng(0)
    alphabet = list("ab c\n=") + ["é", "e\u0301", "日本", "<|e|>", "\U0001f600"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 400))))
        floor = token_floor(tokenizer, text, limit=10_000)
        assert floor is not None and floor <= len(tokenizer.encode(text))
    huge = "code 1 " * 400_000
    assert token_floor(tokenizer, huge, limit=64) > 64  # from a prefix: the spy tests show it reads no more
    assert token_floor(Tokenizer.synthetic_chat(), "code 1", limit=64) is None  # no bound claimed
