"""The end of a finite dataset: running out of data means "no more handouts", not "drop what is in flight".

Groups still decoding when the data runs out (the continuous engine with sampler.max_new_tokens >
sampler.chunk_steps, so a group spans several decode chunks) finish, are put and trained; the last, short
step trains what is left; the run ends normally with every ordinal of every epoch trained or dropped once,
and the same command run again on the finished run directory trains nothing and ends normally too."""

import json
import logging

import pytest

from grpo_jax import cli
from grpo_jax.rollout.actor import Actor
from grpo_jax.run.trainer import Trainer
from test_trainer import FAST, REPO, assert_every_ordinal_accounted_once, read_ledger, tiny_config
from test_trainer_regenerate import force_staleness_once_at_the_end

# 6 new tokens in chunks of 2: every group decodes over 3 chunks, so groups are in flight when the data runs out.
FINITE = ["data.synthetic_size=10", "trainer.max_steps=100", "sampler.chunk_steps=2", "checkpoint.every_steps=1",
          "trainer.tensorboard=false", "trainer.save_final_model=false"]


def watch_the_end_of_the_data(monkeypatch) -> list[int]:
    """Records, the first time the actor finds the data exhausted, how many groups it had reserved then (being
    generated, or admitted and about to be)."""
    at_end = []
    admit = Actor._admit

    def watching_admit(self):
        prompts = admit(self)
        if self.collector.exhausted and not at_end:
            at_end.append(self.buffer.reserved)
        return prompts

    monkeypatch.setattr(Actor, "_admit", watching_admit)
    return at_end


def assert_both_epochs_accounted(run_dir, epochs: int, size: int = 10) -> tuple[list, dict]:
    trained, _ = assert_every_ordinal_accounted_once(run_dir)
    lines = read_ledger(run_dir)
    positions = [(e, i) for line in lines if line["event"] == "train"
                 for e, i in zip(line["epoch"], line["dataset_index"])]
    positions += [(line["epoch"], line["dataset_index"]) for line in lines if line["event"] == "drop"]
    assert sorted(positions) == [(e, i) for e in range(epochs) for i in range(size)]
    reasons = {line["ordinal"]: line["reason"] for line in lines if line["event"] == "drop"}
    assert "run_ended" not in reasons.values(), reasons  # the data ran out: nothing was left untrained
    return trained, reasons


def metrics_steps(run_dir) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r.get("kind") != "eval"]


@pytest.fixture
def cli_log_undone():
    """The CLI sends grpo_jax's log to the stderr of its first call (here the test's capture, closed after the
    test) and stops it propagating: undone afterwards, so later tests log and capture as usual."""
    log = logging.getLogger("grpo_jax")
    saved = log.handlers[:], log.level, log.propagate
    yield
    log.handlers[:] = saved[0]
    log.level, log.propagate = saved[1:]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_groups_in_flight_when_the_data_runs_out_are_trained_and_the_rerun_ends_normally(
        tmp_path, monkeypatch, capsys, cli_log_undone, max_staleness):
    at_end = watch_the_end_of_the_data(monkeypatch)
    args = ["train", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(tmp_path), *FAST, *FINITE,
            "data.num_epochs=2", f"grpo.max_staleness={max_staleness}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    # Running ahead (max_staleness 2), groups are always in flight then. Synchronous (0), only those handed
    # out to top up a step thinned by drops are: so far one, but which groups are dropped can vary with the
    # host's float rounding, so that case is not asserted.
    assert at_end and (at_end[0] > 0 or max_staleness == 0), f"no group was in flight when the data ran out ({at_end})"
    assert_both_epochs_accounted(tmp_path, epochs=2)
    steps = metrics_steps(tmp_path)
    assert steps == list(range(1, len(steps) + 1))
    per_step = [len(line["ordinals"]) for line in read_ledger(tmp_path) if line["event"] == "train"]
    assert per_step[:-1] == [4] * (len(per_step) - 1) and 1 <= per_step[-1] <= 4  # the last step: what was left
    lines = read_ledger(tmp_path)

    with caplog_at_info() as records:
        assert cli.main(args) == 0, capsys.readouterr().err  # the finished run again: nothing to train
    assert read_ledger(tmp_path)[:len(lines)] == lines
    assert [line for line in read_ledger(tmp_path)[len(lines):] if line["event"] in ("train", "drop")] == []
    assert metrics_steps(tmp_path) == steps
    assert any("data exhausted" in r.getMessage() for r in records)
    assert_both_epochs_accounted(tmp_path, epochs=2)


class caplog_at_info:
    """The trainer's INFO records while the block runs (the CLI sets up its own handlers, so pytest's caplog
    fixture does not see them reliably)."""

    def __enter__(self):
        self.records, self.logger = [], logging.getLogger("grpo_jax")
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = self.records.append
        self.logger.addHandler(self.handler)
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def test_static_engine_ends_a_finite_dataset_of_three_epochs_and_the_rerun_trains_nothing(tmp_path):
    config = tiny_config(tmp_path, *FINITE, "sampler.engine=static", "data.num_epochs=3", "grpo.max_staleness=1")
    history = Trainer(config).train()
    trained, _ = assert_both_epochs_accounted(tmp_path, epochs=3)
    assert len(history) == -(-len(trained) // 4)
    rerun = Trainer(config)
    assert rerun.train() == [] and rerun.actor.error is None
    assert_both_epochs_accounted(tmp_path, epochs=3)


def test_groups_grown_too_stale_after_the_data_ran_out_are_generated_again_with_groups_in_flight(tmp_path, monkeypatch):
    at_end = watch_the_end_of_the_data(monkeypatch)
    config = tiny_config(tmp_path, *FINITE, "data.num_epochs=2", "grpo.max_staleness=1")
    trainer = Trainer(config)
    forced = force_staleness_once_at_the_end(trainer)
    history = trainer.train()
    assert trainer.actor.error is None and history
    assert at_end and at_end[0] > 0, f"no group was in flight when the data ran out ({at_end})"
    assert forced, "the data never ran out with groups waiting"
    trained, _ = assert_both_epochs_accounted(tmp_path, epochs=2)  # the forced ones too, none run_ended
    assert set(forced[0]) & set(trained), "no group generated again was trained"

