"""The run-directory lock (run_lock.py, issue 20): a live holder is refused whatever PID namespace or boot it
runs in, a stale lock taken over by two starts at once ends with one holder, a holder whose lock was taken
notices it and the trainer stops, and every refusal says how long the heartbeat is old, when a takeover
becomes possible and which file to delete. The earlier lock tests are in test_hardening.py."""

import errno
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

from grpo_jax import cli, errors
from grpo_jax.state import run_lock
from grpo_jax.state.run_lock import RunDirLock, lock_file
from test_hardening import grpo_log_reaches_caplog_and_capsys  # noqa: F401 (autouse fixture)
from test_trainer import FAST

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")

# A process that takes the lock, says so, and then either releases it and exits at the end of its stdin, or
# dies without releasing anything (os._exit, as SIGKILL would) when it reads "die". NO_FLOCK=1 makes it run as
# on a filesystem without flock.
HOLDER = """
import errno, fcntl, os, sys
if os.environ.get("NO_FLOCK"):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = no_flock
from grpo_jax.state.run_lock import RunDirLock
lock = RunDirLock(sys.argv[1])
lock.acquire()
print("held", os.getpid(), flush=True)
if sys.stdin.readline().strip() == "die":
    os._exit(9)
lock.release()
"""

# A start that tries the lock once and prints what happened.
TAKER = """
import errno, fcntl, os, sys
if os.environ.get("NO_FLOCK"):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = no_flock
from grpo_jax.errors import RunDirError
from grpo_jax.state.run_lock import RunDirLock
try:
    RunDirLock(sys.argv[1]).acquire()
    print("acquired")
except RunDirError as e:
    print("refused:", e)
"""

IN_NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]


def unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*IN_NEW_PID_NAMESPACE, "true"], capture_output=True, check=False).returncode == 0


needs_unshare = pytest.mark.skipif(not unshare_works(), reason="unshare --pid is unavailable (needs root)")


def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")


def start_holder(run_dir, prefix=(), env=None) -> subprocess.Popen:
    holder = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    assert holder.stdout.readline().split()[0] == "held"
    return holder


def stop_holder(holder: subprocess.Popen, how: str = "") -> None:
    holder.stdin.write(how + "\n")
    holder.stdin.close()
    holder.wait(timeout=30)


def try_to_take(run_dir, prefix=(), env=None) -> str:
    done = subprocess.run(
        [*prefix, sys.executable, "-c", TAKER, str(run_dir)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def plant(run_dir, holder: dict, age_s: float = 0.0) -> pathlib.Path:
    """A lock file as `holder` left it, last refreshed `age_s` ago."""
    path = lock_file(run_dir)
    path.write_text(json.dumps(holder) + "\n")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def this_machine(**fields) -> dict:
    """A lock record of a process of this boot and PID namespace."""
    return {
        "host": socket.gethostname(),
        "boot_id": pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "started": "2024-01-01T00:00:00",
        **fields,
    }


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------- PID namespaces, reboots


@needs_unshare
@pytest.mark.parametrize("holder_inside", [False, True], ids=["taker-in-new-pid-ns", "holder-in-new-pid-ns"])
def test_a_live_holder_in_another_pid_namespace_is_refused_and_taken_over_once_it_dies(tmp_path, holder_inside):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir, prefix=IN_NEW_PID_NAMESPACE if holder_inside else ())
    taker = () if holder_inside else IN_NEW_PID_NAMESPACE
    try:
        outcome = try_to_take(run_dir, prefix=taker)
        assert outcome.startswith("refused: run directory") and "is in use by pid" in outcome, outcome
        assert json.loads(lock_file(run_dir).read_text())["pid"] != 0  # the holder's lock is still there
    finally:
        stop_holder(holder, "die")
    # It died without releasing: its flock went with it, so the lock is taken over at once (no heartbeat wait).
    assert try_to_take(run_dir, prefix=taker) == "acquired"


@needs_unshare
def test_without_flock_a_holder_in_another_pid_namespace_is_judged_by_its_heartbeat_not_its_pid(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir, env={"NO_FLOCK": "1"})
    try:
        outcome = try_to_take(run_dir, prefix=IN_NEW_PID_NAMESPACE, env={"NO_FLOCK": "1"})
        assert outcome.startswith("refused:") and "another PID namespace" in outcome, outcome
        assert f"delete {lock_file(run_dir)}" in outcome, outcome
    finally:
        stop_holder(holder)


def test_the_same_host_name_with_another_boot_id_is_judged_by_the_heartbeat(tmp_path, caplog):
    """Another boot id: the machine rebooted, or it is another machine of the same name sharing the directory;
    either way its pid means nothing here and only the heartbeat tells whether it is alive."""
    rebooted = this_machine(pid=1, boot_id="another boot", pid_ns="pid:[1]", token="theirs")
    path = plant(tmp_path, rebooted, age_s=100)
    with pytest.raises(errors.RunDirError) as refused:
        RunDirLock(tmp_path).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert f"in use by pid 1 on host {socket.gethostname()}" in message
    assert "heartbeat 100s ago" in message
    assert f"take the lock over in {run_lock.STALE_AFTER_S - 100:.0f}s" in message
    assert f"delete {path}" in message and "rebooted" in message
    assert json.loads(path.read_text())["token"] == "theirs"
    plant(tmp_path, rebooted, age_s=run_lock.STALE_AFTER_S + 5)
    with caplog.at_level(logging.WARNING, logger="grpo_jax"):
        lock = RunDirLock(tmp_path)
        lock.acquire()
    assert "not refreshed it" in caplog.text and "rebooted" in caplog.text
    lock.release()


def test_the_refusal_of_another_hosts_lock_names_its_heartbeat_when_it_can_be_taken_and_the_file(tmp_path):
    path = plant(tmp_path, {"host": "elsewhere", "pid": 4242, "boot_id": "b", "started": "2024-01-01T00:00:00",
                            "token": "t"}, age_s=40)
    with pytest.raises(errors.RunDirError) as refused:
        RunDirLock(tmp_path).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"run directory {tmp_path} is in use by pid 4242 on host elsewhere"), message
    assert "heartbeat 40s ago" in message
    assert f"take the lock over in {run_lock.STALE_AFTER_S - 40:.0f}s" in message
    assert f"delete {path} " in message and "host elsewhere is gone" in message


# ---------------------------------------------------------------------------------- two starts take over at once


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_two_starts_taking_over_one_stale_lock_at_once_end_with_one_holder(tmp_path, monkeypatch, flock):
    """B judges a dead process's lock stale; before B acts on it, A takes it over (the interleaving of
    /work/shared/repro/lock_race.py, made deterministic): B must not remove A's fresh lock."""
    if not flock:
        monkeypatch.setattr(fcntl, "flock", no_flock)  # a filesystem without flock: the lock file alone decides
    plant(tmp_path, this_machine(pid=dead_pid(), token="dead"))
    a, b = RunDirLock(tmp_path), RunDirLock(tmp_path)
    outcome = {}

    def acquire(name, lock):
        try:
            lock.acquire()
            outcome[name] = "acquired"
        except errors.RunDirError as e:
            outcome[name] = f"refused: {e}"

    class AWhenBJudgesItStale(logging.Handler):
        def emit(self, record):
            if "taking over" in record.getMessage() and "a" not in outcome:
                outcome["a"] = "trying"  # A's own takeover warning must not start A again
                acquire("a", a)

    handler = AWhenBJudgesItStale()
    logging.getLogger("grpo_jax.state.run_lock").addHandler(handler)
    try:
        acquire("b", b)
    finally:
        logging.getLogger("grpo_jax.state.run_lock").removeHandler(handler)
    try:
        assert sorted(outcome) == ["a", "b"], outcome  # A tried while B was taking over
        holders = [name for name, what in outcome.items() if what == "acquired"]
        assert len(holders) == 1, outcome
        holder = {"a": a, "b": b}[holders[0]]
        assert json.loads(lock_file(tmp_path).read_text())["token"] == holder.holder["token"]
        assert [p.name for p in tmp_path.iterdir() if ".taken-" in p.name] == []  # no renamed lock left behind
    finally:
        a.release()
        b.release()


# ---------------------------------------------------------------------------------- the holder checks its lock


@pytest.mark.parametrize("how", ["taken", "deleted"])
def test_a_holder_whose_lock_was_taken_or_deleted_notices_within_a_heartbeat(tmp_path, how):
    lock = RunDirLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    try:
        lock.check()  # ours: nothing to say
        path = lock_file(tmp_path)
        path.unlink()  # what a takeover from another host does (its rename) ...
        if how == "taken":  # ... before it creates its own
            path.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": "2024-01-01T00:00:00",
                                        "token": "theirs"}))
        deadline = time.monotonic() + 10
        while not lock.lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock.lost.is_set()
        with pytest.raises(errors.RunDirError) as stopped:
            lock.check()
        message = str(stopped.value)
        assert "\n" not in message and str(path) in message
        assert ("taken over by pid 4242 on host elsewhere" if how == "taken" else "was deleted") in message, message
    finally:
        lock.release()
    if how == "taken":
        assert json.loads(path.read_text())["token"] == "theirs"  # theirs now: left alone


def test_the_trainer_stops_at_the_next_step_when_another_start_takes_its_lock(tmp_path, monkeypatch, capsys):
    from grpo_jax.run.trainer import Trainer

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    run_dir = tmp_path / "run"
    learn = Trainer._learn

    def learn_then_lose_the_lock(self, groups, step):
        metrics = learn(self, groups, step)
        if step == 1:
            path = lock_file(self.run_dir)
            # In one rename, as a taking start writes it: between an unlink and a write the heartbeat could
            # rightly see a deleted lock instead.
            theirs = path.with_name(path.name + ".theirs")
            theirs.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": "2024-01-01T00:00:00",
                                          "token": "theirs"}))
            theirs.replace(path)
            assert self.run_lock.lost.wait(10)
        return metrics

    monkeypatch.setattr(Trainer, "_learn", learn_then_lose_the_lock)
    code = cli.main(["train", TINY, "--run-dir", str(run_dir), *FAST, "trainer.max_steps=4",
                     "checkpoint.every_steps=1", "checkpoint.save_at_end=false", "trainer.save_final_model=false"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo-jax: error:")]
    assert code == 2 and len(err) == 1, err
    assert "taken over by pid 4242 on host elsewhere" in err[0], err
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [1], steps  # step 2 was learned after the lock was lost: not saved
    assert json.loads(lock_file(run_dir).read_text())["token"] == "theirs"


@pytest.mark.parametrize("what", ["lock", "flock"])
def test_a_holder_whose_lock_or_flock_file_was_deleted_knows_at_once_without_its_heartbeat(tmp_path, what):
    lock = RunDirLock(tmp_path)  # the default 30 s heartbeat: only is_lost() can notice within this test
    lock.acquire()
    try:
        assert not lock.is_lost()  # ours: nothing to say, and nothing slept
        path = lock.flock_path if what == "flock" else lock_file(tmp_path)
        path.unlink()  # what a program of the run may do (issue 36): a second start could take the directory
        assert lock.is_lost() and lock.lost.is_set()
        with pytest.raises(errors.RunDirError) as stopped:
            lock.check()
        message = str(stopped.value)
        assert "\n" not in message and str(path) in message and "deleted" in message, message
        assert "run the same command" in message
    finally:
        lock.release()


def test_a_lock_put_back_by_a_rename_is_still_the_holders(tmp_path):
    lock = RunDirLock(tmp_path)
    lock.acquire()
    try:
        path = lock_file(tmp_path)
        copy = path.with_name("copy")
        copy.write_bytes(path.read_bytes())
        copy.rename(path)  # another file, the same holder (a takeover's put-back where hard links fail)
        assert not lock.is_lost()
        path.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": "2024-01-01T00:00:00",
                                    "token": "theirs"}))
        assert lock.is_lost()
        with pytest.raises(errors.RunDirError, match="taken over by pid 4242 on host elsewhere"):
            lock.check()
    finally:
        lock.release()
