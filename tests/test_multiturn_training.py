"""Training with a multi-turn environment (configs/tiny_multiturn_cpu.yaml, fetch_code): the learner's log-probs of
each packed segment match the continuation engine's behaviour log-probs at staleness 0 (token-in/token-out through
the whole trainer), only sampled tokens are trained, and a short run learns to call the tool, which a policy that
does not call cannot score anything for, with every prompt accounted for once."""

import json
import os
import subprocess
import sys

import numpy as np

from grpo_jax.config_io import load_config
from grpo_jax.run.config import Config
from grpo_jax.run.trainer import Trainer
from test_trainer import REPO
from test_trainer_learning import capture_first_batch

CONFIG = REPO / "configs" / "tiny_multiturn_cpu.yaml"


def multiturn_config(tmp_path, *overrides) -> Config:
    return load_config(Config, CONFIG, [f"run_dir={tmp_path}", "trainer.progress=false", "trainer.tensorboard=false",
                                        "trainer.save_final_model=false", *overrides])


def test_learner_logprobs_match_the_continuation_engine_per_segment(tmp_path):
    config = multiturn_config(tmp_path, "grpo.max_staleness=0", "trainer.max_steps=1", "grpo.prompts_per_step=4",
                              "checkpoint.every_steps=0", "checkpoint.save_at_end=false")
    trainer = Trainer(config)
    seen = capture_first_batch(trainer, {1.0})
    (metrics,) = trainer.train()
    mask = seen["mask"]
    gap = np.abs(seen[1.0] - seen["behaviour"])[mask]
    print(f"{mask.sum()} sampled tokens: max |learner - behaviour| {gap.max():.2e}; env/turns {metrics['env/turns']}")
    assert mask.sum() > 100 and gap.max() < 1e-4
    assert metrics["tis/mismatch_kl"] < 1e-4


def test_a_short_run_learns_to_call_the_tool(tmp_path):
    """100 steps of `grpo-jax train configs/tiny_multiturn_cpu.yaml`, in a process of its own with XLA's usual
    optimization (the suite's fast-compiling flags make this run's many small steps several times slower)."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "grpo_jax.cli", "train", str(CONFIG), "--run-dir", str(run_dir),
               "trainer.max_steps=100", "trainer.progress=false", "trainer.tensorboard=false",
               "trainer.save_final_model=false", "checkpoint.every_steps=50"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = [m for m in history if m.get("kind", "train") == "train" and "reward/mean" in m]
    rewards = [m["reward/mean"] for m in history]
    called = [m["reward/part_called"] for m in history]
    print("reward every 10 steps:", [round(r, 3) for r in rewards[::10]])
    assert len(history) == 100
    # A policy that never calls fetch scores 0; the random start calls it about once in 300 episodes.
    assert np.mean(rewards[:5]) < 0.02
    assert np.mean(rewards[-10:]) > 0.1 and np.mean(called[-10:]) > 0.07
    assert history[-1]["env/turns"] > 1.5  # it reads the tool's answer and answers after it
    audit = subprocess.run([sys.executable, "-m", "grpo_jax.cli", "audit", str(run_dir)], capture_output=True,
                           text=True, env=env)
    assert audit.returncode == 0 and "lost:                 0" in audit.stdout, audit.stdout + audit.stderr
