"""Group-relative advantages for GRPO and its variants.

Rewards come shaped [num_groups, G]: row g holds the G completions sampled for one prompt. All
functions except `filter_zero_variance` and `custom_advantages` (host side, numpy) are pure jnp
(jit-able; numpy input is fine). An optional `valid` mask [num_groups, G] leaves out samples whose
reward failed: they neither enter the group statistics nor receive an advantage.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from grpo_jax.config_io import config_key

BASELINES = ("mean", "leave_one_out")


def group_advantages(rewards, valid=None, baseline: str = "mean", scale_by_std: bool = True,
                     std_ddof: int = 1, eps: float = 1e-6, positive_weight: float = 1.0):
    """Per-sample advantages [num_groups, G] and a zero-variance mask [num_groups] (bool).

    baseline:
      "mean"           A_i = r_i - mean(r)                       (GRPO)
      "leave_one_out"  A_i = r_i - mean_{j != i}(r_j)            (RLOO; = G/(G-1) * (r_i - mean(r)))
    scale_by_std: divide by (std(r) + eps), as in GRPO; False gives Dr. GRPO's unscaled advantages.
    std_ddof: 1 (default) is the unbiased sample std, matching torch.std in the reference GRPO
      implementations (TRL); 0 is the population std. Counts are clamped so tiny groups never divide
      by zero.
    positive_weight: multiplies the advantages above 0 (W-REINFORCE, Zhu et al. 2025, "The Surprising
      Effectiveness of Negative Reinforcement in LLM Reasoning"). Below 1, a sample better than its group is
      reinforced less than a worse one is penalized: penalizing a token moves its probability to the others in
      proportion to theirs, so the policy sharpens more slowly and keeps exploring; 1 is GRPO.

    A group is zero-variance when all its valid rewards are exactly equal (or it has fewer than two
    valid samples): it carries no learning signal and its advantages are exactly 0 (not rounding
    noise divided by eps).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r}: allowed {', '.join(BASELINES)}")
    r = jnp.asarray(rewards)
    r = r.astype(jnp.result_type(r.dtype, jnp.float32))
    v = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    r = jnp.where(v, r, 0.0)
    n = v.sum(axis=1, keepdims=True).astype(r.dtype)
    mean = r.sum(axis=1, keepdims=True) / jnp.maximum(n, 1.0)
    if baseline == "mean":
        adv = r - mean
    else:
        others = (r.sum(axis=1, keepdims=True) - r) / jnp.maximum(n - 1.0, 1.0)
        adv = r - others
    if scale_by_std:
        var = (jnp.where(v, r - mean, 0.0) ** 2).sum(axis=1, keepdims=True) / jnp.maximum(n - std_ddof, 1.0)
        adv = adv / (jnp.sqrt(var) + eps)
    big = jnp.finfo(r.dtype).max
    hi = jnp.where(v, r, -big).max(axis=1)
    lo = jnp.where(v, r, big).min(axis=1)
    zero_var = (hi <= lo) | (n[:, 0] < 2)
    adv = jnp.where(adv > 0, positive_weight * adv, adv)
    adv = jnp.where(v & ~zero_var[:, None], adv, 0.0)
    return adv, zero_var


def custom_advantages(fn, rewards: np.ndarray, step_rewards: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """One group's per-trajectory advantages [G] from a user's function (EnvConfig.advantage), host side:
    fn(rewards=[G] float64, NaN for a failed episode; step_rewards=[G, max_turns] float64, each step's
    StepResult.reward in turn order, NaN where a step gave none or did not happen; valid=[G] bool) returns G
    numbers. Failed episodes get 0 whatever it returns. Raises ValueError naming what was wrong with the
    result, or what fn raised."""
    rewards = np.where(valid, np.asarray(rewards, np.float64), np.nan)
    try:
        out = fn(rewards=rewards, step_rewards=np.array(step_rewards, np.float64), valid=np.array(valid, bool))
    except Exception as e:  # noqa: BLE001 - user code: the caller drops the group with this as its detail
        raise ValueError(f"raised {type(e).__name__}: {e}") from e
    try:
        advantages = np.asarray(out, np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"returned {type(out).__name__} {out!r:.80}, not G numbers") from e
    if advantages.shape != rewards.shape:
        raise ValueError(f"returned shape {advantages.shape}, expected ({len(rewards)},): one advantage per episode")
    if not np.isfinite(advantages[valid]).all() or np.abs(advantages[valid]).max(initial=0.0) > 1e30:
        raise ValueError(f"returned {advantages.tolist()}: an episode that did not fail needs a finite advantage")
    return np.where(valid, advantages, 0.0).astype(np.float32)


def filter_zero_variance(rewards, valid=None):
    """DAPO dynamic sampling, host side: (keep [K] int indices of groups with signal, dropped
    [num_groups] bool). The trainer keeps sampling until it has enough kept groups."""
    r = np.asarray(rewards, np.float64)
    v = np.ones(r.shape, bool) if valid is None else np.asarray(valid, bool)
    hi = np.where(v, r, -np.inf).max(axis=1)
    lo = np.where(v, r, np.inf).min(axis=1)
    dropped = (hi <= lo) | (v.sum(axis=1) < 2)
    return np.flatnonzero(~dropped), dropped


def _masked_moments(x, m):
    n = jnp.maximum(m.sum(), 1)
    mean = jnp.where(m, x, 0.0).sum() / n
    std = jnp.sqrt(jnp.where(m, (x - mean) ** 2, 0.0).sum() / n)
    big = jnp.finfo(x.dtype).max
    any_ = m.any()
    return {
        "mean": mean,
        "std": std,
        "min": jnp.where(any_, jnp.where(m, x, big).min(), 0.0),
        "max": jnp.where(any_, jnp.where(m, x, -big).max(), 0.0),
    }


def advantage_stats(rewards, advantages, zero_var, valid=None) -> dict:
    """Scalar metrics (jnp) over valid samples: reward/*, advantage/* (mean, std, min, max),
    frac_zero_var_groups, and reward/group_std_mean (mean within-group population std)."""
    r = jnp.asarray(rewards)
    r = r.astype(jnp.result_type(r.dtype, jnp.float32))
    a = jnp.asarray(advantages, r.dtype)
    v = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    out = {f"reward/{k}": x for k, x in _masked_moments(r, v).items()}
    out |= {f"advantage/{k}": x for k, x in _masked_moments(a, v).items()}
    n = jnp.maximum(v.sum(axis=1), 1)
    gmean = jnp.where(v, r, 0.0).sum(axis=1) / n
    gstd = jnp.sqrt(jnp.where(v, (r - gmean[:, None]) ** 2, 0.0).sum(axis=1) / n)
    out["reward/group_std_mean"] = gstd.mean()
    out["frac_zero_var_groups"] = jnp.asarray(zero_var, r.dtype).mean()
    return out


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The GRPO section of the config: groups, steps, staleness and how advantages are computed."""

    group_size: int = config_key(8, "Completions per prompt (G).")
    prompts_per_step: int = config_key(8, "Groups per learner step (also the handout size).")
    max_staleness: int = config_key(1, "Learner steps a group may lag the weights that train it; 0 = synchronous.")
    baseline: str = config_key("mean", "What a completion's reward is compared to: mean (GRPO, the group's mean) or "
                                       "leave_one_out (the mean of the others).")
    scale_by_std: bool = config_key(True, "Divide advantages by the group's reward std; false: Dr. GRPO.")
    positive_weight: float = config_key(1.0, "Multiplies advantages above 0 (W-REINFORCE's lambda): below 1, better "
                                             "samples are reinforced less than worse ones are penalized, which "
                                             "keeps the policy exploring; 1 is GRPO.")
    filter_zero_variance: bool = config_key(False, "DAPO dynamic sampling: drop groups whose rewards are all "
                                                   "equal.")

    def validate(self) -> list[str]:
        problems = []
        if self.group_size < 2:
            problems.append(f"group_size={self.group_size}: must be >= 2 (advantages compare samples of a group)")
        if self.prompts_per_step < 1:
            problems.append(f"prompts_per_step={self.prompts_per_step}: must be >= 1")
        if self.max_staleness < 0:
            problems.append(f"max_staleness={self.max_staleness}: must be >= 0")
        if self.baseline not in BASELINES:
            problems.append(f"baseline={self.baseline!r}: allowed mean, leave_one_out")
        if not 0.0 <= self.positive_weight <= 1.0:
            problems.append(f"positive_weight={self.positive_weight}: a number from 0 to 1 (1 is GRPO; W-REINFORCE "
                            "uses 0.1)")
        return problems
