"""Faults around checkpoints (issue 11, items 7 and 8): a full disk during a save, a run or checkpoint directory
that cannot be written, content checksums, and restore errors that are not damage (which must move nothing).
The multi-process agreement on the step to restore is tested through load_latest with a simulated second
process; tests/test_multiprocess.py resumes real processes through the same code."""

import asyncio
import errno
import gc
import json
import logging
import os
import pathlib
import subprocess
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpo_jax import cli
from grpo_jax.checkpoint import (CHECKSUM_KEY, CORRUPT_DIR, CheckpointConfig, Checkpoints, DamagedStep, damage_in,
                                 os_error_number)
from grpo_jax.errors import CheckpointError
from grpo_jax.ledger import audit
from grpo_jax.trainer import Trainer, pack_process_state, unpack_process_state

from test_checkpoint import copy_of, params_of, saved_run, small_save, train_lines  # noqa: F401 - saved_run: fixture
from test_trainer import FAST, REPO, read_ledger, tiny_config

TINY = str(REPO / "configs" / "tiny_cpu.yaml")


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("grpo-jax: error:")]


# ---------------------------------------------------------------------------------- a full disk


def mount_tmpfs(path: pathlib.Path, options: str) -> bool:
    """Mount a tmpfs at `path`; False where this machine does not allow it (not root, no mount in a container)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


class CheckpointDisk:
    """RUN_DIR/checkpoints on a filesystem of its own that can be filled and freed again.

    A real one where mounts are allowed (CI runs as root): a tmpfs, shrunk to what it holds to make it
    full, so the kernel answers ENOSPC to Orbax's own writes. Elsewhere the failure is injected instead: every
    Orbax save raises OSError(ENOSPC) while the disk is "full" (that path cannot show Orbax's writer-thread
    reports being silenced, only the trainer's answer)."""

    def __init__(self, run_dir: pathlib.Path, monkeypatch):
        self.path = run_dir / "checkpoints"
        self.real = mount_tmpfs(self.path, "size=64m")
        self.full = False
        if not self.real:
            save = ocp.CheckpointManager.save

            def save_unless_full(manager, *args, **kwargs):
                if self.full:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return save(manager, *args, **kwargs)

            monkeypatch.setattr(ocp.CheckpointManager, "save", save_unless_full)

    def fill(self) -> None:
        if self.real:
            stat = os.statvfs(self.path)
            used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
            subprocess.run(["mount", "-o", f"remount,size={used + 4 * 4096}", str(self.path)], check=True)
        self.full = True

    def free(self) -> None:
        if self.real:
            subprocess.run(["mount", "-o", "remount,size=64m", str(self.path)], check=True)
        self.full = False

    def unmount(self) -> None:
        if self.real:
            subprocess.run(["umount", "--lazy", str(self.path)], check=True)  # lazy: a failed test may hold files


@pytest.fixture
def checkpoint_disk(tmp_path, monkeypatch):
    disk = CheckpointDisk(tmp_path / "run", monkeypatch)
    yield disk
    disk.unmount()


def fill_before_writing(monkeypatch, disk: CheckpointDisk, step: int) -> None:
    """Fill the checkpoint disk just before the save of `step` is written. The save before it has committed by
    then (one save is in flight at a time), whether or not the trainer has polled it yet."""
    write = Checkpoints._write

    def fill_then_write(self, saved_step, *args):
        if saved_step == step:
            disk.fill()
        return write(self, saved_step, *args)

    monkeypatch.setattr(Checkpoints, "_write", fill_then_write)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_full_disk_mid_save_ends_in_one_line_and_the_rerun_resumes_exactly(tmp_path, checkpoint_disk, monkeypatch,
                                                                            capsys, caplog):
    overrides = ["grpo.max_staleness=0", "trainer.max_steps=2", "checkpoint.every_steps=1", "trainer.tensorboard=false",
                 "trainer.save_final_model=false"]
    whole = Trainer(tiny_config(tmp_path / "whole", *overrides))
    whole.train()

    run_dir = tmp_path / "run"
    fill_before_writing(monkeypatch, checkpoint_disk, 2)
    with caplog.at_level(logging.INFO):
        code = cli.main(["train", TINY, "--run-dir", str(run_dir), *FAST, *overrides])
    gc.collect()  # Orbax's abandoned writes are collected here: none may print a traceback
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = error_lines(err)
    assert f"checkpoint step 2 could not be written to {run_dir / 'checkpoints'}: No space left on device" in line
    assert "a checkpoint of this run takes about" in line and "(step 1 on disk)" in line
    assert "step 1, is in place" in line and "free space and run the same command to resume from step 1" in line
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "Orbax's reports of the full disk got through"
    # Step 1 and its ledger line are there; of the half-written step 2, at most what a write still pending
    # re-created after it was removed (Orbax's temporary directory), which the next start removes.
    assert {p.name for p in checkpoint_disk.path.iterdir()} <= {"1", "2.orbax-checkpoint-tmp"}
    assert [line["step"] for line in read_ledger(run_dir) if line["event"] == "checkpoint"] == [1]

    checkpoint_disk.free()
    monkeypatch.undo()
    resumed = Trainer(tiny_config(run_dir, *overrides))
    assert resumed.resumed_from == 1 and sorted(p.name for p in checkpoint_disk.path.iterdir()) == ["1"]
    resumed.train()
    for a, b in zip(params_of(whole), params_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert train_lines(tmp_path / "whole") == train_lines(run_dir)
    report = audit(run_dir)
    assert report.ok and report.restarts == 1 and report.trained == 8 and not report.lost, report.summary()


def test_a_failed_save_names_the_space_a_checkpoint_needs_and_close_does_not_raise_it_again(tmp_path, monkeypatch):
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(keep_last=2))
    small_save(checkpoints, 1)
    assert checkpoints.wait() == [1]
    on_disk = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "1").rglob("*") if f.is_file())

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoints._manager, "save", disk_full)
    small_save(checkpoints, 2)
    with pytest.raises(CheckpointError) as raised:
        checkpoints.wait()
    message = str(raised.value)
    assert f"about {on_disk / 1024:.1f} KiB (step 1 on disk)" in message, message
    needed = f"room for 3 of them (checkpoint.keep_last=2 and the one being written): about {3 * on_disk / 1024:.1f}"
    assert needed in message, message
    assert "\n" not in message and checkpoints.steps() == [1]
    checkpoints.close()


def test_an_unwritable_run_directory_is_refused_at_start_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    if not mount_tmpfs(run_dir, "ro,size=1m"):
        run_dir = pathlib.Path("/proc/grpo-jax-test-run")  # no mounts allowed here: a directory nobody can create
    try:
        code = cli.main(["train", TINY, "--run-dir", str(run_dir), *FAST])
    finally:
        if run_dir.is_relative_to(tmp_path):
            subprocess.run(["umount", str(run_dir)], check=True)
    err = capsys.readouterr().err
    [line] = error_lines(err)
    assert code == 2 and str(run_dir) in line and ("not writable" in line or "cannot create it" in line), err


def test_an_unwritable_checkpoint_directory_is_refused_at_start_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    checkpoint_dir = run_dir / "checkpoints"
    if not mount_tmpfs(checkpoint_dir, "ro,size=1m"):
        checkpoint_dir.rmdir()
        checkpoint_dir.write_text("")  # no mounts allowed here: a file where the directory should be
    try:
        code = cli.main(["train", TINY, "--run-dir", str(run_dir), *FAST])
    finally:
        if checkpoint_dir.is_dir():
            subprocess.run(["umount", str(checkpoint_dir)], check=True)
    [line] = error_lines(capsys.readouterr().err)
    assert code == 2 and f"checkpoint directory {checkpoint_dir} is not a writable directory" in line, line


# ---------------------------------------------------------------------------------- restoring: damage or not


@pytest.mark.parametrize("item", ["collector", "meta"])
def test_a_json_item_off_its_checksum_is_set_aside_and_the_step_before_is_used(saved_run, tmp_path, item, caplog):
    run_dir = copy_of(saved_run, tmp_path)
    path = run_dir / "checkpoints" / "2" / item / "metadata"
    content = json.loads(path.read_text())
    assert CHECKSUM_KEY in content
    if item == "collector":
        content["collector"]["frontier_ordinal"] += 1  # still valid JSON, but not what was written
    else:
        content["weight_version"] += 1
    path.write_text(json.dumps(content))
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(tiny_config(run_dir, "trainer.max_steps=3"))
    assert trainer.resumed_from == 1
    assert f"checkpoint step 2 cannot be read (item {item} of step 2 does not match its checksum)" in caplog.text
    assert [p.name.split("-")[0] for p in (run_dir / CORRUPT_DIR).iterdir()] == ["2"]
    trainer.train()
    assert audit(run_dir).ok


def raise_once_while_restoring(monkeypatch, error: BaseException, item: str) -> None:
    restore = ocp.CheckpointManager.restore
    raised = []

    def restore_failing_once(manager, step, *args, **kwargs):
        if not raised and item in kwargs["args"].keys():
            raised.append(step)
            raise error
        return restore(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore_failing_once)


@pytest.mark.parametrize("error, item, shown", [
    (OSError(errno.EIO, "Input/output error"), "meta", "OSError: [Errno 5] Input/output error"),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB."), "state",
     "RuntimeError: RESOURCE_EXHAUSTED: Out of memory"),
    (ValueError("UNAVAILABLE: Error reading local file: connection reset"), "state", "UNAVAILABLE"),
])
def test_a_restore_error_that_is_not_damage_stops_in_one_line_and_moves_nothing(saved_run, tmp_path, monkeypatch,
                                                                                capsys, error, item, shown):
    run_dir = copy_of(saved_run, tmp_path)
    ledger_before = (run_dir / "events.jsonl").read_bytes()
    raise_once_while_restoring(monkeypatch, error, item)
    code = cli.main(["train", TINY, "--run-dir", str(run_dir), *FAST, "trainer.max_steps=3"])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 2 and "checkpoint step 2 in" in line and "could not be restored" in line and shown in line, line
    assert "nothing was moved or changed" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    assert not (run_dir / CORRUPT_DIR).exists()
    assert (run_dir / "events.jsonl").read_bytes() == ledger_before  # no new run, no new chain
    monkeypatch.undo()
    trainer = Trainer(tiny_config(run_dir, "trainer.max_steps=3"))
    assert trainer.resumed_from == 2  # once the cause is gone
    trainer.close()


def test_a_checkpoint_written_before_checksums_still_loads(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path)
    for item in ("collector", "meta"):
        path = run_dir / "checkpoints" / "2" / item / "metadata"
        content = json.loads(path.read_text())
        del content[CHECKSUM_KEY]
        path.write_text(json.dumps(content))
    trainer = Trainer(tiny_config(run_dir, "trainer.max_steps=3"))
    assert trainer.resumed_from == 2
    trainer.train()
    report = audit(run_dir)
    assert report.ok and report.trained == 12, report.summary()


def test_damage_is_told_from_other_restore_errors():
    def caused(outer: BaseException, cause: BaseException) -> BaseException:
        outer.__cause__ = cause
        return outer

    damaged = [
        DamagedStep("item meta of step 2 does not match its checksum"),
        FileNotFoundError("File /run/checkpoints/2/meta/metadata not found."),
        json.JSONDecodeError("Unterminated string", "{\"a", 1),
        KeyError('Item "state" was not found in the checkpoint. Available items: [\'meta\']'),
        ValueError('DATA_LOSS: Error reading "w/0" in OCDBT database: checksum mismatch'),
        caused(Exception("Encountered error while reading array index: (slice(0, 8, 1),)."),
               ValueError("OUT_OF_RANGE: Requested byte range [0, 3742) is not valid for value of size 2011")),
        ValueError('NOT_FOUND: Error opening "zarr" driver: Metadata at "b/.zarray" does not exist'),
    ]
    for error in damaged:
        assert damage_in(error), error
    not_damaged = [
        OSError(errno.EIO, "Input/output error"),
        PermissionError(errno.EACCES, "Permission denied"),
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB."),
        ValueError("UNAVAILABLE: connection reset"),
        MemoryError(),
        caused(Exception("Encountered error while reading array index"), MemoryError()),
        KeyError("params"),  # a bug, not a missing item
    ]
    for error in not_damaged:
        assert damage_in(error) is None, error
    handled = ValueError("RESOURCE_EXHAUSTED: out of memory")
    handled.__context__ = FileNotFoundError("an optional file")  # raised while handling it, not caused by it
    assert damage_in(handled) is None
    assert os_error_number(ValueError("RESOURCE_EXHAUSTED: Failed writing [os_error_code='28']")) == errno.ENOSPC
    assert os_error_number(caused(RuntimeError("x"), OSError(errno.EDQUOT, "quota"))) == errno.EDQUOT


def test_each_process_state_is_sealed_with_its_checksum_and_older_unsealed_state_still_opens():
    own, arrays = {"collector": {"frontier_ordinal": 3}}, {"int32": np.arange(4, dtype=np.int32)}
    sealed = pack_process_state(own, arrays)
    opened_own, opened_arrays = unpack_process_state(sealed, sealed=True)
    assert opened_own == own and opened_arrays["int32"].tolist() == [0, 1, 2, 3]
    flipped = sealed.copy()
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(DamagedStep, match="do not match their checksum"):
        unpack_process_state(flipped, sealed=True)
    with pytest.raises(DamagedStep):
        unpack_process_state(sealed[:-40], sealed=True)  # truncated
    older = sealed[:-32]  # what a checkpoint from before the checksum holds
    assert unpack_process_state(older, sealed=False)[0] == own


# ---------------------------------------------------------------------------------- several processes agree


def three_steps(tmp_path) -> Checkpoints:
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(keep_last=5))
    for step in (1, 2, 3):
        small_save(checkpoints, step, value=step)
    checkpoints.wait()
    return checkpoints


ABSTRACT = {"w": jax.ShapeDtypeStruct((4,), np.float32), "count": jax.ShapeDtypeStruct((), np.int32)}


def with_process_1(*rows_of_process_1):
    """agree() as process 0 of two: each call gathers this process's values and process 1's next row."""
    rows = iter(rows_of_process_1)
    return lambda values: np.array([list(values), next(rows)], np.int32)


def test_a_step_damaged_on_another_process_is_set_aside_on_every_process(tmp_path):
    checkpoints = three_steps(tmp_path)
    # Step 3: both list it; both read its JSON; process 1 finds its own state bytes damaged. Step 2: all good.
    agree = with_process_1([3], [0], [1], [2], [0], [0])
    restored = checkpoints.load_latest(lambda meta: ABSTRACT, lambda meta: None, agree=agree)
    assert restored.step == 2 and checkpoints.steps() == [1, 2]
    assert [p.name.split("-")[0] for p in (tmp_path / CORRUPT_DIR).iterdir()] == ["3"]
    checkpoints.close()


def test_a_restore_failure_on_another_process_stops_every_process_and_moves_nothing(tmp_path):
    checkpoints = three_steps(tmp_path)
    agree = with_process_1([3], [0], [2])  # process 1 runs out of memory restoring step 3's arrays
    with pytest.raises(CheckpointError, match="step 3 .* could not be restored by process 1 .*nothing was moved"):
        checkpoints.load_latest(lambda meta: ABSTRACT, lambda meta: None, agree=agree)
    assert checkpoints.steps() == [1, 2, 3] and not (tmp_path / CORRUPT_DIR).exists()
    checkpoints.close()


def test_every_process_restores_the_step_process_0_chose(tmp_path):
    checkpoints = three_steps(tmp_path)
    # As process 1: process 0 (row 0) lists only up to step 2 (it already set 3 aside); this process follows.
    as_process_1 = iter([[2], [0], [0]])
    restored = checkpoints.load_latest(lambda meta: ABSTRACT, lambda meta: None,
                                       agree=lambda values: np.array([next(as_process_1), list(values)], np.int32))
    assert restored.step == 2 and int(restored.state["count"]) == 2
    # A step process 0 chose that this process does not see: a filesystem that is not shared; stop, move nothing.
    as_process_1 = iter([[7], [0]])
    with pytest.raises(CheckpointError, match="does not see checkpoint step 7, which process 0 chose"):
        checkpoints.load_latest(lambda meta: ABSTRACT, lambda meta: None,
                                agree=lambda values: np.array([next(as_process_1), list(values)], np.int32))
    assert checkpoints.steps() == [1, 2, 3]
    checkpoints.close()


def test_only_completions_handed_to_a_closed_event_loop_are_dropped_as_abandoned_io():
    from grpo_jax.checkpoint import _DiskFullReports, _DropAbandonedIo

    def raised(action):
        try:
            action()
        except Exception as e:  # noqa: BLE001 - the report is what is under test
            return types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__, object=None)

    loop = asyncio.new_event_loop()
    loop.close()
    into_closed_loop = raised(lambda: loop.call_soon_threadsafe(print))
    elsewhere = raised(lambda: (_ for _ in ()).throw(RuntimeError("Event loop is closed")))
    other = raised(lambda: 1 / 0)
    reported = []
    hook = _DropAbandonedIo(reported.append, _DiskFullReports())
    for unraisable in (into_closed_loop, elsewhere, other):
        hook(unraisable)
    assert reported == [elsewhere, other]
