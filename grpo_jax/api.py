"""`grpo_jax.train(...)`: `grpo-jax train` from Python (a notebook, a script), with reward functions
passed as Python callables.

    import grpo_jax

    def exact_match(records, completions, lengths):
        return [float(c.strip() == r["answer"]) for r, c in zip(records, completions)]

    history = grpo_jax.train("configs/tiny_cpu.yaml", rewards=[(exact_match, 1.0)],
                             overrides=["trainer.max_steps=5"], run_dir="runs/notebook")
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from grpo_jax.algorithm.rewards import register_function
from grpo_jax.config_io import ConfigError, build_config, config_to_dict, read_config_file
from grpo_jax.envs.environment import AGENTS, register_environment
from grpo_jax.parallel.distributed import initialize
from grpo_jax.run.config import Config
from grpo_jax.run.trainer import Trainer


def _config_reward(spec: Any, key: str, names: dict) -> Any:
    """One item of train()'s `rewards` in its config form: a Python function in the name's place is
    registered (rewards.register_function) and replaced by its registered name. `names` maps the names
    registered so far by this call to their functions."""
    if callable(spec):
        spec = {"name": spec}
    elif isinstance(spec, (list, tuple)) and spec and callable(spec[0]):
        if len(spec) != 2:
            raise ConfigError(f"{key}={spec!r}: a function goes as (function, weight); kwargs are for factories "
                              "named by import path (bind a function's own arguments with functools.partial)")
        spec = {"name": spec[0], "weight": spec[1]}
    if not (isinstance(spec, dict) and callable(spec.get("name"))):
        return spec  # a name, as in a config file: Config.validate checks it
    if spec.get("kwargs"):
        raise ConfigError(f"{key}.kwargs={spec['kwargs']!r}: kwargs are for factories named by import path; bind "
                          "a function's own arguments with functools.partial")
    fn = spec["name"]
    name = register_function(fn)
    if names.setdefault(name, fn) is not fn:
        raise ConfigError(f"{key}: another of these reward functions is also named {name}; give each function a "
                          "name of its own (def, not lambda)")
    return {**spec, "name": name}


def _config_env(env: Any, values: dict) -> dict:
    """The env section with train()'s `env`: a factory (an Environment subclass, or a function returning a new
    Environment) is registered under its own name (envs.environment.register_environment) and named by it; the
    config's other env keys (limits, kwargs) stay. With an env, the rewards default to none."""
    if not callable(env):
        raise ConfigError(f"env={env!r}: expected a factory: an Environment subclass, or a function returning a new "
                          "Environment (name one by import path in the config's env.name instead)")
    name = getattr(env, "__name__", "")
    if not name.isidentifier():
        raise ConfigError(f"env={env!r}: the factory needs a name of its own (def or class, not a lambda or a "
                          "partial); bind arguments with the config's env.kwargs")
    register_environment(name)(env)
    section = dict(values.get("env") or {})
    section["name"] = name
    values = {**values, "env": section}
    values.setdefault("rewards", [])
    return values


def _config_agent(agent: Any, values: dict) -> dict:
    """The env section with train()'s `agent` (an async function run(row, client) -> reward): registered in
    envs.environment.AGENTS under its own name and named by it as env.agent; the config's other env keys (limits,
    renderer) stay, and the rewards default to none."""
    from grpo_jax.envs.agent import check_agent

    name = getattr(agent, "__name__", "")
    check_agent(agent)
    if not name.isidentifier():
        raise ConfigError(f"agent={agent!r}: the agent needs a name of its own (async def, not a partial)")
    AGENTS[name] = agent
    section = {k: v for k, v in dict(values.get("env") or {}).items() if k != "name"}
    values = {**values, "env": {**section, "agent": name}}
    values.setdefault("rewards", [])
    return values


def resolve_config(config: Config | str | os.PathLike | dict, rewards: list | None = None,
                   overrides: list[str] = (), env: Any = None, agent: Any = None) -> Config:
    """The checked Config for train(): `config` (a Config, the path of a YAML file, or a mapping shaped like
    one), its rewards replaced by `rewards`, its environment by `env` or its agent by `agent` when given, then the
    dotted `overrides` applied."""
    if isinstance(config, Config):
        values = config_to_dict(config)
    elif isinstance(config, dict):
        values = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        values = read_config_file(config)
    else:
        raise ConfigError(f"config={config!r}: expected a Config, the path of a YAML file, or a mapping")
    if isinstance(overrides, (str, bytes)):
        # A string is iterable: unchecked, each character would be taken for an override ("override 't'").
        raise ConfigError(f"overrides={overrides!r}: expected a list of key=value strings, e.g. "
                          f"[{overrides!r}]")
    if rewards is not None:
        if not isinstance(rewards, (list, tuple)):
            raise ConfigError(f"rewards={rewards!r}: expected a list, e.g. [(my_reward, 1.0)]")
        names: dict = {}
        values["rewards"] = [_config_reward(spec, f"rewards[{i}]", names) for i, spec in enumerate(rewards)]
    if env is not None and agent is not None:
        raise ConfigError("env and agent: an episode talks to an environment or is driven by an agent; give one")
    if env is not None:
        values = _config_env(env, values)
    if agent is not None:
        values = _config_agent(agent, values)
    return build_config(Config, values, overrides)


def train(config: Config | str | os.PathLike | dict, rewards: list | None = None, overrides: list[str] = (),
          run_dir: str | pathlib.Path | None = None, env: Any = None, agent: Any = None) -> list[dict]:
    """Train as `grpo-jax train CONFIG [overrides] --run-dir RUN_DIR` does, and return the metrics history:
    one dict per learner step of this call (the learner-step lines it appended to RUN_DIR/metrics.jsonl; the
    evaluation lines there, "kind": "eval", are not in it: read_metrics(run_dir, kind="eval") has them).

    config: a Config, the path of a YAML file, or a mapping shaped like one. overrides: dotted key=value
    strings, as on the command line. run_dir: default, the config's run_dir; a run directory that holds a
    checkpoint resumes from it. rewards, when given, replace the config's: each item is a reward function
    fn(records, completions, lengths) -> list[float] (weight 1), a (function, weight) pair, a dict
    {"name": function, "weight", "label", "samples_per_call"}, or any config form (("gsm8k", 1.0),
    {"name": "my_package.rewards:exact_match", "kwargs": {...}}). A function is called exactly as the
    built-in rewards are, on the same threads, deadline and failure handling (grpo_jax.algorithm.rewards).
    env, when given, is the multi-turn environment the run's episodes use (grpo_jax.envs): an Environment
    subclass or a function returning a new Environment, called with the config's env.kwargs for every episode;
    the config's env section (or its defaults) gives the limits, and rewards default to none (the environment's
    reward() scores each episode). agent, when given, drives the episodes instead: an async function
    run(row, client) -> reward calling the model through the OpenAI client it is given (grpo_jax.envs.agent).

    Errors a user can fix raise grpo_jax.errors.UserError (one line, as the CLI prints them). Called from the
    main thread, a SIGINT (a notebook's interrupt) or SIGTERM stops the run after the current step, saves a
    checkpoint and returns the steps trained; a second one exits the process (the kernel) at once.
    """
    config = resolve_config(config, rewards, overrides, env, agent)
    initialize(config.distributed)
    trainer = Trainer(config, run_dir)
    history = trainer.train()
    if not history and not trainer.preempted and not trainer.already_done:
        error = trainer.nothing_trained_error()
        if error is not None:
            raise error
    return history
