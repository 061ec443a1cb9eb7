"""Bad input and faults get a clear answer and lose nothing (issue 11): user errors as one type family, prompts
the sampler cannot take, non-JSON values in data rows through a checkpoint, the run-directory lock, bad-row
reporting, and clean-up after a refused start."""

import dataclasses
import datetime
import decimal
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from grpo_jax import cli, errors
from grpo_jax.data.pipeline import DataConfig, json_value, make_data_iterator
from grpo_jax.data.tokenizer import load_tokenizer
from grpo_jax.run.trainer import Trainer
from grpo_jax.state import run_lock
from grpo_jax.state.ledger import audit
from grpo_jax.state.replay_buffer import Group, ReplayBuffer
from grpo_jax.state.run_lock import RunDirLock, lock_file
from test_trainer import FAST, read_ledger, tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")


@pytest.fixture(autouse=True)
def grpo_log_reaches_caplog_and_capsys():
    """`grpo-jax train` gives the grpo_jax logger its own stderr handler and stops propagation (see
    cli.show_trainer_log); a handler left by an earlier test writes to that test's closed capture. Start each
    test without one, and put things back after."""
    log = logging.getLogger("grpo_jax")
    saved = list(log.handlers), log.propagate, log.level
    log.handlers.clear()
    log.propagate = True
    yield
    log.handlers[:] = saved[0]
    log.propagate, log.level = saved[1], saved[2]


def write_jsonl(path: pathlib.Path, rows: list) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl_overrides(path) -> list[str]:
    return [f"data.path={path}", "data.source=jsonl", "data.prompt_field=question", "data.num_epochs=1",
            "data.shuffle=false"]


# ---------------------------------------------------------------------------------- errors as types


def test_user_errors_share_one_base_class_importable_from_where_they_are_raised():
    from grpo_jax.cli import UsageError
    from grpo_jax.config_io import ConfigError
    from grpo_jax.data.pipeline import DataError
    from grpo_jax.run.trainer import TrainerError

    for cls in (ConfigError, errors.CheckpointError, DataError, UsageError, TrainerError, errors.RunDirError):
        assert issubclass(cls, errors.UserError) and cls.exit_code == 2
    assert (ConfigError, DataError, UsageError, TrainerError) == (
        errors.ConfigError, errors.DataError, errors.UsageError, errors.TrainerError)
    assert issubclass(ConfigError, ValueError) and issubclass(TrainerError, RuntimeError)  # old callers' excepts


def test_the_cli_prints_a_user_error_on_one_line_with_its_exit_code_and_keeps_internal_tracebacks(
        monkeypatch, capsys):
    class Diverged(errors.UserError):
        exit_code = 7

    def diverged(args):
        raise Diverged("the loss is NaN at step 3\nlower optim.lr")

    monkeypatch.setattr(cli, "cmd_plot", diverged)
    assert cli.main(["plot", "somewhere"]) == 7
    assert capsys.readouterr().err == "grpo-jax: error: the loss is NaN at step 3 lower optim.lr\n"

    def bug(args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "cmd_plot", bug)
    with pytest.raises(KeyError):  # not swallowed: its traceback reaches the user
        cli.main(["plot", "somewhere"])


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_bytes("seed: 0\n# caf\xe9\n".encode("latin-1"))
    assert cli.main(["init-model", str(config), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"config file {config} is not UTF-8 text" in err[0], err


# ---------------------------------------------------------------------------------- one tokenizer loader


def test_load_tokenizer_reads_every_spelling_the_config_allows(tmp_path):
    assert load_tokenizer("byte").vocab_size == load_tokenizer("", str(_saved_byte_tokenizer(tmp_path))).vocab_size
    synthetic = load_tokenizer("synthetic")
    assert synthetic.decode(synthetic.encode("copy: 12=")) == "copy: 12="
    with pytest.raises(errors.ConfigError, match="tokenizer='': set tokenizer"):
        load_tokenizer("", "")
    with pytest.raises(errors.CheckpointError, match="tokenizer.json: not found"):
        load_tokenizer(str(tmp_path / "empty"))


def _saved_byte_tokenizer(tmp_path):
    from grpo_jax.data.tokenizer import Tokenizer

    Tokenizer.byte_level().save(tmp_path / "tok")
    (tmp_path / "empty").mkdir()
    return tmp_path / "tok"


# ---------------------------------------------------------------------------------- prompts the sampler cannot take


def test_a_prompt_over_the_sampler_limit_is_a_bad_row_naming_its_length_and_the_limit(tmp_path):
    rows = [{"question": "copy: 1=", "answer": "1"}, {"question": "copy: 1234=", "answer": "1234"}]
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), shuffle=False,
                        num_epochs=1, max_prompt_len=16)
    tok = load_tokenizer("synthetic")
    plain = list(make_data_iterator(config, tok))
    limited = list(make_data_iterator(config, tok, sampler_max_prompt_len=10))
    assert [r.get("bad_row") for r in plain] == [None, None]
    assert [r.get("bad_row") for r in limited] == [None, "prompt_too_long"]
    assert limited[1]["detail"] == "11 tokens > sampler.max_prompt_len=10"
    # The data limit, when it is the smaller one, is the one named.
    tight = list(make_data_iterator(dataclasses.replace(config, max_prompt_len=9), tok, sampler_max_prompt_len=10))
    assert tight[1]["detail"] == "11 tokens > data.max_prompt_len=9"
    # Which rows the sampler can take is not part of the data's identity: a resume with another sampler
    # limit keeps the same stream.
    assert make_data_iterator(config, tok).fingerprint == make_data_iterator(config, tok, 0, 1, 10).fingerprint


def test_the_run_goes_on_past_prompts_the_sampler_cannot_take_and_logs_and_records_why(tmp_path, monkeypatch, caplog):
    import grpo_jax.rollout.actor as actor_module

    monkeypatch.setattr(actor_module, "BAD_ROWS_LOGGED", 2)
    monkeypatch.setattr(actor_module, "BAD_ROWS_LOG_EVERY", 3)
    short = [{"question": f"copy: {d}=", "answer": str(d)} for d in range(1, 9)]
    long = [{"question": f"copy: {d}234=", "answer": f"{d}234"} for d in range(1, 5)]
    data = write_jsonl(tmp_path / "d.jsonl", [row for pair in zip(short, long + long) for row in pair][:12])
    config = tiny_config(tmp_path / "run", *jsonl_overrides(data), "sampler.max_prompt_len=10",
                         "trainer.max_steps=10", "trainer.tensorboard=false")
    with caplog.at_level(logging.WARNING, logger="grpo_jax"):
        history = Trainer(config).train()
    assert history  # the short prompts trained (a random model's groups may also drop as overlong)
    drops = [line for line in read_ledger(tmp_path / "run") if line["event"] == "drop" and line["reason"] == "bad_row"]
    assert [line["dataset_index"] for line in drops] == [1, 3, 5, 7, 9, 11]
    for line in drops:
        assert line["reason"] == "bad_row"
        assert line["detail"] == "prompt_too_long: 11 tokens > sampler.max_prompt_len=10"
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bad row dropped")]
    assert len(logged) == 4  # rate-limited: the first 2, then every 3rd (#1, #2, #3, #6 of 6)
    assert "prompt_too_long: 11 tokens > sampler.max_prompt_len=10" in logged[0]
    report = audit(tmp_path / "run")
    assert report.ok and report.dropped_by_reason["bad_row"] == 6, report.summary()
    assert report.trained + sum(report.dropped_by_reason.values()) == 12, report.summary()


# ---------------------------------------------------------------------------------- non-JSON values in rows


def write_odd_parquet(path: pathlib.Path, n: int = 12) -> pathlib.Path:
    """Prompts the synthetic tokenizer can read, beside columns of every kind JSON has no value for."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.UTC)
    table = pa.table({
        "question": [f"copy: {i % 9 + 1}=" for i in range(n)],
        "answer": [str(i % 9 + 1) for i in range(n)],
        "when": pa.array([when] * n, pa.timestamp("us", tz="UTC")),
        "day": pa.array([datetime.date(2024, 5, 6)] * n, pa.date32()),
        "price": pa.array([decimal.Decimal("3.50")] * n, pa.decimal128(10, 2)),
        "blob": pa.array([b"\x89PNG\x00\xff"] * n, pa.binary()),
        "text_bytes": pa.array([b"caf\xc3\xa9"] * n, pa.binary()),
        "score": [float("nan") if i % 2 else float("-inf") for i in range(n)],
        "wait": pa.array([datetime.timedelta(seconds=90)] * n, pa.duration("ms")),
        "nested": [{"xs": [1.5, float("nan")], "at": when}] * n,
    })
    pq.write_table(table, path)
    return path


ODD_ROW = {"when": "2024-05-06T07:08:09.123456+00:00", "day": "2024-05-06", "price": "3.50",
           "blob": "iVBORwD/", "text_bytes": "café", "wait": 90.0,
           "nested": {"xs": [1.5, "NaN"], "at": "2024-05-06T07:08:09.123456+00:00"}}


def test_non_json_values_become_documented_json_forms_at_read_time():
    assert json_value({"a": (np.int64(3), np.float32(0.5), np.bool_(True)), 4: np.array([[1, 2]])}) == \
        {"a": [3, 0.5, True], "4": [[1, 2]]}
    assert json_value([float("inf"), float("-inf"), float("nan")]) == ["Infinity", "-Infinity", "NaN"]
    assert [float(x) for x in json_value([float("inf"), decimal.Decimal("1.25")])] == [float("inf"), 1.25]
    assert json_value(np.datetime64("2024-01-02T03:04:05.000000001")) == "2024-01-02T03:04:05.000000001"
    assert json_value(np.timedelta64(1500, "ms")) == 1.5
    with pytest.raises(Exception, match=r"unsupported_value: row\['z'\]\[1\] is a complex"):
        json_value({"z": [1, 2j]})


def test_parquet_rows_with_datetimes_decimals_bytes_and_nan_survive_the_replay_buffer_state(tmp_path):
    config = DataConfig(source="parquet", path=str(write_odd_parquet(tmp_path / "odd.parquet")), shuffle=False)
    record = next(make_data_iterator(config, load_tokenizer("synthetic")))
    assert {k: record["row"][k] for k in ODD_ROW} == ODD_ROW and record["row"]["score"] == "-Infinity"
    group = Group(ordinal=0, prompt=record, completions=[np.array([1], np.int32)] * 2,
                  behaviour_logprobs=[np.zeros(1, np.float32)] * 2, rewards=np.zeros(2, np.float32), weight_version=0)
    buffer = ReplayBuffer(4, 1, 2)
    buffer.put(group)
    saved = json.loads(json.dumps(buffer.to_state(), allow_nan=False))  # strict JSON, as a checkpoint holds it
    restored = ReplayBuffer.from_state(saved)
    assert restored._groups[0].prompt["row"] == record["row"]


def test_a_parquet_run_with_odd_columns_saves_a_checkpoint_holding_them_and_resumes(tmp_path, monkeypatch):
    from grpo_jax.run.trainer import Trainer
    from test_checkpoint import preempt_after

    data = write_odd_parquet(tmp_path / "odd.parquet", n=40)
    config = tiny_config(tmp_path / "run", f"data.path={data}", "data.source=parquet", "data.prompt_field=question",
                         "trainer.max_steps=3", "checkpoint.every_steps=0", "grpo.max_staleness=1",
                         "trainer.tensorboard=false")
    save = Trainer.save_checkpoint

    def save_with_groups_waiting(self):
        # Hold the save until the actor has a group in the buffer, so that the checkpoint holds rows.
        deadline = time.monotonic() + 60
        while len(self.buffer) == 0 and self.actor.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        save(self)

    monkeypatch.setattr(Trainer, "save_checkpoint", save_with_groups_waiting)
    preempt_after(monkeypatch, 1)
    first = Trainer(config)
    first.train()
    assert first.preempted
    monkeypatch.undo()
    resumed = Trainer(config)
    assert resumed.resumed_from == 1 and len(resumed.buffer) > 0
    for group in resumed.buffer._groups.values():
        assert {k: group.prompt["row"][k] for k in ODD_ROW} == ODD_ROW
    assert [m["step"] for m in resumed.train()] == [2, 3]
    report = audit(tmp_path / "run")
    assert report.ok and report.trained == 3 * 4, report.summary()


# ---------------------------------------------------------------------------------- the run-directory lock


def hold_lock_in_another_process(run_dir) -> subprocess.Popen:
    code = ("import sys, time; from grpo_jax.state.run_lock import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_train_on_a_held_run_directory_is_refused_naming_the_holder_then_a_dead_holder_is_taken_over(
        tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    holder = hold_lock_in_another_process(run_dir)
    try:
        code = cli.main(["train", TINY, "--run-dir", str(run_dir), *FAST])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert f"is in use by pid {holder.pid} on host {socket.gethostname()}" in err[0], err
        assert not (run_dir / "config.yaml").exists()  # refused before writing anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    logging.getLogger("grpo_jax").propagate = True  # the train command above turned it off
    with caplog.at_level(logging.WARNING, logger="grpo_jax"):
        lock = RunDirLock(run_dir)
        lock.acquire()
    try:
        assert f"pid {holder.pid} is not running" in caplog.text
        assert json.loads(lock_file(run_dir).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not lock_file(run_dir).exists()


def test_the_lock_refuses_a_live_holder_and_takes_over_only_a_dead_one(tmp_path, caplog):
    first = RunDirLock(tmp_path)
    first.acquire()
    with pytest.raises(errors.RunDirError, match=f"in use by pid {os.getpid()} on host"):
        RunDirLock(tmp_path).acquire()  # another trainer of this very process
    peer = RunDirLock(tmp_path, process_index=1)  # the processes of one multi-host run do not refuse each other
    peer.acquire()
    peer.release()
    first.release()

    def plant(holder: dict, age_s: float = 0.0) -> None:
        lock_file(tmp_path).write_text(json.dumps(holder))
        then = time.time() - age_s
        os.utime(lock_file(tmp_path), (then, then))

    other_host = {"host": "elsewhere", "pid": 1, "started": "2024-01-01T00:00:00", "token": "x"}
    plant(other_host, age_s=10)
    with pytest.raises(errors.RunDirError, match="in use by pid 1 on host elsewhere"):
        RunDirLock(tmp_path).acquire()  # another host's process cannot be checked: fresh means alive
    for holder, age_s, reason in [
        (other_host, run_lock.STALE_AFTER_S + 5, "its host has not refreshed it"),
        ({"host": socket.gethostname(), "pid": os.getpid(), "boot_id": run_lock._boot_id(),
          "pid_ns": run_lock._pid_namespace(), "token": "an earlier process"}, 0, "earlier process"),
        # another boot: its pid means nothing, only the heartbeat tells (more in test_run_lock.py)
        ({"host": socket.gethostname(), "pid": 1, "boot_id": "another boot", "token": "y"},
         run_lock.STALE_AFTER_S + 5, "rebooted"),
    ]:
        plant(holder, age_s)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grpo_jax"):
            lock = RunDirLock(tmp_path)
            lock.acquire()
        assert reason in caplog.text
        lock.release()
    lock_file(tmp_path).write_text("")  # being written by a start this instant
    with pytest.raises(errors.RunDirError, match="being locked by another start right now"):
        RunDirLock(tmp_path).acquire()


def test_the_lock_heartbeat_refreshes_the_file_and_release_leaves_another_holder_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    os.utime(lock_file(tmp_path), (0, 0))
    time.sleep(0.5)
    assert time.time() - lock_file(tmp_path).stat().st_mtime < 5
    lock_file(tmp_path).write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "theirs"}))
    heartbeat = lock._heartbeat
    lock.release()
    assert lock_file(tmp_path).exists()  # not ours any more: left alone
    assert not heartbeat.is_alive()


def test_a_run_directory_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(errors.RunDirError, match=r"run directory .*file/run: cannot create it"):
        RunDirLock(tmp_path / "file" / "run").acquire()
    with pytest.raises(errors.RunDirError, match="run directory /proc is not writable"):
        RunDirLock("/proc").acquire()


# ---------------------------------------------------------------------------------- every row bad; failed start-up


def test_a_finite_dataset_whose_rows_are_all_bad_ends_with_one_line_and_exit_2(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": " ", "answer": str(i)} for i in range(5)])
    code = cli.main(["train", TINY, "--run-dir", str(tmp_path / "run"), *FAST, *jsonl_overrides(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("grpo-jax: error: nothing was trained: every one of the 5 prompts handed out was "
                              "dropped (bad_row 5); first bad row: empty_prompt: 'question' is empty"), err[-1]
    drops = [line for line in read_ledger(tmp_path / "run") if line["event"] == "drop"]
    assert [line["detail"] for line in drops] == ["empty_prompt: 'question' is empty"] * 5
    assert not lock_file(tmp_path / "run").exists()


def open_files_under(directory: pathlib.Path) -> list[str]:
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [p for p in paths if p.startswith(str(directory))]


def test_a_start_that_fails_after_opening_things_closes_them(tmp_path, monkeypatch):
    import grpo_jax.run.trainer as trainer_module

    def refused(*args, **kwargs):
        raise errors.ConfigError("rewards: refused for the test")

    config = tiny_config(tmp_path / "run", "data.worker_count=1")
    monkeypatch.setattr(trainer_module, "RewardSuite", refused)  # after the ledger, checkpoints, data and sampler
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(errors.ConfigError) as failure:  # holds the trainer's frames, as a notebook would
        trainer_module.Trainer(config)
    assert (tmp_path / "run" / "events.jsonl").exists()  # it got as far as opening the ledger
    assert open_files_under(tmp_path / "run") == []
    assert {t.name for t in threading.enumerate()} - threads == set()
    assert not lock_file(tmp_path / "run").exists()
    monkeypatch.undo()
    trainer_module.Trainer(config).close()  # the directory is free again
    del failure
