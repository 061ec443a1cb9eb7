"""Agent episodes: black-box agent code written against the OpenAI client, trained token-exactly.

The user's agent is `async def run(row, client) -> reward`: `client` is an `openai.AsyncOpenAI` whose base URL and
API key are this episode's own (grpo_jax.envs.agent_endpoint; `client.base_url` and `client.api_key` give them to
an agent program run as a subprocess, as OPENAI_BASE_URL / OPENAI_API_KEY). It drives its own loop, calling
`client.chat.completions.create(...)` as it would any server, and returns the episode's reward (a number or named
parts), or None after posting one to `/rl/reward`. A config names it as `env.agent: "package.module:run"`;
`grpo_jax.train(config, agent=run)` takes the function.

AgentEnvironment is that agent as an Environment, so episodes run through the EpisodeRunner as any environment's
(the continuation engine, the limits, exactly-once accounting, failures in the ledger):

- reset(row, seed): starts `run` and waits for its first call; the call's messages (and tools) are the opening,
  or its token ids (the token route, /v1/completions: a TokenPrompt, never rendered).
- the engine samples the turn; step(turn) answers the call with it and the engine's record (Environment.note_turn:
  prompt ids, sampled ids, log-probs, weight versions), then waits for the agent's next call or its return. The next
  call's messages continue the trajectory when they start with the conversation so far and the turn returned (its
  content and calls, as the client echoes them); what follows (tool results, user messages) is the step's
  messages, their ids appended after the sampled ids (never re-tokenized). Otherwise (an agent that rewrote, cut
  or reordered its history, or added an assistant message of its own) the call's messages are the conversation
  anew (StepResult.history): a new segment. A token call's ids are the next prompt whole (StepResult.prompt): they
  extend the sequence where they start with the ids it holds, else start a new segment.
- the agent's return ends the episode; reward() gives its value (or the posted one).

Failures, each the episode's (env_error or env_timeout in the ledger, never the run's): the agent raises, hangs past
env.step_timeout_s between calls (or before its first, or after its last), returns without ever calling the model,
returns no reward, lets a response go undelivered (its connection closed first: that turn is not trained), or
calls the model after its run() returned. A turn cut at the call's own `max_tokens` (finish_reason "length") does
not end the episode while the run's limits leave room: the agent's next call goes on in a new segment (the model
never closed that turn, so no render of the conversation extends its ids). Once the trainer ended the episode (the
model ended the conversation, a turn hit the sequence's limits, env.max_turns) a further call is answered 409
(openai.ConflictError), and the agent may still return its reward: the episode is trained as it stands, truncated,
as an environment's would be; an agent that lets the error propagate fails its episode. Calls after the episode
was closed get 410 and are counted. An agent taking a `seed` parameter gets the episode's seed.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable

from grpo_jax.envs.agent_endpoint import AgentCall, AgentEndpoint, AgentReply
from grpo_jax.envs.environment import ENVIRONMENT_ROLES, Environment, StepResult, TokenPrompt, TurnTokens
from grpo_jax.envs.render import AssistantTurn, message_calls
from grpo_jax.envs.tools import ToolCall
from grpo_jax.errors import ConfigError
from grpo_jax.json_text import JSONTextError, loads

AGENT_CLIENT_TIMEOUT_S = 3600.0  # the client's own timeout: the trainer's env.step_timeout_s is what bounds a call


class AgentError(RuntimeError):
    """An agent episode that cannot be trained, in one line."""


def check_agent(run) -> Callable:
    """ConfigError unless `run` is an async function taking (row, client), and `seed=` where it names one."""
    if not inspect.iscoroutinefunction(run):
        raise ConfigError(f"env.agent: {getattr(run, '__name__', run)!r} is not an async function; an agent is "
                          "`async def run(row, client) -> reward`")
    try:
        inspect.signature(run).bind({}, None, **({"seed": 0} if takes_seed(run) else {}))
    except TypeError as e:
        raise ConfigError(f"env.agent: {run.__name__}{inspect.signature(run)} cannot be called as run(row, client) "
                          f"({e})") from e
    return run


def takes_seed(run: Callable) -> bool:
    """Whether the agent takes the episode's seed (a parameter named `seed`: the G episodes of a prompt share one
    unless env.shared_seed is false, as an environment's reset gets it)."""
    return "seed" in inspect.signature(run).parameters


def _comparable(message: dict) -> tuple:
    """A message as the next call's echo of it is compared: role, content, and each call's name and arguments
    (arguments as a JSON string, as the client echoes them, read back)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = loads(arguments)
            except JSONTextError:
                pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), message.get("content") or "", tuple(calls)


class AgentEnvironment(Environment):
    """An agent's `run(row, client)` as one episode's environment (module docstring)."""

    def __init__(self, run: Callable, endpoint: AgentEndpoint):
        self.run, self.endpoint = run, endpoint
        self.tools = ()
        self.session = None
        self._task: asyncio.Task | None = None
        self._call: AgentCall | None = None  # the call the turn being sampled answers
        self._tokens: TurnTokens | None = None
        self._turn: AssistantTurn | None = None
        # The conversation as the last call gave it and the turn as the response gave it (what the agent echoes),
        # or None after a token call.
        self._history: list[dict] | None = []
        self._value = None
        self._returned = False

    async def _next(self) -> AgentCall | None:
        """The agent's next call, or None once run() returned (its value kept); what it raised, as AgentError."""
        getter = asyncio.ensure_future(self.session.calls.get())
        done, _ = await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        if self._task.cancelled():
            raise AgentError("the agent's run() was cancelled")
        error = self._task.exception()
        if error is not None:
            raise AgentError(f"the agent's run() raised {type(error).__name__}: {error}") from error
        self._returned, self._value = True, self._task.result()
        return None

    def _open(self, call: AgentCall) -> list[dict] | TokenPrompt:
        """The call as the conversation so far (its messages, or its token prompt: no messages to compare a
        later chat call with)."""
        self._call = call
        if call.prompt_ids is not None:
            self._history = None
            return TokenPrompt(call.prompt_ids)
        self._history = list(call.messages)
        return call.messages

    async def reset(self, row, seed):
        from openai import AsyncOpenAI  # the `agent` extra

        self.session = self.endpoint.open_session(asyncio.get_running_loop())
        client = AsyncOpenAI(base_url=self.session.base_url, api_key=self.session.key, max_retries=0,
                             timeout=AGENT_CLIENT_TIMEOUT_S)
        self._task = asyncio.ensure_future(self.run(row, client, **({"seed": seed} if takes_seed(self.run) else {})))
        call = await self._next()
        if call is None:
            raise AgentError("the agent's run() returned without calling the model: an agent episode trains the "
                             "turns it asks for")
        self.tools = tuple(call.tools or ())
        return self._open(call)

    def note_turn(self, turn: AssistantTurn, tokens: TurnTokens) -> None:
        self._turn, self._tokens = turn, tokens

    def turn_token_limit(self) -> int | None:
        return self._call.max_tokens if self._call is not None else None

    async def _answer(self, turn: AssistantTurn) -> None:
        """The pending call answered with the turn; AgentError unless the whole response was written."""
        call, self._call, self._turn = self._call, None, None
        call.answer(AgentReply(turn=turn, tokens=self._tokens))
        if not await asyncio.wrap_future(call.delivered):
            raise AgentError("the agent's connection closed before its response was written: the turn is not "
                             "trained")
        if self._history is not None:  # (the history message keeps a turn's reasoning; the response gave it apart)
            self._history.append({"role": "assistant", "content": turn.content,
                                  "tool_calls": message_calls(turn.tool_calls)})

    async def step(self, turn):
        await self._answer(turn)
        call = await self._next()
        if call is None:
            return StepResult(messages=[], done=True)
        if call.prompt_ids is not None or self._history is None:  # the token route, or a chat call after it
            prompt = self._open(call)
            return StepResult(messages=[], prompt=prompt) if isinstance(prompt, TokenPrompt) else StepResult(
                messages=[], history=prompt)
        if call.tools is not None and tuple(call.tools) != self.tools:
            raise AgentError("the agent changed the tools it offers between calls of one episode")
        expected = [_comparable(m) for m in self._history]
        given = call.messages
        continues = (len(given) >= len(expected) and [_comparable(m) for m in given[:len(expected)]] == expected
                     and all(m["role"] in ENVIRONMENT_ROLES for m in given[len(expected):]))
        self._open(call)
        if not continues:
            return StepResult(messages=[], history=given)
        # A tool message names its call by id (OpenAI's format); the renderers read the tool's name.
        names = {c["id"]: c["function"]["name"] for m in given[:len(expected)] for c in m.get("tool_calls") or ()
                 if c.get("id")}
        return StepResult(messages=[{**m, "name": names.get(m.get("tool_call_id"), m.get("name", ""))}
                                    if m["role"] == "tool" else m for m in given[len(expected):]])

    async def reward(self):
        ended = AgentReply(error=(409, "the episode has ended (the model ended the conversation, or a limit was "
                                       "reached: the turn's tokens, the sequence's, env.max_turns): return its "
                                       "reward; this call is not trained"))
        if self._call is not None and self._turn is not None:
            # The episode ended with this turn (the model ended the conversation, or a limit): the agent gets it.
            await self._answer(self._turn)
        elif self._call is not None:  # a call the episode ended before sampling (no room left for its turn)
            self._call, call = None, self._call
            call.answer(ended)
        while not self._returned:
            call = await self._next()
            if call is not None:  # the agent goes on, but its episode has ended: it is told, and may return
                self.session.late_calls += 1
                call.answer(ended)
        if not self.session.calls.empty():
            raise AgentError("the agent called the model after its run() returned")
        value = self._value if self._value is not None else self.session.posted_reward
        if value is None:
            raise AgentError("the agent's run() returned None and posted no reward to /rl/reward")
        return value

    async def close(self):
        if self.session is not None:
            self.endpoint.end_session(self.session)
            while not self.session.calls.empty():
                self.session.calls.get_nowait().answer(AgentReply(error=(410, "the episode has ended")))
        if self._call is not None:
            self._call.answer(AgentReply(error=(410, "the episode has ended")))
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)


def environment_agent(factory: Callable[[], Environment]) -> Callable:
    """An agent that plays an Environment's episodes through the OpenAI client: its reset's messages and tools,
    each response as the turn its step answers (tool results sent back by tool_call_id), its reward. The same
    episodes through the endpoint as in process (tools/bench_agent.py; the tests). An episode the trainer ended
    (409: a limit) is scored as it stands, as the in-process episode would be."""
    from openai import ConflictError

    async def run(row, client, seed=0):
        env = factory()
        try:
            messages = await env.reset(row, seed)
            tools = [tool.schema for tool in env.tools] or None
            while True:
                try:
                    response = await client.chat.completions.create(
                        model="grpo-jax", messages=messages, **({"tools": tools} if tools else {}))
                except ConflictError:
                    break
                choice = response.choices[0]
                message = choice.message.model_dump(exclude_none=True)
                messages.append(message)
                if choice.finish_reason == "length":
                    break
                calls = message.get("tool_calls") or []
                turn = AssistantTurn(text=message.get("content") or "", content=message.get("content") or "",
                                     tool_calls=tuple(ToolCall(name=c["function"]["name"],
                                                               arguments=loads(c["function"]["arguments"]))
                                                      for c in calls),
                                     finish="stop", message=message)
                result = await env.step(turn)
                if result.done:
                    break
                ids = iter(c["id"] for c in calls)
                messages += [{**m, "tool_call_id": next(ids, "")} if m["role"] == "tool" else m
                             for m in result.messages]
            return await env.reward()
        finally:
            await env.close()

    run.__name__ = f"agent_of_{getattr(factory, '__name__', 'environment')}"
    return run
