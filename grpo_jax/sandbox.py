"""Run untrusted Python source (a model's program, a verifier's check) in child processes with hard limits.

`Sandbox(timeout_s=..., memory_mb=..., ...)` holds the limits; `run_python(source, stdin)` runs `source` as the
`__main__` of a fresh interpreter and returns a `SandboxResult`: stdout, stderr, exit code, wall seconds, and
`failure`, None when the program ran to completion with exit code 0 within every limit, else why not:

  "timeout"       still running `timeout_s` after it started: the sandbox killed it (and everything it started)
  "cpu"           killed by RLIMIT_CPU after `cpu_s` seconds of CPU time
  "memory"        died of a MemoryError (RLIMIT_AS: `memory_mb` of address space per process), or its processes
                  together went past `memory_mb` resident (its cgroup, where there is one): all of them killed
  "output_limit"  wrote more than `max_output_bytes` to stdout or to stderr: killed there, the output cut there
  "network"       exited non-zero after trying to reach the network (refused, see below)
  "error"         any other non-zero exit or death (an exception: its traceback is in stderr)

Those are the program's failures. A failure of the sandbox itself raises SandboxError, never a `failure`: the
working directory cannot be made (a full or missing temporary directory), the child cannot be started, its cgroup
cannot be made, the kernel refuses a namespace or a mount it was found to allow.

Each run is one child process, `python -I -S -B` (isolated mode, no site-packages: the standard library only),
started in a new session with a scrubbed environment (PATH and LANG are kept; HOME and TMPDIR point at its
working directory; nothing else, so no WANDB_API_KEY, HF_TOKEN, ... reaches it), in a fresh temporary working
directory that is removed afterwards, with stdin, stdout and stderr on pipes. A small launcher in the child joins
the run's cgroups, enters the namespaces, makes the mounts, drops every capability and sets PR_SET_NO_NEW_PRIVS,
RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE (`max_file_bytes` per file written), RLIMIT_NOFILE (OPEN_FILES) and, in a user
namespace, RLIMIT_NPROC (`max_processes`, counted in that namespace alone), then runs the source. Before it enters
the namespaces it reads only the interpreter's own files (its start-up modules, ctypes, resource): with the files
isolated (below) no program could have written them. At the deadline, or when the output passes its limit, the
child's whole process group is killed with SIGKILL. run_python is safe to call from many threads at once: at most
`workers` children run at a time, the other calls wait for a slot (the wait is not part of the program's
`timeout_s`). close() kills the children running now and refuses later runs; children still running when the
interpreter exits are killed then (and their directories removed), and a child dies with the thread that started
it (PR_SET_PDEATHSIG): a trainer killed with SIGKILL leaves no program running, only the working directories of
the runs it was in (grpo_jax_sandbox_* in the temporary directory) and its empty cgroups, which the next Sandbox
made on the machine removes.

Isolation, probed once per process (`probe_isolation`: the strongest setup whose every claim a probe program run in
it confirms) and recorded on each Sandbox as an `Isolation`:

- `network == "namespace"`: the launcher enters new user, mount, network and PID namespaces (unshare, through
  ctypes; the users are mapped by the launcher outside). The kernel then gives the program no network interface
  but a loopback that is down: every IP connection, 127.0.0.1 included, and every DNS query fails, for the program
  and for anything it starts (curl, another python), whatever library it goes through. The namespace's init is a
  small waiter of the launcher's, in the process group the sandbox kills: when the program ends, or the group is
  killed, init ends and the kernel kills every process in the namespace, even one that left the process group. A
  Python-level audit hook refuses the program's connections to Unix sockets that are files, which code that calls
  libc itself gets past; with the files isolated, /run and /tmp, where such sockets live, are hidden.
- `network == "guard"`, where the kernel refuses those namespaces: a Python audit hook in the child refuses IP
  sockets, name lookups, connecting to Unix sockets, starting processes (fork, exec, subprocess, os.system) and
  ctypes. It stops ordinary code (urllib, requests-style socket use, a subprocess running curl) but not code
  written to get around it: only the interpreter's own checks stand in the way, not the kernel's.
- `files == "read_only"`: in the mount namespace every mount is read-only and nosuid except the working directory
  (bound in at its own path), a private tmpfs on /tmp and one on /dev/shm; /run and the trainer's home directory
  (/root for root) are hidden under an empty tmpfs, but for the interpreter's own directories, bound back in
  read-only; /proc is the PID namespace's own, which shows the program's processes only (never the trainer's, nor
  its /proc/PID/cwd or /root). Nothing the program writes outlives its run.
- `files == "guard"`, where mounts are refused: the audit hook also refuses opening for writing, removing,
  renaming, linking or changing any path outside the working directory (ordinary code; a program started past
  it, or ctypes, is not stopped), and the program sees the host's /proc.
- `runs_as_nobody`: where the trainer is root the program runs as user and group 65534 (nobody) outside (inside
  its user namespace: INSIDE_ID), where that user can read the interpreter; otherwise as the trainer's user (root
  without capabilities, for a root trainer: owning what root owns). RLIMIT_NPROC holds only for a user other
  than root.
- `cgroup`: the controllers ("memory", "pids") that hold each run, in a cgroup of its own (v2 where the unified
  hierarchy has the controller, else v1), under one parent cgroup per Sandbox (grpo_jax_sandbox.PID.START.N,
  removed by close() or at exit): pids.max bounds the run's processes and threads together at `max_processes`,
  memory.max (v1: memory.limit_in_bytes) their resident memory together at `memory_mb`, and the first time they
  reach it the whole run is killed ("memory"). Without one, memory_mb bounds each process's address space only.

Where something does not hold here, the probe logs one warning line that says what (the docs' table of what is
isolated where: docs/data-and-rewards.md). RLIMIT_AS bounds address space, not resident memory: a program that
starts threads reserves address space for each.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import marshal
import os
import pwd
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

logger = logging.getLogger(__name__)

FAILURES = ("timeout", "cpu", "memory", "output_limit", "network", "error")
NETWORK_ISOLATIONS = ("namespace", "guard")  # strongest first
FILE_ISOLATIONS = ("read_only", "guard")  # strongest first
CGROUP_CONTROLLERS = ("memory", "pids")
OPEN_FILES = 64  # RLIMIT_NOFILE: enough for a program's own files and pipes, too few to exhaust the host's
NOBODY = 65534  # the uid and gid a root trainer's programs run as, where they can still read the interpreter
INSIDE_ID = 1000  # the program's uid and gid inside its user namespace (not 0: it holds no capability there)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID  # the launcher's unshare()
MOUNT_SETATTR = 442  # the syscall (Linux 5.12+, every architecture); where it is missing each mount is remounted
MIN_MEMORY_MB = 64  # the interpreter and launcher alone take about 15 MB of address space
CGROUP_PREFIX = "grpo_jax_sandbox"
CGROUP_EMPTY_S = 5.0  # how long a run's cgroup may take to empty once its processes were killed
LAUNCHER_PROCESSES = 3  # in a namespace: the launcher outside, its child that entered the namespaces, their init
READ_CHUNK = 65536
# Never hidden: a home directory that is one of these, or holds one, stays in view (read-only).
SYSTEM_DIRECTORIES = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/proc", "/sys", "/dev", "/opt")


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not the program's failure)."""


class _LauncherFailed(SandboxError):
    """The launcher stopped before the program started (a namespace, a mount, a cgroup refused)."""


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


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What holds for the programs of this process's sandboxes (module docstring): `network` one of
    NETWORK_ISOLATIONS, `files` one of FILE_ISOLATIONS, `runs_as_nobody`, and `cgroup`, the CGROUP_CONTROLLERS
    that hold each run."""

    network: str
    files: str
    runs_as_nobody: bool
    cgroup: tuple[str, ...] = ()

    def shortfalls(self) -> list[str]:
        """What does not hold here, a phrase each (empty where everything does)."""
        namespaced, root = self.network == "namespace", os.geteuid() == 0
        out = []
        if not namespaced:
            out.append("no namespaces that isolate here: the network, starting processes and writing outside its "
                       "directory are refused by a Python audit hook only, which code written to get around it passes")
        elif self.files != "read_only":
            out.append("no mount namespace: writing outside its directory is refused by a Python audit hook only "
                       "(a program it starts gets past it), and it sees the trainer's processes")
        if root and not self.runs_as_nobody:
            out.append("programs run as root's uid (without capabilities), which owns what root owns")
        if namespaced and "pids" not in self.cgroup and root and not self.runs_as_nobody:
            out.append("max_processes does not hold (no pids cgroup; RLIMIT_NPROC does not apply to root)")
        if namespaced and "memory" not in self.cgroup:
            out.append("memory_mb bounds each process's address space, not its processes together (no memory cgroup)")
        return out


@dataclasses.dataclass(frozen=True)
class _Limits:
    timeout_s: float
    cpu_s: int
    memory_mb: int
    max_output_bytes: int
    max_file_bytes: int
    max_processes: int


# The child: `python -I -S -B -c _LAUNCHER CONFIG`, CONFIG a marshalled dict in hex (_launch_config), in its
# working directory, which holds main.py. It imports nothing before it has joined its cgroups, and then only ctypes
# and resource. It tells the parent through config["status_fd"], a line each: "ready" just before the program runs
# (so a launcher that fails before is the sandbox's failure), "launcher: ..." on such a failure, "memory" on the
# program's uncaught MemoryError, "network" on its first network attempt, and in a PID namespace "exit N", the
# program's exit code (the child's own is its launcher's).
#
# In the namespaces, four processes: the launcher (outside: it maps the users of its child), its child (which
# unshares the namespaces and makes the mounts), their init (pid 1: it mounts /proc, then reaps) and the program.
_LAUNCHER = r"""
import marshal, os, sys
config = marshal.loads(bytes.fromhex(sys.argv[1]))
status_fd, told = config["status_fd"], set()
os.set_inheritable(status_fd, False)

def tell(word):
    if word not in told:
        told.add(word)
        try:
            os.write(status_fd, word.encode() + b"\n")
        except OSError:
            pass

def fail(what, number=0):  # the sandbox's own failure: the parent raises SandboxError with it
    tell("launcher: " + what + (": " + os.strerror(number) if number else ""))
    os._exit(70)

for fd in config["cgroup_fds"]:  # first: every process and page of the run is counted from here on
    try:
        os.write(fd, b"0")
    except OSError as e:
        fail("could not join its cgroup", e.errno)
    os.close(fd)

import ctypes, resource
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, SIGKILL, INSIDE = 1, 38, 9, config["inside_id"]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 262144
ATIME = {"noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}
LOCKED = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, **ATIME}
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE = 1, 2, 0x8000
CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000

def check(result, what):
    if result != 0:
        fail(what, ctypes.get_errno())

def die_with(parent):  # set after every change of credentials, which clears it; `parent` may have died before
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL)
    if os.getppid() != parent:
        os._exit(70)

def drop_privileges(uid, gid):
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    # In a user namespace the capabilities outlive the change of uid: dropped here, and none regained by an exec.
    check(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")

def mount(source, target, kind, flags, data=None):
    encode = lambda text: None if text is None else text.encode()
    check(libc.mount(encode(source), encode(target), encode(kind), ctypes.c_ulong(flags), encode(data)),
          f"mount {kind or source} on {target}")

def mount_setattr(path, recursive, add, clear):
    attr = (ctypes.c_uint64 * 4)(add, clear, 0, 0)
    done = libc.syscall(ctypes.c_long(config["mount_setattr"]), ctypes.c_long(-100), path.encode(),
                        ctypes.c_long(AT_RECURSIVE if recursive else 0), ctypes.byref(attr), ctypes.c_long(32))
    if done != 0 and ctypes.get_errno() != 38:  # ENOSYS: an older kernel, remounted one by one instead
        fail(f"mount_setattr {path}", ctypes.get_errno())
    return done == 0

def remount_each_read_only(writable):
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split(" ") for line in f.read().splitlines()]
    for fields in mounts:
        target = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        if target in writable:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
        for option in fields[5].split(","):  # a mount's own flags must be kept, or the kernel refuses (EPERM)
            flags |= LOCKED.get(option, 0)
        if libc.mount(None, target.encode(), None, ctypes.c_ulong(flags), None) != 0 and ctypes.get_errno() != 2:
            fail(f"remount {target} read-only", ctypes.get_errno())  # ENOENT: a mount point hidden below

def make_view():
    # Read-only everywhere but the working directory and a private /tmp and /dev/shm; /run and the home directory
    # hidden, but for the interpreter's own directories bound back in.
    workdir = config["workdir"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    kept = {path: os.open(path, os.O_PATH) for path in sorted(config["keep"], key=len)}  # before they are hidden
    into = os.open(workdir, os.O_PATH)
    libc.setfsgid(INSIDE)  # what is made below belongs to a user of the namespace (unmapped owners: EOVERFLOW)
    libc.setfsuid(INSIDE)
    writable = {workdir}
    for path, private in config["masks"]:
        mode, size = ("1777", config["tmpfs_bytes"]) if private else ("0755", 1 << 20)
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size}")
        if private:
            writable.add(path)
        for keep, fd in kept.items():
            if keep.startswith(path + "/") and not os.path.lexists(keep):
                bind(fd, keep)
    bind(into, workdir)
    for fd in [*kept.values(), into]:
        os.close(fd)
    if mount_setattr("/", True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0):
        for path in writable:
            mount_setattr(path, False, 0, MOUNT_ATTR_RDONLY)
    else:
        remount_each_read_only(writable)

def bind(fd, target):  # the directory (or file) open at fd, at target, made where a tmpfs hid it
    if not os.path.lexists(target):
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)

def map_users(child):
    # From outside the namespace, as only a privileged parent may map another uid (nobody for a root trainer).
    def write(name, text):
        fd = os.open(f"/proc/{child}/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    if not config["setgroups"]:
        write("setgroups", "deny")  # an unprivileged gid_map requires it
    write("uid_map", f"{INSIDE} {config['uid']} 1\n")
    write("gid_map", f"{INSIDE} {config['gid']} 1\n")

def namespaced():
    launcher = os.getpid()
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child:  # the launcher, outside: maps its child's users, then waits for it
        os.close(unshared_w)
        os.close(mapped_r)
        if os.read(unshared_r, 1) == b"u":
            try:
                map_users(child)
            except OSError as e:
                os.kill(child, SIGKILL)
                os.waitpid(child, 0)
                fail("could not map the users of its namespace", e.errno)
            os.write(mapped_w, b"m")
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        os._exit(code if 0 <= code < 256 else 70)
    os.close(unshared_r)
    os.close(mapped_w)
    die_with(launcher)
    flags = config["namespaces"]
    if not flags & CLONE_NEWUSER or (config["files"] == "read_only" and not flags & CLONE_NEWNS):
        fail("its mounts need a user and a mount namespace")  # never the host's own mounts
    check(libc.unshare(flags), "unshare refused")
    os.write(unshared_w, b"u")
    if os.read(mapped_r, 1) != b"m":
        os._exit(70)
    os.close(unshared_w)
    os.close(mapped_r)
    die_with(launcher)
    if config["setgroups"]:
        os.setgroups([])
    if config["files"] == "read_only":
        make_view()
    alive_r, alive_w = os.pipe()  # init reads its end of file once this process is gone
    init = os.fork()
    if init:
        os.close(alive_r)
        drop_privileges(INSIDE, INSIDE)
        die_with(launcher)
        code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
        os._exit(code if 0 <= code < 256 else 70)
    # Init of the new PID namespace, in the process group the parent kills, dying with its parent: when it ends,
    # the kernel kills every process in the namespace. Not the program: init ignores the signals it has no handler
    # for, RLIMIT_CPU's too.
    os.close(alive_w)
    if config["files"] == "read_only":
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        if libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(flags), None) != 0:
            mount("tmpfs", "/proc", "tmpfs", flags, "mode=0555,size=4k")  # no /proc rather than the host's
    program = os.fork()
    if program == 0:
        os.close(alive_r)
        run_program()
    drop_privileges(INSIDE, INSIDE)
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL)
    os.set_blocking(alive_r, False)
    try:
        if os.read(alive_r, 1) == b"":  # its parent died before PR_SET_PDEATHSIG was set
            os._exit(70)
    except BlockingIOError:
        pass
    while True:  # reaping orphans, as init must, until the program ends
        pid, status = os.wait()
        if pid == program:
            tell(f"exit {os.waitstatus_to_exitcode(status)}")
            os._exit(0)

def run_program():
    if config["network"] == "namespace":
        drop_privileges(INSIDE, INSIDE)
    elif config["drop_to"] is not None:
        os.setgroups([])
        drop_privileges(config["drop_to"], config["drop_to"])
        die_with(config["parent"])
    else:  # the trainer's own user, without its capabilities
        drop_privileges(os.getuid(), os.getgid())
        die_with(config["parent"])
    workdir = config["workdir"]
    os.chdir(workdir)  # again, through the mounts made since
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    guard, guard_files = config["network"] == "guard", config["files"] == "guard"
    # Without the namespaces, starting a program (curl, another python) or calling libc through ctypes would get
    # past the guard: it refuses them too.
    GUARDED_EVENTS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
                      "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function"}
    LOOKUP_EVENTS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
    ADDRESS_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    AF_UNIX = 1
    # The events that change a path: the positions of each path argument and of the dir_fd it is relative to.
    CHANGES = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
               "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
               "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "os.chflags": ((0, None),),
               "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),)}
    WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")

    def reaches_another_process(address):
        # A Unix socket address names another process's socket: a path, a file that no network namespace hides (a
        # docker daemon's, maybe), or a name that starts with a NUL byte, in the network namespace's own table.
        if not isinstance(address, (str, bytes)) or not address:
            return False  # a socket pair's: no address
        return guard or address[:1] not in ("\0", b"\0")

    def outside(path, dir_fd=None):
        try:
            if isinstance(path, int):
                path = os.readlink(f"/proc/self/fd/{path}")
                if not path.startswith("/"):
                    return False  # a pipe or a socket: no file
            path = os.fsdecode(os.fspath(path))
            if dir_fd is not None and dir_fd >= 0 and not path.startswith("/"):
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            real = os.path.realpath(path)
        except (OSError, TypeError, ValueError):
            return True
        return not (real == workdir or real.startswith(workdir + "/") or real in DEVICES)

    def refuse(event):
        raise PermissionError(f"sandbox: {event} is not allowed here")

    def audit(event, args):
        if event in LOOKUP_EVENTS:
            tell("network")
            if guard:
                refuse(event)
        elif event == "socket.__new__" and args[1] != AF_UNIX:
            if guard:
                tell("network")
                refuse("an IP socket")
        elif event in ADDRESS_EVENTS:
            if args[0].family != AF_UNIX:
                tell("network")
                if guard:
                    refuse(event)
            elif event != "socket.bind" and reaches_another_process(args[1]):
                tell("network")
                refuse(f"{event} to another process's Unix socket")
        elif guard and event in GUARDED_EVENTS:
            refuse(event)
        elif guard_files:
            if event == "open":
                if args[2] & WRITING and outside(args[0]):
                    refuse(f"writing {args[0]!r} (outside the working directory)")
            elif event in CHANGES:
                for at, dir_at in CHANGES[event]:
                    if outside(args[at], None if dir_at is None else args[dir_at]):
                        refuse(f"{event} of {args[at]!r} (outside the working directory)")

    MB = 1 << 20
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["max_file_bytes"], config["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (config["open_files"], config["open_files"]))
    if config["network"] == "namespace":  # counted per user namespace: this run's alone
        processes = config["max_processes"] + 2  # the launcher's child and init, which run as the program's user
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_mb"] * MB, config["memory_mb"] * MB))
    sys.addaudithook(audit)
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    main = type(sys)("__main__")  # a module of its own, which pickle finds its functions in as it would a script's
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    for name in ("libc", "ctypes"):  # the launcher's globals are within the program's reach: no libc handle in them
        globals().pop(name)
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
    sys.exit(0)

die_with(config["parent"])
if config["network"] == "namespace":
    namespaced()
run_program()
"""


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.cache
def _masks() -> tuple[tuple[str, bool], ...]:
    """The directories a read-only view covers with a tmpfs: (path, private), a private one writable (/tmp,
    /dev/shm), the others empty and read-only (/run, the trainer's home). Never one within another."""
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = os.environ.get("HOME", "")
    masks: list[tuple[str, bool]] = []
    for path, private in (("/tmp", True), ("/dev/shm", True), ("/run", False), (home, False)):
        if not path or not os.path.isdir(path):
            continue
        real = os.path.realpath(path)
        if real == "/" or any(_is_within(system, real) for system in SYSTEM_DIRECTORIES):
            continue
        if any(_is_within(real, other) or _is_within(other, real) for other, _ in masks):
            continue
        masks.append((real, private))
    return tuple(masks)


@functools.cache
def _kept_paths() -> tuple[str, ...]:
    """The interpreter's own directories that lie in a masked one: bound back in, read-only, so that the
    program's interpreter (and one it starts) finds its standard library."""
    named = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable),
             os.path.dirname(os.path.realpath(sys.executable))}
    paths = {os.path.abspath(p) for p in named} | {os.path.realpath(p) for p in named}
    masked = [path for path in paths if os.path.isdir(path) and any(_is_within(path, m) and path != m
                                                                    for m, _ in _masks())]
    return tuple(sorted(p for p in masked if not any(_is_within(p, q) and p != q for q in masked)))


# ----------------------------------------------------------------------------------------------------
# Cgroups


@dataclasses.dataclass(frozen=True)
class _CgroupPlace:
    """Where this process may make cgroups holding `controllers`: `directory` in a hierarchy of cgroup `version`."""

    version: int
    directory: str
    controllers: tuple[str, ...]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _cgroup_places() -> tuple[_CgroupPlace, ...]:
    """For each of CGROUP_CONTROLLERS, the place to make a run's cgroup in: the unified (v2) hierarchy where it has
    the controller (the nearest ancestor of this process's cgroup that hands it to its children, as a cgroup with
    processes may not), else the v1 hierarchy that has it (this process's own cgroup there)."""
    try:
        mounts = [line.split(" ") for line in _read("/proc/self/mountinfo").splitlines()]
        memberships = [line.split(":", 2) for line in _read("/proc/self/cgroup").splitlines()]
    except OSError:
        return ()
    ours = {}
    for _, controllers, path in memberships:
        for controller in controllers.split(",") if controllers else [""]:
            ours[controller] = path

    def directory(fields, membership):  # this process's cgroup in the hierarchy mounted as `fields`
        root, mount_point = fields[3], fields[4]
        if membership is None or not _is_within(membership, root):
            return None
        return os.path.normpath(os.path.join(mount_point, os.path.relpath(membership, root)))

    places, wanted = [], list(CGROUP_CONTROLLERS)
    for fields in mounts:
        kind = fields[fields.index("-") + 1]
        if kind != "cgroup2" or "" not in ours or not wanted:
            continue
        own, mount_point = directory(fields, ours[""]), fields[4]
        try:
            available = [c for c in wanted if c in _read(os.path.join(mount_point, "cgroup.controllers")).split()]
        except OSError:
            continue
        at = own
        while available and at is not None and _is_within(at, mount_point):
            try:
                handed = _read(os.path.join(at, "cgroup.subtree_control")).split()
            except OSError:
                handed = []
            if all(c in handed for c in available):
                places.append(_CgroupPlace(2, at, tuple(available)))
                wanted = [c for c in wanted if c not in available]
                break
            at = None if at == mount_point else os.path.dirname(at)
    for fields in mounts:
        kind = fields[fields.index("-") + 1]
        options = fields[-1].split(",")
        for controller in [c for c in wanted if kind == "cgroup" and c in options]:
            own = directory(fields, ours.get(controller))
            if own is not None and os.path.isdir(own):
                places.append(_CgroupPlace(1, own, (controller,)))
                wanted.remove(controller)
    return tuple(places)


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with its pid, a name no later process shares."""
    try:
        return int(_read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _kill_cgroup(path: str) -> None:
    """SIGKILL every process in the cgroup at `path` (cgroup.kill where there is one)."""
    try:
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            _write(os.path.join(path, "cgroup.kill"), "1")
            return
        pids = [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
    except OSError:
        return
    for pid in pids:
        try:
            handle = os.pidfd_open(pid)  # the process itself: its pid may be reused once it is gone
        except OSError:
            continue
        try:
            if os.path.basename(path) in _read(f"/proc/{pid}/cgroup"):
                signal.pidfd_send_signal(handle, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(handle)


def _remove_cgroup(path: str) -> bool:
    """Kill what is left in the cgroup at `path` and below, and remove them; False where one would not empty."""
    try:
        children = [entry.path for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return True
    except OSError:
        children = []
    removed = all([_remove_cgroup(child) for child in children])
    give_up = time.monotonic() + CGROUP_EMPTY_S
    while True:
        try:
            os.rmdir(path)
            return removed
        except FileNotFoundError:
            return removed
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > give_up:
                logger.warning("sandbox: could not remove cgroup %s: %s", path, e.strerror)
                return False
        _kill_cgroup(path)
        time.sleep(0.002)


def _reap_stale_cgroups(directory: str) -> None:
    """Remove the cgroups that sandboxes of processes now dead made in `directory` (a trainer killed with SIGKILL
    cannot remove its own)."""
    try:
        names = [entry.name for entry in os.scandir(directory) if entry.name.startswith(CGROUP_PREFIX + ".")]
    except OSError:
        return
    for name in names:
        match = re.fullmatch(re.escape(CGROUP_PREFIX) + r"\.(\d+)\.(\d+)\.\w+", name)
        if match and _start_time(int(match[1])) != int(match[2]):
            _remove_cgroup(os.path.join(directory, name))


_PARENT_SERIALS = itertools.count()


class _Cgroups:
    """One Sandbox's cgroups: a parent in each place (made at its first run, removed by close() or at exit) and
    one child per run, which holds the run's limits and is removed after it."""

    def __init__(self, places: tuple[_CgroupPlace, ...], name: str = ""):
        self.places = places
        self.runs = itertools.count()
        self.parents: list[str] = []
        pid = os.getpid()
        name = f"{CGROUP_PREFIX}.{pid}.{_start_time(pid)}.{name or next(_PARENT_SERIALS)}"
        try:
            for place in places:
                _reap_stale_cgroups(place.directory)
                path = os.path.join(place.directory, name)
                os.mkdir(path)
                self.parents.append(path)
                if place.version == 2:
                    _write(os.path.join(path, "cgroup.subtree_control"), " ".join(f"+{c}" for c in place.controllers))
        except OSError as e:
            self.remove()
            raise SandboxError(f"could not make the sandbox's cgroup in {place.directory}: {e.strerror}") from e

    def run(self, limits: _Limits, processes: int) -> _RunCgroup:
        return _RunCgroup(self, next(self.runs), limits.memory_mb << 20, processes)

    def remove(self) -> None:
        for path in self.parents:
            _remove_cgroup(path)
        self.parents = []


class _RunCgroup:
    """One run's cgroup in each place: `join_fds` (its cgroup.procs files, which the launcher writes itself into),
    `oom_fd` (v1: readable once the run reached its memory limit, where the kernel then holds it)."""

    def __init__(self, cgroups: _Cgroups, serial: int, memory_bytes: int, processes: int):
        self.paths: list[str] = []
        self.join_fds: list[int] = []
        self.oom_fd: int | None = None
        self.memory: tuple[int, str] | None = None  # (version, path)
        try:
            for place, parent in zip(cgroups.places, cgroups.parents):
                path = os.path.join(parent, f"run{serial}")
                os.mkdir(path)
                self.paths.append(path)
                if "pids" in place.controllers:
                    _write(os.path.join(path, "pids.max"), str(processes))
                if "memory" in place.controllers:
                    self._limit_memory(place.version, path, memory_bytes)
                self.join_fds.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        except OSError as e:
            self.remove()
            raise SandboxError(f"could not make the run's cgroup: {e}") from e

    def _limit_memory(self, version: int, path: str, memory_bytes: int) -> None:
        self.memory = (version, path)
        if version == 2:
            _write(os.path.join(path, "memory.max"), str(memory_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):  # where the kernel has them
                if os.path.exists(os.path.join(path, name)):
                    _write(os.path.join(path, name), value)
            return
        _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):  # memory and swap together
            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        # v1 has no memory.oom.group: the kernel holds the run at its limit and tells (oom_fd); the sandbox kills
        # all of it then, as v2 would, rather than have the OOM killer pick one process.
        _write(os.path.join(path, "memory.oom_control"), "1")
        self.oom_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        control = os.open(os.path.join(path, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(os.path.join(path, "cgroup.event_control"), f"{self.oom_fd} {control}")
        finally:
            os.close(control)

    def close_join_fds(self) -> None:
        for fd in self.join_fds:
            os.close(fd)
        self.join_fds = []

    def reached_memory_limit(self) -> bool:
        if self.memory is None:
            return False
        version, path = self.memory
        try:
            if version == 2:
                events = dict(line.split() for line in _read(os.path.join(path, "memory.events")).splitlines())
                return int(events.get("oom_kill", 0)) + int(events.get("oom_group_kill", 0)) > 0
            return "under_oom 1" in _read(os.path.join(path, "memory.oom_control"))
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        self.close_join_fds()
        for path in reversed(self.paths):
            _remove_cgroup(path)
        if self.oom_fd is not None:
            os.close(self.oom_fd)
            self.oom_fd = None
        self.paths = []


# ----------------------------------------------------------------------------------------------------
# The probe

_PROBE = r"""
import os, socket
import fractions  # a module the launcher has not loaded: the standard library is readable as this user
print("uid", os.getuid(), "map", *open("/proc/self/uid_map").read().split())
for target in TARGETS:
    path = os.path.join(target, f"grpo_jax_sandbox_probe.{os.getpid()}")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        continue
    os.unlink(path)
    print("wrote", target)
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=2).close()
    print("reached", PORT)
except OSError:
    pass
print("pid", os.getpid())
print("pids", *sorted(name for name in os.listdir("/proc") if name.isdigit()))
print("cgroup", *open("/proc/self/cgroup").read().split())
"""
_PROBE_LIMITS = _Limits(timeout_s=20.0, cpu_s=10, memory_mb=256, max_output_bytes=65536, max_file_bytes=1 << 20,
                        max_processes=8)


def _candidates() -> list[Isolation]:
    """Strongest first."""
    root = os.geteuid() == 0
    return [Isolation(network, files, nobody)
            for network, files in (("namespace", "read_only"), ("namespace", "guard"), ("guard", "guard"))
            for nobody in ((True, False) if root else (False,))]


def _probe_failure(isolation: Isolation, result: SandboxResult, cgroups: _Cgroups | None) -> str | None:
    """Why `isolation` does not hold, judged from the probe program's report; None when it does."""
    if not result.ok:
        return f"the probe program failed ({result.failure}): {result.stderr.strip()[-300:]}"
    report = {}
    for line in result.stdout.splitlines():
        key, _, rest = line.partition(" ")
        report.setdefault(key, []).append(rest.split())
    if "wrote" in report:
        return f"a program could write in {report['wrote'][0][0]}"
    if "reached" in report:
        return "a program reached the host's 127.0.0.1"
    uid, _, *mapping = report["uid"][0]
    outside = next((int(out) + int(uid) - int(inside) for inside, out, count in zip(*[iter(mapping)] * 3)
                    if int(inside) <= int(uid) < int(inside) + int(count)), None)
    if isolation.runs_as_nobody and outside != NOBODY:
        return f"the program ran as uid {outside}, not {NOBODY}"
    if isolation.network == "namespace" and report["pid"][0] != ["2"]:
        return "the program is not in a PID namespace of its own"
    if isolation.files == "read_only" and not set(report["pids"][0]) <= {"1", "2"}:
        return "the program sees processes outside its PID namespace"
    if cgroups is not None and not all(any(f"/{os.path.basename(parent)}/" in line for line in report["cgroup"][0])
                                       for parent in cgroups.parents):
        return "the program is not in its cgroups"
    return None


def _probe(isolation: Isolation, port: int, places: tuple[_CgroupPlace, ...]) -> str | None:
    """Why `isolation` does not hold (None: it does). A failure of the sandbox that says nothing about the
    isolation (no working directory can be made) raises SandboxError."""
    try:
        trainers = [os.getcwd()]  # where a run directory is likely to be
    except OSError:
        trainers = []
    targets = [path for path in (os.path.dirname(os.__file__), "/", *trainers)  # not where a private tmpfs is
               if not any(_is_within(os.path.realpath(path), mask) for mask, private in _masks() if private)]
    source = _PROBE.replace("TARGETS", repr(targets)).replace("PORT", str(port))
    try:
        cgroups = _Cgroups(places, name="probe") if places else None
    except SandboxError as e:
        return f"its cgroups: {e}"
    try:
        result = _run(_PROBE_LIMITS, isolation, source, "", _Registry(), cgroups)
    except _LauncherFailed as e:
        return str(e)
    finally:
        if cgroups is not None:
            cgroups.remove()
    return _probe_failure(isolation, result, cgroups)


def probe_isolation() -> Isolation:
    """The strongest Isolation whose every claim holds here, found by running a probe program in each setup,
    strongest first, until one's report confirms it (its network closed, its writes outside refused, its uid,
    its PID namespace, its cgroups): once per process (probe_isolation.cache_clear() probes again), whatever the
    threads that ask at once. Logs one warning line saying what does not hold, where
    something does not."""
    with _PROBE_LOCK:
        return _probed()


_PROBE_LOCK = threading.Lock()


@functools.cache
def _probed() -> Isolation:
    try:
        places = tuple(_usable_places(_cgroup_places()))
    except SandboxError:
        places = ()
    rejected = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        for candidate in _candidates():
            why = _probe(candidate, port, places)
            if why is not None and places and "cgroup" in why:
                places = ()  # joining them failed: without cgroups
                why = _probe(candidate, port, places)
            if why is None:
                isolation = dataclasses.replace(
                    candidate, cgroup=tuple(c for c in CGROUP_CONTROLLERS if any(c in p.controllers for p in places)))
                break
            user = "nobody" if candidate.runs_as_nobody else "own uid"
            rejected.append(f"{candidate.network}/{candidate.files}/{user}: {why}")
        else:
            raise SandboxError("no isolation holds here: " + "; ".join(rejected))
    shortfalls = isolation.shortfalls()
    if shortfalls:
        logger.warning("sandbox: %s (docs/data-and-rewards.md, the sandbox's table of what is isolated where)",
                       "; ".join(shortfalls))
    return isolation


probe_isolation.cache_clear = _probed.cache_clear


def _usable_places(places: tuple[_CgroupPlace, ...]):
    """The places where a cgroup can be made now (one is made and removed)."""
    for place in places:
        try:
            _Cgroups((place,), name="check").remove()
        except SandboxError:
            continue
        yield place


# ----------------------------------------------------------------------------------------------------
# One run


class _Registry:
    """The children running now (their working directories), and whether new runs are refused."""

    def __init__(self):
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.live: dict[subprocess.Popen, str] = {}


def _launch_config(isolation: Isolation, limits: _Limits, workdir: str, status_fd: int, cgroup_fds: list[int]) -> dict:
    root, nobody = os.geteuid() == 0, isolation.runs_as_nobody
    return {"status_fd": status_fd, "parent": os.getpid(), "workdir": workdir, "cgroup_fds": cgroup_fds,
            "network": isolation.network, "files": isolation.files, "namespaces": NAMESPACES,
            "mount_setattr": MOUNT_SETATTR, "inside_id": INSIDE_ID, "setgroups": root,
            "uid": NOBODY if nobody else os.geteuid(), "gid": NOBODY if nobody else os.getegid(),
            "drop_to": NOBODY if nobody and isolation.network == "guard" else None,
            "masks": list(_masks()), "keep": list(_kept_paths()), "tmpfs_bytes": limits.memory_mb << 20,
            "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "max_file_bytes": limits.max_file_bytes,
            "max_processes": limits.max_processes, "open_files": OPEN_FILES}


def _run(limits: _Limits, isolation: Isolation, source: str, stdin: str, registry: _Registry,
         cgroups: _Cgroups | None) -> SandboxResult:
    """Run `source` once: its working directory made and removed, its cgroup made and removed. Any OSError of the
    sandbox's own is a SandboxError."""
    try:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="grpo_jax_sandbox_"))
    except OSError as e:
        raise SandboxError(f"could not make the program's working directory in {tempfile.gettempdir()}: "
                           f"{e.strerror or e}") from e
    run_cgroup = None
    try:
        try:
            main = os.path.join(workdir, "main.py")
            with open(main, "w", encoding="utf-8") as f:
                f.write(source)
            if isolation.runs_as_nobody:
                for path in (workdir, main):
                    os.chown(path, NOBODY, NOBODY)
        except OSError as e:
            raise SandboxError(f"could not write the program to {workdir}: {e.strerror or e}") from e
        namespaced = isolation.network == "namespace"
        if cgroups is not None:
            run_cgroup = cgroups.run(limits, limits.max_processes + (LAUNCHER_PROCESSES if namespaced else 0))
        return _run_in(limits, isolation, workdir, registry, run_cgroup, stdin)
    finally:
        if run_cgroup is not None:
            run_cgroup.remove()
        _remove_tree(workdir)


def _run_in(limits: _Limits, isolation: Isolation, workdir: str, registry: _Registry, run_cgroup: _RunCgroup | None,
            stdin: str) -> SandboxResult:
    join_fds = run_cgroup.join_fds if run_cgroup is not None else []
    status_read, status_write = os.pipe()
    config = _launch_config(isolation, limits, workdir, status_write, join_fds)
    start = time.monotonic()
    try:
        process = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, marshal.dumps(config).hex()],
                                   pass_fds=(status_write, *join_fds), cwd=workdir,
                                   env=_scrubbed_environment(workdir), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        os.close(status_read)
        raise SandboxError(f"could not start {sys.executable}: {e}") from e
    finally:
        os.close(status_write)
        if run_cgroup is not None:
            run_cgroup.close_join_fds()
    with registry.lock:
        registry.live[process] = workdir
        if registry.closed.is_set():  # closed since this call took its slot
            _kill_group(process)
    try:
        with open(status_read, "rb") as status:
            outcome = _Exchange(process, status, stdin.encode(), start + limits.timeout_s, limits.max_output_bytes,
                                None if run_cgroup is None else run_cgroup.oom_fd).run()
    finally:
        _kill(process)
        with registry.lock:
            del registry.live[process]
    wall_s = time.monotonic() - start
    if registry.closed.is_set() and process.returncode < 0:
        raise SandboxError("the sandbox was closed while the program ran")
    if "ready" not in outcome.told and outcome.killed not in ("timeout", "memory"):
        said = [line for line in outcome.told if line.startswith("launcher: ")] or [outcome.stderr.strip()[-500:]]
        raise _LauncherFailed(f"its launcher failed before the program started (exit code {process.returncode}): "
                              f"{said[0]}")
    exit_code = _exit_code(outcome.told, process.returncode)
    killed = outcome.killed
    if killed is None and run_cgroup is not None and run_cgroup.reached_memory_limit():
        killed = "memory"  # v2: the kernel killed the run at its limit (memory.oom.group)
    return SandboxResult(outcome.stdout, outcome.stderr, exit_code, _failure(killed, outcome.told, exit_code), wall_s)


def _exit_code(told: list[str], returncode: int) -> int:
    """The program's exit code: the last its PID namespace's init told, else the child's own. (The program can
    write to the status pipe too, which can only mislead about itself: whatever it wrote, init writes last.)"""
    codes = [int(line[len("exit "):]) for line in told if re.fullmatch(r"exit -?\d+", line)]
    return codes[-1] if codes else returncode


def _scrubbed_environment(home: str) -> dict[str, str]:
    """Only what a program needs to find programs and decode text: no inherited secrets."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": home, "TMPDIR": home}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sandbox:
    """Limits for each program run (module docstring); `isolation` says what holds here (probe_isolation)."""

    timeout_s: float = 5.0  # wall clock from the child's start (interpreter start-up included) to its kill
    cpu_s: int = 5  # RLIMIT_CPU, seconds of CPU time per process
    memory_mb: int = 512  # RLIMIT_AS per process; with a memory cgroup, also the run's resident memory together
    max_output_bytes: int = 65536  # per stream (stdout, stderr); a program that writes more is killed there
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write (per file, not a quota)
    max_processes: int = 32  # processes and threads at once, the program's own included (pids cgroup, RLIMIT_NPROC)
    workers: int = 4  # programs running at once; more calls wait for a slot
    isolation: Isolation = dataclasses.field(init=False, compare=False)

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
        object.__setattr__(self, "isolation", probe_isolation())
        object.__setattr__(self, "_limits", _Limits(self.timeout_s, self.cpu_s, self.memory_mb, self.max_output_bytes,
                                                    self.max_file_bytes, self.max_processes))
        object.__setattr__(self, "_slots", threading.BoundedSemaphore(self.workers))
        object.__setattr__(self, "_registry", _Registry())
        object.__setattr__(self, "_active", [0])  # runs between taking a slot and cleaning up after the child
        object.__setattr__(self, "_cgroups", [])  # the _Cgroups, once the first run made them
        # At interpreter exit (or when the sandbox is collected) the children still running are killed, and the
        # cgroups removed.
        object.__setattr__(self, "_finalizer", weakref.finalize(self, _end_all, self._registry, self._cgroups))

    @property
    def network_isolation(self) -> str:
        return self.isolation.network

    @property
    def runs_as_nobody(self) -> bool:
        return self.isolation.runs_as_nobody

    def close(self) -> None:
        """Kill the programs running now (their run_python calls raise SandboxError) and refuse later runs."""
        registry = self._registry
        with registry.lock:
            registry.closed.set()
            live = list(registry.live)
            idle = self._active[0] == 0
        for process in live:
            _kill_group(process)
        if idle:
            _remove_cgroups(self._cgroups)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_python(self, source: str, stdin: str = "") -> SandboxResult:
        """Run `source` as a program's __main__ with `stdin` as its standard input (module docstring)."""
        if not isinstance(source, str) or not isinstance(stdin, str):
            raise TypeError(f"run_python(source: {type(source).__name__}, stdin: {type(stdin).__name__}): "
                            "both must be str")
        registry = self._registry
        with self._slots:
            with registry.lock:
                if registry.closed.is_set():
                    raise SandboxError("the sandbox is closed")
                self._active[0] += 1
                try:
                    if self.isolation.cgroup and not self._cgroups:
                        self._cgroups.append(_Cgroups(_places_for(self.isolation)))
                except SandboxError:
                    self._active[0] -= 1
                    raise
            try:
                return _run(self._limits, self.isolation, source, stdin, registry,
                            self._cgroups[0] if self._cgroups else None)
            finally:
                with registry.lock:
                    self._active[0] -= 1
                    last = registry.closed.is_set() and self._active[0] == 0
                if last:
                    _remove_cgroups(self._cgroups)


LIMITS = tuple(f.name for f in dataclasses.fields(Sandbox) if f.init)  # the keyword arguments Sandbox takes


@functools.cache
def _all_places() -> tuple[_CgroupPlace, ...]:
    return _cgroup_places()


def _places_for(isolation: Isolation) -> tuple[_CgroupPlace, ...]:
    """The places of the controllers the probe found to hold."""
    return tuple(p for p in _all_places() if any(c in isolation.cgroup for c in p.controllers))


def _remove_cgroups(holder: list) -> None:
    while holder:
        holder.pop().remove()


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
    stdin written as the child takes it, stdout and stderr read up to their limit, the status words read, and the
    run's memory limit watched (v1 cgroups: `oom_fd`)."""

    def __init__(self, process: subprocess.Popen, status, stdin: bytes, deadline: float, max_output_bytes: int,
                 oom_fd: int | None = None):
        self.process, self.status, self.stdin, self.oom_fd = process, status, stdin, oom_fd
        self.deadline, self.max_output_bytes = deadline, max_output_bytes
        self.output = {process.stdout: bytearray(), process.stderr: bytearray()}
        self.status_bytes = bytearray()
        self.killed: str | None = None  # "timeout", "output_limit" or "memory" when the sandbox killed the child

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
            if self.oom_fd is not None:
                selector.register(self.oom_fd, selectors.EVENT_READ)
            if self.stdin:
                os.set_blocking(self.process.stdin.fileno(), False)
                selector.register(self.process.stdin, selectors.EVENT_WRITE)
            else:
                self.process.stdin.close()
            watched = self.oom_fd is not None  # stays registered: the loop ends when the streams are done with
            while len(selector.get_map()) > watched and self.killed is None:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self.killed = "timeout"
                    break
                for key, _ in selector.select(remaining):
                    if key.fileobj == self.oom_fd:
                        self.killed = "memory"
                        break
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


def _end_all(registry: _Registry, cgroups: list) -> None:
    """At interpreter exit, for the threads still waiting on children, which will not clean up after them."""
    for process, workdir in list(registry.live.items()):
        _kill_group(process)
        _remove_tree(workdir)
    _remove_cgroups(cgroups)


def _remove_tree(path: str) -> None:
    """Remove a run's working directory, even where the program took away the permissions to."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
