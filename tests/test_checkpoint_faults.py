"""Faults around checkpoints (issue 11, items 7 and 8; issue 20, item 7): a full disk during a save, a run or
checkpoint directory that cannot be written, content checksums, every file of a committed step deleted, truncated
or zero-filled (set aside once the step before it reads back), and restore errors that are not damage (which must
move nothing). The multi-process agreement on the step to restore is tested through load_latest with a simulated
second process; tests/test_multiprocess.py resumes real processes through the same code."""

import asyncio
import errno
import gc
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpo_jax import cli
from grpo_jax.errors import CheckpointError
from grpo_jax.run.trainer import Trainer, pack_process_state, unpack_process_state
from grpo_jax.state.checkpoint import (
    CHECKSUM_KEY,
    CORRUPT_DIR,
    CheckpointConfig,
    Checkpoints,
    DamagedStep,
    damage_in,
    not_damage,
    os_error_number,
)
from grpo_jax.state.ledger import audit
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


def caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def read_by_orbax(error: BaseException) -> BaseException:
    """`error` as Orbax raises it from an array read: wrapped in an Exception of its own."""
    return caused(Exception("Encountered error while reading array index: (slice(0, 64, 1),). See full TensorStore "
                            "details: <bound method spec of TensorStore({...})>."), error)


def handling(error: BaseException, while_handling: BaseException) -> BaseException:
    error.__context__ = while_handling
    return error


SHARDING = '"/run/checkpoints/2/state/_sharding"'
# What Orbax and TensorStore raise for a missing, truncated or zero-filled file of a step (seen in the matrix below).
DAMAGE = [
    FileNotFoundError("File /run/checkpoints/2/meta/metadata not found."),
    json.JSONDecodeError("Unterminated string", "{\"a", 1),
    KeyError('Item "state" was not found in the checkpoint. Available items: [\'meta\']'),
    ValueError('DATA_LOSS: Error reading "w/0" in OCDBT database: checksum mismatch'),
    read_by_orbax(ValueError("OUT_OF_RANGE: Requested byte range [0, 3742) is not valid for value of size 2011")),
    ValueError('NOT_FOUND: Error opening "zarr" driver: Metadata at "b/.zarray" does not exist'),
    ValueError(f"FAILED_PRECONDITION: Error reading local file {SHARDING}: Invalid JSON"),
    read_by_orbax(ValueError('FAILED_PRECONDITION: Error reading "params.w/0.0" in OCDBT database: Truncated '
                             'Zstd-compressed stream; at byte 0')),
    ValueError("INVALID_ARGUMENT: Error parsing object member \"zarr_format\""),
    TypeError("string indices must be integers"),  # metadata that parses, into something else
]
# Errors that say nothing about the step's files, and what not_damage() calls them.
NOT_DAMAGE = [
    (PermissionError(errno.EACCES, "Permission denied"), "a permission error"),
    (ValueError(f"PERMISSION_DENIED: Error reading local file {SHARDING}: Failed to open: {SHARDING}: Permission "
                "denied [os_error_code='13']"), "a permission error"),
    (read_by_orbax(ValueError("PERMISSION_DENIED: Error reading \"params.w/0.0\" in OCDBT database: Failed to open: "
                              "Permission denied [os_error_code='13']")), "a permission error"),
    (OSError(errno.EPERM, "Operation not permitted"), "a permission error"),
    (OSError(errno.ENOSPC, "No space left on device"), "a full disk"),
    (ValueError("UNKNOWN: Error writing cache file: Disk quota exceeded [os_error_code='122']"), "a full disk quota"),
    (OSError(errno.EIO, "Input/output error"), "an I/O error of the storage"),
    (read_by_orbax(ValueError("UNKNOWN: Error reading local file: Input/output error [os_error_code='5']")),
     "an I/O error of the storage"),
    (OSError(errno.ESTALE, "Stale file handle"), "a stale file handle"),
    (ValueError("UNAVAILABLE: Error reading local file: connection reset"), "storage that is unavailable"),
    (read_by_orbax(ValueError("DEADLINE_EXCEEDED: Reading gs://bucket/run/checkpoints/2/state/d/1f2e")),
     "a deadline exceeded"),
    (ValueError("CANCELLED: Reading \"params.w/0.0\""), "a cancelled read"),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB."), "out of memory"),
    (ValueError("RESOURCE_EXHAUSTED: Cache pool exhausted"), "out of a resource"),
    (MemoryError(), "out of memory"),
    (read_by_orbax(MemoryError()), "out of memory"),
    (jax.errors.JaxRuntimeError("INTERNAL: Failed to transfer the buffer to the device"),
     "an error of the device runtime"),
    # Raised while handling an I/O error, without naming it as the cause: still not a reason to move the step.
    (handling(ValueError("DATA_LOSS: short read"), OSError(errno.EIO, "Input/output error")),
     "an I/O error of the storage"),
    (ExceptionGroup("reads", [ValueError("NOT_FOUND: x"), OSError(errno.ESTALE, "Stale file handle")]),
     "a stale file handle"),
]


def test_what_is_not_damage_is_told_from_damage():
    for error in DAMAGE:
        assert not_damage(error) is None, error
    for error, kind in NOT_DAMAGE:
        assert not_damage(error) == kind, error
    # damage_in: a DamagedStep among the causes (load_latest wraps Orbax's damage reports in one), nothing else.
    assert damage_in(caused(RuntimeError("x"), DamagedStep("item meta of step 2 does not match its checksum")))
    for error in [*DAMAGE, KeyError("params"), AttributeError("'NoneType' object has no attribute 'shape'")]:
        assert damage_in(error) is None, error
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


async def read_like_orbax(wait):
    try:
        await wait
    except BaseException as e:
        raise Exception("Encountered error while reading array index: ()") from e  # noqa: TRY002 - as Orbax does


def closed_while_suspended(filename: str) -> types.SimpleNamespace:
    """The report of read_like_orbax, defined in `filename`, closed at collection while it waited: the
    GeneratorExit that closes it wrapped in an Exception of its own, as Orbax's array reads do."""
    read = types.FunctionType(read_like_orbax.__code__.replace(co_filename=filename), globals())
    coroutine = read(asyncio.sleep(0))
    coroutine.send(None)
    try:
        coroutine.close()
    except Exception as e:  # noqa: BLE001 - the report is what is under test
        return types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__, object=coroutine)
    raise AssertionError("closing the read did not raise")


def test_only_reports_of_io_that_orbax_abandoned_are_dropped():
    from grpo_jax.state.checkpoint import _DiskFullReports, _DropAbandonedIo

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
    abandoned_read = closed_while_suspended("site-packages/orbax/checkpoint/_src/serialization/serialization.py")
    not_orbax = closed_while_suspended("site-packages/other/reader.py")
    reported = []
    hook = _DropAbandonedIo(reported.append, _DiskFullReports())
    for unraisable in (into_closed_loop, elsewhere, other, abandoned_read, not_orbax):
        hook(unraisable)
    assert reported == [elsewhere, other, not_orbax]


# ---------------------------------------------------------------------------------- every file of a step damaged


def state_of(step: int) -> dict:
    """A small state shaped like the trainer's (device arrays and a host key), different for every step. Its
    weight (16 KiB) is stored in a data file of its own: a smaller one would be inlined in OCDBT's index."""
    return {"params": {"w": jax.numpy.arange(4096, dtype=np.float32).reshape(64, 64) * step},
            "count": jax.numpy.int32(step), "rng": np.full(2, step, np.uint32)}


def buffer_of(step: int) -> dict:
    return {"int32": np.arange(10, dtype=np.int32) * step, "float32": np.full(3, step, np.float32)}


ABSTRACT_STATE = {"params": {"w": jax.ShapeDtypeStruct((64, 64), np.float32)},
                  "count": jax.ShapeDtypeStruct((), np.int32), "rng": jax.ShapeDtypeStruct((2,), np.uint32)}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> pathlib.Path:
    """A run directory with committed steps 1 and 2 (each test copies it)."""
    run_dir = tmp_path_factory.mktemp("two_steps")
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False, keep_last=5))
    for step in (1, 2):
        checkpoints.save(step, state_of(step), buffer_of(step), {"collector": {"step": step}}, {"facts": {}})
    checkpoints.wait()
    checkpoints.close()
    return run_dir


def files_of_step(run_dir: pathlib.Path, step: int) -> list[str]:
    step_dir = run_dir / "checkpoints" / str(step)
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())


def damage(path: pathlib.Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_bytes(b"\0" * path.stat().st_size)


def wrong_in(restored, step: int) -> str | None:
    """What in `restored` is not what step `step` saved, or None."""
    for name, saved, read in [("state", state_of(step), restored.state), ("buffer", buffer_of(step),
                                                                           restored.buffer_arrays)]:
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(saved), jax.tree.leaves(read), strict=True):
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                return f"{name}{jax.tree_util.keystr(path)} is {np.asarray(b).tolist()}"
    if restored.collector != {"collector": {"step": step}}:
        return f"collector is {restored.collector}"
    return None


def resume_problem(run_dir: pathlib.Path) -> str | None:
    """None when load_latest restores step 2 intact, or sets step 2 aside and restores step 1 intact; else what
    went wrong (a refusal to start, wrong values, a step lost)."""
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False, keep_last=5))
    try:
        restored = checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None)
    except Exception as e:  # noqa: BLE001 - what went wrong is the result
        return f"refused to start: {type(e).__name__}: {str(e)[:300]}"
    finally:
        checkpoints.close()
    set_aside = sorted(p.name.split("-")[0] for p in (run_dir / CORRUPT_DIR).glob("*"))
    if restored is None or restored.step not in (1, 2):
        return f"restored {restored and restored.step}"
    if set_aside != ([] if restored.step == 2 else ["2"]):
        return f"restored step {restored.step} with steps {set_aside} set aside"
    return wrong_in(restored, restored.step) and f"step {restored.step}: {wrong_in(restored, restored.step)}"


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # Orbax's abandoned reads stay quiet
@pytest.mark.parametrize("how", ["delete", "truncate", "zero-fill"])
def test_any_file_of_the_newest_step_damaged_restores_it_intact_or_falls_back_to_the_step_before(two_steps, tmp_path,
                                                                                                 how):
    files = files_of_step(two_steps, 2)
    # The damage the review found refused: OCDBT data files and the sharding file (FAILED_PRECONDITION).
    assert "state/_sharding" in files and [f for f in files if f.startswith("state/ocdbt.process_0/d/")], files
    problems = []
    for number, name in enumerate(files):
        run_dir = tmp_path / str(number)
        shutil.copytree(two_steps, run_dir)
        damage(run_dir / "checkpoints" / "2" / name, how)
        problem = resume_problem(run_dir)
        if problem:
            problems.append(f"{how} {name}: {problem}")
    assert not problems, "\n".join(problems)


def test_a_damaged_step_is_set_aside_only_once_a_step_before_it_reads_back(two_steps, tmp_path):
    # Both steps fail the same way: more likely this installation or storage than damage to both; keep them.
    run_dir = tmp_path / "both"
    shutil.copytree(two_steps, run_dir)
    for step in (1, 2):
        damage(run_dir / "checkpoints" / str(step) / "state" / "manifest.ocdbt", "zero-fill")
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False))
    with pytest.raises(CheckpointError) as raised:
        checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None)
    message = str(raised.value)
    assert f"checkpoint step 2 in {run_dir / 'checkpoints'} cannot be read (" in message and "\n" not in message
    assert "nor can step 1 before it (" in message and "nothing was moved" in message, message
    assert checkpoints.steps() == [1, 2] and not (run_dir / CORRUPT_DIR).exists()
    checkpoints.close()

    # The newest step damaged, the one before it unreadable for a reason that is not damage: stop, move nothing.
    run_dir = tmp_path / "then-eio"
    shutil.copytree(two_steps, run_dir)
    damage(run_dir / "checkpoints" / "2" / "state" / "manifest.ocdbt", "zero-fill")
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False))
    restore = checkpoints._manager.restore

    def step_1_unreadable(step, *args, **kwargs):
        if step == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return restore(step, *args, **kwargs)

    checkpoints._manager.restore = step_1_unreadable
    with pytest.raises(CheckpointError, match="step 1 .* could not be restored: OSError: .*Input/output error"):
        checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None)
    assert checkpoints.steps() == [1, 2] and not (run_dir / CORRUPT_DIR).exists()
    checkpoints.close()

    # The only step damaged: nothing to confirm it by; kept, and the message says how to start over.
    run_dir = tmp_path / "only"
    shutil.copytree(two_steps, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "1")
    damage(run_dir / "checkpoints" / "2" / "meta" / "metadata", "zero-fill")
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False))
    with pytest.raises(CheckpointError, match=f"no step before it.*move {run_dir / 'checkpoints' / '2'} into "
                                              f"{run_dir / CORRUPT_DIR}/"):
        checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None)
    assert checkpoints.steps() == [2]
    checkpoints.close()


def fail_reading(checkpoints: Checkpoints, step: int, item: str, error: BaseException) -> None:
    """Orbax's restore of `item` of `step` raises `error` (from inside Orbax, as a storage fault would)."""
    restore = checkpoints._manager.restore

    def restore_failing(restored_step, *args, **kwargs):
        if restored_step == step and item in kwargs["args"].keys():
            raise error
        return restore(restored_step, *args, **kwargs)

    checkpoints._manager.restore = restore_failing


@pytest.mark.parametrize("item", ["meta", "state"])
@pytest.mark.parametrize("error, kind", NOT_DAMAGE, ids=[f"{type(e).__name__}-{k}" for e, k in NOT_DAMAGE])
def test_a_read_error_that_is_not_damage_stops_and_moves_nothing(two_steps, tmp_path, item, error, kind):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False))
    fail_reading(checkpoints, 2, item, error)
    with pytest.raises(CheckpointError) as raised:
        checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None)
    message = str(raised.value)
    assert f"checkpoint step 2 in {run_dir / 'checkpoints'} could not be restored: {type(error).__name__}" in message
    assert f"that is {kind}, not damage to the step, so nothing was moved or changed" in message, message
    assert checkpoints.steps() == [1, 2] and not (run_dir / CORRUPT_DIR).exists()
    checkpoints.close()


@pytest.mark.parametrize("raised_by_own_state, falls_back", [
    (AttributeError("'NoneType' object has no attribute 'addressable_data'"), False),  # a bug of ours
    (TypeError("unsupported operand type(s) for +: 'int' and 'str'"), False),
    (DamagedStep("this process's saved collector/buffer bytes do not match their checksum"), True),
])
def test_an_error_of_our_own_code_while_restoring_is_not_taken_for_damage(two_steps, tmp_path, raised_by_own_state,
                                                                        falls_back):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False))

    def open_own_state(restored):
        if restored.step == 2:
            raise raised_by_own_state

    if falls_back:
        restored = checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None, open_own_state)
        assert restored.step == 1 and wrong_in(restored, 1) is None and checkpoints.steps() == [1]
        assert [p.name.split("-")[0] for p in (run_dir / CORRUPT_DIR).iterdir()] == ["2"]
    else:
        with pytest.raises(CheckpointError, match=f"could not be restored: {type(raised_by_own_state).__name__}: .*"
                                                  "that is an error outside reading the step's files, not damage"):
            checkpoints.load_latest(lambda meta: ABSTRACT_STATE, lambda meta: None, open_own_state)
        assert checkpoints.steps() == [1, 2] and not (run_dir / CORRUPT_DIR).exists()
    checkpoints.close()


READ_EACH_RUN_DIR = """
import sys
import jax, numpy as np
from grpo_jax.state.checkpoint import CheckpointConfig, Checkpoints
from grpo_jax.errors import CheckpointError
target = {"count": jax.ShapeDtypeStruct((), np.int32), "params": {"w": jax.ShapeDtypeStruct((64, 64), np.float32)},
          "rng": jax.ShapeDtypeStruct((2,), np.uint32)}
for run_dir in sys.argv[1:]:
    checkpoints = Checkpoints(run_dir, CheckpointConfig(async_save=False))
    try:
        print("restored step", checkpoints.load_latest(lambda meta: target, lambda meta: None).step, flush=True)
    except CheckpointError as e:
        print("refused:", str(e).replace(chr(10), " "), flush=True)
    checkpoints.close()
"""


def test_a_file_of_the_step_that_cannot_be_read_for_its_permissions_is_not_damage(two_steps):
    """A real permission error (chmod 000), from Python's open() in Orbax and from TensorStore. Root reads any file,
    so as root the read runs as user nobody (setpriv)."""
    as_user = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: no way to read as a user that permissions stop")
        as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        reads_checkout = f"open({str(REPO / 'grpo_jax' / 'state' / 'checkpoint.py')!r}).close()"
        if subprocess.run([*as_user, sys.executable, "-c", reads_checkout], check=False).returncode != 0:
            pytest.skip("user nobody cannot read this checkout or run its Python")
    files = files_of_step(two_steps, 2)
    data = max((f for f in files if f.startswith("state/ocdbt.process_0/d/")),
               key=lambda f: (two_steps / "checkpoints" / "2" / f).stat().st_size)  # the array's chunk
    unreadable = ["meta/metadata", "state/_METADATA", "state/_sharding", "state/manifest.ocdbt", data]
    base = pathlib.Path(tempfile.mkdtemp())  # outside pytest's directories, which user nobody cannot enter
    try:
        run_dirs = []
        for number, name in enumerate(unreadable):
            run_dir = base / str(number)
            shutil.copytree(two_steps, run_dir)
            for path in [run_dir, *run_dir.rglob("*")]:
                path.chmod(0o777 if path.is_dir() else 0o666)
            (run_dir / "checkpoints" / "2" / name).chmod(0)
            run_dirs.append(run_dir)
        base.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        result = subprocess.run([*as_user, sys.executable, "-c", READ_EACH_RUN_DIR, *map(str, run_dirs)],
                                check=False, capture_output=True, text=True, timeout=300, cwd=base,
                                env={**env, "HOME": str(base), "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
        lines = [line for line in result.stdout.splitlines() if line.startswith(("restored", "refused"))]
        assert len(lines) == len(unreadable), result.stdout + result.stderr
        for name, line, run_dir in zip(unreadable, lines, run_dirs, strict=True):
            assert line.startswith("refused:") and "that is a permission error, not damage" in line, (name, line)
            assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == ["1", "2"]
            assert not (run_dir / CORRUPT_DIR).exists(), name
    finally:
        shutil.rmtree(base, ignore_errors=True)
