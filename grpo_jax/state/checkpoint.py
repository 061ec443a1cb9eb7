"""Orbax checkpoints of the whole asynchronous state, and finding the newest good one on resume.

One Orbax CheckpointManager per run directory, steps under RUN_DIR/checkpoints/<step>/, four items each:

    state      arrays: policy parameters, optimizer state, the run's base random key (learner layout)
    buffer     arrays: the replay buffer's contents, one flat array per dtype (replay_buffer.ArrayPool)
    collector  JSON: the collector state (frontier, iterator snapshot, exact accounting above the cut,
               ledger line covered) and the replay buffer's structure, which points into `buffer`
    meta       JSON: format, step, the data fingerprint and the facts a resume must match

With several processes Orbax writes JSON from the primary process only, so `collector` holds
{"per_process": true}, `buffer` is empty, and each process's collector and buffer state is its sealed row
of the array state["processes"] (run.resume.pack_process_state).

Everything is arrays or JSON, so loading a checkpoint never runs code. Orbax writes a step into a
temporary directory and renames it when complete: a save killed half-way never becomes a step (the
leftover is cleaned up when the manager opens). Saves are asynchronous: save() returns once the arrays
are copied on their devices and the JSON is taken; Orbax's host copy, the files and the commit happen
in a background thread.

Content checksums: each JSON item carries the SHA-256 of its own content (CHECKSUM_KEY), and with several
processes each process's own state bytes end with theirs (seal_bytes); both are verified on restore.
Steps written before checksums existed have none and load unchecked.

Faults: on resume, an error Orbax raises while reading a step is damage (a file missing, truncated or
overwritten, reported in many ways), and so is a checksum that does not match (`damage_in`), unless it is
a kind that says nothing about the step's files (`not_damage`: out of memory, permission, storage that is
unavailable, full or failing, a deadline, the device runtime). A damaged step is set aside once an older
step reads back; any other failure, and an error of our own code, stops the start and touches nothing.
A save that fails (a full disk) raises one CheckpointError naming the step, the directory, the error and,
for a full disk, the space a checkpoint needs; Orbax's own reports of a full disk from its writer threads
are silenced.

`Checkpoints.poll()` reports saves that have committed since the last call, so the trainer writes the
ledger's `checkpoint` line only for a step that really is on disk.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax.config_io import config_key
from grpo_jax.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "grpo_jax.state.checkpoint/1"
ITEMS = ("state", "buffer", "collector", "meta")
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints.corrupt"
CHECKSUM_KEY = "content_sha256"  # in each JSON item: the SHA-256 of the rest of it (canonical JSON)
DIGEST_BYTES = 32  # a SHA-256 digest, at the end of sealed bytes
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = config_key(50, "Save after every N learner steps (0: not by steps).")
    every_seconds: float = config_key(0.0, "Save when this long has passed since the last save (0: not by time).")
    keep_last: int = config_key(3, "Keep the newest N steps (plus those keep_every keeps).")
    keep_every: int = config_key(0, "Besides the keep_last newest, keep every step that is a multiple of K (0: "
                                    "none).")
    async_save: bool = config_key(True, "Write in the background; the learner only waits for the host copy.")
    save_at_end: bool = config_key(True, "A final checkpoint when the run reaches max_steps or runs out of data.")
    load_replay_buffer: bool = config_key(True, "false: resume with an empty buffer and generate its prompts again.")
    snapshot_ring: int = config_key(512, "Iterator snapshots kept by the collector (handouts a restore can go "
                                         "back).")
    # The old run's prompt accounting does not describe the new data.
    allow_data_change: bool = config_key(False, "Resume weights and optimizer from a checkpoint of another dataset, "
                                                "tokenizer or prompt format. The data stream then starts afresh at "
                                                "ordinal 0 and the ledger starts a new chain.")

    def validate(self) -> list[str]:
        problems = []
        for key in ("every_steps", "keep_every"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)}: must be >= 0 (0 = off)")
        if self.every_seconds < 0:
            problems.append(f"every_seconds={self.every_seconds}: must be >= 0 (0 = off)")
        if self.keep_last < 1:
            problems.append(f"keep_last={self.keep_last}: must be >= 1")
        if self.snapshot_ring < 1:
            problems.append(f"snapshot_ring={self.snapshot_ring}: must be >= 1")
        return problems


@dataclasses.dataclass
class Restored:
    step: int
    state: Any  # the pytree given to save(), with arrays placed like the abstract target
    buffer_arrays: dict[str, np.ndarray]
    collector: dict  # {"collector": collector state, "buffer": buffer state (pooled)}
    meta: dict


def tree_layout(tree: Any) -> dict[str, list]:
    """{path: [shape, dtype]} of every array leaf: saved in meta, so a resume can name the tensor whose
    shape changed instead of failing inside Orbax (or mistaking a config change for a corrupt step)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[jax.tree_util.keystr(path)] = [list(np.shape(leaf)), str(leaf.dtype)]
    return out


def layout_difference(saved: dict, current: dict) -> str | None:
    """One line naming the first tensor that differs between two tree_layout()s, or None if they match.
    Parameters are looked at first: a model change then names a weight, not its optimizer moment."""
    for path in sorted(set(saved) | set(current), key=lambda p: (not p.startswith("['params']"), p)):
        if path not in current:
            return f"tensor {path} is in the checkpoint but not in this model/optimizer"
        if path not in saved:
            return f"tensor {path} of this model/optimizer is not in the checkpoint"
        if list(saved[path][0]) != list(current[path][0]) or saved[path][1] != current[path][1]:
            return (f"tensor {path} is {saved[path][1]}{saved[path][0]} in the checkpoint and "
                    f"{current[path][1]}{current[path][0]} now")
    return None


class DamagedStep(Exception):
    """Raised while reading a step whose content is not what was written: an Orbax read that failed for a
    reason other than not_damage() (its cause), a checksum that does not match, a meta item that is not a
    record of that step, state bytes that do not unpack. load_latest sets such a step aside."""


# -- content checksums ------------------------------------------------------------------------------


def _canonical(item: Any) -> bytes:
    return json.dumps(item, sort_keys=True, separators=(",", ":")).encode("utf-8")


def with_checksum(item: dict) -> dict:
    """`item` as it will read back (string keys, lists) plus CHECKSUM_KEY, the SHA-256 of that content."""
    plain = json.loads(json.dumps(item))
    return {**plain, CHECKSUM_KEY: hashlib.sha256(_canonical(plain)).hexdigest()}


def verified(item: Any, what: str) -> dict:
    """A JSON item as read back, without its checksum; DamagedStep when it is not an object or does not
    match its checksum. An item written before checksums existed has none and is taken as it is."""
    if not isinstance(item, dict):
        raise DamagedStep(f"{what} is not a JSON object")
    if CHECKSUM_KEY not in item:
        return item
    item = dict(item)
    expected = item.pop(CHECKSUM_KEY)
    if hashlib.sha256(_canonical(item)).hexdigest() != expected:
        raise DamagedStep(f"{what} does not match its checksum")
    return item


def seal_bytes(data: np.ndarray) -> np.ndarray:
    """uint8 `data` followed by its SHA-256 digest."""
    digest = hashlib.sha256(np.ascontiguousarray(data).tobytes()).digest()
    return np.concatenate([data.astype(np.uint8), np.frombuffer(digest, np.uint8)])


def unseal_bytes(data: np.ndarray, what: str) -> np.ndarray:
    """The bytes seal_bytes() was given; DamagedStep when they do not match the digest after them."""
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if len(data) < DIGEST_BYTES or hashlib.sha256(np.ascontiguousarray(body).tobytes()).digest() != digest.tobytes():
        raise DamagedStep(f"{what} do not match their checksum")
    return body


# -- what an error says about a step ------------------------------------------------------------------

# Orbax and TensorStore report a missing, truncated or overwritten file of a step in many ways (NOT_FOUND,
# DATA_LOSS, OUT_OF_RANGE, FAILED_PRECONDITION, INVALID_ARGUMENT, a bare Exception, a KeyError, a JSON error...),
# so an error they raise while reading a step is damage unless it is one of these kinds, which say something
# about this machine, its storage or its devices and nothing about the step's files.
_NOT_DAMAGE_STATUS = {  # TensorStore's and XLA's status, at the start of their messages
    "RESOURCE_EXHAUSTED": "out of a resource", "PERMISSION_DENIED": "a permission error",
    "UNAUTHENTICATED": "a permission error", "UNAVAILABLE": "storage that is unavailable",
    "DEADLINE_EXCEEDED": "a deadline exceeded", "CANCELLED": "a cancelled read", "ABORTED": "an aborted read",
}
_STATUS = re.compile(r"^([A-Z_]+): ")
_NOT_DAMAGE_ERRNO = {
    errno.EACCES: "a permission error", errno.EPERM: "a permission error", errno.ENOSPC: "a full disk",
    errno.EDQUOT: "a full disk quota", errno.EIO: "an I/O error of the storage", errno.ESTALE: "a stale file handle",
    errno.ENOMEM: "out of memory", errno.EMFILE: "too many open files", errno.ENFILE: "too many open files",
    errno.EAGAIN: "a resource temporarily unavailable", errno.EINTR: "an interrupted read",
    errno.ETIMEDOUT: "storage that timed out", errno.ENOTCONN: "storage that is not connected",
    errno.ECONNRESET: "storage that reset the connection", errno.EHOSTDOWN: "storage that is unavailable",
    errno.ENOBUFS: "out of a resource",
}
_OUT_OF_MEMORY = re.compile(r"out of memory", re.IGNORECASE)
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")  # TensorStore's note of the OS error beneath its status


def _causes(error: BaseException | None):
    """`error` and the errors it was raised from, outermost first. Explicit causes only: an error raised
    while another was being handled (__context__) is not explained by it."""
    while error is not None:
        yield error
        error = error.__cause__


def _linked(error: BaseException):
    """`error` and every error linked to it: raised from it, raised while handling it, grouped in it."""
    seen, pending = set(), [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        pending += [e.__cause__, e.__context__]
        if isinstance(e, BaseExceptionGroup):
            pending += e.exceptions


def _one_line(error: BaseException, limit: int = 400) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _error_number(error: BaseException) -> int | None:
    """The errno of this one error (an OSError, or TensorStore's os_error_code in its message), or None."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    found = _OS_ERROR_CODE.search(str(error))
    return int(found.group(1)) if found else None


def not_damage(error: BaseException) -> str | None:
    """What `error`, raised while reading a step, is when it says nothing about the step's files: out of memory
    or another resource, a permission error, storage that is unavailable, slow, full or failing (EIO, ESTALE),
    a deadline, a cancelled read, an error of the device runtime; None otherwise. Every error linked to it
    counts (causes, errors being handled, grouped errors): a good step set aside for a passing fault would
    lose the newest checkpoint, while damage only waits for the fault to be gone."""
    for e in _linked(error):
        if isinstance(e, MemoryError) or _OUT_OF_MEMORY.search(str(e)):
            return "out of memory"
        if isinstance(e, jax.errors.JaxRuntimeError):
            return "an error of the device runtime"
        kind = _NOT_DAMAGE_ERRNO.get(_error_number(e))
        status = _STATUS.match(str(e))
        kind = kind or (status and _NOT_DAMAGE_STATUS.get(status.group(1)))
        if kind:
            return kind
    return None


def damage_in(error: BaseException) -> str | None:
    """Why `error`, raised while reading a step, shows that the step itself is damaged (a DamagedStep among its
    causes: an Orbax read that failed for a reason other than not_damage(), a checksum that does not match,
    metadata that is not a record of that step); None when it does not (a not_damage() kind, or an error of
    our own code, such as a bug): that step must stay."""
    for e in _causes(error):
        if isinstance(e, DamagedStep):
            return str(e)
    return None


def os_error_number(error: BaseException | None) -> int | None:
    """The errno beneath `error` (an OSError, or TensorStore's os_error_code), or None."""
    for e in _causes(error):
        number = _error_number(e)
        if number:
            return number
    return None


class _DiskFullReports(logging.Filter):
    """Orbax reports one full disk many times over: a traceback from each of its writer threads, then one
    for every write still pending when its event loop closed. The trainer ends with one line that says
    it all, so these reports, and only these, are dropped (`seen` then notes that the disk filled)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        in_message = _OS_ERROR_CODE.search(message)
        number = os_error_number(record.exc_info[1] if record.exc_info else None) or (
            int(in_message.group(1)) if in_message else None)
        no_space = "orbax" in record.pathname and (number in NO_SPACE or os.strerror(errno.ENOSPC) in message)
        self.seen = self.seen or no_space
        return not no_space


_DISK_FULL_REPORTS = _DiskFullReports()


def _into_a_closed_loop(unraisable) -> bool:
    """Whether this is the completion of an I/O that Orbax abandoned: when one read or write of a step fails,
    Orbax closes its event loop while tensorstore still has the others in flight, and each one that finishes
    later hands its result to the closed loop from tensorstore's thread (RuntimeError raised in
    call_soon_threadsafe). Nobody awaits that result any more: the failure that abandoned it was already
    raised, and the trainer reports it."""
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


class _DropAbandonedIo:
    """sys.unraisablehook: drops the reports of I/O that Orbax abandoned after a failed read or write, each
    a traceback printed from another thread (sometimes only at garbage collection, sometimes after the
    failure itself was reported, so no flag set on failure could tell them apart in time):
    - completions handed to a closed event loop (see _into_a_closed_loop), after any failure;
    - once the disk has filled, the coroutines of Orbax's writes collected unfinished;
    - Orbax's reads left unfinished after another read failed, closed when collected (Orbax wraps the
      GeneratorExit that closes them in an Exception of its own).
    Everything else goes to the hook that was there before. (It keeps what it needs on itself: some arrive
    while the interpreter shuts down.)"""

    def __init__(self, previous, reports: _DiskFullReports):
        self.previous, self.reports = previous, reports

    def __call__(self, unraisable) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        of_orbax = "orbax" in str(getattr(code, "co_filename", ""))
        abandoned_write = self.reports.seen and of_orbax
        abandoned_read = of_orbax and any(isinstance(e, GeneratorExit) for e in _causes(unraisable.exc_value))
        if not (_into_a_closed_loop(unraisable) or abandoned_write or abandoned_read):
            self.previous(unraisable)


def _silence_abandoned_io_reports() -> None:
    logging.getLogger("absl").addFilter(_DISK_FULL_REPORTS)  # Orbax logs through absl; adding twice is a no-op
    if not isinstance(sys.unraisablehook, _DropAbandonedIo):
        sys.unraisablehook = _DropAbandonedIo(sys.unraisablehook, _DISK_FULL_REPORTS)


def _bytes_on_disk(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _array_bytes(tree: Any) -> int:
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _this_process_only(values) -> np.ndarray:
    return np.asarray(values, np.int32)[None]


# How each process judged reading a step, as gathered across processes.
READ, DAMAGED, FAILED = 0, 1, 2


# One dispatch for the whole tree (a copy per leaf would cost a dispatch each); outputs never alias
# non-donated inputs, so these are new buffers the learner's next step cannot donate away.
_device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class Checkpoints:
    """The run directory's checkpoints: when to save, async saves, commit tracking, resume with fallback."""

    def __init__(self, run_dir: str | pathlib.Path, config: CheckpointConfig):
        self.config = config
        self.run_dir = pathlib.Path(run_dir)
        self.directory = self.run_dir / CHECKPOINT_DIR
        self._refuse_unwritable()
        _silence_abandoned_io_reports()
        self._manager = self._open()
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None  # the background save in flight, if any
        self._committed: list[int] = []  # committed, not yet reported by poll()
        self._uncommitted: list[int] = []  # several processes: saved by Orbax's own async, not yet committed
        self._error: tuple[int, BaseException] | None = None  # a background save's (step, failure), not yet raised
        self._failure_reported = False  # Orbax raises a failed save again from close(): it has been said
        self._last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.last_save_array_bytes = 0  # the latest save's arrays: the space estimate while no step is on disk
        self.blocked_seconds: list[float] = []  # per save: how long save() held the caller

    def _refuse_unwritable(self) -> None:
        """Refuse at start, in one line, a checkpoint directory no file can be written to (a read-only mount,
        a file in its place), instead of failing at the first save."""
        probe = self.directory / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.directory} is not a writable directory "
                                  f"({e.strerror or e}): fix its permissions or mount, or choose another "
                                  "--run-dir") from None

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.keep_last,
            keep_period=self.config.keep_every or None,
            enable_async_checkpointing=self.config.async_save,
            cleanup_tmp_directories=True,  # leftovers of saves killed half-way
            create=True,
        )
        return ocp.CheckpointManager(self.directory.absolute(), options=options, item_names=ITEMS)

    # -- saving -------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the periodic rule asks for a save after `step`."""
        by_steps = self.config.every_steps and step % self.config.every_steps == 0
        by_time = self.config.every_seconds and time.monotonic() - self._last_save_time >= self.config.every_seconds
        return bool(by_steps or by_time) and step != self.last_saved_step

    def save(self, step: int, state: Any, buffer_arrays: dict, collector: dict, meta: dict) -> None:
        """Save step `step`; poll() tells when it has committed.

        async_save: the caller is held only while the arrays are copied on their devices (the learner
        donates its buffers to the next step, so the save needs its own copy) and, if the previous save
        is still being written, until it is done. The Orbax save (host copy, files, commit) runs in a
        background thread. Otherwise the save is written before this returns.

        Several processes: the Orbax save is started from the caller's thread (Orbax's own async mode
        still writes in the background). Its collectives must be issued in the same order on every
        process, which a second thread racing the learner's collectives would not guarantee.
        """
        start = time.perf_counter()
        self._raise_background_error()
        meta = {**meta, "format": FORMAT, "step": int(step), "saved_at": datetime.datetime.now().isoformat(),
                "layout": tree_layout(state)}
        collector, meta = with_checksum(collector), with_checksum(meta)
        self.last_save_array_bytes = _array_bytes(state) + _array_bytes(buffer_arrays)
        if self.config.async_save and jax.process_count() > 1:
            try:
                self._manager.save(step, args=self._args(state, buffer_arrays, collector, meta), force=True)
            except Exception as e:  # noqa: BLE001 - Orbax raises the previous save's failure here too
                raise self._save_failed(self._uncommitted[0] if self._uncommitted else step, e) from e
            self._uncommitted.append(step)
        elif self.config.async_save:
            state = _device_copy(state)
            if self._writer is not None:
                self._writer.join()  # one save in flight at a time, as Orbax itself does
            self._raise_background_error()
            self._writer = threading.Thread(target=self._write, args=(step, state, buffer_arrays, collector, meta),
                                            name="grpo-checkpoint", daemon=True)
            self._writer.start()
        else:
            self._write(step, state, buffer_arrays, collector, meta)
            self._raise_background_error()
        self.blocked_seconds.append(time.perf_counter() - start)
        self._last_save_time = time.monotonic()
        self.last_saved_step = step

    @staticmethod
    def _args(state: Any, buffer_arrays: dict, collector: dict, meta: dict) -> ocp.args.Composite:
        # Saved with force=True: the trainer decides when (due()), not Orbax's own interval rule.
        return ocp.args.Composite(state=ocp.args.StandardSave(state), buffer=ocp.args.StandardSave(buffer_arrays),
                                  collector=ocp.args.JsonSave(collector), meta=ocp.args.JsonSave(meta))

    def _write(self, step: int, state: Any, buffer_arrays: dict, collector: dict, meta: dict) -> None:
        try:
            self._manager.save(step, args=self._args(state, buffer_arrays, collector, meta), force=True)
            self._manager.wait_until_finished()
            if step not in self._manager.all_steps():
                raise CheckpointError(f"checkpoint step {step} was written but is not listed in {self.directory}")
            with self._lock:
                self._committed.append(step)
        except BaseException as e:  # noqa: BLE001 - reported to the learner by poll()/save()/wait()
            with self._lock:
                self._error = (step, e)

    def _raise_background_error(self) -> None:
        with self._lock:
            failure, self._error = self._error, None
        if failure is not None:
            raise self._save_failed(*failure) from failure[1]

    def _save_failed(self, step: int, error: BaseException) -> CheckpointError:
        """The one-line error for a save that failed, once what is left on disk has been looked at: the
        space a checkpoint needs when the disk is full, and whether the last committed step is in place."""
        self._failure_reported = True
        self._uncommitted = []  # the failed save and any after it will never commit
        number = os_error_number(error)
        disk_full = number in NO_SPACE
        if disk_full and jax.process_count() == 1:
            # Its space is what the ledger and the metrics still need; what a write still pending re-creates is
            # removed at the next start, with other leftovers.
            for leftover in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(leftover, ignore_errors=True)
        self._manager.reload()
        previous = [s for s in self.steps() if s < step]
        last = previous[-1] if previous else None
        message = f"checkpoint step {step} could not be written to {self.directory}: "
        if disk_full:
            message += f"{os.strerror(number)} ({errno.errorcode[number]}); {self._space_needed(last)}"
        else:
            message += f"{type(error).__name__}: {_one_line(error)}"
        if last is None:
            return CheckpointError(f"{message}; no checkpoint was committed before it, so the same command run again "
                                   "starts from step 0 and the ledger starts a new chain")
        try:
            self._read_json(last)
            for item in ("state", "buffer"):
                if not (self.directory / str(last) / item).is_dir():
                    raise DamagedStep(f"item {item} of step {last} is missing")
        except Exception as e:  # noqa: BLE001 - said in the message
            return CheckpointError(f"{message}; the last committed checkpoint, step {last}, does not read back either "
                                   f"({damage_in(e) or _one_line(e)})")
        fix = "free space" if disk_full else "fix the cause"
        return CheckpointError(f"{message}; the last committed checkpoint, step {last}, is in place (its items are "
                               "there and its metadata matches its checksums) and the ledger lines it covers were "
                               f"synced to disk before it was saved: {fix} and run the same command to resume from "
                               f"step {last}")

    def _space_needed(self, step_on_disk: int | None) -> str:
        if step_on_disk is not None:
            size, measured = _bytes_on_disk(self.directory / str(step_on_disk)), f"step {step_on_disk} on disk"
        else:
            size, measured = self.last_save_array_bytes, "its arrays"
        kept = self.config.keep_last + 1
        every = " plus every multiple of checkpoint.keep_every kept" if self.config.keep_every else ""
        return (f"a checkpoint of this run takes about {_size(size)} ({measured}) and {self.directory} needs room for "
                f"{kept} of them{every} (checkpoint.keep_last={self.config.keep_last} and the one being written): "
                f"about {_size(kept * size)}")

    def poll(self) -> list[int]:
        """Steps whose save has committed since the last call (oldest first). Never blocks; a failed
        background save raises here."""
        self._raise_background_error()
        if self._uncommitted and not self._manager.is_saving_in_progress():
            try:
                self._manager.check_for_errors()
            except Exception as e:  # noqa: BLE001
                raise self._save_failed(self._uncommitted[0], e) from e
            on_disk = set(self._manager.all_steps())
            with self._lock:
                self._committed += [s for s in self._uncommitted if s in on_disk]
            self._uncommitted = [s for s in self._uncommitted if s not in on_disk]
        with self._lock:
            done, self._committed = self._committed, []
        return done

    def wait(self) -> list[int]:
        """Block until every save started has committed; returns those steps (see poll())."""
        if self._writer is not None:
            self._writer.join()
        if self._uncommitted:
            try:
                self._manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                raise self._save_failed(self._uncommitted[0], e) from e
        return self.poll()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.join()
        try:
            self._manager.close()
        except Exception as e:  # noqa: BLE001
            if not self._failure_reported:  # else: Orbax raising the failed save again, already said
                raise self._save_failed(self.last_saved_step or 0, e) from e

    # -- resuming -----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def load_latest(self, abstract_state: Callable[[dict], Any], check: Callable[[dict], None],
                    open_own_state: Callable[[Restored], None] | None = None,
                    agree: Callable[[list[int]], np.ndarray] = _this_process_only) -> Restored | None:
        """The newest step that reads back completely, or None when there is no step.

        abstract_state(meta) gives the restore target (shapes, dtypes, shardings) for that step's arrays.
        check(meta) raises CheckpointError when the run cannot resume from it (another dataset, another
        model...): that is the user's decision, so it propagates. open_own_state(restored), with several
        processes, takes this process's own collector and buffer out of the restored arrays (DamagedStep
        when they do not match their checksum). agree(values) gathers a row of ints from every process
        (HostAgreement.gather): process 0 chooses the step to try, since it is the one that moves steps
        aside, and every process acts on what all of them found.

        A step that is damaged on any process (see damage_in) is skipped and the one before it is tried;
        once a step reads back, the damaged ones after it are moved to RUN_DIR/checkpoints.corrupt/ with a
        warning (nothing is deleted). If no step before them reads back, nothing is moved and CheckpointError
        says why: an error every step shows is more likely this installation, config or storage than damage
        to each one. Any other failure while reading a step (a not_damage() kind, an error of our own code)
        raises CheckpointError and moves nothing.
        """
        damaged: list[tuple[int, str]] = []  # (step, why), newest first: set aside once an older step reads
        while True:
            listed = [s for s in self.steps() if not damaged or s < damaged[-1][0]]
            step = int(agree([listed[-1] if listed else -1])[0, 0])
            if step < 0:
                if damaged:
                    raise self._nothing_reads_back(damaged)
                return None
            error = None
            if step not in listed:
                error = CheckpointError(f"this process does not see checkpoint step {step}, which process 0 chose: "
                                        f"every process must see the same {self.directory} (one shared filesystem)")
            else:
                try:
                    meta, collector = self._read_json(step)
                except Exception as e:  # noqa: BLE001 - judged by _agreed_damage
                    error = e
            damage = self._agreed_damage(step, error, agree)
            if damage:
                damaged.append((step, damage))
                continue
            check(meta)
            target = abstract_state(meta)
            difference = layout_difference(meta.get("layout", {}), tree_layout(target))
            if difference:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} does not fit this model or "
                                      f"optimizer: {difference}. Resume with the config the run was started with, "
                                      "or start a new run directory.")
            try:
                arrays = self._restore_items(step, state=ocp.args.StandardRestore(target),
                                             buffer=ocp.args.StandardRestore())
                restored = Restored(step, arrays["state"], {k: np.asarray(v) for k, v in arrays["buffer"].items()},
                                    collector, meta)
                if open_own_state is not None:
                    open_own_state(restored)
            except Exception as e:  # noqa: BLE001 - judged by _agreed_damage
                error = e
            damage = self._agreed_damage(step, error, agree)
            if damage:
                damaged.append((step, damage))
                continue
            for newer, why in damaged:
                self._set_aside(newer, why, step)
            return restored

    def _restore_items(self, step: int, **items) -> dict:
        """Orbax's restore of some items of `step`. Its errors are reading the step's files, so they are damage
        (DamagedStep, with Orbax's error as its cause) unless they are a not_damage() kind, raised as they are.
        Errors of our own code happen outside this call and are never taken for damage."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - sorted here, raised again
            if not_damage(e):
                raise
            innermost = list(_causes(e))[-1]  # Orbax wraps TensorStore's error, which names the file
            raise DamagedStep(f"{type(innermost).__name__}: {_one_line(innermost)}") from e

    def _read_json(self, step: int) -> tuple[dict, dict]:
        """(meta, collector) of `step`, checked against their checksums."""
        items = self._restore_items(step, collector=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        meta = verified(items["meta"], f"item meta of step {step}")
        collector = verified(items["collector"], f"item collector of step {step}")
        if meta.get("format") != FORMAT or meta.get("step") != step:
            raise DamagedStep(f"meta is not a {FORMAT} record of step {step}")
        return meta, collector

    def _agreed_damage(self, step: int, error: BaseException | None, agree: Callable) -> str | None:
        """Why `step` is damaged on some process, or None when every process read it so far (`error`: this
        process's failure, if any). A failure of any other kind, on any process, raises and moves nothing."""
        damage = damage_in(error) if error is not None else None
        verdict = READ if error is None else DAMAGED if damage else FAILED
        verdicts = agree([verdict])[:, 0]
        where = f"checkpoint step {step} in {self.directory}"
        keep = "so nothing was moved or changed: fix the cause and run the same command again"
        if verdict == FAILED:
            kind = not_damage(error) or "an error outside reading the step's files"
            raise CheckpointError(f"{where} could not be restored: {type(error).__name__}: {_one_line(error)}; that "
                                  f"is {kind}, not damage to the step, {keep}") from error
        if (verdicts == FAILED).any():
            raise CheckpointError(f"{where} could not be restored by process {int(np.argmax(verdicts == FAILED))} "
                                  f"(its own message says why); that is not damage to the step, {keep}")
        if (verdicts == DAMAGED).any():
            return damage or f"process {int(np.argmax(verdicts == DAMAGED))} found it damaged"
        return None

    def _nothing_reads_back(self, damaged: list[tuple[int, str]]) -> CheckpointError:
        """The refusal when every step failed as damaged: nothing confirms that it is the steps, not this run."""
        (newest, why), older = damaged[0], damaged[1:]
        if not older:
            found = "and there is no step before it to fall back to"
        elif len(older) == 1:
            found = f"nor can step {older[0][0]} before it ({older[0][1]})"
        else:
            found = f"nor can any of the {len(older)} steps before it (" + "; ".join(
                f"step {step}: {reason}" for step, reason in older) + ")"
        paths = " and ".join(str(self.directory / str(step)) for step, _ in damaged)
        return CheckpointError(
            f"checkpoint step {newest} in {self.directory} cannot be read ({why}) {found}, so nothing was moved: with "
            "no step that reads back, the cause may be this installation, config or storage rather than damage. Fix "
            f"the cause and run the same command again; if the step{'s are' if older else ' is'} really damaged, move "
            f"{paths} into {self.run_dir / CORRUPT_DIR}/ and run it again to start from scratch (the ledger then "
            "starts a new chain)")

    def _set_aside(self, step: int, reason: str, used: int) -> None:
        target = self.run_dir / CORRUPT_DIR / f"{step}-{int(time.time())}"
        if jax.process_index() == 0:  # one mover; every process then sees the same steps
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
        if jax.process_count() > 1:
            from orbax.checkpoint import multihost
            multihost.sync_global_processes(f"grpo_jax_set_aside_{step}")
        self._manager.reload()
        logger.warning("checkpoint step %d cannot be read (%s); moved it to %s and resuming from step %d, the newest "
                       "step that reads back", step, reason, target, used)
