"""User code: rewards named by import path in the config, and grpo_jax.train() with Python callables."""

import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

import grpo_jax
from grpo_jax.algorithm import rewards as R
from grpo_jax.algorithm.rewards import registry
from grpo_jax.api import resolve_config
from grpo_jax.cli import EXIT_USER_ERROR, main
from grpo_jax.config_io import ConfigError
from grpo_jax.run.trainer import Trainer
from test_trainer import FAST, REPO, assert_every_ordinal_accounted_once, tiny_config

TINY = str(REPO / "configs" / "tiny_cpu.yaml")
MODULE = "my_user_rewards"

USER_REWARDS = textwrap.dedent('''
    """A user's reward module, as it would sit on PYTHONPATH."""
    import threading

    CALLS = []  # ("factory", value) per factory call; ("call", samples, record fields) per reward call
    RELEASE = threading.Event()  # holds the calls of `flaky` that hang, until the test ends

    def constant(value=1.0):
        CALLS.append(("factory", value))

        def fn(records, completions, lengths):
            CALLS.append(("call", len(completions), sorted(records[0])))
            return [value] * len(completions)

        return fn

    def flaky():
        def fn(records, completions, lengths):
            if completions[0] == "raise":
                raise RuntimeError("user bug")
            if completions[0] == "hang":
                RELEASE.wait()
            return [1.0] * len(completions)

        return fn

    def scoring(records, completions, lengths):  # a reward function, not a factory
        return [0.0] * len(completions)
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """MODULE written into tmp_path/lib and importable from there; forgotten again after the test, with
    every reward name registered meanwhile."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / f"{MODULE}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.setattr(registry, "REWARDS", dict(R.REWARDS))  # the registry get_reward reads
    monkeypatch.setattr(R, "REWARDS", registry.REWARDS)
    yield
    module = sys.modules.pop(MODULE, None)
    if module is not None:
        module.RELEASE.set()


def test_a_reward_named_by_import_path_scores_a_training_run(tmp_path, user_module):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "trainer.max_steps=3",
                         f'rewards=[{{name: "{MODULE}:constant", weight: 2.0, kwargs: {{value: 1.25}}}}]')
    history = Trainer(config).train()

    assert [m["step"] for m in history] == [1, 2, 3]
    assert all(m["reward/mean"] == m["reward/min"] == m["reward/max"] == 2.5 for m in history)  # 2.0 x 1.25
    calls = sys.modules[MODULE].CALLS
    assert calls[:2] == [("factory", 1.25), ("factory", 1.25)]  # config check, then the run's suite
    scored = [c for c in calls if c[0] == "call"]
    assert len(scored) >= 3 * 4 * 4  # steps x prompts x group size, one sample per call
    assert {c[1] for c in scored} == {1}
    assert all({"prompt", "answer"} <= set(c[2]) for c in scored)  # the dataset row of each sample
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rewards"][0]["name"] == f"{MODULE}:constant"
    assert_every_ordinal_accounted_once(run_dir)


@pytest.mark.parametrize("name, message", [
    (f"{MODULE}:exact_match",
     f"invalid config: rewards[1].name='{MODULE}:exact_match': module {MODULE} has no attribute 'exact_match'"),
    ("no_such_package.rewards:exact_match",
     "invalid config: rewards[1].name='no_such_package.rewards:exact_match': no module named no_such_package "
     "(put the directory that holds it on PYTHONPATH"),
    (f"{MODULE}:constant.nope", f"module {MODULE} has no attribute 'constant.nope'"),
])
def test_a_bad_import_path_is_one_config_line_before_anything_starts(tmp_path, capsys, user_module, name, message):
    run_dir = tmp_path / "run"
    code = main(["train", TINY, f'rewards=[{{name: synthetic_digits}}, {{name: "{name}"}}]', "--run-dir", str(run_dir)])
    assert code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run_dir.exists()


def test_naming_the_reward_function_instead_of_its_factory_says_so(user_module):
    with pytest.raises(ConfigError, match=r"rewards\[0\]=.*raised TypeError: .*missing 3 required positional .*"
                                          r"the name must be a factory f\(\*\*kwargs\)"):
        resolve_config(TINY, rewards=[(f"{MODULE}:scoring", 1.0)])


def test_a_user_reward_that_raises_or_hangs_fails_only_those_samples(user_module):
    suite = R.RewardSuite([("format", 1.0), (f"{MODULE}:flaky", 1.0)], timeout_s=1.0)
    result = suite.score([{}] * 4, ["ok", "raise", "hang", "#### 1"])
    sys.modules[MODULE].RELEASE.set()
    assert result.failed.tolist() == [False, True, True, False]
    np.testing.assert_allclose(result.rewards, [1.0, 0.0, 0.0, 2.0])
    assert any("raised RuntimeError: user bug (1 of 4 samples)" in e for e in result.errors), result.errors
    assert any("timed out after 1.0s with 1 of 4 samples not scored" in e for e in result.errors), result.errors
    assert suite.metrics()["reward/timed_out_samples"] == 1


def test_python_api_trains_with_a_callable_reward(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "REWARDS", dict(R.REWARDS))  # the registry get_reward reads
    monkeypatch.setattr(R, "REWARDS", registry.REWARDS)
    calls = itertools.count()

    def length_reward(records, completions, lengths):
        if next(calls) % 5 == 4:
            raise ValueError("every fifth call fails")  # fails its sample, never the run
        return [float(n) for n in lengths]

    history = grpo_jax.train(TINY, rewards=[(length_reward, 0.5)], overrides=FAST + ["trainer.max_steps=3"],
                             run_dir=tmp_path)

    assert [m["step"] for m in history] == [1, 2, 3]
    assert next(calls) >= 3 * 4 * 4
    assert all(0.0 <= m["reward/min"] <= m["reward/max"] <= 0.5 * 6 for m in history)  # 0.5 x <= 6 tokens
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["rewards"]
    assert saved == [{"name": f"{__name__}.{length_reward.__qualname__}", "weight": 0.5}]
    assert_every_ordinal_accounted_once(tmp_path)


def test_python_api_reward_forms_and_refusals(monkeypatch):
    monkeypatch.setattr(registry, "REWARDS", dict(R.REWARDS))  # the registry get_reward reads
    monkeypatch.setattr(R, "REWARDS", registry.REWARDS)

    def score(records, completions, lengths):
        return [1.0] * len(completions)

    config = resolve_config(TINY, rewards=[score, {"name": score, "weight": 2.0, "label": "again"}, ("format", 0.5)],
                            overrides=["trainer.max_steps=7"])
    name = f"{__name__}.{score.__qualname__}"
    assert config.rewards == [{"name": name}, {"name": name, "weight": 2.0, "label": "again"}, ("format", 0.5)]
    assert config.trainer.max_steps == 7
    assert R.get_reward(name) is score
    assert resolve_config(config).rewards == [{"name": name}, {"name": name, "weight": 2.0, "label": "again"},
                                              ["format", 0.5]]  # a Config goes back through the same checks

    with pytest.raises(ConfigError, match=r"rewards\[0\].kwargs=\{'x': 1\}: kwargs are for factories"):
        resolve_config(TINY, rewards=[{"name": score, "kwargs": {"x": 1}}])
    with pytest.raises(ConfigError, match=r"rewards\[0\]=.*a function goes as \(function, weight\)"):
        resolve_config(TINY, rewards=[(score, 1.0, {"x": 1})])
    with pytest.raises(ConfigError, match=r"rewards\[1\]: another of these reward functions is also named"):
        resolve_config(TINY, rewards=[lambda r, c, n: [0.0], lambda r, c, n: [1.0]])
    with pytest.raises(ConfigError, match=r"rewards\[0\].name='nope': allowed"):
        resolve_config(TINY, rewards=[("nope", 1.0)])
    with pytest.raises(ConfigError, match="config=3: expected a Config, the path of a YAML file, or a mapping"):
        resolve_config(3)
    with pytest.raises(ConfigError, match=r"overrides='trainer.max_steps=5': expected a list of key=value strings, "
                                          r"e.g. \['trainer.max_steps=5'\]"):
        resolve_config(TINY, overrides="trainer.max_steps=5")


def test_importing_grpo_jax_does_not_import_jax():
    code = "import sys, grpo_jax; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
