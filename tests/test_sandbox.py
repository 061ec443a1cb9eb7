"""The sandbox for model-written code: limits that hold (wall clock, CPU, memory, output, processes), no network,
nothing inherited, nothing left behind; and the python_output reward that runs completions in it."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from grpo_jax import sandbox
from grpo_jax.algorithm import rewards as R
from grpo_jax.sandbox import Sandbox, SandboxError

REPO = pathlib.Path(__file__).resolve().parents[1]
SLACK_S = 0.5  # killing and reaping a program at its limit, on a busy 2-core machine


@pytest.fixture
def shared_dir():
    """A directory any user may write, for programs to leave traces in (a program may run as nobody)."""
    path = tempfile.mkdtemp(prefix="sandbox_test_")
    os.chmod(path, 0o777)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def guard_only(monkeypatch):
    """Sandboxes made from here on use the guard, as where the kernel refuses the namespaces."""
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: ("guard", False))


def beating(path: pathlib.Path) -> str:
    """Source lines that append a dot to `path` every 10 ms, forever: a process that shows whether it still runs."""
    return f"""
while True:
    with open({str(path)!r}, "a") as beats:
        beats.write(".")
    time.sleep(0.01)
"""


def stops_beating(path: pathlib.Path) -> bool:
    before = path.stat().st_size
    time.sleep(0.3)
    return path.stat().st_size == before


def timed_run(box: Sandbox, source: str, stdin: str = ""):
    start = time.monotonic()
    result = box.run_python(source, stdin)
    return result, time.monotonic() - start


def test_a_correct_program_gets_its_stdin_and_gives_its_stdout():
    box = Sandbox()
    assert box.network_isolation in sandbox.NETWORK_ISOLATIONS
    result = box.run_python("import sys\nwords = sys.stdin.read().split()\nprint(' '.join(reversed(words)))\n"
                            "print('note', file=sys.stderr)", "one two three")
    assert (result.stdout, result.stderr, result.exit_code, result.failure) == ("three two one\n", "note\n", 0, None)
    assert result.ok and 0 < result.wall_s < 5
    # A megabyte of input reaches a program that reads it, and one that never reads it still ends.
    big = "a" * (1 << 20)
    assert box.run_python("import sys; print(len(sys.stdin.read()))", big).stdout == f"{1 << 20}\n"
    assert box.run_python("print('done')", big).stdout == "done\n"


def test_an_exception_is_an_error_with_the_program_s_own_traceback():
    box = Sandbox()
    result = box.run_python("def f():\n    raise ValueError('no answer')\nf()\n")
    assert (result.failure, result.exit_code) == ("error", 1)
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"main.py\", line 3")
    assert result.stderr.endswith("ValueError: no answer\n")
    assert box.run_python("def f(:").stderr.endswith("SyntaxError: invalid syntax\n")
    assert box.run_python("raise SystemExit(3)").exit_code == 3


def test_an_infinite_loop_is_killed_at_the_timeout():
    result, seconds = timed_run(Sandbox(timeout_s=1.0), "print('started', flush=True)\nwhile True:\n    pass")
    assert (result.failure, result.exit_code, result.stdout) == ("timeout", -signal.SIGKILL, "started\n")
    assert 1.0 <= seconds < 1.0 + SLACK_S, seconds


def test_cpu_time_is_limited_apart_from_the_wall_clock():
    result, seconds = timed_run(Sandbox(timeout_s=20.0, cpu_s=1), "while True:\n    pass")
    assert (result.failure, result.exit_code) == ("cpu", -signal.SIGXCPU)
    assert seconds < 10, seconds


def test_a_memory_hog_fails_with_memory_and_the_next_run_is_fine():
    box = Sandbox(memory_mb=256)
    # Touched memory (not zero pages), 16 MB at a time up to 1 GB: four times the limit, and no more should the
    # limit not hold.
    result = box.run_python("chunks = []\nfor _ in range(64):\n    chunks.append(b'x' * (16 << 20))")
    assert (result.failure, result.exit_code) == ("memory", 1)
    assert result.stderr.endswith("MemoryError\n")
    assert box.run_python("print(sum(range(10**6)))").stdout == "499999500000\n"


def test_a_program_that_handles_its_memory_error_is_not_a_failure():
    result = Sandbox(memory_mb=128).run_python("try:\n    b = bytearray(1 << 30)\nexcept MemoryError:\n"
                                               "    print('too big')")
    assert (result.failure, result.stdout) == (None, "too big\n")


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_flood_is_cut_at_the_limit_and_killed_there(stream):
    result, seconds = timed_run(Sandbox(timeout_s=10.0, max_output_bytes=10_000),
                                f"import sys\nwhile True:\n    print('x' * 999, file=sys.{stream})")
    assert (result.failure, result.exit_code) == ("output_limit", -signal.SIGKILL)
    assert getattr(result, stream) == ("x" * 999 + "\n") * 10 and len(getattr(result, stream)) == 10_000
    assert seconds < 2, seconds  # killed at the limit, not at the timeout


def test_a_large_file_is_refused_past_max_file_bytes():
    result = Sandbox(max_file_bytes=1 << 20).run_python(
        "with open('big', 'wb') as f:\n    f.write(b'x' * (1 << 19))\n    f.write(b'x' * (1 << 20))")
    assert result.failure == "error" and "File too large" in result.stderr


def test_loopback_and_name_lookups_fail_with_network(shared_dir):
    server = socket.create_server(("127.0.0.1", 0))
    resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resolver.bind(("127.0.0.1", 0))
    resolver.settimeout(0.2)
    try:
        socket.create_connection(server.getsockname(), timeout=1).close()  # reachable from here
        box = Sandbox()
        connect = box.run_python(f"import socket\nsocket.create_connection({server.getsockname()!r}, timeout=2)")
        assert connect.failure == "network", connect.stderr
        # A query to a resolver: DNS-shaped exfiltration. Nothing may arrive.
        query = box.run_python("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                               f"s.sendto(b'exfiltrated', {resolver.getsockname()!r})")
        assert query.failure == "network", query.stderr
        with pytest.raises(TimeoutError):
            resolver.recvfrom(100)
        lookup = box.run_python("import socket\nsocket.getaddrinfo('example.com', 443)")
        assert lookup.failure == "network" and "gaierror" in lookup.stderr
        # The reason is reported only when the program failed: one that copes with the refusal is fine.
        coping = box.run_python(f"import socket\ntry:\n    socket.create_connection({server.getsockname()!r})\n"
                                "except OSError:\n    print('offline')")
        assert (coping.failure, coping.stdout) == (None, "offline\n")
    finally:
        server.close()
        resolver.close()


def test_the_network_namespace_holds_for_programs_the_program_starts():
    box = Sandbox()
    if box.network_isolation != "namespace":
        pytest.skip("the kernel refuses user and network namespaces here: the guard refuses starting programs")
    server = socket.create_server(("127.0.0.1", 0))
    try:
        # Another interpreter, without the sandbox's audit hook: only the kernel stands in its way.
        inner = f"import socket; socket.create_connection({server.getsockname()!r}, timeout=2)"
        result = box.run_python(f"import subprocess, sys\nsys.exit(subprocess.run([sys.executable, '-c', {inner!r}])"
                                ".returncode)")
        assert result.failure == "error" and "Network is unreachable" in result.stderr, result.stderr
    finally:
        server.close()


def test_without_namespaces_the_guard_refuses_sockets_lookups_processes_and_ctypes(guard_only):
    box = Sandbox()
    assert box.network_isolation == "guard"
    refused = {
        "import socket\nsocket.socket()": ("network", "an IP socket is not allowed"),
        "import socket\nsocket.create_connection(('127.0.0.1', 80))": ("network", "socket.getaddrinfo is not"),
        "import socket\nsocket.getaddrinfo('example.com', 80)": ("network", "socket.getaddrinfo is not allowed"),
        "import urllib.request\nurllib.request.urlopen('http://example.com')": ("network", "is not allowed"),
        "import socket\nsocket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')":
            ("network", "socket.connect to another process's Unix socket is not allowed"),
        "import socket\nsocket.socket(socket.AF_UNIX).connect('\\0abstract')":
            ("network", "socket.connect to another process's Unix socket is not allowed"),
        "import subprocess\nsubprocess.run(['curl', 'http://example.com'])": ("error", "subprocess.Popen is not"),
        "import os\nos.system('echo escaped')": ("error", "os.system is not allowed"),
        "import os\nos.fork()": ("error", "os.fork is not allowed"),
        "import ctypes\nctypes.CDLL(None).socket(2, 1, 0)": ("error", "ctypes.dlopen is not allowed"),
    }
    for source, (failure, message) in refused.items():
        result = box.run_python(source)
        assert (result.failure, result.stdout) == (failure, ""), (source, result)
        assert message in result.stderr, (source, result.stderr)
    # What needs no network still works: a socket pair, asyncio's loop.
    result = box.run_python("import asyncio, socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))\n"
                            "async def main():\n    print('loop')\nasyncio.run(main())")
    assert (result.failure, result.stdout) == (None, "b'x'\nloop\n")


def test_processes_a_program_starts_die_with_it_at_the_timeout_even_outside_its_group(shared_dir):
    box = Sandbox(timeout_s=1.0)
    if box.network_isolation != "namespace":
        pytest.skip("without a PID namespace the guard refuses starting processes (tested above)")
    beats = shared_dir / "beats"
    program = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os.setsid()\n" + \
              "\n".join("        " + line for line in beating(beats).splitlines()) + "\ntime.sleep(60)"
    result, seconds = timed_run(box, program)
    assert result.failure == "timeout" and seconds < 1.0 + SLACK_S
    assert beats.stat().st_size > 0  # the children ran
    assert stops_beating(beats)


def test_the_environment_is_scrubbed_and_the_working_directory_is_fresh_and_removed(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb")
    monkeypatch.setenv("HF_TOKEN", "secret-hf")
    box = Sandbox()
    program = ("import json, os\nos.makedirs('locked/inner')\nopen('locked/inner/f', 'w').write('x')\n"
               "os.chmod('locked', 0)\nprint(json.dumps({'cwd': os.getcwd(), 'env': dict(os.environ), "
               "'files': sorted(os.listdir('.'))}))")
    first, second = (json.loads(box.run_python(program).stdout) for _ in range(2))
    assert set(first["env"]) == {"PATH", "LANG", "HOME", "TMPDIR"}
    assert first["env"]["PATH"] == os.environ["PATH"]
    assert first["env"]["HOME"] == first["env"]["TMPDIR"] == first["cwd"]
    assert first["files"] == second["files"] == ["locked", "main.py"]  # nothing from the run before
    assert first["cwd"] != second["cwd"]
    assert not os.path.exists(first["cwd"]) and not os.path.exists(second["cwd"])


def test_a_root_trainer_s_programs_run_as_nobody_where_they_can(monkeypatch, shared_dir):
    if os.geteuid() != 0:
        pytest.skip("only root drops to nobody")
    network, _ = sandbox.probe_isolation()
    owned_by_root = shared_dir / "owned_by_root"
    owned_by_root.write_text("")
    os.chmod(owned_by_root, 0o644)
    append = f"open({str(owned_by_root)!r}, 'a').write('x')"
    if not Sandbox().runs_as_nobody:  # as here, where the standard library is root's alone: root's files are open
        assert Sandbox().run_python(append).ok
    # Forced (the programs below use only modules the launcher has loaded, readable or not).
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: (network, True))
    box = Sandbox(max_processes=4)
    result = box.run_python(append)
    assert result.failure == "error" and "PermissionError" in result.stderr
    if network == "namespace":  # RLIMIT_NPROC applies to nobody: 4 processes, the program's own included
        forks = box.run_python("import os, signal\nstarted = 0\nfor _ in range(10):\n    try:\n"
                               "        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n"
                               "        signal.pause()\n    started += 1\nprint(started)")
        assert forks.stdout == "3\n", forks


def test_eight_threads_share_two_workers_never_more(shared_dir):
    box = Sandbox(workers=2, timeout_s=10.0)
    program = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"
    results = [None] * 8

    def run(i):
        results[i] = box.run_python(program)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r.ok for r in results), results
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    running, most = 0, 0
    for _, change in sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans]):
        running += change
        most = max(most, running)
    assert most == 2


def test_close_kills_the_running_programs_and_refuses_more(shared_dir):
    box = Sandbox(timeout_s=30.0)
    beats = shared_dir / "beats"
    outcome = {}

    def run():
        try:
            box.run_python("import time\n" + beating(beats))
        except SandboxError as e:
            outcome["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    give_up = time.monotonic() + 10
    while not beats.exists() and time.monotonic() < give_up:
        time.sleep(0.01)
    box.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and outcome["error"] == "the sandbox was closed while the program ran"
    assert stops_beating(beats)
    with pytest.raises(SandboxError, match="closed"):
        box.run_python("print(1)")


@pytest.mark.parametrize("end", ["exits", "is killed"])
def test_programs_still_running_when_the_interpreter_ends_are_killed(shared_dir, end):
    beats, workdir = shared_dir / "beats", shared_dir / "workdir"
    program = f"import os, time\nopen({str(workdir)!r}, 'w').write(os.getcwd())" + beating(beats)
    script = f"""
import os, signal, threading, time
from grpo_jax.sandbox import Sandbox
box = Sandbox(timeout_s=60.0)
threading.Thread(target=box.run_python, args=({program!r},), daemon=True).start()
give_up = time.monotonic() + 10
while not os.path.exists({str(beats)!r}) and time.monotonic() < give_up:
    time.sleep(0.01)
if {end == "is killed"}:  # no atexit, no finalizer: only the kernel can end the program
    os.kill(os.getpid(), signal.SIGKILL)
"""
    ended = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=30)
    assert ended.returncode == (-signal.SIGKILL if end == "is killed" else 0)
    assert stops_beating(beats)
    if end == "exits":
        assert not os.path.exists(workdir.read_text())
    shutil.rmtree(workdir.read_text(), ignore_errors=True)  # what a killed trainer leaves (documented)


def test_limits_are_checked_naming_key_value_and_meaning():
    for kwargs, message in [({"timeout_s": 0}, "timeout_s=0: must be a number > 0 (the wall-clock seconds"),
                            ({"timeout_s": True}, "timeout_s=True: must be a number > 0"),
                            ({"cpu_s": 1.5}, "cpu_s=1.5: must be an integer >= 1 (seconds of CPU time"),
                            ({"memory_mb": 16}, "memory_mb=16: must be an integer >= 64 (MB of address space"),
                            ({"max_output_bytes": 0}, "max_output_bytes=0: must be an integer >= 1"),
                            ({"workers": 0}, "workers=0: must be an integer >= 1 (programs running at once)")]:
        with pytest.raises(ValueError) as info:
            Sandbox(**kwargs)
        assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(TypeError):
        Sandbox(5.0)  # keyword-only: a bare number could be any of the limits
    with pytest.raises(TypeError, match="must be str"):
        Sandbox().run_python(b"print(1)")


# ----------------------------------------------------------------------------------------------------
# The python_output reward.

CASES = [  # (completion, record, score)
    ("Six sevens:\n```python\nprint(6 * 7)\n```", {"answer": "Work...\n#### 42"}, 1.0),
    ("```python\nprint(41)\n```", {"answer": "#### 42"}, 0.0),
    ("The answer is 42.", {"answer": "42"}, 0.0),  # no program
    ("```python\nprint(1)\n```\nNo, fixed:\n```python\nprint(40 + 2)\n```", {"answer": "42"}, 1.0),  # the last
    ("```python\nprint(40 + 2)\n```\nor\n```python\nprint(1)", {"answer": "42"}, 1.0),  # an unclosed last one
    ("```python\nprint(42)\nraise SystemExit(3)\n```", {"answer": "42"}, 0.0),  # right output, failed program
    ("```python\nwhile True:\n    pass\n```", {"answer": "42"}, 0.0),  # timeout
    ("```python\nimport socket\nsocket.create_connection(('127.0.0.1', 80))\n```", {"answer": "42"}, 0.0),
    ("```python\nprint('  hello world \\n')\n```", {"answer": " hello world"}, 1.0),  # both stripped
]


def test_python_output_scores_the_last_program_s_output():
    fn = R.get_reward("python_output", timeout_s=1.0)
    records, completions, expected = zip(*[(record, completion, score) for completion, record, score in CASES])
    assert fn(list(records), list(completions)) == list(expected)
    with_stdin = R.get_reward("python_output", stdin_key="input", answer_key="sum")
    program = "```python\nprint(sum(map(int, input().split())))\n```"
    assert with_stdin([{"input": "3 4", "sum": 7}, {"input": "3 5", "sum": 7}], [program] * 2) == [1.0, 0.0]


def test_python_output_in_a_suite_scores_failed_programs_zero_and_fails_samples_the_sandbox_cannot_run(monkeypatch):
    records = [record for _, record, _ in CASES]
    completions = [completion for completion, _, _ in CASES]
    with R.RewardSuite([{"name": "python_output", "kwargs": {"timeout_s": 1.0}}], timeout_s=8.0) as suite:
        result = suite.score(records, completions)
        assert result.errors == [] and not result.failed.any()
        np.testing.assert_array_equal(result.rewards, [score for _, _, score in CASES])
        monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # the sandbox, not the program, fails
        result = suite.score(records[:2], completions[:2])
    assert result.failed.tolist() == [True, True]
    assert "raised SandboxError: could not start /nonexistent/python" in result.errors[0]


def test_python_output_is_registered_and_its_kwargs_are_checked():
    assert "python_output" in R.REWARDS and "python_output" in R.BUILTIN_REWARDS
    for kwargs, message in [
        ({"timout_s": 1}, "python_output: unknown kwarg timout_s=1; allowed answer_key, stdin_key, timeout_s, cpu_s, "
                          "memory_mb, max_output_bytes, max_file_bytes, max_processes, workers"),
        ({"answer_key": ""}, "python_output: answer_key='': must be the name of the field that holds the expected "
                             "output"),
        ({"stdin_key": None}, "python_output: stdin_key=None: must be the name of the field given to the program"),
        ({"memory_mb": 10}, "python_output: memory_mb=10: must be an integer >= 64"),
        ({"timeout_s": -1}, "python_output: timeout_s=-1: must be a number > 0"),
    ]:
        with pytest.raises(ValueError) as info:
            R.get_reward("python_output", **kwargs)
        assert str(info.value).startswith(message), str(info.value)
