"""The learner inside the trainer: the learner's log-probs match the sampler's at its temperature, PPO
mini-batches run, and a non-finite update trains nothing (its prompts are dropped, and enough of them in a
row end the run with one line and no new checkpoint)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jitted_token_logprobs
from grpo_jax.algorithm.learner import NonFiniteError
from grpo_jax.cli import main
from grpo_jax.run.trainer import Trainer
from test_trainer import FAST, REPO, assert_every_ordinal_accounted_once, read_ledger, tiny_config


def capture_first_batch(trainer, temperatures):
    """Wrap the learner's step: before the first update, record the batch's behaviour log-probs and the
    learner's own log-probs at each of `temperatures`."""
    seen, step = {}, trainer.learner.step

    def wrapped(batch):
        if not seen:
            model = trainer.learner.model()
            seen["mask"] = np.asarray(batch.loss_mask) > 0
            seen["behaviour"] = np.asarray(batch.behaviour_logprobs)
            for t in temperatures:
                seen[t] = np.asarray(jitted_token_logprobs(model, batch.tokens, batch.input_mask, temperature=t)[0])
        return step(batch)

    trainer.learner.step = wrapped
    return seen


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_learner_logprobs_match_the_sampler_at_its_temperature(tmp_path, temperature):
    config = tiny_config(tmp_path, "grpo.max_staleness=0", "trainer.max_steps=1", f"sampler.temperature={temperature}",
                         "model.dtype=float32", "checkpoint.every_steps=0", "checkpoint.save_at_end=false")
    trainer = Trainer(config)
    seen = capture_first_batch(trainer, {temperature, 1.0})
    (metrics,) = trainer.train()
    mask = seen["mask"]
    gap = np.abs(seen[temperature] - seen["behaviour"])[mask]
    print(f"temperature {temperature}: max |learner - behaviour| {gap.max():.2e}, "
          f"tis/mismatch_kl {metrics['tis/mismatch_kl']:.2e}")
    assert gap.max() < 1e-4
    assert metrics["tis/mismatch_kl"] < 1e-4
    if temperature != 1.0:  # the check can fail: the untempered log-probs are far from the behaviour ones
        assert np.abs(seen[1.0] - seen["behaviour"])[mask].max() > 1e-2


def test_mini_batches_and_epochs_in_a_run(tmp_path):
    config = tiny_config(tmp_path, "trainer.max_steps=3", "optim.mini_batches=4", "optim.epochs=2",
                         "optim.micro_batch_size=2", "optim.lr=1e-2", "optim.warmup_steps=0")
    history = Trainer(config).train()
    assert [m["updates/applied"] for m in history] == [8, 8, 8]
    print("clip fractions (low, high):", [(m["clip/frac_low"], m["clip/frac_high"]) for m in history])
    assert max(m["clip/frac_low"] + m["clip/frac_high"] for m in history) > 0
    trained, _ = assert_every_ordinal_accounted_once(tmp_path)
    assert len(trained) == 3 * 4


def poison_steps(trainer, steps):
    """Make the learner's batch non-finite (NaN advantages) on the given 1-based learner calls."""
    step, calls = trainer.learner.step, []

    def wrapped(batch):
        calls.append(1)
        if len(calls) in steps:
            batch = dataclasses.replace(batch, advantages=jnp.full_like(batch.advantages, jnp.nan))
        return step(batch)

    trainer.learner.step = wrapped


def test_a_skipped_update_drops_its_prompts_and_the_run_goes_on(tmp_path):
    config = tiny_config(tmp_path, "trainer.max_steps=4", "grpo.max_staleness=0", "optim.max_nonfinite_in_row=2")
    trainer = Trainer(config)
    poison_steps(trainer, {2})
    history = trainer.train()
    assert [m["updates/applied"] for m in history] == [1, 0, 1, 1]
    trained, dropped = assert_every_ordinal_accounted_once(tmp_path)
    train_lines = [line for line in read_ledger(tmp_path) if line["event"] == "train"]
    assert [len(line["ordinals"]) for line in train_lines] == [4, 0, 4, 4]
    nonfinite = [line["ordinal"] for line in read_ledger(tmp_path)
                 if line["event"] == "drop" and line["reason"] == "nonfinite_update"]
    assert len(nonfinite) == 4 and not set(nonfinite) & set(trained)


def test_reaching_max_nonfinite_in_row_stops_without_a_new_checkpoint(tmp_path):
    config = tiny_config(tmp_path, "trainer.max_steps=8", "grpo.max_staleness=0", "optim.max_nonfinite_in_row=2",
                         "checkpoint.every_steps=1")
    trainer = Trainer(config)
    poison_steps(trainer, {3, 4})
    with pytest.raises(NonFiniteError, match=r"learner step 4: 2 steps in a row .* last finite loss"):
        trainer.train()
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [1, 2, 3]  # step 3 (one skipped update, below the limit) was saved; nothing after
    assert not (tmp_path / "final_model").exists()
    lines = read_ledger(tmp_path)
    assert [line["step"] for line in lines if line["event"] == "checkpoint"] == [1, 2, 3]
    assert sum(line["event"] == "drop" and line["reason"] == "nonfinite_update" for line in lines) == 8
    assert not any(line["event"] == "drop" and line["reason"] == "run_ended" for line in lines)


def test_cli_reports_divergence_in_one_line(tmp_path, capsys, monkeypatch):
    # A learning rate that overflows float32 within a step: the loss goes non-finite and stays so.
    code = main(["train", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(tmp_path), *FAST,
                 "optim.lr=1e38", "optim.warmup_steps=0", "optim.grad_clip=0", "optim.max_nonfinite_in_row=1",
                 "optim.eps=1e-30", "trainer.max_steps=6", "checkpoint.every_steps=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == NonFiniteError.exit_code == 3
    assert len(err) >= 1 and err[-1].startswith("grpo-jax: error: learner step")
    assert "Traceback" not in "\n".join(err)
