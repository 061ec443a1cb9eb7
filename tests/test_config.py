"""Config loading: YAML + dotted overrides, refused early with messages that name key, value, allowed."""

import pathlib

import pytest
import yaml

from grpo_jax.config_io import ConfigError, load_config, parse_override, save_config
from grpo_jax.run.config import Config

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_cpu.yaml"


def test_every_shipped_config_loads(monkeypatch):
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert TINY in configs
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # the agent configs' modules, as the README runs them
    for path in configs:
        load_config(Config, path)


def test_overrides_are_typed_and_nested():
    cfg = load_config(Config, TINY, ["model.dtype=bfloat16", "sampler.temperature=0.7",
                                     "model.num_layers=3", "seed=7", "sampler.top_p=1e-1", "optim.lr=1e-6"])
    assert cfg.optim.lr == 1e-6
    assert cfg.model.dtype == "bfloat16" and cfg.model.num_layers == 3
    assert cfg.sampler.temperature == 0.7 and cfg.sampler.top_p == 0.1 and cfg.seed == 7
    # an int where a float is expected is widened
    assert load_config(Config, TINY, ["sampler.temperature=1"]).sampler.temperature == 1.0


@pytest.mark.parametrize("override, fragments", [
    ("optimizer.lr=1e-6", ["unknown config key 'optimizer'", "optim"]),
    ("optim.learning_rate=1e-6", ["unknown config key 'optim.learning_rate'", "lr"]),
    ("optim.lr=-1", ["optim.lr=-1", "must be > 0"]),
    ("loss.aggregation=sum", ["loss.aggregation='sum'", "token_mean"]),
    ("grpo.group_size=1", ["grpo.group_size=1", ">= 2"]),
    ("data.source=csv", ["data.source='csv'", "jsonl"]),
    ("rewards=[{name: nope}]", ["rewards[0]", "nope"]),
    ("rewards=[{name: python_output, kwargs: {memory_mb: 16}}]",
     ["rewards[0]", "python_output: memory_mb=16", ">= 64"]),
    ("rewards=[{name: python_output, kwargs: {timeout_s: 10}}]",
     ["rewards[0].kwargs.timeout_s=10: must be below trainer.reward_timeout_s=10.0", "raise trainer.reward_timeout_s"]),
    ("model.hidden=3", ["unknown config key 'model.hidden'", "hidden_size"]),
    ("model.num_layers=two", ["model.num_layers='two'", "integer"]),
    ("model.num_layers=2.5", ["model.num_layers=2.5", "integer"]),
    ("model.tie_embeddings=7", ["model.tie_embeddings=7", "true or false"]),
    ("model.dtype=float8", ["model.dtype='float8'", "bfloat16", "float32"]),
    ("model.num_kv_heads=3", ["model.num_kv_heads=3", "must divide num_heads=4"]),
    ("sampler.temperature=-1", ["sampler.temperature=-1", ">= 0"]),
    ("sampler.top_p=0", ["sampler.top_p=0", "top_p"]),
    ("mesh.learner.tensor=0", ["mesh.learner.tensor=0", "positive"]),
    ("seed", ["expected key=value"]),
    # an optional section (env: X | None) reports its own bad key, not "expected EnvConfig | None"
    ("env={name: fetch_code, max_turns: 0}", ["env.max_turns=0: must be an integer >= 1"]),
    ("env={name: fetch_code, turns: 2}", ["unknown config key 'env.turns'", "max_turns"]),
])
def test_bad_values_are_refused_with_key_value_and_allowed(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(Config, TINY, [override])
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_a_python_output_program_may_run_less_than_the_reward_timeout():
    assert load_config(Config, TINY, ["rewards=[{name: python_output}]"]).rewards == [{"name": "python_output"}]
    cfg = load_config(Config, TINY, ["rewards=[{name: python_output, kwargs: {timeout_s: 10}}]",
                                     "trainer.reward_timeout_s=30"])
    assert cfg.rewards[0]["kwargs"] == {"timeout_s": 10}


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Config, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Config, bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Config, bad)
    bad.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model=3: expected a mapping"):
        load_config(Config, bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(Config, TINY, ["model.num_layers=3"])
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["num_layers"] == 3
    assert load_config(Config, tmp_path / "config.yaml") == cfg


def test_parse_override_values():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=text") == (["a"], "text")
    with pytest.raises(ConfigError):
        parse_override("a..b=1")


MULTITURN = REPO / "configs" / "tiny_multiturn_cpu.yaml"


def refusal(path, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(Config, path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_top_k_above_the_vocabulary_is_refused_naming_both_before_any_compile(tmp_path):
    # issue 36 item 13: the engines failed inside lax.top_k while tracing, a raw JAX error from the actor.
    message = refusal(TINY, "sampler.top_k=33")
    assert "sampler.top_k=33: more than the model's vocabulary of 32 tokens (model.vocab_size)" in message, message
    assert "set at most 32, or 0 (off)" in message
    assert load_config(Config, TINY, ["sampler.top_k=32"]).sampler.top_k == 32
    # From a checkpoint: its config.json says, whatever the model section holds.
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "vocab_size": 48, "hidden_size": 32, '
                                          '"intermediate_size": 64, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 4, "num_key_value_heads": 2}')
    message = refusal(TINY, f"model_path={tmp_path}", "sampler.top_k=49", "model={}")
    assert f"sampler.top_k=49: more than the model's vocabulary of 48 tokens ({tmp_path}/config.json)" in message
    assert load_config(Config, TINY, [f"model_path={tmp_path}", "sampler.top_k=48", "model={}"]).sampler.top_k == 48
    # A model_path without a readable config.json: loading the model says so, not this check.
    assert load_config(Config, TINY, [f"model_path={tmp_path / 'nowhere'}", "sampler.top_k=49"]).sampler.top_k == 49


def test_episodes_need_a_slot_for_each_of_a_groups_episodes():
    # issue 36 item 13: with 4 slots for groups of 16 the actor died with "run: 1..4 rows with one seed and one key".
    message = refusal(MULTITURN, "sampler.slots=4")
    assert "sampler.slots=4: with an env section a group's grpo.group_size=16 episodes run together" in message
    assert "at least 16, or 0" in message, message
    for slots in (0, 16, 24):
        assert load_config(Config, MULTITURN, [f"sampler.slots={slots}"]).sampler.slots == slots
    assert load_config(Config, TINY, ["sampler.slots=2"]).sampler.slots == 2  # single-turn: the engine shares slots
