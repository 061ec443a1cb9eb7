"""Which finished groups are trained and which are dropped: one verdict for the static, streaming and episode paths.

    Judged (a group's G samples: which counted, their rewards, group_advantages') -> verdict -> Keep | Drop

Contract:
- Pure: no thread, device or ledger. The actor scores (RewardSuite, or the episodes' reward()), computes the
  group-relative advantages, then asks verdict; it keeps the logging, the reward-error streak and the ledger calls
  (Drop.reason and Drop.detail are what the ledger records).
- The decision is taken on the advantages the group would train with (env.advantage's when set), in this order:
  fewer than 2 samples count (Judged.failure names why: reward_error, or the episodes' commonest failure);
  env.advantage fails (reward_error); an advantage that is not finite (reward_error: rewards too large for
  float32); every sample hit max_new_tokens (overlong; single-turn only); with grpo.filter_zero_variance, every
  counted sample's advantage exactly 0 (zero_variance: its policy term has no gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from grpo_jax.algorithm.advantages import custom_advantages

# The longest detail (a reward's or an environment's error) quoted in a drop's ledger line or a stop message.
DETAIL_CHARS = 300


def one_line(text, limit: int = DETAIL_CHARS) -> str:
    """`text` (any object, as str) on one line, at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclasses.dataclass(frozen=True, kw_only=True)
class Judged:
    """What one finished group of G samples is judged on."""

    valid: np.ndarray  # [G] bool: the sample was scored (single-turn) / the episode did not fail
    rewards: np.ndarray  # [G] float32 (a sample that does not count: any value)
    advantages: np.ndarray  # [G] float32: group_advantages' of rewards over valid
    failure: str = "reward_error"  # the drop reason when fewer than 2 samples count
    failure_detail: str | None = None  # ... and its ledger detail
    overlong: np.ndarray | None = None  # [G] bool: the sample hit max_new_tokens; None for episodes
    step_rewards: np.ndarray | None = None  # [G, turns] float32, NaN where none: env.advantage's input


@dataclasses.dataclass(frozen=True, kw_only=True)
class Keep:
    """A group to train, with the advantages it trains with."""

    advantages: np.ndarray  # [G] float32, 0 for a sample that does not count
    zero_variance: bool  # every counted advantage is 0 (trained only without filter_zero_variance; for the metrics)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drop:
    """A group not trained: its ledger reason and detail."""

    reason: str
    detail: str | None = None
    scoring_failed: bool = False  # dropped because rewards, episodes or env.advantage failed (the actor's streak)


def without_signal(valid: np.ndarray, advantages: np.ndarray) -> bool:
    """Whether advantages (one per sample, those it would train with) give a group's policy term no gradient: every
    counted sample's advantage is exactly 0. group_advantages gives exact zeros to a group whose rewards are all
    equal; env.advantage's function decides for itself (equal values that are not 0 still move every sample's
    likelihood, so they train)."""
    return not np.any(np.asarray(advantages)[np.asarray(valid, bool)] != 0)


def verdict(judged: Judged, *, filter_zero_variance: bool, custom_advantage: Callable | None = None,
            custom_advantage_name: str = "") -> Keep | Drop:
    """Train or drop one finished group (the module docstring's order). custom_advantage: env.advantage's function
    (algorithm.advantages.custom_advantages calls it), named custom_advantage_name in a drop's detail."""
    valid = np.asarray(judged.valid, bool)
    if valid.sum() < 2:
        return Drop(reason=judged.failure, detail=judged.failure_detail, scoring_failed=True)
    advantages = np.asarray(judged.advantages, np.float32)
    if custom_advantage is not None:
        try:
            advantages = custom_advantages(custom_advantage, judged.rewards, judged.step_rewards, valid)
        except ValueError as e:
            return Drop(reason="reward_error", detail=one_line(f"env.advantage {custom_advantage_name}: {e}"),
                        scoring_failed=True)
    if not np.isfinite(advantages).all():
        # Each reward fits float32 (RewardSuite checks), but the group's mean or spread does not.
        counted = np.asarray(judged.rewards)[valid]
        return Drop(reason="reward_error", scoring_failed=True,
                    detail=f"the group's rewards ({counted.min():.3g} .. {counted.max():.3g}) are too large for "
                           "float32 advantages")
    if judged.overlong is not None and np.asarray(judged.overlong, bool).all():
        return Drop(reason="overlong")
    zero_variance = without_signal(valid, advantages)
    if filter_zero_variance and zero_variance:
        return Drop(reason="zero_variance")
    return Keep(advantages=advantages, zero_variance=zero_variance)
