"""RewardSuite: the weighted sum of a run's rewards, scored so that no reward crashes or hangs a run: each term on a
thread pool of its own or in killable worker processes, under a deadline, every failure a failed sample (see the
package docstring)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from grpo_jax.algorithm.rewards import builtin  # noqa: F401 - registers the built-in factories BUILTIN_REWARDS lists
from grpo_jax.algorithm.rewards.registry import REWARDS, RewardFn, get_reward

ISOLATIONS = ("thread", "process")
# Built-in rewards that run a regex from the config, by the kwarg that holds it. A pattern like ^(a+)+$ can
# backtrack for minutes inside one call to `re`, which holds the GIL all along: every other thread of the process
# (the learner, the run lock's heartbeat, the deadline itself) stops with it. Only killing a process stops such a
# call, so these run in worker processes unless their spec says otherwise.
CONFIG_REGEX_REWARDS = {"format": "pattern"}
BUILTIN_REWARDS = frozenset(REWARDS)  # the factories registered above, which a worker process finds by name
FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards are trained in float32: larger totals become inf there


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One term of the combined reward. `label` names it in metrics (default: `name`).

    `samples_per_call` is how many samples one call of the function scores. The default, 1, means a
    slow, hung or failing sample fails only itself; raise it for a function that gains from batching
    (a reward model, a remote verifier), at the price of failing a whole call's samples together.

    `isolation` is where its calls run: "thread" (threads of this process), "process" (worker processes
    that are killed at the deadline: the only way to stop a call that holds the GIL, such as a regex that
    backtracks catastrophically; the function is built in each worker from `name` and `kwargs`, so it must
    be a built-in or a factory by import path), or "" (the default): "process" for a built-in reward given a
    regex by the config (CONFIG_REGEX_REWARDS), else "thread". See `runs_in`.
    """

    name: str
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)
    label: str | None = None
    samples_per_call: int = 1
    isolation: str = ""

    def __post_init__(self):
        if isinstance(self.samples_per_call, bool) or not isinstance(self.samples_per_call, int) \
                or self.samples_per_call < 1:
            raise ValueError(f"reward {self.name!r}: samples_per_call={self.samples_per_call!r}: must be an "
                             "integer >= 1")
        if self.isolation not in ("", *ISOLATIONS):
            raise ValueError(f"reward {self.name!r}: isolation={self.isolation!r}: allowed {', '.join(ISOLATIONS)} "
                             "(or leave it out: process for a built-in reward given a regex, else thread)")
        if self.isolation == "process" and ":" not in self.name and self.name not in BUILTIN_REWARDS:
            raise ValueError(f"reward {self.name!r}: isolation=process builds the reward again in a worker process "
                             f"from its name, which must be a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or a "
                             "factory by import path 'package.module:factory'; a Python function passed to "
                             "grpo_jax.train runs on threads (leave isolation out)")

    @property
    def runs_in(self) -> str:
        """"thread" or "process": `isolation` when given, else "process" for a built-in reward whose regex
        comes from the config, "thread" otherwise."""
        if self.isolation:
            return self.isolation
        regex_kwarg = CONFIG_REGEX_REWARDS.get(self.name)
        return "process" if regex_kwarg is not None and regex_kwarg in self.kwargs else "thread"

    @classmethod
    def parse(cls, spec: Any) -> RewardSpec:
        """From a RewardSpec, a (name, weight[, kwargs]) sequence, or a dict with those keys (+ label,
        samples_per_call, isolation)."""
        if isinstance(spec, RewardSpec):
            return spec
        if isinstance(spec, dict):
            allowed = {"name", "weight", "kwargs", "label", "samples_per_call", "isolation"}
            if set(spec) - allowed or "name" not in spec:
                raise ValueError(f"reward spec {spec!r}: needs 'name'; allowed keys {', '.join(sorted(allowed))}")
            return cls(spec["name"], float(spec.get("weight", 1.0)), dict(spec.get("kwargs") or {}),
                       spec.get("label"), spec.get("samples_per_call", 1), spec.get("isolation") or "")
        if isinstance(spec, (list, tuple)) and len(spec) in (2, 3):
            return cls(spec[0], float(spec[1]), dict(spec[2]) if len(spec) == 3 else {})
        raise ValueError(f"reward spec {spec!r}: expected (name, weight[, kwargs]) or a dict")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """rewards [B] (weighted sum; 0.0 where failed), failed [B] bool, per_function {label: [B]}
    (NaN where that function failed), errors: at most a few lines per function, each saying which
    failure and how many samples it cost; function_errors {label: those lines as one} for the functions
    that failed a sample."""

    rewards: np.ndarray
    failed: np.ndarray
    per_function: dict[str, np.ndarray]
    errors: list[str]
    function_errors: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def num_failed(self) -> int:
        return int(self.failed.sum())


class _Job:
    """One reward function's share of one score() call. Workers claim `samples_per_call` samples at a
    time, so a call that hangs holds back only its own samples while the other workers score the rest.
    Every write goes through `lock` and stops once the caller has closed the job (at its `deadline`, a
    time.monotonic() value), so a late call can never change a result already returned."""

    def __init__(self, records: list, completions: list, lengths: list | None, samples_per_call: int,
                 deadline: float, copy_records: bool):
        self.records, self.completions, self.lengths = records, completions, lengths
        self.copy_records = copy_records  # give each call a deep copy of its records (see arguments)
        self.n = len(completions)
        self.samples_per_call = samples_per_call
        self.deadline = deadline
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.values = [math.nan] * self.n  # a list: cheaper than an array to write one sample into
        self.next_start = 0
        self.finished = 0  # samples whose call has returned or raised
        self.in_call = 0  # workers inside the reward function for this job
        self.closed = False
        self.errored = 0  # samples whose call raised or returned junk
        self.first_error: str | None = None
        self.first_error_samples = 0  # of those, the samples whose call failed with first_error itself
        self.other_error: str | None = None  # the first error that differs from it
        if self.n == 0:
            self.done.set()

    def claim(self) -> slice | None:
        with self.lock:
            if self.closed or self.next_start >= self.n:
                return None
            start = self.next_start
            self.next_start = min(self.n, start + self.samples_per_call)
            self.in_call += 1
            return slice(start, self.next_start)

    def record(self, rows: slice, values: list | None, error: str | None) -> None:
        with self.lock:
            self.in_call -= 1
            if self.closed:
                return
            if error is None:
                self.values[rows] = values
            else:
                self.errored += rows.stop - rows.start
                self.first_error = self.first_error or error
                if error == self.first_error:
                    self.first_error_samples += rows.stop - rows.start
                else:
                    self.other_error = self.other_error or error
            self.finished += rows.stop - rows.start
            if self.finished == self.n:
                self.done.set()

    def abandon(self, rows: slice) -> None:
        """A call stopped at the deadline: its samples stay unscored (score() fails them as timed out)."""
        with self.lock:
            self.in_call -= 1

    def close(self) -> None:
        with self.lock:
            self.closed = True

    @property
    def num_calls(self) -> int:
        return -(-self.n // self.samples_per_call)

    def arguments(self, rows: slice) -> tuple[list, list, list | None]:
        """A call's arguments. With copy_records, its own deep copy of the records: a function that changes a
        row (caching a parsed value in it) must change neither the caller's row, which the replay buffer
        checkpoints, nor what other calls see."""
        records = self.records[rows]
        return (copy.deepcopy(records) if self.copy_records else records, self.completions[rows],
                None if self.lengths is None else self.lengths[rows])


def _as_floats(out: Any, count: int) -> list[float]:
    values = np.asarray(out, dtype=np.float64)
    if values.shape != (count,):
        raise ValueError(f"returned shape {values.shape} for {count} completions")
    return values.tolist()


def _call(fn: RewardFn, records: list, completions: list, lengths: list | None) -> tuple[list | None, str | None]:
    """One call of a reward function: (values, None), or (None, what went wrong)."""
    try:
        out = fn(records, completions, lengths)
    except BaseException as e:  # noqa: BLE001 — any failure of user code is a failed sample
        return None, f"raised {type(e).__name__}: {e}"
    try:
        return _as_floats(out, len(completions)), None
    except (TypeError, ValueError) as e:
        return None, f"bad output: {e}"


class _RewardPool:
    """The daemon threads that run one reward function, at most `max_threads` of them.

    Python cannot stop a thread, so a thread inside a call whose deadline has passed is stuck until the
    call returns (then it rejoins the pool). A job gets min(`workers`, max_threads - stuck) threads;
    once every thread is stuck the function is not called at all, so a function that never returns
    costs at most `max_threads` threads however many calls follow. Idle threads exit after
    IDLE_EXIT_S, so a suite that is no longer used leaves no threads behind.
    """

    IDLE_EXIT_S = 60.0

    def __init__(self, fn: RewardFn, label: str, workers: int, max_threads: int):
        self.fn, self.label = fn, label
        self.workers, self.max_threads = workers, max_threads
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # one entry per thread asked to work on a job
        self._num_threads = 0
        self._overdue: list[_Job] = []  # closed jobs that still have threads inside a call

    def stuck_threads(self) -> int:
        with self._lock:
            return self._stuck_locked()

    def _stuck_locked(self) -> int:
        self._overdue = [job for job in self._overdue if job.in_call > 0]
        return sum(job.in_call for job in self._overdue)

    def submit(self, job: _Job) -> bool:
        """Start threads on `job`; False, starting nothing, when every thread is stuck."""
        if job.n == 0:
            return True
        with self._lock:
            stuck = self._stuck_locked()
            helpers = min(self.workers, self.max_threads - stuck, job.num_calls)
            if helpers <= 0:
                return False
            # Counted under the lock, which an idle thread also takes before exiting.
            for _ in range(helpers - (self._num_threads - stuck)):
                self._num_threads += 1
                threading.Thread(target=self._serve, daemon=True, name=f"reward-{self.label}").start()
            for _ in range(helpers):
                self._queue.put(job)
        return True

    def retire(self, job: _Job) -> None:
        """After `job` is closed: its threads still inside a call are stuck from now on."""
        with self._lock:
            if job.in_call > 0:
                self._overdue.append(job)

    def timed_out(self, job: _Job) -> str:
        return f"calls still running: {job.in_call}"

    def close(self) -> None:
        """Nothing to release: idle threads exit by themselves, and a stuck one cannot be stopped."""

    def _serve(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # else a job was queued meanwhile, counting on this thread
                        self._num_threads -= 1
                        return
                continue
            self._work(job)

    def _work(self, job: _Job) -> None:
        while (rows := job.claim()) is not None:
            try:
                arguments = job.arguments(rows)
            except Exception as e:  # noqa: BLE001 — a row deepcopy cannot copy fails its samples, not the thread
                job.record(rows, None, f"its records cannot be copied: {type(e).__name__}: {e}")
                continue
            job.record(rows, *_call(self.fn, *arguments))


# What a worker process runs (python -c ... REQUESTS_FD REPLIES_FD PARENT_PID). It takes the parent's sys.path before
# importing grpo_jax, so that grpo_jax and a user's reward module import there as they do in the parent. The worker
# leads a session of its own, so Ctrl-C at the terminal does not reach it (the parent decides when its workers end),
# and its pipes are not inherited by the programs a reward starts.
_WORKER_BOOT = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
for fd in sys.argv[1:3]:
    os.set_inheritable(int(fd), False)
from multiprocessing.connection import Connection
requests = Connection(int(sys.argv[1]), writable=False)
sys.path[:] = requests.recv()
from grpo_jax.algorithm.rewards.suite import _serve_in_worker
_serve_in_worker(requests, Connection(int(sys.argv[2]), readable=False), int(sys.argv[3]))
"""
_PARENT_POLL_S = 1.0


def _end_with_parent(parent: int) -> None:
    """Kill the worker's group once `parent` is gone: a parent killed outright (SIGKILL, the OOM killer) runs no
    exit handler to do it, and a call that hangs would keep the worker, and what it started, running for good."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os.killpg(0, signal.SIGKILL)  # the worker leads its group: this ends it too


def _serve_in_worker(requests, replies, parent: int) -> None:
    """A worker process's loop (see _WorkerProcess): build the function, then answer calls one at a time until
    the parent closes the pipe. The parent kills the worker's group before it closes the pipe, so a pipe that
    ends unkilled means the parent died: the group ends then, with what its reward started."""
    threading.Thread(target=_end_with_parent, args=(parent,), daemon=True, name="end-with-parent").start()
    name, kwargs = requests.recv()
    try:
        fn = get_reward(name, **kwargs)
    except BaseException as e:  # noqa: BLE001 — reported to the parent, which fails the samples
        replies.send(("failed", f"{type(e).__name__}: {e}"))
        return
    replies.send(("ready", None))
    while True:
        try:
            records, completions, lengths = requests.recv()
        except EOFError:  # the parent died (see above)
            os.killpg(0, signal.SIGKILL)
            return
        replies.send(_call(fn, records, completions, lengths))


RUNNING, STARTING = "running", "starting"  # _WorkerProcess.call at the deadline


def _exit_description(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _WorkerProcess:
    """A child Python process that builds one reward function (from its spec's name and kwargs) and runs its
    calls one at a time, over two pipes. Started with subprocess (fork and exec at once): forking a process
    that runs JAX's threads is unsafe, and multiprocessing's spawn would run the user's __main__ script again.

    The worker leads its own session and process group, which the programs its reward starts (a verifier, a
    compiler) join: killing the worker kills the group, so none of them outlives it, reparented to init and
    holding a pipe of the trainer's open. (A program that starts a session of its own leaves the group: what starts
    one, as the sandbox does, ends it itself.)"""

    def __init__(self, spec: RewardSpec):
        child_requests, requests = os.pipe()
        replies, child_replies = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOT, str(child_requests), str(child_replies), str(os.getpid())],
                pass_fds=(child_requests, child_replies), stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            for fd in (requests, replies):
                os.close(fd)
            raise
        finally:
            os.close(child_requests)
            os.close(child_replies)
        self._requests = Connection(requests, readable=False)
        self._replies = Connection(replies, writable=False)
        self._ready = False
        self._kill_lock = threading.Lock()  # the group is killed before the worker is reaped, once
        self.dead = False  # the process exited (or was killed): replace it
        self.failure: str | None = None  # why it could not build the function: every call fails with this
        try:
            self._requests.send(list(sys.path))
            self._requests.send((spec.name, dict(spec.kwargs)))
        except OSError:
            self.dead = True

    def call(self, records: list, completions: list, lengths: list | None,
             deadline: float) -> tuple[list | None, str | None] | str:
        """(values, None) or (None, what went wrong); or, when `deadline` (time.monotonic()) passed first,
        RUNNING (the call still runs: kill() this worker) or STARTING (the process was not ready to take the
        call: it goes on starting, for the next one)."""
        if self.failure is not None:
            return None, self.failure
        try:
            payload = pickle.dumps((records, completions, lengths))
        except Exception as e:  # noqa: BLE001 — a row that cannot be pickled fails its samples, not the run
            return None, f"its samples cannot be sent to its worker process: {type(e).__name__}: {e}"
        try:
            if not self._ready:  # a fresh process imports grpo_jax and builds the function first
                if not self._replies.poll(max(0.0, deadline - time.monotonic())):
                    return STARTING
                status, detail = self._replies.recv()
                if status != "ready":
                    self.failure = f"could not be built in its worker process: {detail}"
                    return None, self.failure
                self._ready = True
            self._requests.send_bytes(payload)
            if not self._replies.poll(max(0.0, deadline - time.monotonic())):
                return RUNNING
            return self._replies.recv()
        except (EOFError, OSError):
            self.dead = True
            exited = self._wait_for_exit(timeout=5.0)
            self.signal_kill()  # what its reward started dies with it
            return None, f"its worker process died ({_exit_description(self.process.returncode if exited else None)})"

    def _wait_for_exit(self, timeout: float) -> bool:
        """Whether the worker exits within `timeout` seconds, left unreaped: while it is a zombie its pid is
        still its group's, which signal_kill then kills."""
        give_up = time.monotonic() + timeout
        while True:
            try:
                if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # already reaped (signal_kill, from close())
                return True
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.01)

    def kill(self) -> None:
        """End the process and close the pipes. Only the thread that uses the worker (or close(), for an idle
        one) calls this."""
        self.signal_kill()
        self._requests.close()
        self._replies.close()

    def signal_kill(self) -> None:
        """End the process and every program in its group (and reap the process) without touching the pipes,
        which another thread may be waiting on: it then reads the end of the pipe and finds the worker dead. The
        group is killed only before the worker is reaped: after that its pid, the group's id, may name another."""
        with self._kill_lock:
            if self.process.returncode is None:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except OSError:  # the group is gone (ESRCH)
                    pass
            self.process.wait()


def _signal_kill_all(workers: set) -> None:
    for worker in list(workers):
        worker.signal_kill()


class _ProcessPool:
    """The worker processes that run one reward function (a spec that runs_in "process"): `workers` of them,
    started with the suite (each takes a moment to import). A score() call gets one short-lived thread per
    process it uses, which only waits on pipes (it never holds the GIL for long). A call still running at
    the deadline has its process killed, which stops even a call that holds the GIL in its process, and a
    fresh process is started in its place; a process that dies in a call fails that call's samples and is
    replaced too. close() kills them all; whatever close() misses is killed when the interpreter exits, and a
    worker whose parent died without exiting (SIGKILL) kills itself. Killing a worker kills its process group: the
    programs its reward started end with it (_WorkerProcess)."""

    def __init__(self, spec: RewardSpec, label: str, workers: int):
        self.spec, self.label, self.workers = spec, label, workers
        self._lock = threading.Condition()  # close() waits on it for the processes being started
        self._starting = 0  # processes being started (a replacement, outside the lock): close() waits for them
        self._live: set[_WorkerProcess] = set()
        self._idle: list[_WorkerProcess] = []
        self._closed = False
        self.replaced = 0  # processes killed at a deadline or found dead, since the pool was made
        self._finalizer = weakref.finalize(self, _signal_kill_all, self._live)
        for _ in range(workers):
            self._idle.append(self._start())

    def _start(self) -> _WorkerProcess | None:
        """A new worker process; None once the pool is closed. One started while close() runs is killed before
        close() returns (it waits for every start under way), so none outlives the pool."""
        with self._lock:
            if self._closed:
                return None
            self._starting += 1
        try:
            worker = _WorkerProcess(self.spec)
            with self._lock:
                if not self._closed:
                    self._live.add(worker)
                    return worker
            worker.kill()
            return None
        finally:
            with self._lock:
                self._starting -= 1
                self._lock.notify_all()

    def stuck_threads(self) -> int:
        return 0  # a thread never outlives its call's deadline: the process is killed instead

    def submit(self, job: _Job) -> bool:
        if job.n == 0:
            return True
        if self._closed:
            raise RuntimeError(f"reward {self.label!r}: the RewardSuite is closed")
        for _ in range(min(self.workers, job.num_calls)):
            threading.Thread(target=self._work, args=(job,), daemon=True, name=f"reward-{self.label}").start()
        return True

    def retire(self, job: _Job) -> None:
        """Nothing stays behind a closed job: its calls' processes are killed at the deadline."""

    def timed_out(self, job: _Job) -> str:
        return "a call still running at the deadline has its worker process killed and replaced"

    def _work(self, job: _Job) -> None:
        worker = self._take()
        try:
            while worker is not None and (rows := job.claim()) is not None:
                outcome = worker.call(*job.arguments(rows), job.deadline)
                if isinstance(outcome, str):  # the deadline passed: the samples stay unscored
                    job.abandon(rows)
                    if outcome == RUNNING:  # only a kill stops the call
                        worker = self._replace(worker)
                    return
                if worker.dead:  # replaced first, so that the pool is whole again when score() returns
                    worker = self._replace(worker)
                job.record(rows, *outcome)
        finally:
            self._give_back(worker)

    def _take(self) -> _WorkerProcess | None:
        with self._lock:
            if self._closed:
                return None
            if self._idle:
                return self._idle.pop()
        return self._start()  # the threads of an earlier call are still handing theirs back

    def _replace(self, worker: _WorkerProcess) -> _WorkerProcess | None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)
            self.replaced += 1
            if self._closed:
                return None
        return self._start()

    def _give_back(self, worker: _WorkerProcess | None) -> None:
        if worker is None:
            return
        with self._lock:
            if not self._closed and not worker.dead and len(self._idle) < self.workers:
                self._idle.append(worker)
                return
            self._live.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker process, idle or in a call, and wait for them to end."""
        with self._lock:
            self._closed = True
            while self._starting:  # each ends with its process in _live, or killed
                self._lock.wait()
            idle, self._idle = self._idle, []
            busy = [w for w in self._live if w not in idle]
            self._live.clear()
        for worker in idle:
            worker.kill()
        for worker in busy:
            worker.signal_kill()  # its thread sees the pipe end, and closes the pipes when it hands it back


class RewardSuite:
    """Weighted sum of reward functions, each run on its own small pool of daemon threads, or of worker
    processes (RewardSpec.isolation).

    `timeout_s` bounds one score() call: every function scores every sample of the call
    concurrently, and whatever is not scored `timeout_s` seconds after the call started fails, while
    the samples scored by then keep their scores. A function that raises, returns the wrong number of
    values or returns non-finite values fails the samples of that call only (one sample per call
    unless its spec says `samples_per_call`), and so does a weighted value, or a weighted total, beyond
    float32's range (rewards are trained in float32). Failures are reported in the result, never raised.

    Each call of a function gets its own copy of its records (a deep copy on threads, a pickled one in a
    worker process): a function that changes a row (caching a parsed value in it) changes neither the
    caller's rows, which the replay buffer checkpoints, nor what its other calls or the other functions see.

    Each function runs on at most `workers` threads (or processes) per score() call. On threads it owns
    at most `max_threads` threads in all; threads stuck in calls past their deadline count against
    that bound, and a function whose threads are all stuck fails its samples at once without being
    called (see _RewardPool). In processes, a call past its deadline has its process killed and
    replaced (see _ProcessPool), which also stops a call that holds the GIL. metrics() reports
    timed-out samples, stuck threads and each function's failure rate. close() ends the worker
    processes.
    """

    def __init__(self, specs: list, timeout_s: float = 10.0, workers: int = 4, max_threads: int = 16):
        self.specs = [RewardSpec.parse(s) for s in specs]
        if not self.specs:
            raise ValueError("reward specs: need at least one reward function")
        labels = [s.label or s.name for s in self.specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"reward labels {labels}: must be unique (give repeated rewards a 'label')")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        if not 1 <= workers <= max_threads:
            raise ValueError(f"workers={workers}, max_threads={max_threads}: need 1 <= workers <= max_threads")
        self.labels = labels
        self.timeout_s = float(timeout_s)
        # Built here also for the functions that run in worker processes: a bad name or kwargs fail now, once.
        self.fns = [get_reward(s.name, **s.kwargs) for s in self.specs]
        self._pools: list[_RewardPool | _ProcessPool] = []
        try:
            for spec, fn, label in zip(self.specs, self.fns, labels):
                self._pools.append(_ProcessPool(spec, label, workers) if spec.runs_in == "process"
                                   else _RewardPool(fn, label, workers, max_threads))
        except BaseException:
            self.close()
            raise
        self.timed_out_samples = 0  # since construction, summed over functions
        self._counts_lock = threading.Lock()  # score() runs on the actor thread, metrics() on the learner's
        self._scored = 0  # samples scored since the last metrics() call
        self._failed = {label: 0 for label in labels}  # of those, failed by each function
        self._failed_any = 0  # of those, failed by any function

    @property
    def stuck_threads(self) -> int:
        return sum(pool.stuck_threads() for pool in self._pools)

    def close(self) -> None:
        """End the worker processes (functions that run in processes); threads need nothing. Idempotent; a
        closed suite scores no more."""
        for pool in self._pools:
            pool.close()

    def __enter__(self) -> RewardSuite:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict[str, float | int]:
        """For the trainer's metrics. `reward/timed_out_samples`: samples, summed over functions, that a
        function had not scored by the deadline (or was not called for because all its threads were
        stuck), since the suite was made. `reward/stuck_threads`: threads now inside a call whose
        deadline has passed. `reward/<label>/failure_rate`: the fraction of the samples scored since the
        last metrics() call that function `label` failed (raised, junk, non-finite, beyond float32, timed
        out), and `reward/failure_rate` the fraction that any function failed (those get no reward); NaN
        when no sample was scored since."""
        with self._counts_lock:
            scored, failed, failed_any = self._scored, dict(self._failed), self._failed_any
            self._scored, self._failed_any = 0, 0
            self._failed = dict.fromkeys(self._failed, 0)
        rate = (lambda k: k / scored) if scored else (lambda k: math.nan)
        out: dict[str, float | int] = {"reward/timed_out_samples": self.timed_out_samples,
                                       "reward/stuck_threads": self.stuck_threads,
                                       "reward/failure_rate": rate(failed_any)}
        out.update({f"reward/{label}/failure_rate": rate(failed[label]) for label in self.labels})
        return out

    def score(self, records: list[dict], completions: list[str], lengths: list[int] | None = None) -> RewardResult:
        """Score a batch of B completions; see the class docstring for failure handling."""
        n = len(completions)
        if len(records) != n or (lengths is not None and len(lengths) != n):
            raise ValueError(f"score: {len(records)} records, {n} completions, "
                             f"{None if lengths is None else len(lengths)} lengths; need equal counts")
        records, completions = list(records), list(completions)
        lengths = None if lengths is None else [int(x) for x in lengths]
        deadline = time.monotonic() + self.timeout_s
        # A call in a worker process gets its copy of the records by pickling; one on a thread, by deepcopy.
        jobs = [_Job(records, completions, lengths, spec.samples_per_call, deadline,
                     copy_records=spec.runs_in == "thread") for spec in self.specs]
        started = [pool.submit(job) for pool, job in zip(self._pools, jobs)]
        for job, ok in zip(jobs, started):
            if ok:
                job.done.wait(max(0.0, deadline - time.monotonic()))

        per_function, lines = {}, {}
        for label, pool, job, ok in zip(self.labels, self._pools, jobs, started):
            job.close()
            pool.retire(job)
            values = np.array(job.values, np.float64)
            said = lines[label] = []
            if not ok:
                self.timed_out_samples += n
                said.append(f"not called, {n} samples failed: all its {pool.max_threads} threads are stuck in calls "
                            f"that outlived their {self.timeout_s}s limit")
            unscored = n - job.finished if ok else 0
            if unscored:
                self.timed_out_samples += unscored
                said.append(f"timed out after {self.timeout_s}s with {unscored} of {n} samples not scored; "
                            f"{pool.timed_out(job)}")
            if job.first_error is not None:
                others = job.errored - job.first_error_samples
                said.append(f"{job.first_error} ({job.first_error_samples} of {n} samples)" + (
                    f"; {others} more failed otherwise, e.g. {job.other_error}" if others else ""))
            nonfinite = int((~np.isfinite(values)).sum()) - job.errored - unscored - (0 if ok else n)
            if nonfinite:
                said.append(f"{nonfinite} non-finite values")
            per_function[label] = values
        self._fail_beyond_float32(per_function, lines)

        total = np.zeros(n, np.float64)
        failed = np.zeros(n, bool)
        for spec, label in zip(self.specs, self.labels):
            values = per_function[label]
            failed |= ~np.isfinite(values)
            total += spec.weight * np.where(np.isfinite(values), values, 0.0)
        rewards = np.where(failed, 0.0, total)
        errors = [f"{label}: {line}" for label in self.labels for line in lines[label]]
        function_errors = {label: "; ".join(said) for label, said in lines.items() if said}
        with self._counts_lock:
            self._scored += n
            self._failed_any += int(failed.sum())
            for label, values in per_function.items():
                self._failed[label] += int((~np.isfinite(values)).sum())
        return RewardResult(rewards, failed, per_function, errors, function_errors)

    def _fail_beyond_float32(self, per_function: dict[str, np.ndarray], lines: dict[str, list[str]]) -> None:
        """Fail the samples whose weighted values or weighted total lie beyond float32's range (an inf there makes
        the group's advantages NaN), each on the function with the largest weighted value (set to NaN in
        per_function), with a line naming it."""
        with np.errstate(over="ignore", invalid="ignore"):
            terms = np.stack([spec.weight * np.where(np.isfinite(per_function[label]), per_function[label], 0.0)
                              for spec, label in zip(self.specs, self.labels)])
            scored = np.isfinite(np.stack([per_function[label] for label in self.labels])).all(axis=0)
            too_large = scored & ~((np.abs(terms) <= FLOAT32_MAX).all(axis=0)
                                   & (np.abs(terms.sum(axis=0)) <= FLOAT32_MAX))
        if not too_large.any():
            return
        culprit = np.abs(terms).argmax(axis=0)
        for i, (spec, label) in enumerate(zip(self.specs, self.labels)):
            mine = too_large & (culprit == i)
            if not mine.any():
                continue
            first = int(np.flatnonzero(mine)[0])
            value = per_function[label][first]
            lines[label].append(f"{int(mine.sum())} values too large for float32, in which rewards are trained "
                                f"(e.g. {value:.3g} x weight {spec.weight:g}): the weighted values and their total "
                                f"must stay within +-{FLOAT32_MAX:.3g}")
            per_function[label] = np.where(mine, math.nan, per_function[label])
