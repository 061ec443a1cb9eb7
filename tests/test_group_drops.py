"""Which finished groups the actor trains and which it drops (rollout.grouping.verdict, shared by the static and
streaming path, Actor._finish, and the episodes' path, Actor._finish_episodes): the decision is taken on the
advantages the group would train with (group_advantages', or env.advantage's), so with grpo.filter_zero_variance a
group is dropped as zero_variance exactly when every scored sample's advantage is 0: its policy term has no gradient.
The verdict is tested alone (pure, no thread); the actor's two paths are driven on an Actor without a model (its
device-free attributes set by hand)."""

import collections
import types

import numpy as np
import pytest

from grpo_jax.algorithm.advantages import GRPOConfig, group_advantages
from grpo_jax.algorithm.rewards import RewardResult
from grpo_jax.envs.trajectory import Segment
from grpo_jax.rollout.actor import Actor
from grpo_jax.rollout.common import GroupResult
from grpo_jax.rollout.episodes import EpisodeResult
from grpo_jax.rollout.grouping import Drop, Judged, Keep, verdict, without_signal

G = 4


def turn_penalised(rewards, step_rewards, valid):
    """docs/environments.md's example: reward() less 0.05 per rewarded step, then group-relative."""
    score = rewards - 0.05 * np.isfinite(step_rewards).sum(axis=1)
    return (score - np.nanmean(score)) / (np.nanstd(score) + 1e-6)


class Ledger:
    """The collector and buffer the actor reports to: what happened to each ordinal."""

    def __init__(self):
        self.outcomes, self.groups = {}, {}

    def mark_dropped(self, ordinal, reason, detail=None):
        self.outcomes[ordinal] = reason

    def mark_finished(self, ordinal):
        self.outcomes[ordinal] = "finished"

    def put(self, group):
        self.groups[group.ordinal] = group

    def release(self, n):
        pass


def bare_actor(filter_zero_variance: bool, custom_advantage=None) -> tuple[Actor, Ledger]:
    """An Actor with only what _finish and _finish_episodes read: configs, collector, buffer, counters, and
    group_advantages at the actor's own settings (the jitted padded-block version is a device detail)."""
    ledger = Ledger()
    actor = object.__new__(Actor)
    actor.grpo = GRPOConfig(group_size=G, filter_zero_variance=filter_zero_variance)
    actor.limits = types.SimpleNamespace(reward_error_handouts=0)
    actor.collector = actor.buffer = ledger
    actor.custom_advantage = custom_advantage
    actor.sampler = types.SimpleNamespace(config=types.SimpleNamespace(max_turns=3, advantage="tests:custom"))
    actor.env_failures = collections.Counter()
    actor.generated_tokens = actor.failed_samples = actor.reward_error_calls = actor.reward_error_streak = 0
    actor.last_reward_error = None
    actor._group_advantages = lambda r, v: tuple(np.array(x) for x in group_advantages(r, v))
    return actor, ledger


def episode(reward: float, steps: int) -> EpisodeResult:
    """A finished episode of one segment: 3 prompt tokens, 2 sampled, `steps` rewarded steps."""
    segment = Segment(tokens=(1, 2, 3, 4, 5), loss_mask=(0, 0, 0, 1, 1), behaviour_logprobs=(0, 0, 0, -1.0, -1.0),
                      weight_versions=(-1, -1, -1, 0, 0))
    trajectory = types.SimpleNamespace(segments=(segment,), turns=steps, tool_calls=0, tool_errors=0,
                                       truncated=False)
    return EpisodeResult(trajectory=trajectory, reward=reward, step_rewards=[0.0] * steps)


PROMPT = types.SimpleNamespace(ordinal=7, record={"row": {}, "prompt_ids": [1, 2]})


def finish_episodes(custom, rewards, steps=(1, 1, 1, 1), filter_zero_variance=True):
    actor, ledger = bare_actor(filter_zero_variance, custom)
    Actor._finish_episodes(actor, [PROMPT], [episode(r, k) for r, k in zip(rewards, steps)])
    return ledger.outcomes[PROMPT.ordinal], ledger.groups.get(PROMPT.ordinal)


def test_custom_advantages_that_differ_are_trained_although_the_rewards_are_equal():
    """The docs' turn-penalised example on four right answers in 1, 2, 3 and 3 steps: equal reward() values, and
    advantages [1.51, 0.30, -0.91, -0.91] (it was dropped as zero_variance on the equal rewards)."""
    outcome, group = finish_episodes(turn_penalised, [1.0] * G, steps=(1, 2, 3, 3))
    assert outcome == "finished"
    np.testing.assert_allclose(group.advantages, [1.508, 0.302, -0.905, -0.905], atol=1e-3)
    assert group.zero_variance is False


def test_custom_advantages_all_zero_are_dropped_and_all_equal_but_not_zero_are_trained():
    outcome, _ = finish_episodes(lambda rewards, step_rewards, valid: np.zeros(G), [0.0, 1.0, 0.5, 1.0])
    assert outcome == "zero_variance"  # rewards that differ do not save a group its function gave no signal
    # The same advantage for every episode still moves the policy (each sample's likelihood by the same weight):
    # the function's signal, trained.
    outcome, group = finish_episodes(lambda rewards, step_rewards, valid: np.full(G, 0.5), [1.0] * G)
    assert outcome == "finished" and group.zero_variance is False
    # ... and without the filter a group of zero advantages trains, flagged for the metrics.
    outcome, group = finish_episodes(lambda rewards, step_rewards, valid: np.zeros(G), [1.0] * G,
                                     filter_zero_variance=False)
    assert outcome == "finished" and group.zero_variance is True


def test_without_a_custom_advantage_equal_rewards_still_drop_and_differing_ones_train():
    assert finish_episodes(None, [1.0] * G)[0] == "zero_variance"
    outcome, group = finish_episodes(None, [1.0, 0.0, 1.0, 0.0])
    assert outcome == "finished" and group.zero_variance is False


def static_finish(rewards, finish_reasons=("stop",) * G, filter_zero_variance=True, failed=(False,) * G):
    """Actor._finish (the static and streaming paths) on one group whose reward suite scored `rewards`."""
    actor, ledger = bare_actor(filter_zero_variance)
    actor.tokenizer = types.SimpleNamespace(decode=lambda tokens: "text")
    scored = RewardResult(rewards=np.asarray(rewards, np.float32), failed=np.asarray(failed),
                          per_function={"r": np.where(failed, np.nan, rewards)}, errors=[],
                          function_errors={"r": "boom"} if any(failed) else {})
    actor.rewards = types.SimpleNamespace(score=lambda records, texts, lengths: scored)
    result = GroupResult(tag=PROMPT, tokens=[np.array([5, 6], np.int32)] * G, logprobs=[np.zeros(2, np.float32)] * G,
                         versions=[np.zeros(2, np.int32)] * G, finish_reasons=list(finish_reasons))
    Actor._finish(actor, [PROMPT], [result])
    return ledger.outcomes[PROMPT.ordinal], ledger.groups.get(PROMPT.ordinal)


def test_the_static_path_takes_the_same_decisions():
    assert static_finish([1.0] * G)[0] == "zero_variance"
    outcome, group = static_finish([1.0] * G, filter_zero_variance=False)
    assert outcome == "finished" and group.zero_variance is True
    assert static_finish([1.0, 0.0, 0.0, 0.0])[0] == "finished"
    assert static_finish([1.0, 0.0, 0.0, 0.0], finish_reasons=("length",) * G)[0] == "overlong"
    assert static_finish([1.0, 0.0, 0.0, 0.0], failed=(True, True, True, False))[0] == "reward_error"


@pytest.mark.parametrize("valid, advantages, overlong, expected", [
    ([1, 1, 0, 0], [1.0, -1.0, 0.0, 0.0], None, None),
    ([1, 0, 0, 0], [0.0, 0.0, 0.0, 0.0], None, "too_few"),
    ([1, 1, 1, 1], [np.inf, 0.0, 0.0, 0.0], None, "reward_error"),
    ([1, 1, 1, 1], [1.0, -1.0, 0.0, 0.0], [1, 1, 1, 1], "overlong"),
    ([1, 1, 1, 1], [1.0, -1.0, 0.0, 0.0], [1, 1, 1, 0], None),
    ([1, 1, 1, 1], [0.0, 0.0, 0.0, 0.0], None, "zero_variance"),
    ([1, 1, 1, 0], [0.0, 0.0, 0.0, 3.0], None, "zero_variance"),  # a failed sample's value is never trained
    ([1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5], None, None),
    ([1, 1, 1, 1], [0.0, 0.0, 0.0, 1e-30], None, None),  # exactly: a tiny advantage is still a gradient
])
def test_verdict(valid, advantages, overlong, expected):
    valid, advantages = np.asarray(valid, bool), np.asarray(advantages, np.float32)
    judged = Judged(valid=valid, rewards=np.ones(G, np.float32), advantages=advantages, failure="too_few",
                    failure_detail="why", overlong=None if overlong is None else np.asarray(overlong, bool))
    outcome = verdict(judged, filter_zero_variance=True)
    if expected is None:
        assert isinstance(outcome, Keep) and outcome.zero_variance is False
        np.testing.assert_array_equal(outcome.advantages, advantages)
        return
    assert isinstance(outcome, Drop) and outcome.reason == expected
    # The streak of failing rewards counts only drops where scoring failed, not groups without signal.
    assert outcome.scoring_failed == (expected in ("too_few", "reward_error"))
    if expected == "too_few":
        assert outcome.detail == "why"
    if expected == "zero_variance":
        assert without_signal(valid, advantages)
        kept = verdict(judged, filter_zero_variance=False)
        assert isinstance(kept, Keep) and kept.zero_variance is True


def test_verdict_on_a_custom_advantage_that_fails_names_it():
    def broken(rewards, step_rewards, valid):
        raise KeyError("turns")
    judged = Judged(valid=np.ones(G, bool), rewards=np.array([1.0, 0.0, 1.0, 0.0], np.float32),
                    advantages=np.array([1.0, -1.0, 1.0, -1.0], np.float32), step_rewards=np.zeros((G, 3)))
    outcome = verdict(judged, filter_zero_variance=True, custom_advantage=broken, custom_advantage_name="env:adv")
    assert outcome == Drop(reason="reward_error", detail="env.advantage env:adv: raised KeyError: 'turns'",
                           scoring_failed=True)


def test_rewards_too_large_for_float32_advantages_are_a_reward_error_naming_their_range():
    judged = Judged(valid=np.ones(G, bool), rewards=np.array([1.0, 3e38, -3e38, 0.0], np.float32),
                    advantages=np.array([np.inf, 0.0, 0.0, 0.0], np.float32))
    assert verdict(judged, filter_zero_variance=False) == Drop(
        reason="reward_error", scoring_failed=True,
        detail="the group's rewards (-3e+38 .. 3e+38) are too large for float32 advantages")


@pytest.mark.parametrize("seed", range(20))
def test_the_verdict_on_random_groups_matches_a_reference(seed):
    """Random groups against the rule written out plainly: drop exactly when fewer than 2 count, an advantage is
    not finite, all are overlong, or (filtered) every counted advantage is 0; a kept group trains its advantages."""
    rng = np.random.default_rng(seed)
    valid = rng.random(G) < 0.7
    advantages = np.where(rng.random(G) < 0.5, 0.0, rng.normal(size=G)).astype(np.float32)
    if rng.random() < 0.1:
        advantages[rng.integers(G)] = np.nan
    overlong = rng.random(G) < 0.8 if rng.random() < 0.5 else None
    filtered = bool(rng.random() < 0.5)
    outcome = verdict(Judged(valid=valid, rewards=np.zeros(G, np.float32), advantages=advantages, overlong=overlong),
                      filter_zero_variance=filtered)
    if valid.sum() < 2 or not np.isfinite(advantages).all():
        expected = "reward_error"
    elif overlong is not None and overlong.all():
        expected = "overlong"
    elif filtered and (advantages[valid] == 0).all():
        expected = "zero_variance"
    else:
        expected = None
    assert (outcome.reason if isinstance(outcome, Drop) else None) == expected
