"""The reward registry: factories by name (register_reward, get_reward), by import path ("package.module:factory",
grpo_jax.plugins), and Python functions handed to grpo_jax.train (register_function). The signature every reward
function has is in the package docstring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_jax.plugins import ImportPathError, import_object

RewardFn = Callable[[list, list, "list[int] | None"], list]

REWARDS: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str):
    """Decorator adding a factory `(**kwargs) -> RewardFn` to REWARDS under `name`."""

    def deco(factory):
        REWARDS[name] = factory
        return factory

    return deco


class RewardNameError(ImportPathError):
    """A reward name that does not resolve to a factory: unknown, or an import path that fails. `reason`
    is the message without the name, for callers that name the config key themselves."""

    def __init__(self, name: str, reason: str):
        super().__init__(name, reason)
        self.args = (f"reward={name!r}: {reason}",)


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
    """The factory named by "package.module:attribute" (grpo_jax.plugins.import_object); every failure is a
    RewardNameError naming the module and the attribute."""
    try:
        return import_object(path)
    except ImportPathError as e:
        raise RewardNameError(path, e.reason) from e


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
