"""Run untrusted Python source (a model's program, a verifier's check) in child processes with hard limits.

`Sandbox(timeout_s=..., memory_mb=..., ...)` holds the limits; `run_python(source, stdin)` runs `source` as the
`__main__` of a fresh interpreter and returns a `SandboxResult`: stdout, stderr, exit code, wall seconds, and
`failure`, None when the program ran to completion with exit code 0 within every limit, else why not:

  "timeout"       still running `timeout_s` after it started: the sandbox killed it (and everything it started)
  "cpu"           killed by RLIMIT_CPU after `cpu_s` seconds of CPU time
  "memory"        died of a MemoryError (RLIMIT_AS: `memory_mb` of address space per process)
  "output_limit"  wrote more than `max_output_bytes` to stdout or to stderr: killed there, the output cut there
  "network"       exited non-zero after trying to reach the network (refused, see below)
  "error"         any other non-zero exit or death (an exception: its traceback is in stderr)

Those are the program's failures. A failure of the sandbox itself (the child cannot be started, the kernel
refuses the namespaces it was found to allow) raises SandboxError: not the program's fault.

Each run is one child process, `python -I -S -B` (isolated mode, no site-packages: the standard library only),
started in a new session with a scrubbed environment (PATH and LANG are kept; HOME and TMPDIR point at its
working directory; nothing else, so no WANDB_API_KEY, HF_TOKEN, ... reaches it), in a fresh temporary working
directory that is removed afterwards, with stdin, stdout and stderr on pipes. A small launcher in the child sets
RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE (`max_file_bytes` per file written), RLIMIT_NOFILE (OPEN_FILES) and
RLIMIT_NPROC (`max_processes`; Linux never applies it to root), then runs the source. At the deadline, or when
the output passes its limit, the child's whole process group is killed with SIGKILL. run_python is safe to call
from many threads at once: at most `workers` children run at a time, the other calls wait for a slot (the
wait is not part of the program's `timeout_s`). close() kills the children running now and refuses later runs;
children still running when the interpreter exits are killed then (and their directories removed), and a child
dies with the thread that started it (PR_SET_PDEATHSIG): a trainer killed with SIGKILL leaves no program running,
only the working directories of the runs it was in (grpo_jax_sandbox_* in the temporary directory).

Isolation, probed once per process (`probe_isolation`) and recorded on each Sandbox:

- `network_isolation == "namespace"`: the launcher enters new user, network and PID namespaces
  (unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID), through ctypes). The kernel then gives the program no
  network interface but a loopback that is down: every IP connection, 127.0.0.1 included, and every DNS query
  fails, for the program and for anything it starts (curl, another python), whatever library it goes
  through. The namespace's init is a small waiter of the launcher's, in the process group the sandbox kills:
  when the program ends, or the group is killed, init ends and the kernel kills every process in the
  namespace, even one that left the process group. Unix sockets that are files (/var/run/docker.sock) are not
  network-namespaced: a Python-level audit hook refuses the program's connections to them, which code that
  calls libc itself (ctypes, a program it starts) gets past.
- `network_isolation == "guard"`, where the kernel refuses those namespaces: a Python audit hook in the
  child refuses IP sockets, name lookups, connecting to Unix sockets, starting processes (fork, exec,
  subprocess, os.system) and ctypes. It stops ordinary code (urllib, requests-style socket use, a
  subprocess running curl) but not code written to get around it: only the interpreter's own checks stand
  in the way, not the kernel's. With processes refused, killing the process group kills all of it.

Files: there is no filesystem isolation. The program reads and writes what its user may: when the trainer runs
as root and the interpreter's standard library is readable by others, the launcher first drops to user and
group 65534 (nobody: `runs_as_nobody`), which also makes RLIMIT_NPROC apply; otherwise it runs as the trainer's
user, as root where the trainer is root (in the user namespace without root's capabilities, but owning what root
owns). RLIMIT_AS bounds address space, not resident memory: a program that starts threads reserves address
space for each.

A run costs a process start: 25 to 45 ms with the namespaces, 20 to 25 ms with the guard (median, `print(1)`, on
a 2-core machine shared with other jobs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

FAILURES = ("timeout", "cpu", "memory", "output_limit", "network", "error")
NETWORK_ISOLATIONS = ("namespace", "guard")  # strongest first
OPEN_FILES = 64  # RLIMIT_NOFILE: enough for a program's own files and pipes, too few to exhaust the host's
NOBODY = 65534  # the uid and gid a root trainer's programs run as, where they can still read the standard library
MIN_MEMORY_MB = 64  # the interpreter and launcher alone take about 15 MB of address space
READ_CHUNK = 65536


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not the program's failure)."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One run. `exit_code` as subprocess gives it: the program's exit status, or -N when a signal N ended it
    (-9 when the sandbox killed it). `failure`: None or one of FAILURES (module docstring). `stdout` and
    `stderr` are decoded as UTF-8 (undecodable bytes replaced), each at most max_output_bytes long."""

    stdout: str
    stderr: str
    exit_code: int
    failure: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.failure is None


# The child: `python -I -S -B -c _LAUNCHER CONFIG STATUS_FD`, in its working directory, which holds main.py. It
# tells the parent through STATUS_FD, a line each: "ready" just before the program runs (so a launcher that fails
# before is the sandbox's failure), "memory" on the program's uncaught MemoryError, "network" on its first
# network attempt, and in a PID namespace "exit N", the program's exit code (the child's own is its launcher's).
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys, _socket
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, PR_SET_PDEATHSIG = 0x10000000, 0x20000000, 0x40000000, 1
config = json.loads(sys.argv[1])
status_fd = int(sys.argv[2])
os.set_inheritable(status_fd, False)
told = set()

def tell(word):
    if word not in told:
        told.add(word)
        try:
            os.write(status_fd, word.encode() + b"\n")
        except OSError:
            pass

libc = ctypes.CDLL(None, use_errno=True)  # loaded before dropping to nobody, who may not read the standard library
if config["drop_to"] is not None:
    os.setgroups([])
    os.setgid(config["drop_to"])
    os.setuid(config["drop_to"])
if config["network"] == "namespace" and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
    tell("unshare refused: " + os.strerror(ctypes.get_errno()))
    os._exit(70)
# Die with the thread that started this launcher, even when it is killed before it can kill this process group.
# Set after the changes of credentials above, which clear it.
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != config["parent"]:  # it died before that
    os._exit(70)
if config["network"] == "namespace":
    if os.fork():  # the launcher, outside the namespace: waits for its init
        os.wait()
        os._exit(0)
    # Init of the new PID namespace, in the process group the parent kills, and dying with the launcher: when it
    # ends, the kernel kills every process in the namespace. Not the program: init ignores the signals it has no
    # handler for, RLIMIT_CPU's too.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    program = os.fork()
    if program:
        while True:  # reaping orphans, as init must, until the program ends
            pid, status = os.wait()
            if pid == program:
                tell(f"exit {os.waitstatus_to_exitcode(status)}")
                os._exit(0)
if config["probe"]:
    import fractions  # a module the launcher has not loaded: the standard library is readable as this user
    os._exit(0)

guard = config["network"] == "guard"
# Without the namespaces, starting a program (curl, another python) or calling libc through ctypes would get past the
# guard: it refuses them too.
GUARDED_EVENTS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
                  "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function"}
LOOKUP_EVENTS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
ADDRESS_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}

def reaches_another_process(address):
    # A Unix socket address names another process's socket: a path, a file that no network namespace hides (a
    # docker daemon's, maybe), or a name that starts with a NUL byte, in the network namespace's own table.
    if not isinstance(address, (str, bytes)) or not address:
        return False  # a socket pair's: no address
    return guard or address[:1] not in ("\0", b"\0")

def refuse(event):
    raise PermissionError(f"sandbox: {event} is not allowed here")

def audit(event, args):
    if event in LOOKUP_EVENTS:
        tell("network")
        if guard:
            refuse(event)
    elif event == "socket.__new__" and args[1] != _socket.AF_UNIX:
        if guard:
            tell("network")
            refuse("an IP socket")
    elif event in ADDRESS_EVENTS:
        if args[0].family != _socket.AF_UNIX:
            tell("network")
            if guard:
                refuse(event)
        elif event != "socket.bind" and reaches_another_process(args[1]):
            tell("network")
            refuse(f"{event} to another process's Unix socket")
    elif guard and event in GUARDED_EVENTS:
        refuse(event)

with open("main.py", encoding="utf-8") as f:
    source = f.read()
MB = 1 << 20
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (config["max_file_bytes"], config["max_file_bytes"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (config["open_files"], config["open_files"]))
processes = config["max_processes"] + (2 if config["network"] == "namespace" else 0)  # the launcher's and init
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
resource.setrlimit(resource.RLIMIT_AS, (config["memory_mb"] * MB, config["memory_mb"] * MB))
sys.addaudithook(audit)
sys.argv = ["main.py"]
sys.path.insert(0, os.getcwd())
main = type(sys)("__main__")  # a module of its own, which pickle finds its functions in as it would a script's
main.__file__ = "main.py"
sys.modules["__main__"] = main
del libc, ctypes  # the launcher's frame is within the program's reach: no libc handle in it
if guard:  # and importing ctypes again loads libc, which the guard refuses
    for name in [name for name in sys.modules if name == "ctypes" or name.startswith("ctypes.")]:
        del sys.modules[name]
tell("ready")
try:
    exec(compile(source, "main.py", "exec"), main.__dict__)
except SystemExit:
    raise
except BaseException as error:
    if isinstance(error, MemoryError):
        tell("memory")
    error = error.with_traceback(error.__traceback__.tb_next)  # without the launcher's frame
    sys.excepthook(type(error), error, error.__traceback__)
    sys.exit(1)
"""


@functools.cache
def probe_isolation() -> tuple[str, bool]:
    """(network_isolation, runs_as_nobody) for this process's sandboxes: the strongest setup a child really gets
    here, found by starting the launcher in each, strongest first (a few tens of milliseconds, once)."""
    drops = (True, False) if os.geteuid() == 0 else (False,)
    for network in NETWORK_ISOLATIONS:
        for drop in drops:
            if _launcher_starts(network, drop):
                return network, drop
    return "guard", False


def _launcher_starts(network: str, drop: bool) -> bool:
    config = {"network": network, "drop_to": NOBODY if drop else None, "probe": True, "parent": os.getpid()}
    status_read, status_write = os.pipe()
    with open(status_read, "rb") as status:
        try:
            probe = subprocess.run(_command(config, status_write), pass_fds=(status_write,), cwd="/",
                                   env=_scrubbed_environment("/"), stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        finally:
            os.close(status_write)
        told = status.read().decode("utf-8", "replace").splitlines()
    return _exit_code(told, probe.returncode) == 0


def _exit_code(told: list[str], returncode: int) -> int:
    """The program's exit code: the last its PID namespace's init told, else the child's own. (The program can
    write to the status pipe too, which can only mislead about itself: whatever it wrote, init writes last.)"""
    codes = [int(line[len("exit "):]) for line in told if re.fullmatch(r"exit -?\d+", line)]
    return codes[-1] if codes else returncode


def _command(config: dict, status_fd: int) -> list[str]:
    return [sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(config), str(status_fd)]


def _scrubbed_environment(home: str) -> dict[str, str]:
    """Only what a program needs to find programs and decode text: no inherited secrets."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": home, "TMPDIR": home}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sandbox:
    """Limits for each program run (module docstring); `network_isolation` and `runs_as_nobody` say what the
    kernel allowed here (probe_isolation)."""

    timeout_s: float = 5.0  # wall clock from the child's start (interpreter start-up included) to its kill
    cpu_s: int = 5  # RLIMIT_CPU, seconds of CPU time per process
    memory_mb: int = 512  # RLIMIT_AS, address space per process
    max_output_bytes: int = 65536  # per stream (stdout, stderr); a program that writes more is killed there
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write (per file, not a quota)
    max_processes: int = 32  # RLIMIT_NPROC: the program's processes, itself included (not applied to root)
    workers: int = 4  # programs running at once; more calls wait for a slot
    network_isolation: str = dataclasses.field(init=False, compare=False)
    runs_as_nobody: bool = dataclasses.field(init=False, compare=False)

    def __post_init__(self):
        timeout = self.timeout_s
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout_s={timeout!r}: must be a number > 0 (the wall-clock seconds a program may run)")
        for key, minimum, meaning in (("cpu_s", 1, "seconds of CPU time a process may use"),
                                      ("memory_mb", MIN_MEMORY_MB, "MB of address space per process; the "
                                                                   "interpreter alone takes about 15"),
                                      ("max_output_bytes", 1, "bytes of stdout, and of stderr, a program may write"),
                                      ("max_file_bytes", 1, "bytes a program may write to one file"),
                                      ("max_processes", 1, "processes the program may have at once, itself "
                                                           "included"),
                                      ("workers", 1, "programs running at once")):
            value = getattr(self, key)
            if not (_is_int(value) and value >= minimum):
                raise ValueError(f"{key}={value!r}: must be an integer >= {minimum} ({meaning})")
        network, nobody = probe_isolation()
        object.__setattr__(self, "network_isolation", network)
        object.__setattr__(self, "runs_as_nobody", nobody)
        object.__setattr__(self, "_slots", threading.BoundedSemaphore(self.workers))
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_closed", threading.Event())
        object.__setattr__(self, "_live", {})  # the children running now: their working directories
        # At interpreter exit (or when the sandbox is collected) the children still running are killed.
        object.__setattr__(self, "_finalizer", weakref.finalize(self, _end_all, self._live))

    def close(self) -> None:
        """Kill the programs running now (their run_python calls raise SandboxError) and refuse later runs."""
        with self._lock:
            self._closed.set()
            live = list(self._live)
        for process in live:
            _kill_group(process)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_python(self, source: str, stdin: str = "") -> SandboxResult:
        """Run `source` as a program's __main__ with `stdin` as its standard input (module docstring)."""
        if not isinstance(source, str) or not isinstance(stdin, str):
            raise TypeError(f"run_python(source: {type(source).__name__}, stdin: {type(stdin).__name__}): "
                            "both must be str")
        with self._slots:
            if self._closed.is_set():
                raise SandboxError("the sandbox is closed")
            workdir = tempfile.mkdtemp(prefix="grpo_jax_sandbox_")
            try:
                return self._run_in(workdir, source, stdin)
            finally:
                _remove_tree(workdir)

    def _run_in(self, workdir: str, source: str, stdin: str) -> SandboxResult:
        main = os.path.join(workdir, "main.py")
        with open(main, "w", encoding="utf-8") as f:
            f.write(source)
        if self.runs_as_nobody:
            for path in (workdir, main):
                os.chown(path, NOBODY, NOBODY)
        config = {"network": self.network_isolation, "drop_to": NOBODY if self.runs_as_nobody else None,
                  "probe": False, "parent": os.getpid(), "cpu_s": self.cpu_s, "memory_mb": self.memory_mb,
                  "max_file_bytes": self.max_file_bytes, "max_processes": self.max_processes,
                  "open_files": OPEN_FILES}
        status_read, status_write = os.pipe()
        start = time.monotonic()
        try:
            process = subprocess.Popen(_command(config, status_write), pass_fds=(status_write,), cwd=workdir,
                                       env=_scrubbed_environment(workdir), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            os.close(status_read)
            raise SandboxError(f"could not start {sys.executable}: {e}") from e
        finally:
            os.close(status_write)
        with self._lock:
            self._live[process] = workdir
            if self._closed.is_set():  # closed since this call took its slot
                _kill_group(process)
        try:
            with open(status_read, "rb") as status:
                outcome = _Exchange(process, status, stdin.encode(), start + self.timeout_s,
                                    self.max_output_bytes).run()
        finally:
            _kill(process)
            with self._lock:
                del self._live[process]
        wall_s = time.monotonic() - start
        if self._closed.is_set() and process.returncode < 0:
            raise SandboxError("the sandbox was closed while the program ran")
        if "ready" not in outcome.told and outcome.killed != "timeout":
            said = [line for line in outcome.told if line.startswith("unshare")] or [outcome.stderr.strip()[-500:]]
            raise SandboxError(f"its launcher failed before the program started (exit code {process.returncode}): "
                               f"{said[0]}")
        exit_code = _exit_code(outcome.told, process.returncode)
        return SandboxResult(outcome.stdout, outcome.stderr, exit_code,
                             _failure(outcome.killed, outcome.told, exit_code), wall_s)


LIMITS = tuple(f.name for f in dataclasses.fields(Sandbox) if f.init)  # the keyword arguments Sandbox takes


def _failure(killed: str | None, told: list[str], exit_code: int) -> str | None:
    """Why the run failed (FAILURES), or None."""
    if killed:
        return killed
    if exit_code == -signal.SIGXCPU:
        return "cpu"
    if exit_code == 0:
        return None
    if "memory" in told:
        return "memory"
    if "network" in told:
        return "network"
    return "error"


class _Exchange:
    """One child's pipes, served from the calling thread until the child closes its output or must be killed:
    stdin written as the child takes it, stdout and stderr read up to their limit, the status words read."""

    def __init__(self, process: subprocess.Popen, status, stdin: bytes, deadline: float, max_output_bytes: int):
        self.process, self.status, self.stdin = process, status, stdin
        self.deadline, self.max_output_bytes = deadline, max_output_bytes
        self.output = {process.stdout: bytearray(), process.stderr: bytearray()}
        self.status_bytes = bytearray()
        self.killed: str | None = None  # "timeout" or "output_limit" when the sandbox killed the child

    @property
    def stdout(self) -> str:
        return self.output[self.process.stdout][:self.max_output_bytes].decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.output[self.process.stderr][:self.max_output_bytes].decode("utf-8", "replace")

    @property
    def told(self) -> list[str]:
        return self.status_bytes.decode("utf-8", "replace").splitlines()

    def run(self) -> _Exchange:
        with selectors.DefaultSelector() as selector:
            for stream in (self.process.stdout, self.process.stderr, self.status):
                selector.register(stream, selectors.EVENT_READ)
            if self.stdin:
                os.set_blocking(self.process.stdin.fileno(), False)
                selector.register(self.process.stdin, selectors.EVENT_WRITE)
            else:
                self.process.stdin.close()
            while len(selector.get_map()) > 0 and self.killed is None:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self.killed = "timeout"
                    break
                for key, _ in selector.select(remaining):
                    self._serve(selector, key.fileobj)
        if self.killed is None:  # the output is closed: the program has ended, or closed it and runs on
            try:
                self.process.wait(max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.killed = "timeout"
        return self

    def _serve(self, selector: selectors.BaseSelector, stream) -> None:
        if stream is self.process.stdin:
            try:
                written = os.write(stream.fileno(), self.stdin[:READ_CHUNK])
            except BlockingIOError:
                return
            except BrokenPipeError:  # the program stopped reading: the rest of its input is not wanted
                written = len(self.stdin)
            self.stdin = self.stdin[written:]
            if not self.stdin:
                selector.unregister(stream)
                stream.close()
            return
        chunk = os.read(stream.fileno(), READ_CHUNK)
        if not chunk:
            selector.unregister(stream)
            return
        if stream is self.status:
            self.status_bytes += chunk
            return
        kept = self.output[stream]
        kept += chunk[:self.max_output_bytes + 1 - len(kept)]
        if len(kept) > self.max_output_bytes:
            self.killed = "output_limit"


def _kill(process: subprocess.Popen) -> None:
    """Kill the child's process group and reap the child."""
    _kill_group(process)
    process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except OSError:  # stdin with input the program never read
                pass


def _kill_group(process: subprocess.Popen) -> None:
    """Only until the child is reaped is its pid, the group's id, sure not to be reused."""
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _end_all(live: dict) -> None:
    """At interpreter exit, for the threads still waiting on children, which will not clean up after them."""
    for process, workdir in list(live.items()):
        _kill_group(process)
        _remove_tree(workdir)


def _remove_tree(path: str) -> None:
    """Remove a run's working directory, even where the program took away the permissions to."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
