"""Reward functions, selected by name in the config, and a weighted suite that never crashes a run.

Every reward function has one signature:

    fn(records: list[dict], completions: list[str], lengths: list[int] | None) -> list[float]

`records[i]` is the dataset row that prompt i came from (e.g. GSM8K {"question", "answer"}),
`completions[i]` the decoded completion text, `lengths[i]` the number of completion tokens generated
(including the stop token when one was sampled); only length-based rewards need `lengths`. A function
returns one float per completion. Returning NaN for a sample means "could not score this one" (for
example an unparsable reference): `RewardSuite` marks just that sample as failed.

Functions are built by factories: `get_reward(name, **kwargs)` validates the kwargs up front, so a
config typo fails at startup rather than mid-run.

Rewards of your own follow the same convention. In a config, `name: "my_package.rewards:exact_match"`
names a factory by import path: `exact_match(**kwargs)` is called with the spec's kwargs (once when the
config is checked, once when the run starts) and returns the reward function above. In Python,
grpo_jax.train(rewards=[(fn, weight)]) takes the reward function itself (see register_function). Either
way the function runs on RewardSuite's threads, under the same deadline and failure handling as the
built-in ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import queue
import re
import threading
import time
from fractions import Fraction
from typing import Any, Callable

import numpy as np

from grpo_jax import tasks

RewardFn = Callable[[list, list, "list[int] | None"], list]

REWARDS: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str):
    """Decorator adding a factory `(**kwargs) -> RewardFn` to REWARDS under `name`."""

    def deco(factory):
        REWARDS[name] = factory
        return factory

    return deco


class RewardNameError(ValueError):
    """A reward name that does not resolve to a factory: unknown, or an import path that fails. `reason`
    is the message without the name, for callers that name the config key themselves."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"reward={name!r}: {reason}")
        self.name, self.reason = name, reason


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """Build the reward function `name`: registered in REWARDS, or a factory named by import path
    "package.module:factory". A name that does not resolve raises RewardNameError; bad kwargs raise
    ValueError or TypeError."""
    if name in REWARDS:
        return REWARDS[name](**kwargs)
    if ":" not in name:
        raise RewardNameError(name, f"allowed {', '.join(sorted(REWARDS))}, or a factory of your own by import "
                                    "path 'package.module:factory'")
    factory = import_factory(name)
    try:
        fn = factory(**kwargs)
    except Exception as e:  # noqa: BLE001 - whatever user code raises, it is a config problem found at start
        # A TypeError is usually a name that points at the reward function itself, or a misspelt kwarg.
        hint = ("; the name must be a factory f(**kwargs) returning fn(records, completions, lengths)"
                if isinstance(e, TypeError) else "")
        raise ValueError(f"{name}(**kwargs) raised {type(e).__name__}: {e}{hint}") from e
    if not callable(fn):
        raise ValueError(f"{name}(**kwargs) returned {type(fn).__name__}, not a reward function; the name must be a "
                         "factory f(**kwargs) returning fn(records, completions, lengths)")
    return fn


def import_factory(path: str) -> Callable[..., RewardFn]:
    """The object named by "package.module:attribute" (the attribute may be dotted: Class.method).
    Every failure is a RewardNameError naming the module and the attribute."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise RewardNameError(path, "expected an import path 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise RewardNameError(path, f"no module named {e.name} (put the directory that holds it on "
                                        "PYTHONPATH, or install it)") from e
        raise RewardNameError(path, f"importing module {module_name} raised ModuleNotFoundError: {e}") from e
    except Exception as e:  # noqa: BLE001 - user code: report it, whatever it raised
        raise RewardNameError(path, f"importing module {module_name} raised {type(e).__name__}: {e}") from e
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise RewardNameError(path, f"module {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise RewardNameError(path, f"{module_name}.{attribute} is a {type(found).__name__}, not a factory")
    return found


def register_function(fn: RewardFn) -> str:
    """Make a Python reward function fn(records, completions, lengths) usable by name in this process
    (grpo_jax.train's `rewards=`), and return that name: "<module>.<qualname>". It holds no ':', so it is
    never taken for a factory's import path; a later function of the same name replaces this one (a
    notebook cell run again)."""
    name = f"{getattr(fn, '__module__', None) or 'python'}.{getattr(fn, '__qualname__', type(fn).__name__)}"

    def factory():
        return fn

    REWARDS[name] = factory
    return name


# ----------------------------------------------------------------------------------------------------
# Numbers in free text.

# A number, optionally signed, with an optional $ before it, thousands commas, decimals and an optional
# "/denominator". The sign must touch the number and not follow a word character or closing bracket,
# so "16-3" and "16 - 3" read as 16 and 3. Anything after the number (%, units, words, a full stop) is
# ignored.
_NUMBER = re.compile(
    r"(?<![\w.)\]])(?P<neg>[-−])?\$?(?P<neg2>[-−])?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?)(?![\d/]))?"
)


def _to_fraction(m: re.Match) -> Fraction | None:
    try:
        value = Fraction(m.group("num").replace(",", ""))
        if m.group("den"):
            value /= Fraction(m.group("den"))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if (m.group("neg") or m.group("neg2")) else value


def parse_number(text: str, last: bool = False) -> Fraction | None:
    """The first (or last) number in `text` as an exact Fraction, or None when there is none."""
    matches = list(_NUMBER.finditer(text)) if last else [m for m in [_NUMBER.search(text)] if m]
    for m in reversed(matches) if last else matches:
        value = _to_fraction(m)
        if value is not None:
            return value
    return None


def _latex_to_text(s: str) -> str:
    # Just enough LaTeX for boxed answers: \frac{3}{4}, 1{,}200, \$, \%, thin spaces, \text{...}.
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", s)
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    s = s.replace("\\$", "$").replace("\\%", "%")
    return re.sub(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}", r" \1", s)


def _last_boxed(text: str) -> str | None:
    # Brace matching, because \boxed{\frac{3}{4}} nests.
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?([^\n]*)", re.IGNORECASE)


def extract_final_answer(text: str, last_number_fallback: bool = True) -> Fraction | None:
    """The completion's final answer, trying in order and taking the first that holds a number:

    1. the last "#### N" (GSM8K's own format), 2. the last \\boxed{N}, 3. the last "answer is N" /
    "answer: N", 4. if `last_number_fallback`, the last number anywhere in the text.
    """
    text = _latex_to_text(text)
    hashes = _HASHES.findall(text)
    if hashes and (v := parse_number(hashes[-1])) is not None:
        return v
    boxed = _last_boxed(text)
    if boxed is not None and (v := parse_number(boxed)) is not None:
        return v
    answer_is = _ANSWER_IS.findall(text)
    if answer_is and (v := parse_number(answer_is[-1])) is not None:
        return v
    if last_number_fallback:
        return parse_number(text, last=True)
    return None


def parse_reference(answer: str) -> Fraction | None:
    """The reference number from a GSM8K answer field (its "#### N" line), or a bare number."""
    hashes = _HASHES.findall(answer)
    return parse_number(hashes[-1] if hashes else answer)


def numbers_match(a: Fraction, b: Fraction, abs_tol: float = 1e-6) -> bool:
    """Exact equality of fractions, or |a - b| <= abs_tol (decimals that went through floats).

    The tolerance is absolute, not relative, so that 1000000 and 1000001 never match.
    """
    return a == b or abs(float(a) - float(b)) <= abs_tol


# ----------------------------------------------------------------------------------------------------
# Reward factories.


@register_reward("gsm8k")
def gsm8k_reward(answer_key: str = "answer", last_number_fallback: bool = True, abs_tol: float = 1e-6) -> RewardFn:
    """1.0 when the completion's final answer equals the reference number, else 0.0; NaN when the
    record's reference cannot be parsed (a data problem, reported as a failed sample)."""

    def fn(records, completions, lengths=None):
        out = []
        for record, completion in zip(records, completions):
            ref = parse_reference(str(record[answer_key]))
            if ref is None:
                out.append(float("nan"))
                continue
            got = extract_final_answer(completion, last_number_fallback)
            out.append(float(got is not None and numbers_match(got, ref, abs_tol)))
        return out

    return fn


FORMAT_GSM8K = r"####\s*-?[\d,\.]+"
FORMAT_ANSWER_TAG = r"<answer>.*?</answer>"


@register_reward("format")
def format_reward(pattern: str = FORMAT_GSM8K) -> RewardFn:
    """1.0 when `pattern` (a regex, searched with DOTALL) occurs in the completion, else 0.0.
    FORMAT_ANSWER_TAG is the <answer>...</answer> alternative."""
    regex = re.compile(pattern, re.DOTALL)

    def fn(records, completions, lengths=None):
        return [float(regex.search(c) is not None) for c in completions]

    return fn


@register_reward("overlong")
def overlong_reward(max_len: int, cache_len: int) -> RewardFn:
    """DAPO soft overlong punishment on the completion length L in tokens:
    0 for L <= max_len - cache_len, then a linear ramp to -1 at L = max_len, and -1 beyond."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len}, max_len={max_len}: need 0 < cache_len <= max_len")
    free = max_len - cache_len

    def fn(records, completions, lengths=None):
        if lengths is None:
            raise ValueError("overlong reward needs completion token lengths")
        return [0.0 if n <= free else max(-1.0, (free - n) / cache_len) for n in lengths]

    return fn


@register_reward("synthetic_digits")
def synthetic_digits_reward(answer_key: str = "answer", stop: str | list[str] = "\n",
                            length_penalty: float = 0.5) -> RewardFn:
    """Digit-wise partial credit for the synthetic tasks (see tasks.digits_score); `stop` is one
    string or a list (e.g. ["\n", "<eos>"] when the decoder keeps the EOS text)."""
    stop = stop if isinstance(stop, str) else tuple(stop)

    def fn(records, completions, lengths=None):
        return [tasks.digits_score(str(r[answer_key]), c, stop, length_penalty) for r, c in zip(records, completions)]

    return fn


# ----------------------------------------------------------------------------------------------------
# Weighted suite.


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One term of the combined reward. `label` names it in metrics (default: `name`).

    `samples_per_call` is how many samples one call of the function scores. The default, 1, means a
    slow, hung or failing sample fails only itself; raise it for a function that gains from batching
    (a reward model, a remote verifier), at the price of failing a whole call's samples together.
    """

    name: str
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)
    label: str | None = None
    samples_per_call: int = 1

    def __post_init__(self):
        if isinstance(self.samples_per_call, bool) or not isinstance(self.samples_per_call, int) \
                or self.samples_per_call < 1:
            raise ValueError(f"reward {self.name!r}: samples_per_call={self.samples_per_call!r}: must be an "
                             "integer >= 1")

    @classmethod
    def parse(cls, spec: Any) -> "RewardSpec":
        """From a RewardSpec, a (name, weight[, kwargs]) sequence, or a dict with those keys (+ label,
        samples_per_call)."""
        if isinstance(spec, RewardSpec):
            return spec
        if isinstance(spec, dict):
            allowed = {"name", "weight", "kwargs", "label", "samples_per_call"}
            if set(spec) - allowed or "name" not in spec:
                raise ValueError(f"reward spec {spec!r}: needs 'name'; allowed keys {', '.join(sorted(allowed))}")
            return cls(spec["name"], float(spec.get("weight", 1.0)), dict(spec.get("kwargs") or {}),
                       spec.get("label"), spec.get("samples_per_call", 1))
        if isinstance(spec, (list, tuple)) and len(spec) in (2, 3):
            return cls(spec[0], float(spec[1]), dict(spec[2]) if len(spec) == 3 else {})
        raise ValueError(f"reward spec {spec!r}: expected (name, weight[, kwargs]) or a dict")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """rewards [B] (weighted sum; 0.0 where failed), failed [B] bool, per_function {label: [B]}
    (NaN where that function failed), errors: at most a few lines per function, each saying which
    failure and how many samples it cost."""

    rewards: np.ndarray
    failed: np.ndarray
    per_function: dict[str, np.ndarray]
    errors: list[str]

    @property
    def num_failed(self) -> int:
        return int(self.failed.sum())


class _Job:
    """One reward function's share of one score() call. Worker threads claim `samples_per_call`
    samples at a time, so a call that hangs holds back only its own samples while the other workers
    score the rest. Every write goes through `lock` and stops once the caller has closed the job (at
    its deadline), so a late call can never change a result already returned."""

    def __init__(self, records: list, completions: list, lengths: list | None, samples_per_call: int):
        self.records, self.completions, self.lengths = records, completions, lengths
        self.n = len(completions)
        self.samples_per_call = samples_per_call
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.values = [math.nan] * self.n  # a list: cheaper than an array to write one sample into
        self.next_start = 0
        self.finished = 0  # samples whose call has returned or raised
        self.in_call = 0  # threads inside the reward function for this job
        self.closed = False
        self.errored = 0  # samples whose call raised or returned junk
        self.first_error: str | None = None
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
            self.finished += rows.stop - rows.start
            if self.finished == self.n:
                self.done.set()

    def close(self) -> None:
        with self.lock:
            self.closed = True

    @property
    def num_calls(self) -> int:
        return -(-self.n // self.samples_per_call)


def _as_floats(out: Any, count: int) -> list[float]:
    values = np.asarray(out, dtype=np.float64)
    if values.shape != (count,):
        raise ValueError(f"returned shape {values.shape} for {count} completions")
    return values.tolist()


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
            lengths = None if job.lengths is None else job.lengths[rows]
            try:
                out = self.fn(job.records[rows], job.completions[rows], lengths)
            except BaseException as e:  # noqa: BLE001 — any failure of user code is a failed sample
                job.record(rows, None, f"raised {type(e).__name__}: {e}")
                continue
            try:
                values = _as_floats(out, rows.stop - rows.start)
            except (TypeError, ValueError) as e:
                job.record(rows, None, f"bad output: {e}")
                continue
            job.record(rows, values, None)


class RewardSuite:
    """Weighted sum of reward functions, each run on its own small pool of daemon threads.

    `timeout_s` bounds one score() call: every function scores every sample of the call
    concurrently, and whatever is not scored `timeout_s` seconds after the call started fails, while
    the samples scored by then keep their scores. A function that raises, returns the wrong number of
    values or returns non-finite values fails the samples of that call only (one sample per call
    unless its spec says `samples_per_call`). Failures are reported in the result, never raised.

    Each function runs on at most `workers` threads per score() call and owns at most `max_threads`
    threads in all; threads stuck in calls past their deadline count against that bound, and a
    function whose threads are all stuck fails its samples at once without being called (see
    _RewardPool). metrics() reports timed-out samples and stuck threads.
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
        self.fns = [get_reward(s.name, **s.kwargs) for s in self.specs]
        self._pools = [_RewardPool(fn, label, workers, max_threads) for fn, label in zip(self.fns, labels)]
        self.timed_out_samples = 0  # since construction, summed over functions

    @property
    def stuck_threads(self) -> int:
        return sum(pool.stuck_threads() for pool in self._pools)

    def metrics(self) -> dict[str, int]:
        """For the trainer's metrics. `reward/timed_out_samples`: samples, summed over functions, that a
        function had not scored by the deadline (or was not called for because all its threads were
        stuck), since the suite was made. `reward/stuck_threads`: threads now inside a call whose
        deadline has passed."""
        return {"reward/timed_out_samples": self.timed_out_samples, "reward/stuck_threads": self.stuck_threads}

    def score(self, records: list[dict], completions: list[str], lengths: list[int] | None = None) -> RewardResult:
        """Score a batch of B completions; see the class docstring for failure handling."""
        n = len(completions)
        if len(records) != n or (lengths is not None and len(lengths) != n):
            raise ValueError(f"score: {len(records)} records, {n} completions, "
                             f"{None if lengths is None else len(lengths)} lengths; need equal counts")
        records, completions = list(records), list(completions)
        lengths = None if lengths is None else [int(x) for x in lengths]
        jobs = [_Job(records, completions, lengths, spec.samples_per_call) for spec in self.specs]
        started = [pool.submit(job) for pool, job in zip(self._pools, jobs)]
        deadline = time.monotonic() + self.timeout_s
        for job, ok in zip(jobs, started):
            if ok:
                job.done.wait(max(0.0, deadline - time.monotonic()))

        total = np.zeros(n, np.float64)
        failed = np.zeros(n, bool)
        per_function, errors = {}, []
        for spec, label, pool, job, ok in zip(self.specs, self.labels, self._pools, jobs, started):
            job.close()
            pool.retire(job)
            values = np.array(job.values, np.float64)
            if not ok:
                self.timed_out_samples += n
                errors.append(f"{label}: not called, {n} samples failed: all its {pool.max_threads} threads are "
                              f"stuck in calls that outlived their {self.timeout_s}s limit")
            unscored = n - job.finished if ok else 0
            if unscored:
                self.timed_out_samples += unscored
                errors.append(f"{label}: timed out after {self.timeout_s}s with {unscored} of {n} samples not "
                              f"scored; calls still running: {job.in_call}")
            if job.first_error is not None:
                errors.append(f"{label}: {job.first_error} ({job.errored} of {n} samples)")
            nonfinite = int((~np.isfinite(values)).sum()) - job.errored - unscored - (0 if ok else n)
            if nonfinite:
                errors.append(f"{label}: {nonfinite} non-finite values")
            per_function[label] = values
            failed |= ~np.isfinite(values)
            total += spec.weight * np.where(np.isfinite(values), values, 0.0)
        rewards = np.where(failed, 0.0, total)
        return RewardResult(rewards, failed, per_function, errors)
