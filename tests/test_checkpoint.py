"""Checkpoints and resume in the trainer (in-process): exact synchronous resume, preemption, fallback from a
corrupt step, refusals, and older checkpoints without ordinal data. The SIGKILL end-to-end test is in
test_resume_e2e.py; the frontier arithmetic itself is tested in test_collector.py."""

import json
import logging
import os
import pathlib
import signal

import jax
import numpy as np
import pytest

from grpo_jax import cli
from grpo_jax.errors import CheckpointError
from grpo_jax.run.trainer import Trainer
from grpo_jax.state.checkpoint import CORRUPT_DIR, layout_difference, tree_layout
from grpo_jax.state.ledger import audit
from test_trainer import read_ledger, tiny_config


def preempt_after(monkeypatch, step: int) -> None:
    """Send this process a real SIGTERM right after learner step `step` (the trainer's handler catches it)."""
    learn = Trainer._learn

    def learn_then_signal(self, groups, s):
        metrics = learn(self, groups, s)
        if self.version == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(Trainer, "_learn", learn_then_signal)


def params_of(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(trainer.learner.params))]


def train_lines(run_dir) -> dict[int, list[int]]:
    """step -> ordinals trained, as the surviving chain has them (later runs overwrite undone steps)."""
    return {line["step"]: line["ordinals"] for line in read_ledger(run_dir) if line["event"] == "train"}


def test_synchronous_run_interrupted_and_resumed_ends_with_identical_parameters(tmp_path, monkeypatch):
    overrides = ["grpo.max_staleness=0", "trainer.max_steps=6", "checkpoint.every_steps=0", "trainer.tensorboard=false"]
    whole = Trainer(tiny_config(tmp_path / "whole", *overrides))
    whole.train()

    preempt_after(monkeypatch, 3)
    first = Trainer(tiny_config(tmp_path / "split", *overrides))
    history = first.train()
    assert first.preempted and [m["step"] for m in history] == [1, 2, 3]
    assert first.checkpoints.steps() == [3]
    assert not (tmp_path / "split" / "final_model").exists()  # not the end of the run
    monkeypatch.undo()

    second = Trainer(tiny_config(tmp_path / "split", *overrides))
    assert second.resumed_from == 3 and second.version == 3
    assert [m["step"] for m in second.train()] == [4, 5, 6]
    for a, b in zip(params_of(whole), params_of(second), strict=True):
        np.testing.assert_array_equal(a, b)
    assert train_lines(tmp_path / "whole") == train_lines(tmp_path / "split")
    report = audit(tmp_path / "split")
    assert report.ok and report.restarts == 1 and report.trained == 24 and not report.lost, report.summary()


def test_async_preemption_without_the_replay_buffer_loses_nothing(tmp_path, monkeypatch):
    overrides = ["grpo.max_staleness=2", "trainer.max_steps=7", "checkpoint.every_steps=2",
                 "trainer.tensorboard=false", "checkpoint.load_replay_buffer=false"]
    preempt_after(monkeypatch, 3)
    first = Trainer(tiny_config(tmp_path, *overrides))
    first.train()
    assert first.preempted and first.checkpoints.steps() == [2, 3]
    monkeypatch.undo()
    second = Trainer(tiny_config(tmp_path, *overrides))
    assert len(second.buffer) == 0  # load_replay_buffer=false: its prompts are generated again
    second.train()
    report = audit(tmp_path)
    assert report.ok and report.trained == 28 and not report.lost and not report.trained_twice, report.summary()
    checkpoint_lines = [line for line in read_ledger(tmp_path) if line["event"] == "checkpoint"]
    assert [line["step"] for line in checkpoint_lines] == [2, 3, 4, 6, 7]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # Orbax's abandoned reads stay quiet
def test_a_corrupt_latest_step_falls_back_to_the_one_before(tmp_path, caplog):
    overrides = ["trainer.max_steps=4", "checkpoint.every_steps=2", "trainer.tensorboard=false"]
    Trainer(tiny_config(tmp_path, *overrides)).train()
    for data_file in (tmp_path / "checkpoints" / "4" / "state" / "d").iterdir():
        data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])  # truncated
    with caplog.at_level(logging.WARNING):
        resumed = Trainer(tiny_config(tmp_path, "trainer.max_steps=6", *overrides[1:]))
    assert resumed.resumed_from == 2
    assert "checkpoint step 4 cannot be read" in caplog.text
    assert [p.name.split("-")[0] for p in (tmp_path / CORRUPT_DIR).iterdir()] == ["4"]  # set aside, not deleted
    resumed.train()
    report = audit(tmp_path)
    assert report.ok and report.trained == 24, report.summary()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> pathlib.Path:
    """A finished 2-step run with checkpoints, for the refusal tests (each copies it)."""
    run_dir = tmp_path_factory.mktemp("saved")
    Trainer(
        tiny_config(run_dir, "trainer.max_steps=2", "checkpoint.every_steps=1", "trainer.tensorboard=false")
    ).train()
    return run_dir


def copy_of(saved_run: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    import shutil
    shutil.copytree(saved_run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("override, message", [
    ("data.shuffle_seed=1", "another dataset, tokenizer, prompt format or shuffle.*allow_data_change"),
    ("data.synthetic_task=reverse", "another dataset"),
    ("data.worker_count=1", "data.worker_count=0, this config has 1: Grain cannot restore"),
    ("model.hidden_size=48", r"tensor \['params'\].* is float32\[32, 32\] in the checkpoint and float32\[32, 48\] now"),
])
def test_a_checkpoint_that_does_not_fit_the_config_is_refused_with_the_reason(saved_run, tmp_path, override, message):
    run_dir = copy_of(saved_run, tmp_path)
    with pytest.raises(CheckpointError, match=message):
        Trainer(tiny_config(run_dir, "trainer.max_steps=3", override))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]  # nothing set aside


def test_the_cli_refuses_another_dataset_in_one_line_with_exit_code_2(saved_run, tmp_path, capsys):
    run_dir = copy_of(saved_run, tmp_path)
    config = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    code = cli.main(
        [
            "train",
            str(config),
            "--run-dir",
            str(run_dir),
            "data.shuffle_seed=5",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_layers=1",
            "grpo.group_size=4",
            "grpo.prompts_per_step=4",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data fingerprint" in err[0], err


def test_allow_data_change_keeps_the_weights_and_starts_a_new_ledger_chain(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path)
    trainer = Trainer(tiny_config(run_dir, "trainer.max_steps=3", "data.shuffle_seed=1",
                                  "checkpoint.allow_data_change=true"))
    assert trainer.version == 2 and trainer.collector.next_ordinal == 0
    trainer.train()
    starts = [line for line in read_ledger(run_dir) if line["event"] == "run_start"]
    assert starts[-1]["resumed_from"] is None
    report = audit(run_dir)
    assert report.ok and report.trained == 4 and report.chain == [(1, None)], report.summary()


def test_a_group_size_change_with_groups_in_the_buffer_is_refused(saved_run, tmp_path):
    trainer = Trainer(tiny_config(copy_of(saved_run, tmp_path), "trainer.max_steps=2"))
    meta = {"step": 2, "facts": {**trainer._resume_facts(), "group_size": 8}}
    with pytest.raises(CheckpointError, match="groups of 8 completions.*load_replay_buffer=false"):
        trainer._check_resumable({**meta, "buffered_groups": 1})
    trainer._check_resumable({**meta, "buffered_groups": 0})  # an empty buffer holds no groups to misfit


def test_a_finished_run_resumed_with_the_same_max_steps_does_nothing(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path)
    lines = read_ledger(run_dir)
    assert Trainer(tiny_config(run_dir, "trainer.max_steps=2")).train() == []
    assert read_ledger(run_dir) == lines


def test_a_finished_run_killed_before_its_final_model_writes_it_on_resume(saved_run, tmp_path):
    # A kill after the last checkpoint committed, before (or while) final_model/ was written.
    import shutil
    run_dir = copy_of(saved_run, tmp_path)
    lines = read_ledger(run_dir)
    written = (run_dir / "final_model" / "model.safetensors").read_bytes()
    shutil.rmtree(run_dir / "final_model")
    (run_dir / "final_model").mkdir()  # an export cut short leaves no config.json (written last)
    assert Trainer(tiny_config(run_dir, "trainer.max_steps=2")).train() == []
    assert (run_dir / "final_model" / "model.safetensors").read_bytes() == written  # the checkpoint's weights
    assert (run_dir / "final_model" / "config.json").exists()
    assert read_ledger(run_dir) == lines
    Trainer(tiny_config(run_dir, "trainer.max_steps=2")).close()  # the run directory's lock was released


def test_a_checkpoint_without_ordinal_data_resumes_with_a_warning_stating_the_loss(saved_run, tmp_path, caplog):
    run_dir = copy_of(saved_run, tmp_path)
    item = run_dir / "checkpoints" / "2" / "collector" / "metadata"
    saved = json.loads(item.read_text())
    # The older format: only the iterator's live position.
    live = {"format": "grpo_jax.data.collector/0", "iterator_state": saved["collector"]["iterator_state"]}
    item.write_text(json.dumps({"collector": live, "buffer": saved["buffer"]}))
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(tiny_config(run_dir, "trainer.max_steps=3"))
    assert "no ordinal data (an older format)" in caplog.text and "lost (up to 8 with this config)" in caplog.text
    assert trainer.version == 2
    trainer.train()
    assert audit(run_dir).ok


def test_tree_layout_names_the_first_difference():
    a = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    assert layout_difference(tree_layout(a), tree_layout(a)) is None
    assert "['w'] is float32[2, 3] in the checkpoint and float32[2, 4] now" in layout_difference(
        tree_layout(a), tree_layout({**a, "w": np.zeros((2, 4), np.float32)}))
    assert "['c'] of this model/optimizer is not in the checkpoint" in layout_difference(
        tree_layout(a), tree_layout({**a, "c": np.zeros(1, np.float32)}))


def small_save(checkpoints, step, value=1.0):
    state = {"w": jax.numpy.full((4,), float(value)), "count": jax.numpy.int32(step)}
    checkpoints.save(step, state, {"int32": np.arange(3, dtype=np.int32)}, {"collector": {"step": step}}, {"m": 1})


def test_keeps_the_last_n_plus_every_kth_and_reports_commits_in_order(tmp_path):
    from grpo_jax.state.checkpoint import CheckpointConfig, Checkpoints
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(keep_last=2, keep_every=4))
    committed = []
    for step in range(1, 10):
        small_save(checkpoints, step, value=step)
        committed += checkpoints.poll()
    committed += checkpoints.wait()
    assert committed == list(range(1, 10))
    assert checkpoints.steps() == [4, 8, 9]
    assert max(checkpoints.blocked_seconds) < 5.0
    # A save killed half-way leaves only Orbax's temporary directory: never a step, cleaned up on open.
    (tmp_path / "checkpoints" / "10.orbax-checkpoint-tmp-1234").mkdir()
    checkpoints.close()
    reopened = Checkpoints(tmp_path, CheckpointConfig())
    assert reopened.steps() == [4, 8, 9]
    abstract = {"w": jax.ShapeDtypeStruct((4,), np.float32), "count": jax.ShapeDtypeStruct((), np.int32)}
    restored = reopened.load_latest(lambda meta: abstract, lambda meta: None)
    assert restored.step == 9 and restored.collector == {"collector": {"step": 9}}
    assert np.asarray(restored.state["w"]).tolist() == [9.0] * 4 and int(restored.state["count"]) == 9
    assert restored.buffer_arrays["int32"].tolist() == [0, 1, 2]
    reopened.close()


def test_a_failed_background_save_is_reported_not_lost(tmp_path, monkeypatch):
    from grpo_jax.state.checkpoint import CheckpointConfig, Checkpoints
    checkpoints = Checkpoints(tmp_path, CheckpointConfig())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints._manager, "save", disk_full)
    small_save(checkpoints, 1)
    with pytest.raises(CheckpointError, match="checkpoint step 1 could not be written to .*: No space left on device"):
        checkpoints.wait()
    assert checkpoints.steps() == []


def test_saves_are_due_by_steps_or_by_time(tmp_path, monkeypatch):
    from grpo_jax.state import checkpoint as module
    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    by_steps = module.Checkpoints(tmp_path / "a", module.CheckpointConfig(every_steps=3))
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]
    by_time = module.Checkpoints(tmp_path / "b", module.CheckpointConfig(every_steps=0, every_seconds=60))
    assert not by_time.due(1)
    now[0] += 61
    assert by_time.due(2)
    small_save(by_time, 2)
    assert not by_time.due(2) and not by_time.due(3)  # the clock restarts at each save
    now[0] += 61
    assert by_time.due(4)
    by_time.close()
    by_steps.close()


def test_a_checkpoint_from_another_process_count_is_refused(saved_run, tmp_path):
    trainer = Trainer(tiny_config(copy_of(saved_run, tmp_path), "trainer.max_steps=2"))
    meta = {"step": 2, "facts": {**trainer._resume_facts(), "process_count": 4}}
    with pytest.raises(CheckpointError, match="written by 4 JAX process\\(es\\), this run has 1"):
        trainer._check_resumable(meta)


def test_meta_counts_the_buffered_groups_the_group_size_check_reads(saved_run):
    for step in (1, 2):
        item = saved_run / "checkpoints" / str(step)
        meta = json.loads((item / "meta" / "metadata").read_text())
        saved = json.loads((item / "collector" / "metadata").read_text())
        assert meta["buffered_groups"] == len(saved["buffer"]["ordinals"])


def test_a_stop_after_a_resume_before_the_first_new_step_exits_as_preempted_without_saving_again(
        saved_run, tmp_path, capsys):
    run_dir = copy_of(saved_run, tmp_path)
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    trainer = Trainer(tiny_config(run_dir, "trainer.max_steps=4"))
    assert trainer.resumed_from == 2
    trainer.stop_signals.stop()  # what the SIGTERM handler does, before step 3 is trained
    assert trainer.train() == [] and trainer.preempted
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == steps
    assert audit(run_dir).ok
    # The same command resumes from step 2 again and trains on.
    assert [m["step"] for m in Trainer(tiny_config(run_dir, "trainer.max_steps=4")).train()] == [3, 4]
    report = audit(run_dir)
    assert report.ok and report.restarts == 2, report.summary()


def test_a_checkpoint_with_a_fingerprint_of_the_earlier_format_is_refused_saying_so(saved_run, tmp_path):
    trainer = Trainer(tiny_config(copy_of(saved_run, tmp_path), "trainer.max_steps=2"))
    facts = {**trainer._resume_facts(), "data_fingerprint": "data-v1-aad256f4"}
    trainer.close()
    with pytest.raises(CheckpointError, match="earlier grpo_jax.*did not hash the data file's content"):
        trainer._check_resumable({"step": 2, "facts": facts})
