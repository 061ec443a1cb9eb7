"""Reward functions, selected by name in the config, and a weighted suite that never crashes a run.

The package: registry (names, import paths, register_function), answers (numbers in free text), builtin (the
built-in factories), suite (RewardSuite, its thread pools and worker processes, loaded on first use, so that a
module that needs only answers or the registry starts none of that). Everything is importable from here.

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
built-in ones; a spec with `isolation: "process"` runs it in worker processes instead, which are killed
at the deadline (RewardSpec), the default for a built-in reward given a regex by the config. A config
that names a factory runs that code wherever the config is loaded: the import, then the factory. Code the model
wrote never runs in this interpreter: `python_output` runs it in a grpo_jax.sandbox.Sandbox, and a factory of
your own creates one once and calls it per sample.

Each call gets its own copy of its records, so a function may change them. A function that fails on
every sample never fails the run here: the actor stops the run once no group could be trained for
trainer.reward_error_handouts handouts (grpo_jax.rollout.actor).
"""

from __future__ import annotations

import importlib

from grpo_jax.algorithm.rewards.answers import (
    extract_final_answer,
    numbers_match,
    parse_number,
    parse_reference,
    reference_output,
)
from grpo_jax.algorithm.rewards.builtin import (
    FORMAT_ANSWER_TAG,
    FORMAT_GSM8K,
    format_reward,
    gsm8k_reward,
    last_python_block,
    overlong_reward,
    python_output_reward,
    synthetic_digits_reward,
)
from grpo_jax.algorithm.rewards.registry import (
    REWARDS,
    RewardFn,
    RewardNameError,
    get_reward,
    import_factory,
    register_function,
    register_reward,
)

__all__ = [
    "REWARDS", "RewardFn", "RewardNameError", "get_reward", "import_factory", "register_function", "register_reward",
    "extract_final_answer", "numbers_match", "parse_number", "parse_reference", "reference_output",
    "FORMAT_ANSWER_TAG", "FORMAT_GSM8K", "format_reward", "gsm8k_reward", "last_python_block", "overlong_reward",
    "python_output_reward", "synthetic_digits_reward",
    "BUILTIN_REWARDS", "CONFIG_REGEX_REWARDS", "FLOAT32_MAX", "ISOLATIONS", "RewardResult", "RewardSpec",
    "RewardSuite",
]


def __getattr__(name: str):
    """The suite's names (RewardSuite, RewardSpec, RewardResult, ...), importing it on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    suite = importlib.import_module(f"{__name__}.suite")  # sets this package's `suite`: no second lookup here
    if name == "suite":
        return suite
    try:
        return getattr(suite, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
