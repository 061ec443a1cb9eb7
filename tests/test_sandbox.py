"""The sandbox for model-written code: limits that hold (wall clock, CPU, memory, output, processes), no network,
nothing inherited, nothing written outside its directory, nothing left behind (processes, files, cgroups), the
isolation probed and reported truthfully; and the python_output reward that runs completions in it."""

import errno
import json
import logging
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
from grpo_jax.sandbox import Isolation, Sandbox, SandboxError

REPO = pathlib.Path(__file__).resolve().parents[1]
SLACK_S = 0.5  # killing and reaping a program at its limit, on a busy 2-core machine
ISOLATION = sandbox.probe_isolation()
NAMESPACED = pytest.mark.skipif(ISOLATION.network != "namespace",
                                reason="the kernel refuses user namespaces here: the guard refuses starting processes")
READ_ONLY = pytest.mark.skipif(ISOLATION.files != "read_only", reason="the kernel refuses mount namespaces here")


@pytest.fixture
def run_dir(monkeypatch):
    """A temporary directory of the test's own that the sandbox makes its working directories in, so that the
    processes of its programs can be found (processes_in) and what runs leave behind listed."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="sandbox_test_"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def outside_dir():
    """A directory outside every working directory and not hidden by the sandbox, with a file in it, which any
    user may change today (0777 and 0666): a program must still not be able to."""
    base = "/var/tmp" if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK) else str(REPO)
    path = pathlib.Path(tempfile.mkdtemp(prefix="sandbox_outside_", dir=base))
    os.chmod(path, 0o777)
    (path / "events.jsonl").write_text("kept\n")
    os.chmod(path / "events.jsonl", 0o666)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def guarded(monkeypatch, network="guard", nobody=False, cgroup=()):
    """Sandboxes made from here on have the guard's isolation, as where the kernel refuses the namespaces
    (network="guard") or only the mounts (network="namespace")."""
    isolation = Isolation(network, "guard", nobody, cgroup)
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: isolation)
    return isolation


def processes_in(directory: pathlib.Path) -> list[int]:
    """The processes whose working directory lies in `directory`: a program's, and whatever it started."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd.startswith(f"{directory}/"):
            found.append(int(pid))
    return found


def wait_for(condition, timeout_s=10.0):
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def our_cgroups() -> list[str]:
    """The cgroups this process's sandboxes hold now."""
    found = []
    for place in sandbox._cgroup_places():
        try:
            names = os.listdir(place.directory)
        except OSError:
            continue
        found += [os.path.join(place.directory, name) for name in names
                  if name.startswith(f"{sandbox.CGROUP_PREFIX}.{os.getpid()}.")]
    return found


def timed_run(box: Sandbox, source: str, stdin: str = ""):
    start = time.monotonic()
    result = box.run_python(source, stdin)
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def box():
    with Sandbox(timeout_s=10.0) as shared:
        yield shared


def test_a_correct_program_gets_its_stdin_and_gives_its_stdout(box):
    assert box.network_isolation in sandbox.NETWORK_ISOLATIONS and box.isolation.files in sandbox.FILE_ISOLATIONS
    result = box.run_python("import sys\nwords = sys.stdin.read().split()\nprint(' '.join(reversed(words)))\n"
                            "print('note', file=sys.stderr)", "one two three")
    assert (result.stdout, result.stderr, result.exit_code, result.failure) == ("three two one\n", "note\n", 0, None)
    assert result.ok and 0 < result.wall_s < 5
    # A megabyte of input reaches a program that reads it, and one that never reads it still ends.
    big = "a" * (1 << 20)
    assert box.run_python("import sys; print(len(sys.stdin.read()))", big).stdout == f"{1 << 20}\n"
    assert box.run_python("print('done')", big).stdout == "done\n"


def test_an_exception_is_an_error_with_the_program_s_own_traceback(box):
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


@pytest.mark.skipif("memory" not in ISOLATION.cgroup, reason="no memory cgroup can be made here")
def test_processes_together_past_memory_mb_fail_with_memory_and_are_all_killed(run_dir):
    # Six processes of 30 MB each, every one within its own 64 MB of address space: 180 MB together, against 64.
    program = ("import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        block = bytearray(30 << 20)\n"
               "        for i in range(0, len(block), 4096):\n            block[i] = 1\n"
               "        print('held', flush=True)\n        time.sleep(30)\ntime.sleep(30)")
    before = our_cgroups()
    with Sandbox(memory_mb=64, timeout_s=20.0) as box:
        result, seconds = timed_run(box, program)
    assert result.failure == "memory", result
    assert result.stdout.count("held") <= 2 and seconds < 10, (result, seconds)  # killed at once, all of it
    wait_for(lambda: processes_in(run_dir) == [], 2.0)
    assert our_cgroups() == before  # the run's cgroup removed after it, the Sandbox's by close()


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


def test_loopback_and_name_lookups_fail_with_network(box):
    server = socket.create_server(("127.0.0.1", 0))
    resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resolver.bind(("127.0.0.1", 0))
    resolver.settimeout(0.2)
    try:
        socket.create_connection(server.getsockname(), timeout=1).close()  # reachable from here
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


@NAMESPACED
def test_the_network_namespace_holds_for_programs_the_program_starts(box):
    server = socket.create_server(("127.0.0.1", 0))
    try:
        # Another interpreter, without the sandbox's audit hook: only the kernel stands in its way.
        inner = f"import socket; socket.create_connection({server.getsockname()!r}, timeout=2)"
        result = box.run_python(f"import subprocess, sys\nsys.exit(subprocess.run([sys.executable, '-c', {inner!r}])"
                                ".returncode)")
        assert result.failure == "error" and "Network is unreachable" in result.stderr, result.stderr
    finally:
        server.close()


def test_without_namespaces_the_guard_refuses_sockets_lookups_processes_and_ctypes(monkeypatch):
    guarded(monkeypatch)
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


@pytest.mark.parametrize("network", ["guard", "namespace"])
def test_without_mounts_the_guard_refuses_writing_outside_the_working_directory(monkeypatch, outside_dir, network):
    if network == "namespace" and ISOLATION.network != "namespace":
        pytest.skip("the kernel refuses user namespaces here")
    guarded(monkeypatch, network)
    box = Sandbox()
    target = outside_dir / "events.jsonl"
    for source in (f"open({str(target)!r}, 'a').write('x')", f"import os\nos.remove({str(target)!r})",
                   f"import os\nos.rename({str(target)!r}, 'stolen')",
                   f"import shutil\nshutil.rmtree({str(outside_dir)!r})",
                   f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'a').write('x')",
                   f"import os\nos.chdir({str(outside_dir)!r})\nopen('new', 'w')",
                   f"import os\nos.open({str(outside_dir / 'new')!r}, os.O_WRONLY | os.O_CREAT)"):
        result = box.run_python(source)
        assert result.failure == "error" and "(outside the working directory) is not allowed" in result.stderr, \
            (source, result.stderr)
    assert sorted(os.listdir(outside_dir)) == ["events.jsonl"] and target.read_text() == "kept\n"
    # Its own directory, a temporary file, reading anything, /dev/null: as before.
    result = box.run_python("import os, tempfile\nopen('mine', 'w').write('x')\nos.makedirs('a/b')\n"
                            "os.rename('mine', 'a/b/mine')\nwith tempfile.NamedTemporaryFile() as f:\n"
                            "    f.write(b'x')\n"
                            f"open('/dev/null', 'w').write('x')\nprint(open({str(target)!r}).read().strip(),"
                            " sorted(os.listdir('.')))")
    assert (result.failure, result.stdout) == (None, "kept ['a', 'main.py']\n"), result


@READ_ONLY
def test_a_program_cannot_write_any_file_the_launcher_or_the_interpreter_reads(box):
    # Opened for appending and closed at once: nothing would be written even where the open succeeded.
    program = """
import ctypes, json, os, sys
read = {m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
read.add(os.path.realpath(sys.executable))
read = {path for path in read if not os.path.abspath(path).startswith(os.getcwd() + "/")}  # not its own main.py
for path in sorted(read):
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        print("writable", path)
    except OSError:
        pass
print("checked", len(read))
"""
    result = box.run_python(program)
    assert result.ok and "writable" not in result.stdout, result
    assert int(result.stdout.split()[-1]) > 20


@READ_ONLY
def test_nothing_a_program_writes_outlives_its_run(box, run_dir):
    marker = f"grpo_jax_marker_{os.getpid()}"
    for place in ("/tmp", "/dev/shm"):  # where the code before this fix left them
        request_cleanup = pathlib.Path(place, marker)
        if request_cleanup.exists():
            request_cleanup.unlink()
    program = ("import os\nfor place in ('/tmp', '/dev/shm', os.getcwd()):\n"
               f"    open(os.path.join(place, {marker!r}), 'w').write('x')\n"
               f"print(sorted(os.path.exists(os.path.join(p, {marker!r})) for p in ('/tmp', '/dev/shm')))")
    assert box.run_python(program).stdout == "[True, True]\n"  # a private /tmp and /dev/shm, writable
    left = [place for place in ("/tmp", "/dev/shm") if os.path.exists(f"{place}/{marker}")]
    for place in left:
        os.remove(f"{place}/{marker}")
    assert left == []
    second = box.run_python(f"import os\nprint([os.path.exists(os.path.join(p, {marker!r})) for p in ('/tmp', "
                            "'/dev/shm', '.')])")
    assert second.stdout == "[False, False, False]\n"
    assert os.listdir(run_dir) == []  # its working directories removed


@READ_ONLY
def test_a_program_cannot_touch_a_run_directory_nor_see_the_trainer_s_processes(box, outside_dir):
    target = outside_dir / "events.jsonl"
    paths = [str(target), f"/proc/{os.getpid()}/root{target}", f"/proc/{os.getpid()}/cwd/events.jsonl"]
    os.chdir(outside_dir)  # as a trainer started in its run directory
    try:
        program = f"""
import os, shutil
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for path in {paths!r}:
    changes = (lambda: open(path, "a").write("x"), lambda: os.remove(path),
               lambda: shutil.rmtree(os.path.dirname(path)))
    for change in changes:
        try:
            change()
            print("changed", path)
        except OSError as e:
            print("refused", e.errno)
"""
        result = box.run_python(program)
    finally:
        os.chdir(REPO)
    assert result.ok and "changed" not in result.stdout, result
    assert result.stdout.splitlines()[0] == "pids [1, 2]"  # its init and itself: the trainer's are not there
    assert {int(line.split()[1]) for line in result.stdout.splitlines()[1:]} <= {errno.EROFS, errno.ENOENT,
                                                                               errno.EACCES}
    assert sorted(os.listdir(outside_dir)) == ["events.jsonl"] and target.read_text() == "kept\n"


@READ_ONLY
def test_the_trainer_s_home_and_sockets_are_hidden_but_the_interpreter_is_not(box):
    home = sandbox._masks()
    program = ("import os, subprocess, sys\nprint(os.listdir('/run'))\n"
               "print(subprocess.run([sys.executable, '-c', 'import fractions; print(2)'], capture_output=True,"
               " text=True).stdout.strip())")
    result = box.run_python(program)
    assert result.stdout == "[]\n2\n", (result, home)
    hidden = [path for path, private in home if not private and path != "/run"]
    for path in hidden:  # the home directory: only the interpreter's own directories in it, if any
        listing = box.run_python(f"import os\nprint(sorted(os.listdir({path!r})))").stdout
        assert set(eval(listing)) <= {os.path.relpath(p, path).split("/")[0] for p in sandbox._kept_paths()}


@NAMESPACED
def test_a_program_holds_no_capability_and_cannot_undo_its_mounts(box):
    result = box.run_python("import ctypes, os\nstatus = open('/proc/self/status').read()\n"
                            "print([line.split()[1] for line in status.splitlines() if line.startswith(('CapEff', "
                            "'CapPrm', 'NoNewPrivs'))])\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "print(libc.umount2(b'/proc', 2), ctypes.get_errno())")
    assert result.stdout == f"['0000000000000000', '0000000000000000', '1']\n-1 {errno.EPERM}\n", result


@NAMESPACED
def test_processes_a_program_starts_die_with_it_at_the_timeout_even_outside_its_group(run_dir):
    box = Sandbox(timeout_s=1.0)
    program = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        os.setsid()\n"
               "        os.execv('/bin/sleep', ['sleep', '60'])\nprint('started', flush=True)\ntime.sleep(60)")
    result, seconds = timed_run(box, program)
    assert result.failure == "timeout" and result.stdout == "started\n" and seconds < 1.0 + SLACK_S
    wait_for(lambda: processes_in(run_dir) == [], 2.0)


def test_limits_hold_for_processes_even_for_a_root_trainer(run_dir):
    box = Sandbox(max_processes=8, timeout_s=20.0)
    if box.network_isolation != "namespace":
        pytest.skip("without a PID namespace the guard refuses starting processes (tested above)")
    if os.geteuid() == 0 and not box.runs_as_nobody and "pids" not in box.isolation.cgroup:
        pytest.skip("programs run as root here, without a pids cgroup: max_processes does not hold (documented)")
    program = ("import os, signal\nstarted = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        signal.pause()\n    started += 1\n"
               "print(started + 1)")
    result = box.run_python(program)
    assert result.ok and int(result.stdout) == 8, result  # the program and 7 children: max_processes at once
    threads = box.run_python("import threading, time\nstarted = 0\nfor _ in range(40):\n    try:\n"
                             "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
                             "    except RuntimeError:\n        break\n    started += 1\nprint(started + 1)")
    assert threads.ok and int(threads.stdout) <= 8, threads


def test_a_root_trainer_s_programs_run_as_nobody_where_they_can(box):
    if os.geteuid() != 0:
        pytest.skip("only root drops to nobody")
    uid = box.run_python("import os\nprint(os.getuid(), open('/proc/self/uid_map').read().split())").stdout.split()
    if box.runs_as_nobody and box.network_isolation == "namespace":
        assert uid[0] == str(sandbox.INSIDE_ID) and eval(" ".join(uid[1:])) == [str(sandbox.INSIDE_ID),
                                                                                 str(sandbox.NOBODY), "1"]
    elif box.runs_as_nobody:
        assert uid[0] == str(sandbox.NOBODY)


def test_the_environment_is_scrubbed_and_the_working_directory_is_fresh_and_removed(monkeypatch, box):
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb")
    monkeypatch.setenv("HF_TOKEN", "secret-hf")
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


def test_six_threads_share_two_workers_never_more():
    box = Sandbox(workers=2, timeout_s=10.0)
    program = "import time\nstart = time.time()\ntime.sleep(0.2)\nprint(start, time.time())"
    results = [None] * 6

    def run(i):
        results[i] = box.run_python(program)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
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


def test_close_kills_the_running_programs_refuses_more_and_removes_its_cgroups(run_dir):
    before = our_cgroups()
    box = Sandbox(timeout_s=30.0)
    outcome = {}

    def run():
        try:
            box.run_python("import time\nopen('started', 'w').close()\ntime.sleep(60)")
        except SandboxError as e:
            outcome["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: any((run_dir / name / "started").exists() for name in os.listdir(run_dir)))
    assert processes_in(run_dir)
    box.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and outcome["error"] == "the sandbox was closed while the program ran"
    wait_for(lambda: processes_in(run_dir) == [], 2.0)
    assert os.listdir(run_dir) == [] and our_cgroups() == before
    with pytest.raises(SandboxError, match="closed"):
        box.run_python("print(1)")


@pytest.mark.parametrize("end", ["exits", "is killed"])
def test_programs_still_running_when_the_interpreter_ends_are_killed(run_dir, end):
    script = f"""
import os, signal, threading, time
from grpo_jax.sandbox import Sandbox
box = Sandbox(timeout_s=60.0)
threading.Thread(target=box.run_python, args=("import time\\nopen('started', 'w').close()\\ntime.sleep(60)",),
                 daemon=True).start()
give_up = time.monotonic() + 10
while not any(os.path.exists(os.path.join({str(run_dir)!r}, d, "started")) for d in os.listdir({str(run_dir)!r})):
    assert time.monotonic() < give_up
    time.sleep(0.01)
print(os.getpid(), flush=True)
if {end == "is killed"}:  # no atexit, no finalizer: only the kernel can end the program
    os.kill(os.getpid(), signal.SIGKILL)
"""
    ended = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=30, capture_output=True, text=True,
                           env={**os.environ, "TMPDIR": str(run_dir)})
    assert ended.returncode == (-signal.SIGKILL if end == "is killed" else 0), ended.stderr
    wait_for(lambda: processes_in(run_dir) == [], 2.0)
    pid = int(ended.stdout)
    left = [path for place in sandbox._cgroup_places() for path in
            (os.path.join(place.directory, name) for name in os.listdir(place.directory))
            if os.path.basename(path).startswith(f"{sandbox.CGROUP_PREFIX}.{pid}.")]
    if end == "exits":
        assert os.listdir(run_dir) == [] and left == []
    else:  # its working directory and its cgroups stay (documented): the next Sandbox's first run removes the latter
        assert len(os.listdir(run_dir)) == 1 and len(left) == len(sandbox._places_for(ISOLATION))
        with Sandbox() as next_box:
            assert next_box.run_python("print(1)").ok
        assert not any(os.path.exists(path) for path in left)


def test_a_sandbox_leaves_no_cgroup_behind(box):
    if not ISOLATION.cgroup:
        pytest.skip("no cgroup can be made here")
    before = our_cgroups()
    with Sandbox() as other:
        assert other.run_python("print(1)").ok
        made = set(our_cgroups()) - set(before)
        assert len(made) == len(sandbox._places_for(ISOLATION))  # a parent in each hierarchy
        assert not any(entry.is_dir() for path in made for entry in os.scandir(path))  # no run's left in them
    assert our_cgroups() == before


def test_a_failure_of_the_sandbox_itself_is_a_sandbox_error_never_a_failure(monkeypatch, box):
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tmp")  # as a temporary directory gone, or full
    with pytest.raises(SandboxError, match="could not make the program's working directory in /nonexistent/tmp"):
        box.run_python("print(1)")
    monkeypatch.undo()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(SandboxError, match="could not start /nonexistent/python"):
        box.run_python("print(1)")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_probe_reports_only_what_holds_and_says_what_does_not_in_one_line(monkeypatch):
    if ISOLATION.network != "namespace":
        pytest.skip("the kernel refuses user namespaces here: nothing to break")
    # A setup whose namespaces leave the network open: the probe's program reaches the host, so no "namespace".
    monkeypatch.setattr(sandbox, "NAMESPACES", sandbox.NAMESPACES & ~sandbox.CLONE_NEWNET)
    sandbox.probe_isolation.cache_clear()
    try:
        said = Lines()
        logging.getLogger("grpo_jax.sandbox").addHandler(said)
        try:
            isolation = sandbox.probe_isolation()
        finally:
            logging.getLogger("grpo_jax.sandbox").removeHandler(said)
        assert isolation.network == "guard" and isolation.files == "guard"
        warnings = said.lines
        assert len(warnings) == 1 and "\n" not in warnings[0], warnings
        assert warnings[0].startswith("sandbox: no namespaces that isolate here: the network, starting processes "
                                      "and writing outside its directory are refused by a Python audit hook only")
        assert "docs/data-and-rewards.md" in warnings[0]
    finally:
        sandbox.probe_isolation.cache_clear()
        monkeypatch.undo()
        assert sandbox.probe_isolation() == ISOLATION


def test_threads_that_make_their_first_sandboxes_at_once_get_one_probe_s_isolation():
    sandbox.probe_isolation.cache_clear()  # as an environment's first tool calls, on their threads
    found = []
    threads = [threading.Thread(target=lambda: found.append(Sandbox().isolation)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == [ISOLATION] * 4


@READ_ONLY
def test_the_probe_of_a_trainer_started_in_tmp_finds_the_same(monkeypatch):
    monkeypatch.chdir("/tmp")  # where its programs' writes land in their private /tmp, not the trainer's
    sandbox.probe_isolation.cache_clear()
    try:
        assert sandbox.probe_isolation() == ISOLATION
    finally:
        sandbox.probe_isolation.cache_clear()
        monkeypatch.undo()
        assert sandbox.probe_isolation() == ISOLATION


@READ_ONLY
def test_where_mount_setattr_is_missing_each_mount_is_remounted_read_only(monkeypatch, outside_dir):
    monkeypatch.setattr(sandbox, "MOUNT_SETATTR", 100_000)  # no such syscall: ENOSYS, as before Linux 5.12
    box = Sandbox()
    target = outside_dir / "events.jsonl"
    result = box.run_python(f"import os\nopen('mine', 'w').write('x')\nopen('/tmp/t', 'w').write('x')\n"
                            f"for path in ({str(target)!r}, os.path.dirname(os.__file__) + '/os.py'):\n"
                            "    try:\n        open(path, 'a')\n        print('WROTE', path)\n"
                            "    except OSError as e:\n        print(e.errno)")
    first, second = result.stdout.split()  # the run directory open to all, the standard library root's
    assert int(first) == errno.EROFS and int(second) in (errno.EROFS, errno.EACCES), result


def test_cgroups_are_made_in_v2_where_its_unified_hierarchy_hands_out_the_controller_else_in_v1(monkeypatch, tmp_path):
    unified, memory = tmp_path / "unified", tmp_path / "memory"
    for directory, files in {unified: {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": "memory"},
                             unified / "a": {"cgroup.subtree_control": "memory pids"},
                             unified / "a" / "b": {"cgroup.subtree_control": ""},  # the trainer's: processes in it
                             memory / "job": {}}.items():
        directory.mkdir(parents=True)
        for name, text in files.items():
            (directory / name).write_text(text)
    files = {"/proc/self/mountinfo": f"30 1 0:26 / {unified} rw - cgroup2 cgroup2 rw\n"
                                     f"31 1 0:27 / {memory} rw - cgroup cgroup rw,memory\n",
             "/proc/self/cgroup": "0::/a/b\n4:memory:/job\n"}
    real_read = sandbox._read
    monkeypatch.setattr(sandbox, "_read", lambda path: files[path] if path in files else real_read(path))
    # The nearest ancestor that hands both to its children: both in v2, none in v1.
    assert sandbox._cgroup_places() == (sandbox._CgroupPlace(2, str(unified / "a"), ("memory", "pids")),)
    (unified / "cgroup.controllers").write_text("cpu memory")  # v2 without pids: pids nowhere (no v1 pids here)
    assert sandbox._cgroup_places() == (sandbox._CgroupPlace(2, str(unified / "a"), ("memory",)),)
    (unified / "cgroup.controllers").write_text("hugetlb")  # a hybrid, as the machine this was built on
    assert sandbox._cgroup_places() == (sandbox._CgroupPlace(1, str(memory / "job"), ("memory",)),)


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
