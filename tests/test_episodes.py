"""Episode runner tests: episodes of fetch_code on a tiny random model through the continuation engine, token-in/
token-out (each segment's behaviour log-probs are a full forward pass's, its loss mask exactly the sampled tokens);
and environments that raise, hang, return junk or open too long fail their episode with its reason, never the
batch."""

import asyncio

import jax
import numpy as np
import pytest

from conftest import jitted_token_logprobs
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.environment import EnvConfig
from grpo_jax.envs.render import make_renderer
from grpo_jax.envs.synthetic import FetchCodeEnv, make_fetch_code_dataset
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.rollout.continuation import ContinuationEngine
from grpo_jax.rollout.episodes import EpisodeRunner
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
