"""Reward functions (on real GSM8K rows), synthetic tasks, and the failure-proof weighted suite."""

import json
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from grpo_jax.algorithm import rewards as R
from grpo_jax.data.tasks import DIGIT_TASKS, digits_score, make_synthetic_dataset


def load_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def reference_text(row):
    return row["answer"].split("####")[-1].strip()


def written_forms(raw: str, value: Fraction) -> list[str]:
    """The number written the ways a model might write a final answer, each naming only it."""
    plain = str(value.numerator) if value.denominator == 1 else f"{float(value)}"
    comma = f"{value.numerator:,}" if value.denominator == 1 else plain
    return [
        f"Step by step we get the result.\n#### {raw}",
        f"#### {plain}",
        f"####{comma} dollars",
        f"#### ${comma}.00",
        f"So the total is $\\boxed{{{plain}}}$.",
        f"\\boxed{{{comma.replace(',', '{,}')}\\text{{ apples}}}}",
        f"Therefore, the answer is {raw}.",
        f"The final answer is: **${comma}**",
        f"Answer: {plain}%",
        f"She ends up with {comma} eggs in total.",  # last-number fallback only
    ]


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir):
    return load_rows(gsm8k_dir / "test.jsonl") + load_rows(gsm8k_dir / "train.jsonl")


def test_gsm8k_every_reference_scores_itself_in_every_format(gsm8k_rows):
    fn = R.get_reward("gsm8k")
    strict = R.get_reward("gsm8k", last_number_fallback=False)
    records, right, wrong = [], [], []
    for row in gsm8k_rows:
        raw = reference_text(row)
        value = R.parse_reference(row["answer"])
        assert value is not None, raw
        assert value == Fraction(raw.replace(",", ""))
        for good, bad in zip(written_forms(raw, value), written_forms(str(value + 1), value + 1)):
            records.append(row)
            right.append(good)
            wrong.append(bad)
    assert len(gsm8k_rows) >= 8000
    assert fn(records, right) == [1.0] * len(records)
    assert fn(records, wrong) == [0.0] * len(records)
    # Without the fallback only the bare-number form (last in each group) stops scoring.
    n_forms = len(written_forms("1", Fraction(1)))
    expected = [0.0 if i % n_forms == n_forms - 1 else 1.0 for i in range(len(records))]
    assert strict(records, right) == expected


def test_gsm8k_reference_solution_scores_itself(gsm8k_rows):
    # The dataset's own worked solutions (with <<calc>> annotations) end in "#### N".
    fn = R.get_reward("gsm8k", last_number_fallback=False)
    assert fn(gsm8k_rows, [r["answer"] for r in gsm8k_rows]) == [1.0] * len(gsm8k_rows)


@pytest.mark.parametrize("completion,reference,expected", [
    ("#### 1,200", "#### 1200", 1.0),
    ("#### 1200", "#### 1,200", 1.0),
    ("The answer is $1,200.50.", "1200.5", 1.0),
    ("#### -7", "#### -7", 1.0),
    ("#### −7", "#### -7", 1.0),  # unicode minus
    ("She lost -$7.", "-7", 1.0),
    ("#### 7", "#### -7", 0.0),
    ("16 - 3 - 4 = 9, so 9", "9", 1.0),
    ("we compute 12 - 5", "-5", 0.0),  # a binary minus is not a sign
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0),
    ("3/4 of a cup", "0.75", 1.0),
    ("#### 0.75", "3/4", 1.0),
    ("#### .5", "0.5", 1.0),
    ("#### 0.333", "1/3", 0.0),  # abs_tol is 1e-6, not a rounding allowance
    ("#### 0.3333333333", "1/3", 1.0),
    ("#### 18.0", "18", 1.0),
    ("#### 18.000000001", "18", 1.0),  # float noise within abs_tol
    ("#### 1000001", "1000000", 0.0),  # tolerance is absolute, never relative
    ("#### 50%", "50", 1.0),
    ("#### 18\nThe answer is 19", "18", 1.0),  # #### beats "answer is"
    ("\\boxed{18} and the answer is 19", "18", 1.0),  # boxed beats "answer is"
    ("I am not sure.", "18", 0.0),
    ("", "18", 0.0),
    ("#### eighteen, so 18", "18", 1.0),  # a marker without a number falls through
    ("1,2,3 then 18", "18", 1.0),
    ("1/0 then 18", "18", 1.0),
])
def test_gsm8k_cases(completion, reference, expected):
    assert R.get_reward("gsm8k")([{"answer": reference}], [completion]) == [expected]


def test_gsm8k_unparsable_reference_is_nan_and_answer_key():
    out = R.get_reward("gsm8k")([{"answer": "#### n/a"}], ["#### 3"])
    assert np.isnan(out[0])
    assert R.get_reward("gsm8k", answer_key="target")([{"target": 3}], ["#### 3"]) == [1.0]


def test_format_reward():
    fn = R.get_reward("format")
    assert fn([{}] * 4, ["#### 12", "####-1,200.5", "the answer is 12", "#### twelve"]) == [1.0, 1.0, 0.0, 0.0]
    tag = R.get_reward("format", pattern=R.FORMAT_ANSWER_TAG)
    assert tag([{}] * 3, ["<answer>\n12\n</answer>", "<answer>12", "12"]) == [1.0, 0.0, 0.0]


def test_overlong_reward():
    fn = R.get_reward("overlong", max_len=100, cache_len=20)
    lengths = [0, 80, 81, 90, 100, 101, 500]
    out = fn([{}] * len(lengths), [""] * len(lengths), lengths)
    np.testing.assert_allclose(out, [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="lengths"):
        fn([{}], [""], None)
    with pytest.raises(ValueError, match="cache_len"):
        R.get_reward("overlong", max_len=10, cache_len=20)


def test_registry():
    assert {"gsm8k", "format", "overlong", "synthetic_digits"} <= set(R.REWARDS)
    with pytest.raises(ValueError, match="allowed.*format.*gsm8k"):
        R.get_reward("gsm9k")
    with pytest.raises(TypeError):
        R.get_reward("gsm8k", last_number_fallbak=False)  # typos fail at construction


# ----------------------------------------------------------------------------------------------------
# Synthetic tasks.


def test_synthetic_dataset_is_deterministic_and_correct():
    for task in DIGIT_TASKS:
        a = make_synthetic_dataset(task, 200, seed=3, min_digits=1, max_digits=4)
        assert a == make_synthetic_dataset(task, 200, seed=3, min_digits=1, max_digits=4)
        assert a != make_synthetic_dataset(task, 200, seed=4, min_digits=1, max_digits=4)
        for row in a:
            prompt, answer = row["prompt"], row["answer"]
            assert prompt.isascii() and prompt.startswith(f"{task}: ") and prompt.endswith("=")
            body = prompt[len(task) + 2:-1]
            if task == "add":
                x, y = body.split("+")
                assert int(answer) == int(x) + int(y)
                assert all(1 <= len(v) <= 4 and (len(v) == 1 or v[0] != "0") for v in (x, y))
            else:
                assert 1 <= len(body) <= 4 and body.isdigit()
                assert answer == (body if task == "copy" else body[::-1])
        assert {len(r["answer"]) for r in a if task != "add"} in ({1, 2, 3, 4}, set())
    with pytest.raises(ValueError, match="allowed copy, reverse, add"):
        make_synthetic_dataset("sort", 1, 0)
    with pytest.raises(ValueError, match="min_digits"):
        make_synthetic_dataset("copy", 1, 0, min_digits=3, max_digits=2)


@pytest.mark.parametrize("completion,expected", [
    ("7183\n", 1.0),
    ("7183", 1.0),  # ended by EOS (not in the text)
    (" 7183 \nrubbish 99", 1.0),  # only up to the first newline
    ("7188\n", 0.75),
    ("718\n", 0.75 - 0.5 * 0.25),
    ("71833\n", 1.0 - 0.5 * 0.25),
    ("\n", -0.5),
    ("3817\n", 0.0),
    ("71837183718371837183", 1.0 - 0.5),  # no stop: the whole text is the answer
])
def test_digits_score(completion, expected):
    assert digits_score("7183", completion) == pytest.approx(expected)


def test_digits_score_several_stops():
    assert digits_score("12", "12<eos>\n99", stop=("\n", "<eos>")) == 1.0
    assert R.get_reward("synthetic_digits", stop=["<eos>"])([{"answer": "12"}], ["12<eos>3"]) == [1.0]


def test_synthetic_reward_registered_and_prompt_dependent():
    rows = make_synthetic_dataset("reverse", 2, seed=0, min_digits=3, max_digits=3)
    fn = R.get_reward("synthetic_digits")
    answers = [r["answer"] + "\n" for r in rows]
    assert fn(rows, answers) == [1.0, 1.0]
    assert fn(rows, answers[::-1]) != [1.0, 1.0] or rows[0]["answer"] == rows[1]["answer"]


# ----------------------------------------------------------------------------------------------------
# Weighted suite and failure handling.


@pytest.fixture
def test_rewards(monkeypatch):
    def boom(**_):
        def fn(records, completions, lengths=None):
            raise RuntimeError("kaboom")
        return fn

    def short(**_):
        return lambda records, completions, lengths=None: [1.0] * (len(completions) - 1)

    def partial_nan(**_):
        return lambda records, completions, lengths=None: [float("nan") if c == "bad" else 0.5 for c in completions]

    def sleepy(seconds=5.0, **_):
        def fn(records, completions, lengths=None):
            time.sleep(seconds)
            return [1.0] * len(completions)
        return fn

    def not_numbers(**_):
        return lambda records, completions, lengths=None: ["x"] * len(completions)

    def slow_on(slow="slow", seconds=5.0, **_):
        # Sleeps on the completions equal to `slow` only; scores every other one 1.0.
        def fn(records, completions, lengths=None):
            if slow in completions:
                time.sleep(seconds)
            return [1.0] * len(completions)
        return fn

    def boom_on(**_):
        def fn(records, completions, lengths=None):
            if "boom" in completions:
                raise RuntimeError("kaboom")
            return [0.5] * len(completions)
        return fn

    def call_sizes(log, **_):
        def fn(records, completions, lengths=None):
            log.append(len(completions))
            return [float(len(c)) for c in completions]
        return fn

    for name, f in [("boom", boom), ("short", short), ("partial_nan", partial_nan), ("sleepy", sleepy),
                    ("not_numbers", not_numbers), ("slow_on", slow_on), ("boom_on", boom_on),
                    ("call_sizes", call_sizes)]:
        monkeypatch.setitem(R.REWARDS, name, f)


@pytest.fixture
def hang_release():
    """A reward 'hang' that blocks on an Event until the test ends, like a call that never returns;
    releasing it at teardown lets the stuck threads finish."""
    release = threading.Event()

    def hang(**_):
        def fn(records, completions, lengths=None):
            if "hang" in completions:
                release.wait()
            return [1.0] * len(completions)
        return fn

    R.REWARDS["hang"] = hang
    yield release
    release.set()
    del R.REWARDS["hang"]


def reward_threads(label):
    return sum(t.name == f"reward-{label}" for t in threading.enumerate())


def test_suite_weighted_sum():
    suite = R.RewardSuite([("gsm8k", 1.0), {"name": "format", "weight": 0.25},
                           ("overlong", 0.5, {"max_len": 10, "cache_len": 4})], timeout_s=5)
    recs = [{"answer": "#### 3"}] * 3
    res = suite.score(recs, ["#### 3", "3", "#### 4"], [1, 8, 20])
    np.testing.assert_allclose(res.rewards, [1.25, 1.0 + 0.5 * (6 - 8) / 4, 0.25 - 0.5])
    assert not res.failed.any() and res.errors == [] and res.num_failed == 0
    assert list(res.per_function) == ["gsm8k", "format", "overlong"]
    np.testing.assert_allclose(res.per_function["format"], [1, 0, 1])


def test_suite_failures_are_reported_not_raised(test_rewards):
    suite = R.RewardSuite([("format", 1.0), ("partial_nan", 1.0)], timeout_s=5)
    res = suite.score([{}] * 3, ["#### 1", "bad", "ok"])
    assert res.failed.tolist() == [False, True, False]
    np.testing.assert_allclose(res.rewards, [1.5, 0.0, 0.5])
    assert np.isnan(res.per_function["partial_nan"][1])
    assert res.errors == ["partial_nan: 1 non-finite values"]

    for name, message in [("boom", "boom: raised RuntimeError: kaboom (3 of 3 samples)"),
                          ("short", "short: bad output: returned shape (0,) for 1 completions (3 of 3 samples)"),
                          ("not_numbers", "not_numbers: bad output")]:
        res = R.RewardSuite([("format", 1.0), (name, 1.0)], timeout_s=5).score([{}] * 3, ["#### 1", "b", "c"])
        assert res.failed.all() and res.num_failed == 3, name
        assert np.all(res.rewards == 0.0)
        np.testing.assert_allclose(res.per_function["format"], [1, 0, 0])
        assert len(res.errors) == 1 and res.errors[0].startswith(message)


def test_suite_timeout_fails_only_unscored_samples(test_rewards):
    suite = R.RewardSuite([("format", 1.0), ("sleepy", 1.0, {"seconds": 3.0})], timeout_s=0.5)
    start = time.monotonic()
    res = suite.score([{}] * 2, ["#### 1", "x"])
    assert time.monotonic() - start < 2.5
    assert res.failed.all()
    assert res.errors == ["sleepy: timed out after 0.5s with 2 of 2 samples not scored; calls still running: 2"]
    np.testing.assert_allclose(res.per_function["format"], [1, 0])
    assert suite.metrics() == {"reward/timed_out_samples": 2, "reward/stuck_threads": 2, "reward/failure_rate": 1.0,
                               "reward/format/failure_rate": 0.0, "reward/sleepy/failure_rate": 1.0}
    assert all(t.daemon for t in threading.enumerate() if t.name == "reward-sleepy")


def test_one_slow_sample_fails_only_itself(test_rewards):
    # One call per sample on a few threads: the slow sample holds one thread while the others score
    # the rest of the handout, so only it misses the deadline.
    suite = R.RewardSuite([("slow_on", 1.0, {"seconds": 2.0})], timeout_s=0.5)
    completions = ["a"] * 5 + ["slow"] + ["b"] * 58
    start = time.monotonic()
    res = suite.score([{}] * 64, completions)
    assert time.monotonic() - start < 2.5
    assert np.flatnonzero(res.failed).tolist() == [5]
    assert res.rewards[res.failed].tolist() == [0.0] and res.rewards[~res.failed].tolist() == [1.0] * 63
    assert res.errors == ["slow_on: timed out after 0.5s with 1 of 64 samples not scored; calls still running: 1"]
    assert suite.metrics() == {"reward/timed_out_samples": 1, "reward/stuck_threads": 1, "reward/failure_rate": 1 / 64,
                               "reward/slow_on/failure_rate": 1 / 64}
    # The slow call returns later: its thread rejoins the pool and the late value is discarded.
    deadline = time.monotonic() + 10
    while suite.stuck_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = suite.metrics()  # nothing scored since the last call: no failure rate to report
    assert {k: v for k, v in metrics.items() if not k.endswith("failure_rate")} == {
        "reward/timed_out_samples": 1, "reward/stuck_threads": 0}
    assert np.isnan(metrics["reward/failure_rate"]) and np.isnan(metrics["reward/slow_on/failure_rate"])


def test_error_in_one_sample_does_not_fail_the_others(test_rewards):
    suite = R.RewardSuite([("format", 1.0), ("boom_on", 2.0)], timeout_s=5)
    res = suite.score([{}] * 4, ["#### 1", "boom", "x", "boom"])
    assert res.failed.tolist() == [False, True, False, True]
    np.testing.assert_allclose(res.rewards, [2.0, 0.0, 1.0, 0.0])
    assert res.errors == ["boom_on: raised RuntimeError: kaboom (2 of 4 samples)"]
    assert suite.metrics()["reward/timed_out_samples"] == 0


def test_samples_per_call_batches_and_fails_together(test_rewards):
    sizes = []
    suite = R.RewardSuite([{"name": "call_sizes", "kwargs": {"log": sizes}, "samples_per_call": 4}], timeout_s=5)
    res = suite.score([{}] * 10, ["x" * i for i in range(10)])
    assert sorted(sizes) == [2, 4, 4] and res.rewards.tolist() == list(range(10))
    # A batched function that fails fails its whole call's samples, and only those.
    res = R.RewardSuite([{"name": "boom_on", "samples_per_call": 2}], timeout_s=5).score(
        [{}] * 4, ["a", "boom", "c", "d"]
    )
    assert res.failed.tolist() == [True, True, False, False]
    assert res.errors == ["boom_on: raised RuntimeError: kaboom (2 of 4 samples)"]
    with pytest.raises(ValueError, match="samples_per_call=0"):
        R.RewardSpec.parse({"name": "format", "samples_per_call": 0})


def test_hung_reward_costs_a_bounded_number_of_threads(test_rewards, hang_release):
    # Every handout has two samples that never return. Stuck threads pile up to max_threads, then the
    # function is no longer called, and its samples fail at once, however many handouts follow.
    suite = R.RewardSuite([("format", 1.0), ("hang", 1.0)], timeout_s=0.5, workers=3, max_threads=5)
    before = threading.active_count()
    completions = ["hang", "#### 1", "hang", "#### 2"]
    stuck_seen, refused = [], 0
    for _ in range(12):
        start = time.monotonic()
        res = suite.score([{}] * 4, completions)
        assert time.monotonic() - start < 2.5
        assert res.failed[[0, 2]].all()
        stuck_seen.append(suite.stuck_threads)
        refused += any("not called" in e for e in res.errors)
        assert reward_threads("hang") <= 5
        assert threading.active_count() <= before + 5 + 3  # the hung function's bound + format's pool
    assert stuck_seen[0] == 2 and max(stuck_seen) == 5 and stuck_seen[-1] == 5
    assert refused >= 8
    assert res.errors == ["hang: not called, 4 samples failed: all its 5 threads are stuck in calls that "
                          "outlived their 0.5s limit"]
    np.testing.assert_allclose(res.per_function["format"], [0, 1, 0, 1])
    metrics = suite.metrics()
    assert metrics["reward/stuck_threads"] == 5
    assert metrics["reward/timed_out_samples"] >= 2 * 12
    # Once the hung calls return, their threads serve the function again.
    hang_release.set()
    deadline = time.monotonic() + 10
    while suite.stuck_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert suite.stuck_threads == 0
    res = suite.score([{}] * 4, completions)
    assert not res.failed.any() and res.errors == []


def test_idle_reward_threads_exit(test_rewards, monkeypatch):
    monkeypatch.setattr(R._RewardPool, "IDLE_EXIT_S", 0.2)
    suite = R.RewardSuite([{"name": "boom_on", "label": "idle_probe"}], timeout_s=5, workers=3)
    assert suite.score([{}] * 8, ["a"] * 8).errors == []
    assert 1 <= reward_threads("idle_probe") <= 3
    deadline = time.monotonic() + 10
    while reward_threads("idle_probe") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reward_threads("idle_probe") == 0
    # A later call starts threads again.
    assert suite.score([{}] * 2, ["a", "boom"]).failed.tolist() == [False, True]


def test_suite_spec_validation():
    with pytest.raises(ValueError, match="allowed"):
        R.RewardSuite([("nope", 1.0)])
    with pytest.raises(ValueError, match="unique"):
        R.RewardSuite([("format", 1.0), ("format", 2.0)])
    with R.RewardSuite([("format", 1.0), {"name": "format", "weight": 2.0, "label": "tag",
                                          "kwargs": {"pattern": R.FORMAT_ANSWER_TAG}}]) as suite:
        assert suite.labels == ["format", "tag"]
    with pytest.raises(ValueError, match="keys"):
        R.RewardSpec.parse({"name": "format", "wieght": 1.0})
    with pytest.raises(ValueError, match="equal counts"):
        suite.score([{}], ["a", "b"])
    with pytest.raises(ValueError, match="timeout_s"):
        R.RewardSuite([("format", 1.0)], timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        R.RewardSuite([("format", 1.0)], workers=5, max_threads=4)
