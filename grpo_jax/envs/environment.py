"""Environments: what a multi-turn (agentic) episode talks to. Host-side, JAX-free, asynchronous.

An episode, as the rollout engine runs it (grpo_jax.rollout.episodes):

    env = make_environment(config)             # the factory, called for every episode: a fresh Environment
    messages = await env.reset(row, seed)      # the opening conversation, from the dataset row
    repeat:                                    # the model writes one assistant turn (ids sampled by the engine,
        result = await env.step(turn)          #   parsed by the renderer into an AssistantTurn)
    until result.done, or config.max_turns assistant turns, or config.max_total_tokens tokens in the sequence
                                               #   (then the episode is truncated)
    reward = await env.reward()                # the episode's reward: a float, or named parts {name: float}
    await env.close()                          # always: after a failure or a timeout too

Each call within config.step_timeout_s; at most config.concurrency calls at once, on one event loop: an
environment must not block it (Tool.run sends plain tool functions to the runner's worker threads, at most
config.concurrency at work; so does asyncio.to_thread). Python cannot stop a thread: a plain tool still running
past the timeout keeps its thread, outside that count, and a call that blocks the loop itself past it gets the loop
replaced (the episodes on it fail); more such threads at once than config.concurrency stop the run
(grpo_jax.rollout.episodes). `reset` gets its own deep copy of the row: it may change it.

The environment speaks messages, the trainer owns tokens: an environment never sees or makes token ids. A
message is a dict {"role": ..., "content": str}: `reset` returns system, user (and, for a few-shot opening,
assistant) messages; `step` returns user and tool messages ({"role": "tool", "name": ..., "content": ...},
one per result, in call order; a call that could not be parsed has no name). The renderer of the model's
family turns them into ids (grpo_jax.envs.render).

Tools: `tools` lists the Tool objects the model is offered (their schemas go into the prompt). The default
`step` runs the turn's tool calls and answers with their results, and ends the episode on a turn without tool
calls. A call that could not be parsed, names no tool, or fails (ToolError) is answered with "Error: ..." as its
result and counted in StepResult.tool_errors; the episode goes on. Override `step` for anything else (a
simulated user, a game); `reset` and `reward` are always yours.

Config: EnvConfig names the factory by a short name registered in ENVIRONMENTS (the built-ins: gsm8k_python,
grpo_jax.envs.gsm8k; countdown_multiturn and fetch_code, grpo_jax.envs.synthetic; or one of your own,
register_environment), or by import path ("package.module:factory", loaded as reward factories are:
grpo_jax.plugins.import_object), called with `kwargs`; an Environment subclass is such a factory itself.
A run's config names it in its `env:` section (run.config.Config.env); grpo_jax.train(config, env=factory) registers
a factory of the user's and names it there.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence

from grpo_jax.config_io import config_key
from grpo_jax.envs.render import ENVIRONMENT_ROLES, RENDERER_NAMES, TEMPLATE, AssistantTurn, check_messages
from grpo_jax.envs.tools import Tool, ToolError, is_int, is_number
from grpo_jax.errors import ConfigError
from grpo_jax.plugins import ImportPathError, import_object


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    """What the environment says after an assistant turn. reward: this step's reward, if it gives one (the
    episode's is `Environment.reward()`); info: anything for the logs; tool_errors: how many of the turn's tool
    calls failed (the default step counts them). history: the whole conversation anew, for an environment whose
    next prompt does not extend the last (an agent that rewrote or cut its history): the trajectory starts a new
    segment from it, and `messages` must then be empty. prompt: the next prompt whole, as token ids (an agent's
    token route): it extends the sequence where it starts with the ids held, else starts a new segment."""

    messages: list[dict]
    reward: float | None = None
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)
    tool_errors: int = 0
    history: list[dict] | None = None
    prompt: TokenPrompt | None = None

    def __post_init__(self):
        check_messages(self.messages, "StepResult.messages", ENVIRONMENT_ROLES)
        if self.history is not None:
            check_messages(self.history, "StepResult.history")
            if self.messages or not self.history:
                raise ValueError("StepResult.history: the whole conversation, non-empty, with messages=[]")
        if self.prompt is not None and (self.messages or self.history is not None
                                        or not isinstance(self.prompt, TokenPrompt)):
            raise ValueError("StepResult.prompt: a TokenPrompt, the next prompt whole, with messages=[] and no "
                             "history")
        if self.reward is not None and not is_number(self.reward):
            raise ValueError(f"StepResult.reward={self.reward!r}: a number, or None for no reward at this step")
        if not isinstance(self.done, bool):
            raise ValueError(f"StepResult.done={self.done!r}: True or False")
        if not isinstance(self.info, dict):
            raise ValueError(f"StepResult.info={self.info!r}: a dict")
        if not (is_int(self.tool_errors) and self.tool_errors >= 0):
            raise ValueError(f"StepResult.tool_errors={self.tool_errors!r}: an integer >= 0")


@dataclasses.dataclass(frozen=True)
class TokenPrompt:
    """A prompt given as token ids (an agent's token route), what `reset` may return instead of messages: the
    sequence exactly as the model is to see it, never rendered."""

    ids: tuple[int, ...]

    def __post_init__(self):
        if not self.ids or not all(is_int(i) and i >= 0 for i in self.ids):
            raise ValueError("TokenPrompt.ids: a non-empty sequence of token ids (integers >= 0)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnTokens:
    """The engine's record of one sampled turn (Environment.note_turn): the ids the model was given, those it
    sampled (its stop id included), each one's behaviour log-prob and weight version."""

    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]


def reward_parts(value, where: str = "reward()") -> dict[str, float]:
    """An episode's reward as named parts: a number is {"reward": value}; a dict must map names to numbers."""
    if is_number(value):
        return {"reward": float(value)}
    if isinstance(value, dict) and value and all(isinstance(k, str) and is_number(v) for k, v in value.items()):
        return {k: float(v) for k, v in value.items()}
    raise ValueError(f"{where} returned {value!r}: a number, or a non-empty dict of named numbers "
                     "({'correct': 1.0, 'format': 0.5})")


class Environment(abc.ABC):
    """One episode's environment (module docstring). Subclasses write reset and reward, and step unless the
    default (run the turn's tool calls) is what they need."""

    tools: Sequence[Tool] = ()

    @abc.abstractmethod
    async def reset(self, row: dict, seed: int) -> list[dict]:
        """The opening conversation for dataset row `row` (this episode's own copy); `seed` makes any randomness of
        the episode repeatable. The trainer gives the G episodes of a prompt the same seed: draw the task instance
        from it."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Run the turn's tool calls and answer with their results; a turn without any ends the episode."""
        if not turn.tool_calls and turn.parse_error is None:
            return StepResult(messages=[], done=True)
        by_name = {tool.name: tool for tool in self.tools}
        messages, errors = [], 0
        for call in turn.tool_calls:
            try:
                if call.name not in by_name:
                    raise ToolError(f"unknown tool {call.name!r} (tools: {', '.join(by_name) or 'none'})")
                result = await by_name[call.name].run(call.arguments)
            except ToolError as e:
                result, errors = f"Error: {e}", errors + 1
            messages.append({"role": "tool", "name": call.name, "content": result})
        if turn.parse_error is not None:
            messages.append({"role": "tool", "content": f"Error: {turn.parse_error}"})
            errors += 1
        return StepResult(messages=messages, tool_errors=errors)

    def note_turn(self, turn: AssistantTurn, tokens: TurnTokens) -> None:
        """The turn that step() (or, when the episode ended with it, reward()) answers, and the engine's record
        of it, given just before; an environment that speaks messages only need not look (the agent environment
        returns them to the agent)."""

    def turn_token_limit(self) -> int | None:
        """The most tokens the next assistant turn may take, below the run's limits (None: those alone)."""
        return None

    @abc.abstractmethod
    async def reward(self) -> float | dict[str, float]:
        """The episode's reward once it ended (done, or truncated): a number, or named parts."""

    async def close(self) -> None:
        """Release what the episode holds (called after every episode, also one that failed or timed out)."""


# Environment factories by short name. The built-ins register themselves when their module is imported; those
# modules import this one, so they are imported on the first lookup of a short name, not here.
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}
BUILTIN_ENVIRONMENT_MODULES = ("grpo_jax.envs.gsm8k", "grpo_jax.envs.synthetic")


def register_environment(name: str):
    """Decorator adding a factory `(**kwargs) -> Environment` to ENVIRONMENTS under `name`, which an EnvConfig
    then names. A later factory of the same name replaces the earlier (a notebook cell run again)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_environment({name!r}): a short name without ':' (a name with one is an import "
                         "path), e.g. 'my_game'")

    def deco(factory):
        ENVIRONMENTS[name] = factory
        return factory

    return deco


def environment_factory(name: str) -> Callable[..., Environment]:
    """The factory `name` names: registered in ENVIRONMENTS, or by import path "package.module:factory". A name
    that does not resolve raises ImportPathError (its `reason` names the fix), as reward names do."""
    if ":" in name:
        return import_object(name)
    for module in BUILTIN_ENVIRONMENT_MODULES:
        importlib.import_module(module)
    if name not in ENVIRONMENTS:
        raise ImportPathError(name, f"allowed {', '.join(sorted(ENVIRONMENTS))}, or a factory of your own by import "
                                    "path 'package.module:factory'")
    return ENVIRONMENTS[name]


AGENTS: dict[str, Callable] = {}  # agents registered by grpo_jax.train(config, agent=run), by their names


def agent_function(name: str) -> Callable:
    """The agent `name` names (env.agent): registered in AGENTS (grpo_jax.train's `agent`), or by import path
    "package.module:run"; ImportPathError (its `reason` names the fix) when it does not resolve."""
    if ":" in name:
        return import_object(name, what="function")
    if name not in AGENTS:
        raise ImportPathError(name, "an agent by import path 'package.module:run' (or grpo_jax.train(config, "
                                    "agent=run))")
    return AGENTS[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """The environment a run's episodes use, and the limits on an episode (module docstring)."""

    name: str = config_key("", "The factory: a short name in ENVIRONMENTS ('gsm8k_python'), or "
                               "'package.module:factory'.")
    agent: str = config_key("", "Instead of an environment: 'package.module:run', an agent `async def run(row, "
                                "client) -> reward` that calls the model through an OpenAI-compatible endpoint of "
                                "its episode's own (grpo_jax.envs.agent).")
    agent_host: str = config_key("127.0.0.1", "The address the agent endpoint listens on (loopback: only this "
                                              "machine's agents reach it).")
    kwargs: dict = config_key(help="Passed to the factory.", default_factory=dict)
    max_turns: int = config_key(8, "Assistant turns per episode; an episode still going then is truncated.")
    max_total_tokens: int = config_key(4096, "The most tokens one sequence may hold (prompt, sampled and "
                                             "environment tokens); an episode that would pass it is truncated.")
    concurrency: int = config_key(32, "Environment calls running at once, and worker threads for their plain tools "
                                      "(per process); more threads stuck in calls past step_timeout_s than this stop "
                                      "the run.")
    step_timeout_s: float = config_key(30.0, "The longest one reset, step, reward or close may take.")
    renderer: str = config_key("", "The chat format that turns messages into ids: a family's (qwen2, qwen3, "
                                   "qwen3_instruct, llama3, gemma3, compact) or template (the checkpoint's own chat "
                                   "template); '': the model family's where it renders as the checkpoint's template "
                                   "does, else template (render.renderer_for_run).")
    renderer_options: dict = config_key(help="Options of the renderer, e.g. {enable_thinking: false} for qwen3; for "
                                             "template: tool_format (auto, template, folded), tool_parser (auto, "
                                             "hermes, llama_json, mistral, none), and the template's own variables.",
                                        default_factory=dict)
    shared_seed: bool = config_key(True, "The G episodes of a prompt reset with one seed (the same task instance: "
                                         "advantages compare answers to the same question); false: each episode "
                                         "its own seed (independent instances of the prompt's task).")
    advantage: str = config_key("", "'package.module:function': each group's per-trajectory advantages from its "
                                    "episodes' rewards and per-step rewards (algorithm.advantages.custom_advantages); "
                                    "'': GRPO's group-relative advantages of reward().")

    def validate(self) -> list[str]:
        problems = []
        if self.agent:
            if self.name:
                problems.append(f"name={self.name!r} and agent={self.agent!r}: an episode talks to an environment "
                                "or is driven by an agent; set one")
            try:
                agent_function(self.agent)
            except ImportPathError as e:
                problems.append(f"agent={self.agent!r}: {e.reason} (an async function run(row, client) -> reward)")
            if not isinstance(self.agent_host, str) or not self.agent_host:
                problems.append(f"agent_host={self.agent_host!r}: an address to listen on, e.g. 127.0.0.1")
        elif not self.name:
            problems.append("name='': name a built-in environment (gsm8k_python, countdown_multiturn, fetch_code) or "
                            "a factory of your own by import path 'package.module:factory', or an agent (env.agent)")
        else:
            try:
                environment_factory(self.name)
            except ImportPathError as e:
                problems.append(f"name={self.name!r}: {e.reason}")
        if not isinstance(self.kwargs, dict):
            problems.append(f"kwargs={self.kwargs!r}: a mapping of the factory's keyword arguments")
        for key, meaning in (("max_turns", "assistant turns per episode"),
                             ("max_total_tokens", "tokens one sequence may hold"),
                             ("concurrency", "environment calls at once")):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                problems.append(f"{key}={value!r}: must be an integer >= 1 ({meaning})")
        if not (is_number(self.step_timeout_s) and 0 < self.step_timeout_s < math.inf):
            problems.append(f"step_timeout_s={self.step_timeout_s!r}: must be a number of seconds > 0")
        if self.renderer and self.renderer not in RENDERER_NAMES:
            problems.append(f"renderer={self.renderer!r}: allowed {', '.join(RENDERER_NAMES)}, or '' for the "
                            "model's own")
        if not isinstance(self.renderer_options, dict):
            problems.append(f"renderer_options={self.renderer_options!r}: a mapping of the renderer's options")
        if not isinstance(self.shared_seed, bool):
            problems.append(f"shared_seed={self.shared_seed!r}: true or false (whether a prompt's G episodes reset "
                            "with one seed)")
        if self.advantage:
            try:
                import_object(self.advantage, what="function")
            except ImportPathError as e:
                problems.append(f"advantage={self.advantage!r}: {e.reason} (a function fn(rewards, step_rewards, "
                                "valid) -> G advantages)")
        return problems


ARCHITECTURE_RENDERERS = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3",
                          "gemma3": "gemma3"}  # model.architecture -> the renderer of its family


def renderer_family(config: EnvConfig, architecture: str) -> str:
    """The renderer a run asks for: env.renderer, else the model architecture's family, else the template
    renderer (an architecture no family renderer covers)."""
    return config.renderer or ARCHITECTURE_RENDERERS.get(architecture, TEMPLATE)


def make_environment(config: EnvConfig) -> Environment:
    """A new Environment from the config's factory. Every failure is a ConfigError naming env.name and the fix."""
    problems = config.validate()
    if problems:
        raise ConfigError("invalid config: " + "; ".join(f"env.{p}" for p in problems))
    factory = environment_factory(config.name)
    shape = "the name must be a factory f(**kwargs) returning a new grpo_jax.envs.environment.Environment"
    try:
        env = factory(**config.kwargs)
    except Exception as e:  # noqa: BLE001 - whatever user code raises, it is a config problem found at start
        raise ConfigError(f"env.name={config.name!r}: {config.name}(**kwargs) raised {type(e).__name__}: {e}"
                          + (f"; {shape}" if isinstance(e, TypeError) else "")) from e
    if not isinstance(env, Environment):
        raise ConfigError(f"env.name={config.name!r}: {config.name}(**kwargs) returned a {type(env).__name__}, "
                          f"not an Environment; {shape}")
    names = set()
    for i, tool in enumerate(env.tools):
        if not isinstance(tool, Tool):
            raise ConfigError(f"env.name={config.name!r}: tools[{i}] is a {type(tool).__name__}, not a Tool; make "
                              "it one with grpo_jax.envs.tools.Tool.from_function(fn)")
        if tool.name in names:
            raise ConfigError(f"env.name={config.name!r}: two tools are named {tool.name!r}; the model calls tools "
                              "by name, so give each its own")
        names.add(tool.name)
    return env
