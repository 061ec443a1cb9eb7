"""One `grpo-jax train` per run directory: the lock file RUN_DIR/train.process{P}.lock.

Each JAX process P locks its own file, so the processes of one multi-host run never refuse each other,
while a second run on the same directory is refused by the process with the same index (its process 0
at least). Two mechanisms, because neither works everywhere:

  - flock: from start to exit the holder keeps an exclusive flock on RUN_DIR/train.process{P}.flock, an
    empty file that is never renamed or removed (so the flock always guards the same file). The kernel drops
    it when the holder dies, however it dies, and it excludes a second holder on the same machine in any
    PID namespace or container; NFS passes it to the server, excluding a holder on another client too. A
    start that cannot get it is refused. Where flock fails (ENOLCK, EOPNOTSUPP: some shared filesystems),
    the lock file alone decides.
  - the lock file, created with O_EXCL, holds JSON naming the holder: host, pid, the kernel's boot id, the
    PID namespace, the process's start time, whether it holds the flock, and a random token. The holder
    refreshes its mtime every HEARTBEAT_S seconds (the heartbeat).

A start that finds the lock file judges the holder it names, and takes a dead holder's lock over with a
warning:
  - the same kernel (boot id) and PID namespace: its pid is checked (not running, or reused: start time);
  - the same kernel, another PID namespace (another container): its pid cannot be checked from here; it has
    exited if it held the flock and this start now holds it;
  - otherwise (another host, or the same host name with another boot id: a reboot, or another machine of
    that name sharing the directory), and where the rules above cannot tell: the heartbeat; a lock untouched
    for STALE_AFTER_S is taken to be dead.
A takeover cannot remove another start's fresh lock: it renames the lock to a name of its own, reads what
it renamed and goes on only if that is the lock it judged (same file, same content); otherwise it puts it
back and judges again.

The holder checks its lock at every heartbeat: when the file no longer holds its token (taken over, or
deleted) `lost` is set and check() raises RunDirError naming who has it. The trainer also looks at once, at
every learner step (is_lost(): is the lock file at its path the one this holder created, same st_dev and
st_ino, and is the flock file the one it holds the flock on?), and stops with check(): a lock or flock file
deleted under a live run (by hand, or by a program the run started) would let a second start in. watch()
adds other paths the run keeps there (the trainer's checkpoints/): moved() names those deleted or replaced
since, for the trainer to save and stop.

What this does not guarantee on a shared filesystem without flock: O_EXCL creation must be atomic (NFSv3+
is; gcsfuse is not strictly); the heartbeat rule trusts clocks to agree within a minute or so and treats a
holder frozen for STALE_AFTER_S (SIGSTOP, a hung mount) as dead, which then stops at its next heartbeat.
"""

from __future__ import annotations

import fcntl
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


def flock_file(run_dir: str | os.PathLike, process_index: int = 0) -> pathlib.Path:
    return pathlib.Path(run_dir) / f"train.process{process_index}.flock"


def _boot_id() -> str | None:
    try:
        return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace ("pid:[4026531836]"): a pid means the same process only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
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


def _same_file(path: pathlib.Path, opened: os.stat_result) -> bool:
    """Whether `path` still leads to the open file whose fstat is `opened` (True when it cannot be looked at)."""
    try:
        seen = path.stat()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return (seen.st_dev, seen.st_ino) == (opened.st_dev, opened.st_ino)


def _same_kernel(holder: dict) -> bool:
    """Whether the holder ran on this machine since its last boot (so flock and, in one PID namespace, pids
    speak about it). Without boot ids on either side (not Linux): the host name."""
    ours = _boot_id()
    if ours and holder.get("boot_id"):
        return holder["boot_id"] == ours
    return ours is None and holder.get("boot_id") is None and holder.get("host") == socket.gethostname()


def _same_pid_namespace(holder: dict) -> bool:
    return _same_kernel(holder) and isinstance(holder.get("pid"), int) and holder.get("pid_ns") == _pid_namespace()


class RunDirLock:
    """Holds RUN_DIR/train.process{P}.lock from acquire() to release(); see the module docstring.
    heartbeat_s: how often the holder refreshes and checks its lock (HEARTBEAT_S by default)."""

    def __init__(self, run_dir: str | os.PathLike, process_index: int = 0, heartbeat_s: float | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.path = lock_file(run_dir, process_index)
        self.flock_path = flock_file(run_dir, process_index)
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "process_index": int(process_index),
                       "boot_id": _boot_id(), "pid_ns": _pid_namespace(), "start_ticks": _start_ticks(os.getpid()),
                       "flock": False, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": uuid.uuid4().hex}
        self.lost = threading.Event()  # set by the heartbeat when the lock is no longer this run's
        self._lost_to: dict | None = None  # who holds it then (None: the file was deleted)
        self._flock_gone = False  # lost because the flock file was deleted
        self._flock_fd: int | None = None
        self._created: tuple[int, int] | None = None  # (st_dev, st_ino) of the lock file this holder created
        self._watched: dict[pathlib.Path, os.stat_result] = {}  # see watch()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- taking the lock ------------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Create the run directory and take its lock; RunDirError (one line) if another run holds it or
        the directory cannot be written."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"run directory {self.run_dir}: cannot create it ({e.strerror or e}); choose another "
                              "--run-dir") from None
        self.holder["flock"] = self._take_flock()
        try:
            for _ in range(5):  # a lock taken over below may be re-created by a racing start: look again
                if self._create():
                    break
                self._take_over_if_stale()
            else:
                raise RunDirError(f"run directory {self.run_dir}: another start keeps taking {self.path.name}; is a "
                                  "second `grpo-jax train` starting on it?")
        except BaseException:
            self._drop_flock()
            raise
        _HELD_HERE.add(self.holder["token"])
        self._heartbeat = threading.Thread(target=self._beat, name="grpo-run-lock", daemon=True)
        self._heartbeat.start()

    def _take_flock(self) -> bool:
        """Take the flock for as long as the lock is held: True, or False where the filesystem has no flock.
        RunDirError if another process holds it."""
        try:
            # O_CLOEXEC: a process this one starts must not keep the flock after this one has died.
            fd = os.open(self.flock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise self._not_writable(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._flock_refusal() from None
        except OSError as e:
            os.close(fd)
            logger.info("no flock on %s (%s): only the lock file's heartbeat tells a live holder from a dead one",
                        self.flock_path, e.strerror or e)
            return False
        self._flock_fd = fd
        return True

    def _drop_flock(self) -> None:
        if self._flock_fd is not None:
            os.close(self._flock_fd)  # the flock goes with it; the file stays (see the module docstring)
            self._flock_fd = None

    def _create(self) -> bool:
        """Create the lock file naming this process: True, or False if there is one already."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise self._not_writable(e) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(self.holder) + "\n")
                f.flush()
                created = os.fstat(f.fileno())
            self._created = (created.st_dev, created.st_ino)
        except OSError as e:
            self.path.unlink(missing_ok=True)
            raise RunDirError(f"run directory {self.run_dir}: cannot write {self.path.name} "
                              f"({e.strerror or e})") from None
        return True

    def _read(self, path: pathlib.Path | None = None) -> tuple[dict | None, os.stat_result]:
        """(the holder, or None when the file is empty or not JSON; the file's stat). FileNotFoundError when
        there is no such file."""
        path = path or self.path
        stat = path.stat()
        try:
            holder = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            return None, stat
        return (holder if isinstance(holder, dict) else None), stat

    def _take_over_if_stale(self) -> None:
        """Judge the lock file's holder: refuse (RunDirError) while it may be alive, else move its lock away
        so that the caller creates its own. Returns without doing anything when the lock changed meanwhile."""
        try:
            holder, judged = self._read()
        except FileNotFoundError:
            return  # released meanwhile: try again
        age_s = time.time() - judged.st_mtime
        if holder is None:
            # Being written this instant by another start, or left empty by a crash right after creating it.
            if age_s <= HEARTBEAT_S:
                raise RunDirError(f"run directory {self.run_dir} is being locked by another start right now "
                                  f"({self.path.name} is not complete yet); try again in a minute")
            reason = f"it is unreadable and {age_s:.0f}s old"
        else:
            reason = self._gone_because(holder, age_s)
            if reason is None:
                raise self._refusal(holder, age_s)
        logger.warning("taking over the lock %s of pid %s on host %s: %s", self.path,
                       (holder or {}).get("pid"), (holder or {}).get("host"), reason)
        # Not read-compare-unlink: another start may replace the lock between our read and our unlink. A
        # rename moves exactly one file, which we then check is the one we judged.
        moved = self.path.with_name(f"{self.path.name}.taken-{self.holder['token']}")
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return  # another start moved it first: judge what is there now
        try:
            taken, stat = self._read(moved)
        except FileNotFoundError:
            return
        if taken == holder and (stat.st_ino, stat.st_mtime_ns) == (judged.st_ino, judged.st_mtime_ns):
            moved.unlink(missing_ok=True)
            return
        self._put_back(moved, taken)

    def _put_back(self, moved: pathlib.Path, taken: dict | None) -> None:
        """The lock changed hands between our judgement and our rename: return the new holder's lock."""
        try:
            os.link(moved, self.path)  # never replaces a lock that a third start created meanwhile
        except FileExistsError:
            logger.warning("the lock %s of pid %s on host %s was moved by this start and a third start has "
                           "created one since: that holder stops at its next heartbeat", self.path,
                           (taken or {}).get("pid"), (taken or {}).get("host"))
        except OSError:  # no hard links here (gcsfuse): a rename, unless a lock appeared since
            if not self.path.exists():
                try:
                    os.rename(moved, self.path)
                except OSError:
                    pass  # then that holder stops at its next heartbeat
        moved.unlink(missing_ok=True)

    def _gone_because(self, holder: dict, age_s: float) -> str | None:
        """Why the lock's holder is certainly gone, or None if it may still be running."""
        pid = holder.get("pid")
        if _same_pid_namespace(holder):
            if pid == os.getpid():
                return None if holder.get("token") in _HELD_HERE else "an earlier process had this pid"
            if not _pid_running(pid):
                return f"pid {pid} is not running"
            if holder.get("start_ticks") is not None and _start_ticks(pid) not in (None, holder["start_ticks"]):
                return f"pid {pid} is now another process"
            return None
        if _same_kernel(holder) and holder.get("flock") and self._flock_fd is not None:
            return (f"its process (pid {pid} in another PID namespace of this machine) has exited: the flock it "
                    f"held on {self.flock_path.name} is free")
        if age_s > STALE_AFTER_S:
            return (f"its host has not refreshed it for {age_s:.0f}s (more than {STALE_AFTER_S:.0f}s)"
                    f"{self._unknown_because(holder)}")
        return None

    def _unknown_because(self, holder: dict) -> str:
        """Why this start cannot check the holder's process and must go by the heartbeat, for the messages."""
        if _same_kernel(holder):
            return f"; pid {holder.get('pid')} is in another PID namespace (another container), out of sight here"
        if holder.get("boot_id") and holder.get("host") == socket.gethostname():
            return (f"; host {holder.get('host')} has rebooted since it took the lock, or is another machine of "
                    "that name")
        return ""

    # -- messages -------------------------------------------------------------------------------------------

    def _not_writable(self, e: OSError) -> RunDirError:
        return RunDirError(f"run directory {self.run_dir} is not writable ({e.strerror or e}): fix its permissions "
                           "or choose another --run-dir")

    def _in_use(self, holder: dict, age_s: float, then: str) -> RunDirError:
        return RunDirError(
            f"run directory {self.run_dir} is in use by pid {holder.get('pid')} on host {holder.get('host')} "
            f"(since {holder.get('started')}; lock {self.path}, heartbeat {age_s:.0f}s ago): wait for that run to "
            f"end, or use another --run-dir; {then}")

    def _refusal(self, holder: dict, age_s: float) -> RunDirError:
        """The refusal of a holder that may be alive (the lock file decided)."""
        if _same_pid_namespace(holder):
            return self._in_use(holder, age_s, "the lock is free as soon as that process exits")
        wait_s = max(STALE_AFTER_S - age_s, 0.0)
        return self._in_use(holder, age_s, (
            f"if its heartbeat stops, a start can take the lock over in {wait_s:.0f}s; to start now, delete "
            f"{self.path} once you are sure host {holder.get('host')} is gone or no longer runs it"
            f"{self._unknown_because(holder)}"))

    def _flock_refusal(self) -> RunDirError:
        """The refusal when another process holds the flock: it is running (on this machine, or on one whose
        flocks this filesystem shares)."""
        try:
            holder, stat = self._read()
        except FileNotFoundError:
            holder, stat = None, None
        if holder is None or (_same_pid_namespace(holder) and self._gone_because(holder, 0.0) is not None):
            # The lock file is not written yet, or names a dead process: a start holding the flock is taking
            # it right now.
            return RunDirError(f"run directory {self.run_dir} is being locked by another start right now (it holds "
                               f"{self.flock_path}); try again in a minute")
        return self._in_use(holder, time.time() - stat.st_mtime, (
            f"a running process holds the flock on {self.flock_path}, so the lock is free only once it exits"))

    def _lost_message(self) -> str:
        if self._flock_gone:
            return (f"run directory {self.run_dir}: the file {self.flock_path} that this run holds its flock on was "
                    "deleted, so another start could take the directory; this run stops lest two trainers write one "
                    "directory (was it deleted by hand, or by a program the run started?); run the same command "
                    "again to resume from the last committed checkpoint")
        taker = self._lost_to
        what = ("was deleted" if taker is None else
                f"was taken over by pid {taker.get('pid')} on host {taker.get('host')} (since {taker.get('started')})")
        return (f"run directory {self.run_dir}: this run's lock {self.path} {what}, so this run stops lest two "
                f"trainers write one directory (did its heartbeat stop for more than {STALE_AFTER_S:.0f}s, or was "
                "the lock deleted, by hand or by a program the run started?); run the same command again to resume "
                "once the other run has ended")

    # -- holding the lock -----------------------------------------------------------------------------------

    def _beat(self) -> None:
        """The heartbeat: refresh the lock's mtime (other hosts read it) and notice when it is not ours."""
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder, _ = self._read()
            except FileNotFoundError:
                # A start that moved it by mistake puts it back at once (see _put_back): look again first.
                if self._stop.wait(min(self.heartbeat_s, 1.0)):
                    return
                try:
                    holder, _ = self._read()
                except FileNotFoundError:
                    holder = None
                except OSError:
                    continue
            except OSError as e:
                logger.warning("cannot read the run lock %s (%s)", self.path, e.strerror or e)
                continue
            if holder is not None and holder.get("token") == self.holder["token"]:
                try:
                    os.utime(self.path)
                except OSError as e:
                    logger.warning("cannot refresh the run lock %s (%s)", self.path, e.strerror or e)
                continue
            self._lost_to = holder
            self.lost.set()
            logger.warning("the run lock %s is no longer this run's (%s): the run stops at its next learner step",
                           self.path, "deleted" if holder is None else
                           f"pid {holder.get('pid')} on host {holder.get('host')} holds it")
            return

    def is_lost(self) -> bool:
        """Look now, without waiting for the heartbeat: True (and `lost` set) when the lock file at its path is
        not the one this holder created and does not hold its token (deleted, or another start's), or when the
        flock file this holder has the flock on is no longer at its path (a start would flock a new one)."""
        if self.lost.is_set() or self._heartbeat is None:
            return self.lost.is_set()
        if self._flock_fd is not None and not _same_file(self.flock_path, os.fstat(self._flock_fd)):
            self._lost_to, self._flock_gone = None, True
            self.lost.set()
            return True
        try:
            seen = self.path.stat()
        except FileNotFoundError:
            seen = None
        except OSError:
            return False  # cannot look (a flaky mount): the heartbeat looks again
        if seen is not None and self._created is not None and (seen.st_dev, seen.st_ino) == self._created:
            return False
        if seen is None:
            # A start that moved the lock by mistake puts it back at once (see _put_back): look again first.
            time.sleep(min(self.heartbeat_s, 1.0))
        try:
            holder, _ = self._read()
        except FileNotFoundError:
            holder = None
        except OSError:
            return False
        if holder is not None and holder.get("token") == self.holder["token"]:
            return False  # ours, though another file (put back by a rename where hard links fail)
        self._lost_to = holder
        self.lost.set()
        return True

    def watch(self, path: str | os.PathLike) -> None:
        """Notice (moved()) when `path`, a file or directory the run keeps in its run directory, is deleted or
        another one put in its place."""
        path = pathlib.Path(path)
        self._watched[path] = path.stat()

    def moved(self) -> list[pathlib.Path]:
        """The watched paths that are deleted or no longer the ones watched (their st_dev and st_ino)."""
        return [path for path, seen in self._watched.items() if not _same_file(path, seen)]

    def check(self, lost_elsewhere: bool = False) -> None:
        """RunDirError (one line) if this run's lock was taken over or deleted; with lost_elsewhere (another
        process of this run lost its lock), stop with it."""
        if self.lost.is_set():
            raise RunDirError(self._lost_message())
        if lost_elsewhere:
            raise RunDirError(f"run directory {self.run_dir}: another process of this run lost its run lock (its "
                              "own error says who took it), so every process stops")

    def release(self) -> None:
        """Remove the lock if it is still ours, and drop the flock (idempotent)."""
        if self._heartbeat is None:
            return
        self._stop.set()
        self._heartbeat.join()
        self._heartbeat = None
        _HELD_HERE.discard(self.holder["token"])
        try:
            holder, _ = self._read()
        except FileNotFoundError:
            holder = None
        if holder and holder.get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)
        self._drop_flock()  # only now: a start that gets the flock must not find this run's lock file
