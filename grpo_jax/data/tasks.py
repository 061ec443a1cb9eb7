"""Synthetic digit tasks for CPU runs: a tiny model trained from scratch learns them within minutes.

Prompts are short plain ASCII for the byte-level tokenizer, e.g.

    copy: 3817=      -> 3817
    reverse: 3817=   -> 7183
    add: 12+7=       -> 19

The model should answer and then stop: with a newline, or with the EOS token (which the decoder drops
from the completion text). `digits_score` reads the completion only up to the first stop string, so
whatever follows the answer is ignored, and gives partial credit per digit: a 2-layer model gets a
dense, prompt-dependent signal long before it solves a task exactly. `copy` is the easiest (attend to
the same offset), `reverse` needs position arithmetic, `add` needs carries; use 1-4 digits for quick
runs.

`fetch_code` is not a digit task: its rows ("code?") are the openings of the multi-turn environment
`fetch_code` (grpo_jax.envs.synthetic), which draws the code per episode and gives the reward; a config
names both (`data: {source: synthetic, synthetic_task: fetch_code, prompt_field: prompt}` and the env).
"""

from __future__ import annotations

import numpy as np

DIGIT_TASKS = ("copy", "reverse", "add")
# fetch_code: the rows of the multi-turn environment of that name (grpo_jax.envs.synthetic), whose reward the
# environment gives: the code to answer with is drawn per episode, so the row holds none.
TASKS = (*DIGIT_TASKS, "fetch_code")
FETCH_CODE_PROMPT = "code?"
# Every character a synthetic prompt or answer uses: the char-level tokenizer (`tokenizer: synthetic`)
# of the CPU runs is built over exactly these, so a tiny model explores ~25 symbols instead of 259 bytes.
# (The digit tasks' only: fetch_code's words are tokens of `tokenizer: synthetic_chat`, and adding letters here
# would change the ids of models trained with this tokenizer.)
SYNTHETIC_ALPHABET = "0123456789 :+=\n" + "".join(sorted(set("".join(DIGIT_TASKS))))


def _digit_string(rng: np.random.Generator, n: int) -> str:
    # Leading zeros allowed: copy/reverse are string tasks, and "0381" reversed must stay 4 digits.
    return "".join(str(d) for d in rng.integers(0, 10, size=n))


def _integer(rng: np.random.Generator, n: int) -> int:
    # An n-digit integer without a leading zero (0-9 for one digit).
    if n == 1:
        return int(rng.integers(0, 10))
    return int(rng.integers(10 ** (n - 1), 10**n))


def make_synthetic_dataset(task: str, n: int, seed: int, min_digits: int = 1, max_digits: int = 4) -> list[dict]:
    """`n` rows {"prompt", "answer", "task"}, identical for the same arguments.

    Each operand has a digit count drawn uniformly from [min_digits, max_digits]. Use different seeds
    for the train and eval splits. fetch_code rows are {"prompt": "code?", "answer": "", "task", "id"}: id a
    random integer from the seed, from which (with the episode's seed) the environment draws the code; answer
    is empty (the data pipeline reads an answer field; the code is not in the row); the digit counts do not
    apply (the environment's code_digits does).
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r}: allowed {', '.join(TASKS)}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"min_digits={min_digits}, max_digits={max_digits}: need 1 <= min_digits <= max_digits")
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        if task == "fetch_code":
            # each row its own id, so rows (and splits of other seeds) sharing an episode seed get other codes
            rows.append({"prompt": FETCH_CODE_PROMPT, "answer": "", "task": task, "id": int(rng.integers(0, 2**31))})
            continue
        if task == "add":
            a = _integer(rng, int(rng.integers(min_digits, max_digits + 1)))
            b = _integer(rng, int(rng.integers(min_digits, max_digits + 1)))
            prompt, answer = f"add: {a}+{b}=", str(a + b)
        else:
            s = _digit_string(rng, int(rng.integers(min_digits, max_digits + 1)))
            prompt, answer = f"{task}: {s}=", (s if task == "copy" else s[::-1])
        rows.append({"prompt": prompt, "answer": answer, "task": task})
    return rows


def extract_answer(completion: str, stop: str | tuple[str, ...] | list[str] = "\n") -> str:
    """The completion up to the first of the `stop` strings (the whole text when none occurs),
    stripped of spaces."""
    cut = len(completion)
    for s in (stop,) if isinstance(stop, str) else stop:
        i = completion.find(s)
        if i >= 0:
            cut = min(cut, i)
    return completion[:cut].strip()


def digits_score(target: str, completion: str, stop: str | tuple[str, ...] | list[str] = "\n",
                 length_penalty: float = 0.5) -> float:
    """Per-character partial credit in [-length_penalty, 1]; 1 exactly when the answer matches.

    score = (#positions i < min(len) with pred[i] == target[i]) / len(target)
            - length_penalty * min(1, |len(pred) - len(target)| / len(target))

    Positions are left-aligned (the order the model writes them). The length term means padding the
    answer with extra characters, or stopping early, always costs something.
    """
    pred = extract_answer(completion, stop)
    n = len(target)
    if n == 0:
        return 1.0 if not pred else -length_penalty
    correct = sum(p == t for p, t in zip(pred, target))
    return correct / n - length_penalty * min(1.0, abs(len(pred) - n) / n)
