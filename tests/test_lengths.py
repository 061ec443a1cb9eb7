"""The expected lengths grpo-jax compile projects at (algorithm.lengths): the quantiles a step logs, their pooling
over a run's steps, the engine's keys per decode step, and optim.expected_lengths_from read by the plan."""

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.algorithm.lengths import (
    BUCKETS,
    QUANTILES,
    REPRESENTATIVES,
    ExpectedLengths,
    LengthHistory,
    expected_lengths,
    length_quantiles,
    pooled_lengths,
)
from grpo_jax.config_io import ConfigError
from grpo_jax.run.metrics import length_history
from grpo_jax.run.plan import RunPlan
from test_trainer import tiny_config

lengths_lists = st.lists(st.integers(1, 20_000), min_size=1, max_size=300)


@given(lengths_lists)
@settings(max_examples=50, deadline=None)
def test_a_steps_quantiles_are_numpys_rounded(lengths):
    q = length_quantiles(lengths)
    reference = np.quantile(np.array(lengths, np.float64), np.linspace(0, 1, QUANTILES))
    assert len(q) == QUANTILES and q[0] == min(lengths) and q[-1] == max(lengths)
    assert np.all(np.abs(np.array(q) - reference) <= 0.5)


@given(st.lists(lengths_lists, min_size=1, max_size=6))
@settings(max_examples=50, deadline=None)
def test_pooled_lengths_stay_within_the_steps_and_keep_their_mean(steps):
    """Pooling REPRESENTATIVES lengths from several steps' quantiles: sorted, inside the steps' range, and with
    the mean of the steps' interpolated distributions (each step weighing the same) to within rounding and the
    coarseness of 20 bins of a 21-point quantile function."""
    quantiles = [length_quantiles(lengths) for lengths in steps]
    pooled = pooled_lengths(quantiles)
    assert len(pooled) == REPRESENTATIVES and list(pooled) == sorted(pooled)
    assert min(q[0] for q in quantiles) <= pooled[0] and pooled[-1] <= max(q[-1] for q in quantiles)
    grid = np.linspace(0, 1, 10_001)
    mixture_mean = np.mean([np.interp(grid, np.linspace(0, 1, QUANTILES), q).mean() for q in quantiles])
    spread = max(q[-1] for q in quantiles) - min(q[0] for q in quantiles)
    assert abs(np.mean(pooled) - mixture_mean) <= 0.5 + 0.06 * spread


def test_pooling_two_unlike_steps_keeps_both_modes():
    """A step of short answers and a step of long ones pool into half of each: their mean (505) alone would
    describe neither."""
    pooled = pooled_lengths([[10] * QUANTILES, [1000] * QUANTILES])
    assert pooled == (10,) * 10 + (1000,) * 10


@given(st.integers(1, 4096), st.lists(st.integers(1, 8192), min_size=1, max_size=20))
@settings(max_examples=50, deadline=None)
def test_decode_keys_weigh_every_sampled_token_the_same(prompt, completions):
    """decode_keys against a count of every decode step of every completion: a completion of c tokens holds
    prompt + t keys at its t-th step; the closed form counts c / 2 for (c - 1) / 2, within half a key per step."""
    held = [prompt + t for c in completions for t in range(c)]
    keys = ExpectedLengths(prompt=prompt, completions=tuple(completions), source="test").decode_keys()
    assert abs(keys - np.mean(held)) <= 1.0


def test_a_long_tail_holds_more_keys_and_spreads_over_the_sequences():
    tail = ExpectedLengths(prompt=64, completions=(22, 22, 22, 190), source="test")
    mean = ExpectedLengths(prompt=64, completions=(64,), source="test")
    assert tail.mean_completion == mean.mean_completion == 64
    assert tail.decode_keys() == 137 > mean.decode_keys() == 96  # (3 x 22 x 75 + 190 x 159) / 256
    assert tail.for_sequences(8) == [22] * 6 + [190] * 2 and tail.for_sequences(2) == [22, 190]
    # A row's FLOPs grow faster than its length: the mean over the profile is above the FLOPs at its mean.
    assert tail.mean_of(lambda p, c: (p + c) ** 2) > mean.mean_of(lambda p, c: (p + c) ** 2)
    assert "up to 190" in tail.describe() and mean.describe() == "64 + 64 tokens"


def test_expected_lengths_from_a_history_the_keys_or_the_buckets():
    history = LengthHistory(quantiles=((100,) * QUANTILES,), prompt_mean=40.4, source="runs/a, steps 1-1")
    from_run = expected_lengths(prompt_bucket=64, completion_bucket=80, history=history)
    assert (from_run.prompt, from_run.completions, from_run.given) == (40, (80,) * REPRESENTATIVES, True)
    assert expected_lengths(prompt_bucket=64, completion_bucket=80, expected_prompt_len=8,
                            history=history).prompt == 8
    unlogged = LengthHistory(quantiles=((5,) * QUANTILES,), prompt_mean=None, source="s")
    assert expected_lengths(prompt_bucket=64, completion_bucket=80, history=unlogged).prompt == 64
    keys = expected_lengths(prompt_bucket=64, completion_bucket=80, expected_completion_len=30)
    assert (keys.prompt, keys.completions, keys.given) == (64, (30,), True)
    buckets = expected_lengths(prompt_bucket=64, completion_bucket=80)
    assert (buckets.prompt, buckets.completions, buckets.source, buckets.given) == (64, (80,), BUCKETS, False)


def write_metrics(run_dir, rows) -> None:
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"torn')


def test_length_history_reads_the_last_steps_that_logged_quantiles(tmp_path):
    old = {"step": 1, "length/mean": 5.0}
    rows = [old] + [{"step": s, "length/quantiles": [s] * QUANTILES, "prompt_length/mean": 10.0 * s}
                    for s in range(2, 6)] + [{"kind": "eval", "step": 5, "eval/length/mean": 3.0}]
    write_metrics(tmp_path / "run", rows)
    history = length_history(tmp_path / "run", steps=3)
    assert history.quantiles == tuple((float(s),) * QUANTILES for s in (3, 4, 5))
    assert history.prompt_mean == 40.0 and history.source.endswith("metrics.jsonl, steps 3-5")
    assert length_history(tmp_path / "run" / "metrics.jsonl").quantiles[0][0] == 2.0
    write_metrics(tmp_path / "older", [old])
    with pytest.raises(ValueError, match="no learner step logged length/quantiles.*expected_completion_len"):
        length_history(tmp_path / "older")


def test_the_plan_packs_and_projects_at_a_previous_runs_lengths(tmp_path):
    """optim.expected_lengths_from: the learner's expected rows follow the run's distribution (a long tail needs
    more packed rows than its mean alone); a run directory without metrics is a one-line ConfigError naming the
    key; with expected_completion_len as well, the config is refused."""
    assert jax.device_count() == 8
    # The tests' tiny config: 6-token completions at most; half the samples at 1 token, half at 6.
    quantiles = [1] * 10 + [3] + [6] * 10
    write_metrics(tmp_path / "previous", [{"step": 1, "length/quantiles": quantiles, "prompt_length/mean": 6.0}])
    base = tiny_config(tmp_path / "run")
    plan = RunPlan.build(tiny_config(tmp_path / "run", f"optim.expected_lengths_from={tmp_path / 'previous'}"),
                         jax.devices())
    lengths = plan.expected_lengths
    assert lengths.prompt == 6 and lengths.longest_completion == plan.completion_bucket == 6
    assert lengths.mean_completion == pytest.approx(np.mean(lengths.completions)) and lengths.spread
    mean_only = RunPlan.build(tiny_config(tmp_path / "run", "optim.expected_prompt_len=6",
                                          f"optim.expected_completion_len={round(lengths.mean_completion)}"),
                              jax.devices())
    if plan.packing:
        assert plan.expected_learner_rows >= mean_only.expected_learner_rows
    missing = RunPlan.build(tiny_config(tmp_path / "run", f"optim.expected_lengths_from={tmp_path / 'nothing'}"),
                            jax.devices())
    with pytest.raises(ConfigError, match=r"^optim.expected_lengths_from='.*nothing': .*metrics.jsonl does not "
                                          r"exist[^\n]*$"):
        _ = missing.expected_lengths
    problems = base.optim.__class__(expected_lengths_from="runs/a", expected_completion_len=9).validate()
    assert any("expected_lengths_from='runs/a': set it or expected_completion_len" in p for p in problems)
