"""The built-in reward factories, registered by name: gsm8k, format, overlong, synthetic_digits, python_output."""

from __future__ import annotations

import re
from typing import Any

from grpo_jax import sandbox
from grpo_jax.algorithm.rewards.answers import extract_final_answer, numbers_match, parse_reference, reference_output
from grpo_jax.algorithm.rewards.registry import RewardFn, register_reward
from grpo_jax.data import tasks


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


_PYTHON_BLOCK = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)


def last_python_block(text: str) -> str | None:
    """The code in the last closed ```python fenced block of `text`, or None when there is none (a block the
    completion did not close, cut off at the token limit, does not count)."""
    blocks = _PYTHON_BLOCK.findall(text)
    return blocks[-1] if blocks else None




@register_reward("python_output")
def python_output_reward(answer_key: str = "answer", stdin_key: str = "", **limits: Any) -> RewardFn:
    """1.0 when the completion's last ```python block, run in a grpo_jax.sandbox.Sandbox with `limits` (its
    keyword arguments: timeout_s, memory_mb, ...), exits 0 and prints, once stripped, the record's reference
    (reference_output of its `answer_key` field), else 0.0. `stdin_key` names a field given to the program as
    its standard input ("": none). A completion without a block, and a program that fails (a timeout, the
    memory limit, an exception, the network), score 0.0: those are the model's failures. One the sandbox
    itself cannot run raises (SandboxError), which fails the sample."""
    if not isinstance(answer_key, str) or not answer_key:
        raise ValueError(f"python_output: answer_key={answer_key!r}: must be the name of the field that holds the "
                         "expected output, e.g. 'answer'")
    if not isinstance(stdin_key, str):
        raise ValueError(f"python_output: stdin_key={stdin_key!r}: must be the name of the field given to the program "
                         "as its standard input, or '' for none")
    for key, value in limits.items():
        if key not in sandbox.LIMITS:
            raise ValueError(f"python_output: unknown kwarg {key}={value!r}; allowed answer_key, stdin_key, "
                             f"{', '.join(sandbox.LIMITS)}")
    try:
        box = sandbox.Sandbox(**limits)
    except ValueError as e:
        raise ValueError(f"python_output: {e}") from None
    # No close(): the sandbox keeps no process between runs, and one still running at exit is killed then.

    def fn(records, completions, lengths=None):
        out = []
        for record, completion in zip(records, completions):
            expected = reference_output(str(record[answer_key]))
            stdin = str(record[stdin_key]) if stdin_key else ""
            code = last_python_block(completion)
            if code is None:
                out.append(0.0)
                continue
            result = box.run_python(code, stdin)
            out.append(float(result.ok and result.stdout.strip() == expected))
        return out

    return fn
