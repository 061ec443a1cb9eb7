"""Group-relative advantages against a per-group NumPy reference, plus properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from grpo_jax.algorithm.advantages import (
    advantage_stats,
    custom_advantages,
    filter_zero_variance,
    group_advantages,
)

N, G = 4, 6
# Few distinct values, so that ties and zero-variance groups come up often; float32-exact so that the
# float64 reference sees the same inputs as jnp.
REWARDS = arrays(np.float32, (N, G), elements=st.sampled_from([0.0, 0.5, 1.0, -1.0])
                 | st.integers(-300, 300).map(lambda k: np.float32(k / 100)))
VALID = arrays(np.bool_, (N, G))


def reference(rewards, valid, baseline, scale_by_std, ddof, eps=1e-6, positive_weight=1.0):
    adv = np.zeros_like(rewards)
    zero_var = np.zeros(len(rewards), bool)
    for g, (row, ok) in enumerate(zip(rewards, valid)):
        vals = [float(x) for x, k in zip(row, ok) if k]
        if len(vals) < 2 or len(set(vals)) == 1:
            zero_var[g] = True
            continue
        n = len(vals)
        mean = sum(vals) / n
        std = (sum((x - mean) ** 2 for x in vals) / (n - ddof)) ** 0.5
        for j in range(len(row)):
            if not ok[j]:
                continue
            base = mean if baseline == "mean" else (sum(vals) - row[j]) / (n - 1)
            a = row[j] - base
            a = a / (std + eps) if scale_by_std else a
            adv[g, j] = positive_weight * a if a > 0 else a
    return adv, zero_var


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("positive_weight", [1.0, 0.1])
def test_matches_numpy_reference(baseline, scale_by_std, ddof, with_valid, positive_weight):
    rng = np.random.default_rng(0)
    r = rng.integers(0, 3, size=(8, 5)) / 2.0
    r[0] = 0.5  # zero variance
    valid = np.ones((8, 5), bool)
    if with_valid:
        valid = rng.random((8, 5)) > 0.25
        valid[1] = [True, False, False, False, False]  # one valid sample: no signal
    adv, zv = group_advantages(r, valid if with_valid else None, baseline, scale_by_std, ddof,
                               positive_weight=positive_weight)
    ref_adv, ref_zv = reference(r, valid, baseline, scale_by_std, ddof, positive_weight=positive_weight)
    np.testing.assert_array_equal(np.asarray(zv), ref_zv)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(r=REWARDS, valid=VALID)
def test_mean_baseline_has_zero_group_mean_and_invalid_get_zero(r, valid):
    for scale in (True, False):
        adv, zv = map(np.asarray, group_advantages(r, valid, "mean", scale))
        assert np.all(adv[~valid] == 0.0)
        assert np.all(adv[zv] == 0.0)
        sums = np.where(valid, adv, 0).sum(axis=1)
        np.testing.assert_allclose(sums, 0.0, atol=1e-3 * max(1.0, np.abs(adv).max()))
        ref_adv, ref_zv = reference(r, valid, "mean", scale, 1)
        np.testing.assert_array_equal(zv, ref_zv)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(r=REWARDS, valid=VALID, weight=st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0.01, 1.0))
def test_positive_weight_scales_only_the_better_samples(r, valid, weight):
    """W-REINFORCE: a sample better than its group keeps its sign and is scaled by the weight; a worse one, a
    zero-variance group and a sample that does not count are as GRPO has them."""
    grpo, zv = map(np.asarray, group_advantages(r, valid))
    weighted, zv_weighted = map(np.asarray, group_advantages(r, valid, positive_weight=weight))
    np.testing.assert_array_equal(zv_weighted, zv)
    np.testing.assert_array_equal(weighted[grpo <= 0], grpo[grpo <= 0])
    np.testing.assert_allclose(weighted[grpo > 0], np.float32(weight) * grpo[grpo > 0], rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(r=REWARDS)
def test_leave_one_out_is_scaled_mean_baseline(r):
    loo, _ = group_advantages(r, baseline="leave_one_out", scale_by_std=False)
    mean, _ = group_advantages(r, baseline="mean", scale_by_std=False)
    np.testing.assert_allclose(np.asarray(loo), G / (G - 1) * np.asarray(mean), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(r=REWARDS, scale=st.floats(0.5, 10), shift=st.floats(-5, 5))
def test_std_scaled_advantages_ignore_affine_reward_changes(r, scale, shift):
    a1, z1 = group_advantages(r)
    a2, z2 = group_advantages(r * scale + shift)
    spread = np.ptp(r, axis=1)
    ok = spread > 0.05  # far from eps and from float32 rounding of tiny spreads
    np.testing.assert_allclose(np.asarray(a2)[ok], np.asarray(a1)[ok], rtol=1e-3, atol=1e-3)


@settings(max_examples=40, deadline=None)
@given(r=REWARDS, valid=VALID)
def test_filter_agrees_with_zero_variance_mask(r, valid):
    keep, dropped = filter_zero_variance(r, valid)
    _, zv = group_advantages(r, valid)
    np.testing.assert_array_equal(dropped, np.asarray(zv))
    np.testing.assert_array_equal(keep, np.flatnonzero(~np.asarray(zv)))


def test_filter_reports_dropped_groups():
    r = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [2, 2, 3]], float)
    keep, dropped = filter_zero_variance(r)
    assert keep.tolist() == [1, 3]
    assert dropped.tolist() == [True, False, True, False]


def test_identical_rewards_give_exact_zeros_not_eps_noise():
    # 0.1 summed six times is not 0.6 in floats: without the explicit zeroing, rounding / eps would
    # leave visible noise.
    adv, zv = group_advantages(np.full((2, 6), 0.1))
    assert np.all(np.asarray(adv) == 0.0) and np.all(np.asarray(zv))


def test_group_of_one():
    adv, zv = group_advantages(np.array([[3.0], [1.0]]), baseline="leave_one_out")
    assert np.all(np.asarray(adv) == 0.0) and np.all(np.asarray(zv))


def test_jit_and_unknown_baseline():
    r = np.random.default_rng(1).random((3, 4))
    f = jax.jit(group_advantages, static_argnames=("baseline", "scale_by_std", "std_ddof", "eps"))
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(r))[0]), np.asarray(group_advantages(r)[0]), rtol=1e-6)
    with pytest.raises(ValueError, match="allowed mean, leave_one_out"):
        group_advantages(r, baseline="median")


def test_stats():
    rng = np.random.default_rng(2)
    r = rng.integers(0, 2, size=(5, 4)).astype(float)
    r[0] = 1.0
    valid = rng.random((5, 4)) > 0.2
    adv, zv = group_advantages(r, valid)
    s = jax.jit(advantage_stats)(r, adv, zv, valid)
    a = np.asarray(adv)
    np.testing.assert_allclose(float(s["reward/mean"]), r[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(s["reward/std"]), r[valid].std(), rtol=1e-5)
    np.testing.assert_allclose(float(s["advantage/min"]), a[valid].min(), rtol=1e-6)
    np.testing.assert_allclose(float(s["advantage/max"]), a[valid].max(), rtol=1e-6)
    np.testing.assert_allclose(float(s["frac_zero_var_groups"]), np.asarray(zv).mean())
    group_std = [r[g][valid[g]].std() if valid[g].any() else 0.0 for g in range(5)]
    np.testing.assert_allclose(float(s["reward/group_std_mean"]), np.mean(group_std), rtol=1e-5)


# ---- env.advantage: a user's function of a group's episodes (custom_advantages) ----------------------------


def turn_penalised(rewards, step_rewards, valid):
    """docs/environments.md's example."""
    score = rewards - 0.05 * np.isfinite(step_rewards).sum(axis=1)
    return (score - np.nanmean(score)) / (np.nanstd(score) + 1e-6)


def test_custom_advantages_pass_the_groups_rewards_and_zero_failed_episodes():
    rewards = np.array([1.0, 0.5, 7.0, 0.0], np.float32)
    steps = np.array([[1, 1, np.nan], [1, np.nan, np.nan], [np.nan] * 3, [0, 0, 0]], np.float32)
    valid = np.array([True, True, False, True])
    out = custom_advantages(turn_penalised, rewards, steps, valid)
    score = np.array([1.0 - 0.1, 0.5 - 0.05, 0.0 - 0.15])  # the failed episode's 7.0 never enters
    expected = (score - score.mean()) / (score.std() + 1e-6)
    np.testing.assert_allclose(out, [expected[0], expected[1], 0.0, expected[2]], rtol=1e-5)
    assert out.dtype == np.float32

    seen = {}
    custom_advantages(lambda **kw: seen.update(kw) or np.ones(4), rewards, steps, valid)
    assert np.isnan(seen["rewards"][2]) and seen["rewards"][0] == 1.0
    np.testing.assert_array_equal(seen["step_rewards"], steps)
    np.testing.assert_array_equal(seen["valid"], valid)


@pytest.mark.parametrize("returned, message", [
    ([1.0, 2.0], "returned shape (2,), expected (3,): one advantage per episode"),
    ([1.0, np.nan, 0.0], "an episode that did not fail needs a finite advantage"),
    ("abc", "returned str 'abc', not G numbers"),
    (None, "returned shape (), expected (3,)"),
])
def test_custom_advantages_that_return_junk_say_what_is_wrong(returned, message):
    with pytest.raises(ValueError) as info:
        custom_advantages(lambda **kw: returned, np.zeros(3), np.full((3, 2), np.nan), np.ones(3, bool))
    assert message in str(info.value)
    # a non-finite value for a failed episode is ignored
    out = custom_advantages(lambda **kw: [1.0, np.nan, 0.0], np.zeros(3), np.full((3, 2), np.nan),
                            np.array([True, False, True]))
    np.testing.assert_array_equal(out, [1.0, 0.0, 0.0])


def test_custom_advantages_that_raise_name_the_error():

    def broken(rewards, step_rewards, valid):
        raise KeyError("x")
    with pytest.raises(ValueError, match="raised KeyError: 'x'"):
        custom_advantages(broken, np.zeros(2), np.zeros((2, 1)), np.ones(2, bool))
