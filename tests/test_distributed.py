"""Start-up decisions of grpo_jax.parallel.distributed that need no second process (those are in test_multiprocess), and
the trainer's StopSignals in one process."""

import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from grpo_jax.config_io import ConfigError
from grpo_jax.parallel import distributed
from grpo_jax.parallel.distributed import DistributedConfig, HostAgreement, initialize

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_one_process_starts_nothing(monkeypatch):
    for name in ("GRPO_JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    called = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: called.append(kw))
    assert initialize(DistributedConfig()) is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "only-this-host")
    assert initialize(DistributedConfig()) is False and not called


def test_explicit_and_pod_start_up_pass_the_right_arguments(monkeypatch):
    called = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: called.append(kw))
    monkeypatch.setattr(distributed, "_cpu_collectives", lambda config: None)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
    monkeypatch.setenv("GRPO_JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("GRPO_JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("GRPO_JAX_PROCESS_ID", "3")
    assert initialize(DistributedConfig(heartbeat_timeout_s=7)) is True
    assert called[-1] == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                          "initialization_timeout": 300, "heartbeat_timeout_seconds": 7,
                          "shutdown_timeout_seconds": 60}
    monkeypatch.delenv("GRPO_JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    assert initialize(DistributedConfig()) is True
    assert called[-1] == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 100,
                          "shutdown_timeout_seconds": 60}  # JAX detects the pod


@pytest.mark.parametrize("env, message", [
    ({"GRPO_JAX_NUM_PROCESSES": "two"}, "GRPO_JAX_NUM_PROCESSES='two': must be an integer"),
    ({"GRPO_JAX_NUM_PROCESSES": "2", "GRPO_JAX_PROCESS_ID": "2"}, "0 <= process_id < num_processes"),
    ({}, "needs num_processes >= 1"),
])
def test_an_incomplete_explicit_start_up_is_a_clear_error(monkeypatch, env, message):
    for name in ("GRPO_JAX_NUM_PROCESSES", "GRPO_JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        initialize(DistributedConfig(coordinator_address="localhost:1"))


def test_the_collective_timeout_defaults_to_three_group_timeouts():
    from grpo_jax.run.config import TrainerConfig

    assert TrainerConfig(group_timeout_s=600).collective_timeout() == 1800
    assert TrainerConfig(group_timeout_s=600, collective_timeout_s=90).collective_timeout() == 90
    assert any("collective_timeout_s=-1" in p for p in TrainerConfig(collective_timeout_s=-1).validate())


def test_one_process_agreement_needs_no_collective():
    agreement = HostAgreement(devices=[])
    assert agreement.gather([3, 1]).tolist() == [[3, 1]]
    assert np.asarray(agreement.gather([True, False])).any(axis=0).tolist() == [True, False]


# --- StopSignals while the main thread waits inside C (a collective, a device step), where Python runs no
# signal handler until the call returns. glibc's system() waits in waitpid, retried on EINTR, with the GIL
# released: the same as a process waiting in a collective for a peer.
BLOCKED_IN_C = r"""
import ctypes, sys, time
from grpo_jax.run.trainer import StopSignals
stop_first, c_seconds, python_seconds = sys.argv[1] == "stop_first", sys.argv[2], float(sys.argv[3])
with StopSignals() as signals:
    if stop_first:
        signals.stop()  # another process was signalled (the trainer's agreement), not this one
    print("waiting", flush=True)
    start = time.monotonic()
    ctypes.CDLL(None).system(f"sleep {c_seconds}".encode())
    deadline = time.monotonic() + python_seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)  # in Python: the interpreter runs the signal handler at once
    print(f"returned after {time.monotonic() - start:.1f}s; received={signals.received}", flush=True)
"""


def start_waiting(stop_first: bool, c_seconds: float, python_seconds: float) -> subprocess.Popen:
    # Its own session: the `sleep` child goes with it at the end (killpg).
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_C, "stop_first" if stop_first else "-", str(c_seconds),
                             str(python_seconds)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout.readline() == b"waiting\n", proc.stderr.read().decode()
    time.sleep(0.5)  # inside the wait
    return proc


def end_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone, with its `sleep`
    proc.wait()


def read_until(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """What proc wrote to stderr until `text` appeared (or timeout / its end)."""
    seen, deadline = b"", time.monotonic() + timeout
    while text.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(proc.stderr.fileno(), 4096) if ready else b""
        if ready and not chunk:
            break
        seen += chunk
    return seen.decode()


def test_a_second_signal_exits_at_once_while_the_main_thread_waits_in_c():
    proc = start_waiting(stop_first=False, c_seconds=60, python_seconds=0)
    try:
        proc.send_signal(signal.SIGTERM)
        # The first is taken at once (not when the wait returns): the stop is asked for, the process goes on.
        assert "received SIGTERM: finishing the current step" in read_until(proc, "received SIGTERM", 5)
        assert proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 128 + signal.SIGTERM
        assert time.monotonic() - sent < 5
        end_session(proc)  # its `sleep` holds stderr open
        last = proc.stderr.read().decode().strip().splitlines()[-1]
        assert last.startswith("grpo-jax: second SIGTERM: exiting at once") and "last committed checkpoint" in last
    finally:
        end_session(proc)


def test_one_signal_is_counted_once_even_after_a_stop_asked_by_another_process():
    # One SIGTERM while the main thread runs Python: both the interpreter's handler and the watchdog see it,
    # and it must count once. A stop asked by another process (stop()) is not this process's first signal.
    proc = start_waiting(stop_first=True, c_seconds=0, python_seconds=2)
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert "received=15" in out.decode()
        assert err.decode().count("received SIGTERM") == 1
    finally:
        end_session(proc)
