"""End-to-end async trainer runs on tiny models: meshes, ledger accounting, health checks, epochs."""

import json
import pathlib

import jax
import numpy as np
import pytest

from grpo_jax.config_io import ConfigError, load_config
from grpo_jax.run.config import Config
from grpo_jax.run.metrics import REQUIRED_KEYS
from grpo_jax.run.trainer import Trainer, TrainerError, plan_run
from grpo_jax.state.ledger import audit

REPO = pathlib.Path(__file__).resolve().parents[1]
FAST = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "grpo.group_size=4",
        "grpo.prompts_per_step=4", "trainer.progress=false", "trainer.group_timeout_s=120",
        "sampler.max_new_tokens=6"]


def tiny_config(tmp_path, *overrides) -> Config:
    return load_config(Config, REPO / "configs" / "tiny_cpu.yaml",
                       FAST + [f"run_dir={tmp_path}"] + list(overrides))


def read_ledger(run_dir):
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "events.jsonl").read_text().splitlines()]


def assert_every_ordinal_accounted_once(run_dir):
    lines = read_ledger(run_dir)
    trained = [o for line in lines if line["event"] == "train" for o in line["ordinals"]]
    dropped = [line["ordinal"] for line in lines if line["event"] == "drop"]
    assert len(trained) == len(set(trained)), "an ordinal was trained twice"
    assert not set(trained) & set(dropped), "an ordinal was both trained and dropped"
    accounted = sorted(trained + dropped)
    assert accounted == list(range(len(accounted))), "the handed-out ordinals have a hole"
    report = audit(run_dir)
    assert report.ok, report.summary()
    return trained, dropped


def test_async_run_on_split_meshes_accounts_for_every_prompt(tmp_path):
    assert jax.device_count() == 8
    config = tiny_config(tmp_path, "mesh.actor_devices=4", "mesh.learner.fsdp=2", "mesh.learner.tensor=2",
                         "mesh.actor.fsdp=4", "trainer.max_steps=6", "grpo.max_staleness=2")
    trainer = Trainer(config)
    assert len(trainer.actor_mesh.devices.flat) == 4 and len(trainer.learner_mesh.devices.flat) == 4
    assert not set(trainer.actor_mesh.devices.flat) & set(trainer.learner_mesh.devices.flat)
    batch_specs, learner_step = [], trainer.learner.step

    def recording_step(batch):
        batch_specs.append({leaf.sharding.spec for leaf in jax.tree.leaves(batch)})
        return learner_step(batch)

    trainer.learner.step = recording_step
    history = trainer.train()
    assert [m["step"] for m in history] == list(range(1, 7))
    # The batch arrives committed to the learner's rows layout (an uncommitted one may sit whole on each device).
    assert batch_specs == [{jax.sharding.PartitionSpec(("data", "fsdp"))}] * 6
    for m in history:
        assert set(REQUIRED_KEYS) <= set(m)
        assert m["staleness/max"] <= 2
        assert m["sync/bytes"] > 0
    trained, _ = assert_every_ordinal_accounted_once(tmp_path)
    assert len(trained) == 6 * 4
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") != "eval"]  # the learner-step lines
    assert len(rows) == 6 and rows[-1]["step"] == 6
    assert list((tmp_path / "tb").iterdir()), "no TensorBoard event file"
    assert (tmp_path / "config.yaml").is_file()
    from grpo_jax.model.hf import load_hf_model
    final, _ = load_hf_model(tmp_path / "final_model")  # the trained policy, loadable as a HF checkpoint
    assert (jax.device_get(final.embed[...]) == jax.device_get(trainer.learner.params["embed"][...])).all()
    # The learner's and the actor's copy of the weights agree after the last sync.
    learner_leaf = jax.tree.leaves(trainer.learner.params)[0]
    actor_leaf = jax.tree.leaves(trainer.sampler.state)[0]
    assert set(actor_leaf.sharding.device_set) <= set(trainer.actor_mesh.devices.flat)
    assert (jax.device_get(learner_leaf) == jax.device_get(actor_leaf)).all()

    from grpo_jax.run.plot import plot_run
    names = {p.name for p in plot_run(tmp_path)}
    assert {"reward.png", "kl.png", "lengths.png", "staleness.png", "throughput.png"} <= names


def test_a_batch_that_does_not_split_over_the_learner_devices_is_refused(tmp_path):
    config = tiny_config(tmp_path, "grpo.group_size=3", "mesh.learner.fsdp=8", "mesh.actor.fsdp=8")
    with pytest.raises(ConfigError, match=r"mesh.learner: the batch is split 8 ways \(data x fsdp\); its 12 rows "
                                          r"\(prompts_per_step x group_size\) must split evenly"):
        Trainer(config)


def test_scanned_layers_beside_a_several_device_actor_are_refused_on_cpu(tmp_path):
    """XLA's CPU client deadlocks (and aborts after 40 s) when a scanned learner step and the actor's program stop
    at collectives over the same 8 devices at once: refused before anything starts, in one line naming the key;
    with one actor device the scan runs."""
    config = tiny_config(tmp_path / "shared", "model.scan_layers=true", "mesh.learner.fsdp=8", "mesh.actor.fsdp=8")
    with pytest.raises(ConfigError, match=r"^model.scan_layers=true: on the CPU backend .* \(here 8 and 8\)") as info:
        Trainer(config)
    assert "\n" not in str(info.value)
    plan = plan_run(tiny_config(tmp_path / "apart", "model.scan_layers=true", "mesh.actor_devices=1",
                                "grpo.prompts_per_step=7"))
    assert plan.model.scans_layers(jax.default_backend())


def test_synchronous_run_on_shared_devices_is_on_policy(tmp_path):
    config = tiny_config(tmp_path, "grpo.max_staleness=0", "trainer.max_steps=4", "mesh.learner.fsdp=8",
                         "mesh.actor.fsdp=8")
    history = Trainer(config).train()
    assert len(history) == 4
    assert all(m["staleness/max"] == 0 for m in history)
    assert_every_ordinal_accounted_once(tmp_path)


def test_finite_epochs_end_cleanly_with_every_index_once(tmp_path):
    config = tiny_config(tmp_path, "data.num_epochs=2", "data.synthetic_size=10", "trainer.max_steps=100")
    history = Trainer(config).train()
    trained, dropped = assert_every_ordinal_accounted_once(tmp_path)
    assert len(trained) + len(dropped) == 20  # two epochs of 10, nothing lost, no deadlock at the end
    lines = read_ledger(tmp_path)
    positions = [
        (e, i) for line in lines if line["event"] == "train" for e, i in zip(line["epoch"], line["dataset_index"])
    ]
    positions += [(line["epoch"], line["dataset_index"]) for line in lines if line["event"] == "drop"]
    assert sorted(positions) == [(e, i) for e in range(2) for i in range(10)]
    assert history and history[-1]["step"] <= 5


def test_actor_failure_stops_the_learner_with_its_error(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, "trainer.max_steps=3")
    trainer = Trainer(config)

    def broken(*args, **kwargs):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(trainer.sampler, "step" if hasattr(trainer.sampler, "step") else "generate", broken)
    with pytest.raises(TrainerError, match="actor thread failed.*sampler exploded"):
        trainer.train()


def test_no_groups_within_the_timeout_is_a_clear_error(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, "trainer.max_steps=3", "trainer.group_timeout_s=1")
    trainer = Trainer(config)
    import threading
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(5)
        raise RuntimeError("released")

    monkeypatch.setattr(trainer.sampler, "step" if hasattr(trainer.sampler, "step") else "generate", hang)
    try:
        with pytest.raises(TrainerError, match="no full step of 4 groups arrived within trainer.group_timeout_s=1"):
            trainer.train()
    finally:
        release.set()


def test_bad_rows_are_dropped_with_a_reason(tmp_path, gsm8k_dir):
    data = tmp_path / "data.jsonl"
    rows = [json.dumps({"question": "copy: 12=", "answer": "12"})] * 6
    rows[1] = "{not json"
    rows[3] = json.dumps({"answer": "3"})
    data.write_text("\n".join(rows) + "\n")
    config = tiny_config(tmp_path / "run", f"data.path={data}", "data.source=jsonl", "data.prompt_field=question",
                         "data.num_epochs=1", "trainer.max_steps=10")
    Trainer(config).train()
    drops = {line["dataset_index"]: line["reason"] for line in read_ledger(tmp_path / "run") if line["event"] == "drop"}
    assert drops.get(1) == "bad_row" and drops.get(3) == "bad_row"
    assert_every_ordinal_accounted_once(tmp_path / "run")


def test_gsm8k_config_runs_two_steps_with_a_tiny_qwen2(tmp_path, gsm8k_dir):
    """The shipped GSM8K config, with a random tiny Qwen2 of the same architecture in place of the real
    checkpoint and the real GSM8K prompts and reward, on 4 + 4 simulated devices."""
    from grpo_jax.data.tokenizer import Tokenizer
    from grpo_jax.model.hf import save_hf_model
    from grpo_jax.model.transformer import ModelConfig, create_model

    model_dir = tmp_path / "tiny_qwen2"
    tiny = ModelConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, qkv_bias=True, tie_embeddings=True, architecture="qwen2")
    save_hf_model(create_model(tiny), model_dir, tokenizer=Tokenizer.byte_level())
    config = load_config(Config, REPO / "configs" / "gsm8k_qwen2_5.yaml", [
        f"model_path={model_dir}", f"data.path={gsm8k_dir}", f"run_dir={tmp_path / 'run'}",
        "trainer.max_steps=2", "trainer.progress=false", "trainer.group_timeout_s=300",
        "grpo.prompts_per_step=4", "grpo.group_size=2", "optim.micro_batch_size=2",
        "sampler.max_new_tokens=8", "sampler.min_batch_bucket=4", "sampler.min_prompt_bucket=512",
        "model.remat=false"])
    assert [r["name"] for r in config.rewards] == ["gsm8k", "format"]
    history = Trainer(config).train()
    assert [m["step"] for m in history] == [1, 2]
    lines = read_ledger(tmp_path / "run")
    trained = [line for line in lines if line["event"] == "train"]
    assert all(0 <= i < 7473 for line in trained for i in line["dataset_index"])
    assert_every_ordinal_accounted_once(tmp_path / "run")


# Qwen3: per-head query and key norms. Gemma 3 besides: a local layer over the last 4 tokens with its own RoPE
# base, (1 + weight) norms before and after attention and the MLP, a GELU gate, scaled embeddings.
FAMILIES = {"qwen3": ("Qwen3ForCausalLM", ()),
            "gemma3": ("Gemma3ForCausalLM", ("model.num_layers=2",
                                             "model.layer_types=[sliding_attention, full_attention]",
                                             "model.sliding_window=4", "model.rope_local_theta=10000",
                                             "model.query_pre_attn_scalar=24"))}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tiny_model_of_each_newer_family_trains_and_exports_as_that_family(tmp_path, family):
    """Their norms are parameters like any other: trained, synchronised to the actor, checkpointed and exported
    (test_hf.py checks the logits against transformers)."""
    from grpo_jax.model.hf import load_hf_model
    from grpo_jax.model.transformer import param_dict

    hf_class, extra = FAMILIES[family]
    config = tiny_config(tmp_path, f"model.architecture={family}", "model.head_dim=16", "model.qkv_bias=false",
                         "trainer.max_steps=2", "optim.lr=1e-2", "optim.warmup_steps=0", *extra)
    history = Trainer(config).train()
    assert [m["step"] for m in history] == [1, 2]
    assert_every_ordinal_accounted_once(tmp_path)
    config_json = json.loads((tmp_path / "final_model" / "config.json").read_text())
    assert config_json["architectures"] == [hf_class] and config_json["head_dim"] == 16
    final, _ = load_hf_model(tmp_path / "final_model")
    for key in ("architecture", "layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar"):
        assert getattr(final.config, key) == getattr(config.model, key), key
    start = 0.0 if family == "gemma3" else 1.0  # Gemma's norms scale by 1 + weight, from 0
    norms = {k: np.asarray(v) for k, v in param_dict(final).items() if k.endswith("norm.weight")}
    # Per layer: input, MLP input, query and key norms (and Gemma's two on attention's and the MLP's outputs).
    assert len(norms) == 1 + config.model.num_layers * (6 if family == "gemma3" else 4)
    assert all(not np.all(v == start) for v in norms.values()), norms


@pytest.mark.slow  # trains to a target: left out of the README's test command (pyproject.toml's markers)
def test_reward_rises_on_the_synthetic_task(tmp_path):
    """Rewards, advantages, losses and the learner together learn: a synchronous (deterministic) run on
    the copy task lifts the mean reward well above where it started. The settings are test_warm_start's
    (its programs are then compiled once for both)."""
    from test_warm_start import SETTINGS

    config = tiny_config(tmp_path, *SETTINGS, "optim.lr=3e-3", "trainer.max_steps=30")
    history = Trainer(config).train()
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"synthetic copy task: mean reward {first:.3f} over the first 5 steps, {last:.3f} over the last 5")
    assert last > first + 0.15, rewards
