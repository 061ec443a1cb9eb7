"""One `grpo-jax train` per run directory: the lock file RUN_DIR/train.process{P}.lock.

Each JAX process P locks its own file, so the processes of one multi-host run never refuse each other,
while a second run on the same directory is refused by the process with the same index (its process 0
at least). The file is created with O_EXCL and holds JSON naming the holder: host, pid, the kernel's
boot id and the process's start time (to tell a live holder from a reused pid), and a random token.

A lock whose holder is gone is taken over with a warning:
  - same host: the holder's pid is not running, is another process that reused the pid, or the machine
    rebooted since (boot id);
  - another host: its process cannot be checked from here, so the holder refreshes the file's mtime
    every HEARTBEAT_S seconds and a lock untouched for STALE_AFTER_S is taken to be dead.

No flock: it is a no-op or unsupported on some shared filesystems (gcsfuse), and the file must work the
same everywhere. What this does not guarantee on a shared filesystem: O_EXCL creation must be atomic
(NFSv3+ is; gcsfuse is not strictly); the heartbeat rule trusts clocks to agree within a minute or so
and treats a holder frozen for STALE_AFTER_S (SIGSTOP, a hung mount) as dead.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import threading
import time
import uuid

from grpo_jax.errors import RunDirError

logger = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0

# Tokens of the locks this process holds: a lock naming our own pid is ours only if its token is here
# (otherwise an earlier process had the same pid, as happens in restarted containers).
_HELD_HERE: set[str] = set()


def lock_file(run_dir: str | os.PathLike, process_index: int = 0) -> pathlib.Path:
    return pathlib.Path(run_dir) / f"train.process{process_index}.lock"


def _boot_id() -> str | None:
    try:
        return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None where /proc has no answer."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _gone_because(holder: dict, age_s: float) -> str | None:
    """Why the lock's holder is certainly gone, or None if it may still be running."""
    if holder.get("host") != socket.gethostname():
        if age_s > STALE_AFTER_S:
            return f"its host has not refreshed it for {age_s:.0f}s (more than {STALE_AFTER_S:.0f}s)"
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return "it names no pid"
    if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
        return "the machine has rebooted since"
    if pid == os.getpid():
        return None if holder.get("token") in _HELD_HERE else "an earlier process had this pid"
    if not _pid_running(pid):
        return f"pid {pid} is not running"
    if holder.get("start_ticks") is not None and _start_ticks(pid) not in (None, holder["start_ticks"]):
        return f"pid {pid} is now another process"
    return None


class RunDirLock:
    """Holds RUN_DIR/train.process{P}.lock from acquire() to release(); see the module docstring."""

    def __init__(self, run_dir: str | os.PathLike, process_index: int = 0):
        self.run_dir = pathlib.Path(run_dir)
        self.path = lock_file(run_dir, process_index)
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "process_index": int(process_index),
                       "boot_id": _boot_id(), "start_ticks": _start_ticks(os.getpid()),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Create the run directory and take its lock; RunDirError (one line) if another run holds it or
        the directory cannot be written."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"run directory {self.run_dir}: cannot create it ({e.strerror or e}); choose another "
                              "--run-dir") from None
        for _ in range(3):  # a stale lock removed below may be re-created by a racing start: look again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._remove_if_stale()
                continue
            except OSError as e:
                raise RunDirError(f"run directory {self.run_dir} is not writable ({e.strerror or e}): fix its "
                                  "permissions or choose another --run-dir") from None
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps(self.holder) + "\n")
            except OSError as e:
                self.path.unlink(missing_ok=True)
                raise RunDirError(f"run directory {self.run_dir}: cannot write {self.path.name} "
                                  f"({e.strerror or e})") from None
            _HELD_HERE.add(self.holder["token"])
            self._heartbeat = threading.Thread(target=self._refresh, name="grpo-run-lock", daemon=True)
            self._heartbeat.start()
            return
        raise RunDirError(f"run directory {self.run_dir}: another start keeps taking {self.path.name}; is a second "
                          "`grpo-jax train` starting on it?")

    def _read(self) -> tuple[dict | None, float]:
        """(the holder, or None when the file is empty or not JSON; seconds since it was last refreshed).
        FileNotFoundError when there is no lock."""
        age_s = time.time() - self.path.stat().st_mtime
        try:
            holder = json.loads(self.path.read_text(encoding="utf-8"))
        except ValueError:
            return None, age_s
        return (holder if isinstance(holder, dict) else None), age_s

    def _remove_if_stale(self) -> None:
        try:
            holder, age_s = self._read()
        except FileNotFoundError:
            return  # released meanwhile: try again
        if holder is None:
            # Being written this instant by another start, or left empty by a crash right after creating it.
            if age_s <= HEARTBEAT_S:
                raise RunDirError(f"run directory {self.run_dir} is being locked by another start right now "
                                  f"({self.path.name} is not complete yet); try again in a minute")
            reason = f"it is unreadable and {age_s:.0f}s old"
        else:
            reason = _gone_because(holder, age_s)
            if reason is None:
                raise RunDirError(
                    f"run directory {self.run_dir} is in use by pid {holder.get('pid')} on host "
                    f"{holder.get('host')} (since {holder.get('started')}; lock {self.path}): wait for that run to "
                    "end, or use another --run-dir")
        try:
            current, _ = self._read()
        except FileNotFoundError:
            return
        if current != holder:
            return  # changed hands since it was read: judge the new holder
        logger.warning("taking over the lock %s of pid %s on host %s: %s", self.path,
                       (holder or {}).get("pid"), (holder or {}).get("host"), reason)
        self.path.unlink(missing_ok=True)

    def _refresh(self) -> None:
        """The heartbeat other hosts read (see the module docstring)."""
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError as e:
                logger.warning("cannot refresh the run lock %s (%s)", self.path, e.strerror or e)

    def release(self) -> None:
        """Remove the lock if it is still ours (idempotent)."""
        if self._heartbeat is None:
            return
        self._stop.set()
        self._heartbeat.join()
        self._heartbeat = None
        _HELD_HERE.discard(self.holder["token"])
        try:
            holder, _ = self._read()
        except FileNotFoundError:
            return
        if holder and holder.get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)
