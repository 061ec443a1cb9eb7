"""A run directory that fills up or stops taking writes outside a checkpoint save: the ledger line that fails
changes nothing, the run stops in one line naming the file, and the next start resumes exactly."""

import json
import threading

from grpo_jax import cli
from grpo_jax.data.collector import Collector
from grpo_jax.errors import RunDirError
from grpo_jax.state.ledger import Ledger, LedgerWriteError, audit
from test_trainer import FAST, REPO


class Counting:
    """An iterator of records 0, 1, 2, ... with a JSON state."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        record = {"epoch": 0, "dataset_index": self.i}
        self.i += 1
        return record

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def test_a_ledger_line_that_hits_a_full_disk_changes_no_accounting_and_the_resume_loses_nothing(small_disk):
    run = small_disk.path / "run"
    ledger = Ledger(run)
    collector = Collector(Counting(), handout_size=1, ledger=ledger)
    (first,) = collector.handout()
    collector.mark_finished(first.ordinal)
    collector.mark_trained([first.ordinal], step=1, weight_versions=[0])
    state = collector.checkpoint_state([])
    assert state["ledger_covers"] == {"run": 0, "seq": 1}
    good_bytes = (run / "events.jsonl").read_bytes()

    small_disk.fill()
    # The ledger's last page still has room for a few lines: drop prompts until a line meets the full disk.
    for _ in range(1000):
        good_bytes, counts = (run / "events.jsonl").read_bytes(), collector.counts()
        (second,) = collector.handout()
        try:
            collector.mark_dropped(second.ordinal, "reward_error")
        except LedgerWriteError as e:
            message = str(e)
            break
    else:
        raise AssertionError("1000 drop lines on a full disk did not raise")
    assert "\n" not in message and str(run / "events.jsonl") in message and "No space left" in message
    assert isinstance(LedgerWriteError(""), RunDirError)  # the CLI prints it as one line, exit 2
    # Nothing changed: the ordinal is still outstanding, not dropped; the file holds only complete lines.
    assert collector.counts() == {**counts, "unfinished": 1, "next_ordinal": second.ordinal + 1}
    assert collector.outstanding() == [second.ordinal]
    assert (run / "events.jsonl").read_bytes() == good_bytes

    small_disk.free()  # space comes back, as when a failed checkpoint's temporary files are removed
    for refused in (lambda: collector.mark_dropped(second.ordinal, "reward_error"),
                    lambda: collector.checkpoint_state([]), lambda: ledger.checkpoint(1, 1, state["ledger_covers"])):
        try:
            refused()
        except LedgerWriteError:
            pass
        else:
            raise AssertionError("the ledger took a line or a checkpoint after a failed line")
    ledger.close()  # never raises, also after a failure
    ledger.close()
    assert (run / "events.jsonl").read_bytes() == good_bytes

    # The next start resumes from the checkpoint: the failed drop's ordinal is handed out and accounted again.
    resumed = Ledger(run, resumed_from={"step": 1, **state["ledger_covers"]})
    again = Collector.restore(Counting(), state, [], handout_size=1, ledger=resumed)
    for _ in range(3):
        for prompt in again.handout():
            again.mark_dropped(prompt.ordinal, "zero_variance")
    later = again.checkpoint_state([])
    resumed.checkpoint(2, later["frontier_ordinal"], later["ledger_covers"])
    resumed.close()
    report = audit(run)
    assert report.ok and not report.lost and not report.trained_twice, report.summary()
    # Lines after the covered seq 1 (the drops up to the failed one) were undone by the restore.
    assert report.frontier_ordinal == 4 and report.trained == 1 and report.handed_out == 4


def run_train(run_dir, *overrides) -> int:
    return cli.main(["train", str(REPO / "configs/tiny_cpu.yaml"), "--run-dir", str(run_dir), *FAST,
                     "checkpoint.async_save=false", "trainer.tensorboard=false", "trainer.save_final_model=false",
                     *overrides])


def grpo_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("grpo"))


def test_a_full_disk_before_a_train_line_stops_the_run_in_one_line_and_the_rerun_resumes_exactly(
        small_disk, monkeypatch, capsys):
    run = small_disk.path / "run"
    write_train = Ledger.train
    failed_at = []

    def fill_just_before_a_train_line(self, step, *args, **kwargs):
        # tmpfs hands out whole pages: a line that fits in the ledger's last page is written even on a full
        # disk. Fill it when the next train line (over 100 bytes) cannot fit there, after a checkpoint exists.
        if step > 2 and not failed_at and -self.path.stat().st_size % 4096 < 100:
            small_disk.fill()
            failed_at.append(step)
        return write_train(self, step, *args, **kwargs)

    monkeypatch.setattr(Ledger, "train", fill_just_before_a_train_line)
    assert run_train(run, "trainer.max_steps=60", "checkpoint.every_steps=2") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "events.jsonl" in err and "No space left" in err, err
    assert grpo_threads() == []  # the actor, the checkpoint writer and the reward threads are gone
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [line.get("step") for line in lines if line["event"] == "train"] == list(range(1, failed_at[0]))
    # The newest committed step (its ledger line may be missing: written after the next step, which failed).
    last_checkpoint = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert last_checkpoint == failed_at[0] - 1
    print(err)

    monkeypatch.undo()
    small_disk.free()
    assert run_train(run, "trainer.max_steps=60", "checkpoint.every_steps=2") == 0
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    starts = [line for line in lines if line["event"] == "run_start"]
    assert starts[-1]["resumed_from"]["step"] == last_checkpoint
    report = audit(run)
    assert report.ok and not report.lost and not report.trained_twice and report.restarts == 1, report.summary()
    assert [line["step"] for line in lines if line["event"] == "train" and line["run"] == 1] == list(
        range(last_checkpoint + 1, 61))


def test_a_full_disk_before_a_metrics_line_stops_the_run_in_one_line_and_the_rerun_resumes_exactly(
        small_disk, monkeypatch, capsys):
    from grpo_jax.run.metrics import MetricsWriter

    run = small_disk.path / "run"
    write_metrics, failed_at = MetricsWriter.write, []

    def fill_just_before_a_metrics_line(self, metrics):
        # A metrics line is over 1 KB: fill when it cannot fit in the last page of metrics.jsonl (see above).
        if metrics["step"] > 2 and not failed_at and -(run / "metrics.jsonl").stat().st_size % 4096 < 1024:
            small_disk.fill()
            failed_at.append(metrics["step"])
        return write_metrics(self, metrics)

    monkeypatch.setattr(MetricsWriter, "write", fill_just_before_a_metrics_line)
    assert run_train(run, "trainer.max_steps=30", "checkpoint.every_steps=2", "trainer.tensorboard=true") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "metrics.jsonl" in err and "No space left" in err, err
    assert len([line for line in err.splitlines() if "grpo-jax: error" in line]) == 1, err
    assert grpo_threads() == []
    metrics = (run / "metrics.jsonl").read_text()
    assert metrics.endswith("\n") and [json.loads(line)["step"] for line in metrics.splitlines()] == list(
        range(1, failed_at[0]))  # complete lines only: the failed one was cut off

    monkeypatch.undo()
    small_disk.free()
    assert run_train(run, "trainer.max_steps=30", "checkpoint.every_steps=2") == 0
    report = audit(run)
    assert report.ok and not report.lost and not report.trained_twice and report.restarts == 1, report.summary()
    assert report.trained == 30 * 4


def test_a_config_yaml_that_cannot_be_written_is_refused_in_one_line(small_disk, monkeypatch, capsys):
    from grpo_jax.run import trainer

    run = small_disk.path / "run"
    save_config = trainer.save_config

    def fill_then_save(config, path):
        small_disk.fill()  # the disk fills just before config.yaml
        save_config(config, path)

    monkeypatch.setattr(trainer, "save_config", fill_then_save)
    assert run_train(run, "trainer.max_steps=1") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "config.yaml" in err and "No space left" in err, err
    assert not (run / "config.yaml").exists() and grpo_threads() == []


# ------------------------------------------------------------------ files deleted under a live run (issue 36)


def delete_at_step(monkeypatch, step: int, *names: str) -> None:
    """After learner step `step`, delete `names` from the run directory, as a program of the run can (issue 36:
    a sandboxed program found --run-dir on /proc and deleted events.jsonl, checkpoints/ and the lock)."""
    import shutil

    from grpo_jax.run.trainer import Trainer

    learn = Trainer._learn

    def learn_then_delete(self, groups, at):
        metrics = learn(self, groups, at)
        if at == step:
            for name in names:
                path = self.run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        return metrics

    monkeypatch.setattr(Trainer, "_learn", learn_then_delete)


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("grpo-jax: error:")]


def run_dir_files(run) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and not p.name.startswith("train.process")}


def test_a_ledger_deleted_under_a_live_run_stops_it_in_one_line_with_its_lines_back_and_the_rerun_resumes(
        tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    delete_at_step(monkeypatch, 3, "events.jsonl")
    assert run_train(run, "trainer.max_steps=6", "checkpoint.every_steps=2") == 2
    (error,) = error_lines(capsys.readouterr().err)
    assert str(run / "events.jsonl") in error and "was deleted" in error and "written back" in error, error
    assert grpo_threads() == []
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["event"] == "train"] == [1, 2, 3, 4]  # every line it wrote
    assert audit(run).ok

    monkeypatch.undo()
    assert run_train(run, "trainer.max_steps=6", "checkpoint.every_steps=2") == 0
    report = audit(run)
    assert report.ok and report.restarts == 1 and report.trained == 6 * 4, report.summary()


def test_the_lock_ledger_and_checkpoints_deleted_under_a_live_run_stop_it_at_once_in_one_line(
        tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    delete_at_step(monkeypatch, 3, "events.jsonl", "train.process0.lock", "checkpoints")
    assert run_train(run, "trainer.max_steps=6", "checkpoint.every_steps=2") == 2
    (error,) = error_lines(capsys.readouterr().err)
    assert "train.process0.lock was deleted" in error, error  # at the step's end, not a heartbeat later
    assert not (run / "checkpoints").exists()  # no save once the lock is lost: another start may hold the directory
    assert audit(run).ok  # the ledger's lines were written back when it closed
    assert grpo_threads() == []


def test_checkpoints_deleted_under_a_live_run_are_saved_again_and_a_resume_needs_the_covered_ledger_line(
        tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    delete_at_step(monkeypatch, 3, "checkpoints")
    assert run_train(run, "trainer.max_steps=6", "checkpoint.every_steps=2") == 2
    (error,) = error_lines(capsys.readouterr().err)
    assert str(run / "checkpoints") in error and "saved step 4 there again" in error, error
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    monkeypatch.undo()

    # Issue 36 item 11: the ledger lost (or cut back) past the line checkpoint step 3 covers: refused, nothing changed.
    ledger = run / "events.jsonl"
    kept = ledger.read_bytes()
    ledger.write_bytes(kept[:len(kept) // 3])
    before = run_dir_files(run)
    assert run_train(run, "trainer.max_steps=6", "checkpoint.every_steps=2") == 2
    (error,) = error_lines(capsys.readouterr().err)
    assert str(ledger) in error and "checkpoint step 4" in error and "new run directory" in error, error
    assert run_dir_files(run) == before and grpo_threads() == []

    ledger.write_bytes(kept)  # put back from a copy: the run resumes exactly
    assert run_train(run, "trainer.max_steps=6", "checkpoint.every_steps=2") == 0
    report = audit(run)
    assert report.ok and report.restarts == 1 and report.trained == 6 * 4, report.summary()
