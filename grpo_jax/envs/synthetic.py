"""The built-in environments `countdown_multiturn` and `fetch_code`: synthetic multi-turn tasks that need the
tool's answers.

## countdown_multiturn

A row names a key and a number of lookups (make_countdown_dataset). The environment holds a hidden chain for the
episode, drawn from the seed and the row's key: each lookup of a key on the chain answers with the next key and
how many lookups are left, counting down, and the last one answers with the code:

    user:  key 52, 2 lookups
    call:  lookup(key="52")   ->  "next 17, 1 left"
    call:  lookup(key="17")   ->  "code 4711"
    final: 4711

The code depends on the seed, which the model never sees, so a policy that answers without calling the tool
scores about 10^-code_digits; a policy that copies keys from one answer into the next call solves it. The text
is digits and a few words, short enough for a tiny byte-level model. A lookup of a key that is not on the chain
is a tool error (the model reads which keys it may look up), as is a malformed call; the episode goes on. The
first turn without tool calls is the final answer and ends the episode (the default step).

`reward()`: named parts {"correct", "lookups"}. correct is 1.0 when the final answer's last run of digits is the
code, else 0.0; lookups is lookup_credit times the fraction of the chain's keys the model looked up (partial
credit for the calls, whatever the answer). A perfect episode scores 1 + lookup_credit in all.

## fetch_code

The smallest task that needs the environment: one tool without arguments, whose answer is the code.

    user:  code?
    call:  fetch()   ->  "code 42"
    final: 42

Made for a tiny model trained from scratch with the compact renderer and the synthetic_chat tokenizer, where a
perfect episode samples `<|c|>fetch<|e|>` (3 tokens) and then the code's digits and `<|e|>` (code_digits + 1).
A row is {"prompt", "id"} (make_fetch_code_dataset, or `data.synthetic_task: fetch_code`): the code is drawn
from the episode's seed and the row's id, so the row gives nothing away. The opening is the row's prompt as the
user message (after system_prompt, when one is given). The first turn without tool calls is the answer (the
default step); a call with arguments, of another tool, or malformed is a tool error and the episode goes on.

`reward()`: named parts {"correct", "called", "answered"}, at most 1.0 in all, shaped so that a model trained from
scratch finds the behaviour step by step: the call, then answering with a number, then copying the code's digits.
- called: call_credit shared by the fetch calls that answered, once the model read the code (wrote a turn after
  fetch answered; calling again earns nothing); half of it for an episode that called fetch, or tried a tool call
  (parsed or not) naming it, without reading its answer.
- answered: answer_credit when the model, having read the code, answered with a number (any; with number_alone,
  only an answer that is the number alone scores, answered and correct: a turn of junk whose last number is not the
  copied one then cannot hide a right first digit, nor be paid for a lucky one).
- correct: (1 - call_credit - answer_credit) times the copy task's per-digit credit (digits_score) of the answer's
  last number (its last run of digits): the code's digits it has right, position by position, over the code's
  length, less 0.5 for a number whose length is off by the code's length or more (in proportion when less), never
  below 0.
correct and answered count only once the model read the code, so that a guess never competes with fetching it: a
policy that never calls scores 0.
"""

from __future__ import annotations

import re

import numpy as np

from grpo_jax.data.tasks import make_synthetic_dataset
from grpo_jax.envs.environment import Environment, StepResult, register_environment
from grpo_jax.envs.render import AssistantTurn
from grpo_jax.envs.tools import Tool, ToolError, is_int, is_number

SYSTEM_PROMPT = "Look up the key, then each next key; answer with the code alone."
_DIGITS = re.compile(r"\d+")


def _random_digits(rng: np.random.Generator, n: int, values: int = 10) -> str:
    """n digits, each drawn from 0 .. values - 1."""
    return "".join(str(d) for d in rng.integers(0, values, size=n))


def countdown_prompt(key: str, lookups: int) -> str:
    return f"key {key}, {lookups} lookup{'' if lookups == 1 else 's'}"


def make_countdown_dataset(n: int, seed: int, min_lookups: int = 1, max_lookups: int = 3,
                           key_digits: int = 2) -> list[dict]:
    """`n` rows {"prompt", "key", "lookups"}, identical for the same arguments; each row's number of lookups is
    drawn uniformly from [min_lookups, max_lookups]. Use different seeds for the train and eval splits."""
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    if not 1 <= min_lookups <= max_lookups:
        raise ValueError(f"min_lookups={min_lookups}, max_lookups={max_lookups}: need 1 <= min_lookups <= "
                         "max_lookups")
    if not 1 <= key_digits <= 6:
        raise ValueError(f"key_digits={key_digits}: must be 1 to 6 (short keys keep the text short)")
    if max_lookups > 10**key_digits:
        raise ValueError(f"max_lookups={max_lookups}, key_digits={key_digits}: a chain's keys differ, so at most "
                         f"{10**key_digits} lookups; raise key_digits or lower max_lookups")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        key, lookups = _random_digits(rng, key_digits), int(rng.integers(min_lookups, max_lookups + 1))
        rows.append({"prompt": countdown_prompt(key, lookups), "key": key, "lookups": lookups})
    return rows


@register_environment("countdown_multiturn")
class CountdownMultiturnEnv(Environment):
    """A chain of lookups whose last answer is the code to answer with (module docstring)."""

    def __init__(self, *, code_digits: int = 4, lookup_credit: float = 0.1, system_prompt: str = SYSTEM_PROMPT):
        if not (is_int(code_digits) and 1 <= code_digits <= 12):
            raise ValueError(f"countdown_multiturn: code_digits={code_digits!r}: an integer from 1 to 12 (the "
                             "code's length; 4 makes a guess right once in 10000)")
        if not (is_number(lookup_credit) and 0 <= lookup_credit <= 1):
            raise ValueError(f"countdown_multiturn: lookup_credit={lookup_credit!r}: a number from 0 to 1 (the "
                             "reward for looking up the whole chain; 0 for none)")
        if not isinstance(system_prompt, str):
            raise ValueError(f"countdown_multiturn: system_prompt={system_prompt!r}: a str ('' for no system "
                             "message)")
        self.code_digits, self.lookup_credit, self.system_prompt = code_digits, float(lookup_credit), system_prompt
        self.tools = [Tool.from_function(self.lookup)]
        self.answers: dict[str, str] = {}  # each key on the chain -> what its lookup returns
        self.code: str | None = None
        self.looked_up: set[str] = set()  # keys on the chain the model looked up
        self.final_answer: str | None = None  # the content of the turn without tool calls, once there is one

    def lookup(self, key: str) -> str:
        """Look up a key: the next key and how many lookups are left, or the code.

        Args:
            key: The key from the question, or the next key the last lookup returned.
        """
        if key not in self.answers:
            # the first key only: naming the others would give the chain away
            raise ToolError(f"no key {key!r}; look up the key in the question, then each next key")
        self.looked_up.add(key)
        return self.answers[key]

    async def reset(self, row: dict, seed: int) -> list[dict]:
        key, lookups = row.get("key"), row.get("lookups")
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise ValueError(f"countdown_multiturn: row['key']={key!r}: a string of digits (make_countdown_dataset's "
                             "rows)")
        if not (is_int(lookups) and lookups >= 1):
            raise ValueError(f"countdown_multiturn: row['lookups']={lookups!r}: an integer >= 1")
        if lookups > 10 ** len(key):
            raise ValueError(f"countdown_multiturn: row['lookups']={lookups!r}: at most {10 ** len(key)} for the "
                             f"{len(key)}-digit key {key!r} (a chain's keys differ); use longer keys")
        # From the seed and the key, so that the same (row, seed) is the same episode, and two rows that share a
        # seed do not share a chain.
        rng = np.random.default_rng([seed, int(key)])
        chain = [key]
        while len(chain) < lookups:
            next_key = _random_digits(rng, len(key))
            if next_key not in chain:  # a key twice would make the chain a loop
                chain.append(next_key)
        self.code = _random_digits(rng, self.code_digits)
        self.answers = {k: f"next {n}, {lookups - i - 1} left" for i, (k, n) in enumerate(zip(chain, chain[1:]))}
        self.answers[chain[-1]] = f"code {self.code}"
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": countdown_prompt(key, lookups)}]

    async def step(self, turn: AssistantTurn) -> StepResult:
        result = await super().step(turn)
        if result.done:
            self.final_answer = turn.content
        return result

    async def reward(self) -> dict[str, float]:
        numbers = _DIGITS.findall(self.final_answer or "")
        correct = bool(numbers) and numbers[-1] == self.code
        return {"correct": float(correct), "lookups": self.lookup_credit * (len(self.looked_up) / len(self.answers))}


def make_fetch_code_dataset(n: int, seed: int) -> list[dict]:
    """`n` fetch_code rows {"prompt", "answer" (empty), "task", "id"}, identical for the same arguments: the rows
    `data: {source: synthetic, synthetic_task: fetch_code}` reads. Use different seeds for train and eval."""
    return make_synthetic_dataset("fetch_code", n, seed)


@register_environment("fetch_code")
class FetchCodeEnv(Environment):
    """One argument-less tool whose answer is the code to answer with (module docstring)."""

    def __init__(self, *, code_digits: int = 2, call_credit: float = 0.1, answer_credit: float = 0.1,
                 number_alone: bool = False, code_values: int = 10, system_prompt: str = ""):
        if not (is_int(code_digits) and 1 <= code_digits <= 12):
            raise ValueError(f"fetch_code: code_digits={code_digits!r}: an integer from 1 to 12 (the code's "
                             "length; a guessed digit is right once in 10)")
        if not (is_number(call_credit) and 0 <= call_credit <= 1):
            raise ValueError(f"fetch_code: call_credit={call_credit!r}: a number from 0 to 1 (the reward for "
                             "calling fetch; the answer's digits share the rest of 1.0)")
        if not (is_number(answer_credit) and 0 <= answer_credit <= 1 - call_credit):
            raise ValueError(f"fetch_code: answer_credit={answer_credit!r}: a number from 0 to 1 - call_credit (the "
                             "reward for answering with a number after reading the code)")
        if not isinstance(system_prompt, str):
            raise ValueError(f"fetch_code: system_prompt={system_prompt!r}: a str ('' for no system message)")
        if not isinstance(number_alone, bool):
            raise ValueError(f"fetch_code: number_alone={number_alone!r}: true or false (whether only an answer that "
                             "is a number alone scores)")
        self.code_digits, self.call_credit, self.system_prompt = code_digits, float(call_credit), system_prompt
        if not (is_int(code_values) and 2 <= code_values <= 10):
            raise ValueError(f"fetch_code: code_values={code_values!r}: an integer from 2 to 10 (each digit of the "
                             "code is drawn from 0 .. code_values - 1)")
        self.answer_credit, self.number_alone = float(answer_credit), number_alone
        self.code_values = code_values
        self.tools = [Tool.from_function(self.fetch)]
        self.code: str | None = None
        self.fetches = 0  # calls of fetch that answered
        self.tried = False  # a turn tried a tool call and named fetch (the call may not have parsed)
        self.read_code = False  # the model wrote a turn after fetch answered (it read the code)
        self.final_answer: str | None = None  # the content of the turn without tool calls, once there is one

    def fetch(self) -> str:
        """Fetch the code to answer with."""
        if self.code is None:
            raise ToolError("no code yet: the episode has not been reset")
        self.fetches += 1
        return f"code {self.code}"

    async def reset(self, row: dict, seed: int) -> list[dict]:
        prompt, row_id = row.get("prompt"), row.get("id")
        if not (isinstance(prompt, str) and prompt):
            raise ValueError(f"fetch_code: row['prompt']={prompt!r}: the user's opening, a non-empty str "
                             "(make_fetch_code_dataset's rows)")
        if not (is_int(row_id) and row_id >= 0):
            raise ValueError(f"fetch_code: row['id']={row_id!r}: an integer >= 0, from which with the seed the code "
                             "is drawn (make_fetch_code_dataset's rows)")
        if not (is_int(seed) and seed >= 0):
            raise ValueError(f"fetch_code: seed={seed!r}: an integer >= 0")
        # From the seed and the row's id: the same (row, seed) is the same episode; rows sharing a seed differ.
        self.code = _random_digits(np.random.default_rng([seed, row_id]), self.code_digits, self.code_values)
        self.fetches, self.tried, self.read_code, self.final_answer = 0, False, False, None
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    async def step(self, turn: AssistantTurn) -> StepResult:
        attempted = bool(turn.tool_calls) or turn.parse_error is not None
        self.tried = self.tried or (attempted and "fetch" in turn.text)
        self.read_code = self.read_code or self.fetches > 0  # this turn was written after fetch answered
        result = await super().step(turn)
        if result.done:
            self.final_answer = turn.content
        return result

    async def reward(self) -> dict[str, float]:
        answer, code = (self.final_answer or "").strip(), self.code or ""
        fraction, answered = 0.0, 0.0
        if self.read_code:  # only then: guessing the code must not compete with fetching it
            # The answer's last number, scored with the copy task's per-digit credit (grpo_jax.data.tasks.
            # digits_score): digits right, position by position, less half for a length off by the code's length
            # or more; never below 0, so that reading the code never costs more than not reading it.
            numbers = _DIGITS.findall(answer) if not self.number_alone or _DIGITS.fullmatch(answer) else []
            number = numbers[-1] if numbers else ""
            answered = self.answer_credit if numbers else 0.0
            right = sum(a == c for a, c in zip(number, code))
            fraction = max(0.0, right / len(code) - 0.5 * min(1.0, abs(len(number) - len(code)) / len(code)))
        # In full once the model read fetch's answer (an episode cut off before, by the error messages of a turn
        # of junk calls, earns half), shared by the calls, so that calling again earns nothing.
        called = self.call_credit / 2 if self.tried or self.fetches else 0.0
        if self.read_code:
            called = self.call_credit / self.fetches
        return {"correct": (1 - self.call_credit - self.answer_credit) * fraction, "called": called,
                "answered": answered}
