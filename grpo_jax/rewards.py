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
"""

from __future__ import annotations

import dataclasses
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


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """Build the reward function registered as `name`; unknown names raise ValueError."""
    if name not in REWARDS:
        raise ValueError(f"reward={name!r}: allowed {', '.join(sorted(REWARDS))}")
    return REWARDS[name](**kwargs)


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
    """One term of the combined reward. `label` names it in metrics (default: `name`)."""

    name: str
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)
    label: str | None = None

    @classmethod
    def parse(cls, spec: Any) -> "RewardSpec":
        """From a RewardSpec, a (name, weight[, kwargs]) sequence, or a dict with those keys (+ label)."""
        if isinstance(spec, RewardSpec):
            return spec
        if isinstance(spec, dict):
            unknown = set(spec) - {"name", "weight", "kwargs", "label"}
            if unknown or "name" not in spec:
                raise ValueError(f"reward spec {spec!r}: needs 'name'; allowed keys name, weight, kwargs, label")
            return cls(spec["name"], float(spec.get("weight", 1.0)), dict(spec.get("kwargs") or {}), spec.get("label"))
        if isinstance(spec, (list, tuple)) and len(spec) in (2, 3):
            return cls(spec[0], float(spec[1]), dict(spec[2]) if len(spec) == 3 else {})
        raise ValueError(f"reward spec {spec!r}: expected (name, weight[, kwargs]) or a dict")


@dataclasses.dataclass
class RewardResult:
    """rewards [B] (weighted sum; 0.0 where failed), failed [B] bool, per_function {label: [B]}
    (NaN where that function failed), errors: one line per failure."""

    rewards: np.ndarray
    failed: np.ndarray
    per_function: dict[str, np.ndarray]
    errors: list[str]

    @property
    def num_failed(self) -> int:
        return int(self.failed.sum())


class RewardSuite:
    """Weighted sum of reward functions, each run in its own daemon thread with a deadline.

    A function that raises, returns the wrong number of values, returns non-finite values, or has not
    finished `timeout_s` seconds after the call started, fails the affected samples (all of them, or
    just the non-finite ones); the failures are reported in the result, never raised. Functions run
    concurrently, so the call takes at most about `timeout_s`.

    Python cannot kill a thread: a timed-out function keeps running in the background and its result
    is discarded. Daemon threads are used (not a ThreadPoolExecutor) so that a hung function neither
    blocks later calls on a busy worker nor blocks interpreter exit. `abandoned_threads` counts those
    still running.
    """

    def __init__(self, specs: list, timeout_s: float = 10.0):
        self.specs = [RewardSpec.parse(s) for s in specs]
        if not self.specs:
            raise ValueError("reward specs: need at least one reward function")
        labels = [s.label or s.name for s in self.specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"reward labels {labels}: must be unique (give repeated rewards a 'label')")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.labels = labels
        self.timeout_s = float(timeout_s)
        self.fns = [get_reward(s.name, **s.kwargs) for s in self.specs]
        self._abandoned: list[threading.Thread] = []

    @property
    def abandoned_threads(self) -> int:
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def score(self, records: list[dict], completions: list[str], lengths: list[int] | None = None) -> RewardResult:
        """Score a batch of B completions; see the class docstring for failure handling."""
        n = len(completions)
        if len(records) != n or (lengths is not None and len(lengths) != n):
            raise ValueError(f"score: {len(records)} records, {n} completions, "
                             f"{None if lengths is None else len(lengths)} lengths; need equal counts")
        lengths = None if lengths is None else [int(x) for x in lengths]
        outputs: list[Any] = [None] * len(self.fns)
        threads = []

        def run(k, fn):
            try:
                outputs[k] = ("ok", fn(list(records), list(completions), lengths))
            except BaseException as e:  # noqa: BLE001 — any failure of user code is a failed sample
                outputs[k] = ("error", e)

        for k, fn in enumerate(self.fns):
            t = threading.Thread(target=run, args=(k, fn), daemon=True, name=f"reward-{self.labels[k]}")
            t.start()
            threads.append(t)
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

        total = np.zeros(n, np.float64)
        failed = np.zeros(n, bool)
        per_function, errors = {}, []
        for k, (spec, label, t) in enumerate(zip(self.specs, self.labels, threads)):
            values = np.full(n, np.nan)
            if t.is_alive():
                self._abandoned.append(t)
                errors.append(f"{label}: timed out after {self.timeout_s}s (thread abandoned, still running)")
            elif outputs[k][0] == "error":
                e = outputs[k][1]
                errors.append(f"{label}: raised {type(e).__name__}: {e}")
            else:
                try:
                    got = np.asarray(outputs[k][1], dtype=np.float64)
                    if got.shape != (n,):
                        raise ValueError(f"returned shape {got.shape} for {n} completions")
                    values = got
                    bad = ~np.isfinite(values)
                    if bad.any():
                        errors.append(f"{label}: {int(bad.sum())} non-finite values")
                except (TypeError, ValueError) as e:
                    errors.append(f"{label}: bad output: {e}")
            per_function[label] = values
            failed |= ~np.isfinite(values)
            total += spec.weight * np.where(np.isfinite(values), values, 0.0)
        rewards = np.where(failed, 0.0, total)
        return RewardResult(rewards, failed, per_function, errors)
