"""The agent endpoint: an OpenAI-compatible HTTP server on the trainer's engine, for agent code written against
the OpenAI client (grpo_jax.envs.agent runs an episode through it). JAX-free; aiohttp, on a thread of its own.

Each episode has a session: a base URL of its own (`http://HOST:PORT/e/<session>/v1`, so a harness that takes
only a base URL still tags its calls) and an API key of its own (a secret, checked on every call). Routes, under
the base URL:

- `POST /chat/completions`: `messages` (content a string or a list of text parts), `tools`, `stream` (SSE: the
  turn is sampled whole, then sent as role, content, tool-call and finish chunks and `[DONE]`), `max_tokens` /
  `max_completion_tokens` (caps the turn), `n` (1: the group is the trainer's, grpo.group_size), `temperature` and
  `top_p` (absent, or the sampler's: the learner trains at the sampler's), `stop` (absent or empty: a turn ends at
  the model's end-of-turn token), `logprobs` (accepted; the log-probs always come back). The response is
  OpenAI's `chat.completion` (or its chunks), with the engine's own record of the turn as vLLM's
  `return_token_ids` gives it: `prompt_token_ids`, and in the choice `token_ids`, `token_logprobs` and
  `weight_versions` (the policy version that drew each token).
- `POST /completions`: the token route: `prompt` a list of token ids (the whole sequence the model is to
  continue), `max_tokens`, and the settings above (no stream); the answer is OpenAI's `text_completion` with the
  same record. A prompt that starts with the ids the episode's sequence holds extends it (what follows appended as
  it is), else starts a new segment: nothing is rendered or tokenized.
- `GET /models`: the one model, `grpo-jax`.
- `POST /rl/reward` (beside `/v1`, at `http://HOST:PORT/e/<session>/rl/reward`): `{"reward": number or {name:
  number}}`, the episode's reward when `run` returns None.

A call is handed to its session as an AgentCall; the episode answers it (AgentReply: the turn and its tokens, or
an HTTP error) and learns whether the response was written (`delivered`): a client gone before the whole
response is written is not trained on. Calls to an ended session get 410, to an unknown one 404, with a wrong key
401; a malformed request 400 naming the field. Nothing a request holds reaches the episode unchecked.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import secrets
import socket
import threading
import time

from aiohttp import web

from grpo_jax.envs.environment import TurnTokens
from grpo_jax.envs.render import AssistantTurn

logger = logging.getLogger("grpo_jax.envs.agent_endpoint")

MODEL_NAME = "grpo-jax"
MAX_REQUEST_BYTES = 64 << 20
ENDED_KEPT = 4096  # ended sessions remembered, so that a late call gets 410 (and is counted) rather than 404


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and a one-line message naming the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentReply:
    """The episode's answer to a call: the turn and its tokens, or an error (status, message)."""

    turn: AssistantTurn | None = None
    tokens: TurnTokens | None = None
    error: tuple[int, str] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AgentCall:
    """One chat-completion request, checked: what the episode needs to answer it."""

    messages: list[dict] | None  # a chat call's; None for a token call
    tools: list[dict] | None
    max_tokens: int | None
    stream: bool
    prompt_ids: tuple[int, ...] | None = None  # a token call's (/v1/completions)
    reply: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    delivered: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    def answer(self, reply: AgentReply) -> None:
        if not self.reply.done():
            self.reply.set_result(reply)


class AgentSession:
    """One episode's base URL, key and calls. `calls` is an asyncio.Queue on the episode's event loop."""

    def __init__(self, endpoint: AgentEndpoint, loop: asyncio.AbstractEventLoop):
        self.id, self.key = secrets.token_hex(8), "sk-grpo-" + secrets.token_urlsafe(24)
        self.base_url = f"{endpoint.url}/e/{self.id}/v1"
        self.reward_url = f"{endpoint.url}/e/{self.id}/rl/reward"
        self.loop, self.calls = loop, asyncio.Queue()
        self.closed = False
        self.posted_reward = None  # what /rl/reward said, if anything
        self.late_calls = 0  # calls that came after the session ended

    def post(self, call: AgentCall) -> None:
        try:
            self.loop.call_soon_threadsafe(self.calls.put_nowait, call)
        except RuntimeError:  # its event loop has ended (replaced after a call held it): the episode is over
            raise RequestError(410, "the episode has ended") from None


def _message(i: int, message) -> dict:
    """An OpenAI chat message as the renderers take it: content a string (text parts joined), tool calls as
    {"type", "function": {"name", "arguments"}} with arguments as given, a tool message's tool_call_id kept."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(400, f"{where}: a message is an object with a string role")
    role, content = message["role"], message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError(400, f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are read")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(400, f"{where}.content: a string or a list of text parts")
    out = {"role": role, "content": content}
    if message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(400, f"{where}.tool_calls: a list")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments"), str | dict)):
                raise RequestError(400, f"{where}.tool_calls[{j}]: {{'function': {{'name': str, 'arguments': "
                                        "JSON str}}}}")
            out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    for key in ("tool_call_id", "name", "reasoning_content"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def parse_call(body, temperature: float, top_p: float) -> AgentCall:
    """A chat-completion request's JSON body as an AgentCall, or RequestError naming what is refused."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body is a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list of messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "tools: a list of tool objects")
    max_tokens, stream = _sampling(body, temperature, top_p)
    return AgentCall(messages=[_message(i, m) for i, m in enumerate(messages)], tools=tools, max_tokens=max_tokens,
                     stream=stream)


def parse_token_call(body, temperature: float, top_p: float) -> AgentCall:
    """A completion request (/v1/completions) whose prompt is token ids, as an AgentCall; RequestError naming
    what is refused (a text prompt among it: the route is token-in, token-out)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body is a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # [[ids]]: one prompt
    if not (isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                         for i in prompt)):
        raise RequestError(400, "prompt: a non-empty list of token ids (this route takes ids, not text; chat "
                                "messages go to /chat/completions)")
    max_tokens, stream = _sampling(body, temperature, top_p)
    if stream:
        raise RequestError(400, "stream=true: the token route answers whole; stream chat completions")
    return AgentCall(messages=None, tools=None, max_tokens=max_tokens, stream=False, prompt_ids=tuple(prompt))


def _sampling(body: dict, temperature: float, top_p: float) -> tuple[int | None, bool]:
    """(max_tokens, stream) of a request, RequestError for a sampling setting a training episode refuses."""
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError(400, f"n={n!r}: 1 in a training episode (the trainer samples the group: grpo.group_size)")
    for key, value in (("temperature", temperature), ("top_p", top_p)):
        given = body.get(key)
        if given is not None and not (isinstance(given, int | float) and math.isclose(given, value)):
            raise RequestError(400, f"{key}={given!r}: the learner trains at the sampler's {key} ({value}); leave it "
                                    "out or set that")
    if body.get("stop") not in (None, [], ""):
        raise RequestError(400, f"stop={body['stop']!r}: a turn ends at the model's end-of-turn token in a "
                                "training episode; leave stop out")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
                                       and max_tokens >= 1):
        raise RequestError(400, f"max_tokens={max_tokens!r}: an integer >= 1")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream={stream!r}: true or false")
    return max_tokens, stream


def completion_body(reply: AgentReply, call_ids: list[str], created: int) -> dict:
    """OpenAI's chat.completion for the turn, with the engine's record (module docstring)."""
    turn, tokens = reply.turn, reply.tokens
    message = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [{"id": call_id, "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                                       ensure_ascii=False)}}
                                 for call_id, c in zip(call_ids, turn.tool_calls)]
    if turn.reasoning is not None:
        message["reasoning_content"] = turn.reasoning
    finish = "length" if turn.finish == "length" else "tool_calls" if turn.tool_calls else "stop"
    return {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion", "created": created,
            "model": MODEL_NAME, "prompt_token_ids": list(tokens.prompt_ids),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                         "token_ids": list(tokens.ids), "token_logprobs": list(tokens.logprobs),
                         "weight_versions": list(tokens.versions)}],
            "usage": {"prompt_tokens": len(tokens.prompt_ids), "completion_tokens": len(tokens.ids),
                      "total_tokens": len(tokens.prompt_ids) + len(tokens.ids)}}


def text_completion_body(reply: AgentReply, created: int) -> dict:
    """OpenAI's text_completion for a token call's turn (its text decoded, its stop id left out), with the
    engine's record."""
    turn, tokens = reply.turn, reply.tokens
    return {"id": "cmpl-" + secrets.token_hex(8), "object": "text_completion", "created": created,
            "model": MODEL_NAME, "prompt_token_ids": list(tokens.prompt_ids),
            "choices": [{"index": 0, "text": turn.text, "finish_reason": "length" if turn.finish == "length" else
                         "stop", "logprobs": None, "token_ids": list(tokens.ids),
                         "token_logprobs": list(tokens.logprobs), "weight_versions": list(tokens.versions)}],
            "usage": {"prompt_tokens": len(tokens.prompt_ids), "completion_tokens": len(tokens.ids),
                      "total_tokens": len(tokens.prompt_ids) + len(tokens.ids)}}


def stream_chunks(body: dict) -> list[dict]:
    """The completion as chat.completion.chunk events: role, content, each tool call, then the finish (with the
    engine's record and the usage)."""
    choice, base = body["choices"][0], {k: body[k] for k in ("id", "created", "model")}

    def chunk(delta, finish=None, **extra):
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}]}

    message = choice["message"]
    chunks = [chunk({"role": "assistant", "content": ""})]
    if message["content"]:
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls", ())):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    record = {k: choice[k] for k in ("token_ids", "token_logprobs", "weight_versions")}
    last = chunk({}, choice["finish_reason"], **record)
    last["prompt_token_ids"], last["usage"] = body["prompt_token_ids"], body["usage"]
    return [*chunks, last]


class AgentEndpoint:
    """The HTTP server (module docstring): started at construction on a thread of its own, on `host` (loopback
    by default) and a free port; close() stops it."""

    def __init__(self, *, host: str = "127.0.0.1", temperature: float = 1.0, top_p: float = 1.0):
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.sessions: dict[str, AgentSession] = {}
        self._ended: collections.OrderedDict[str, AgentSession] = collections.OrderedDict()  # the last ENDED_KEPT
        self.stats = {"calls": 0, "refused": 0, "late": 0, "undelivered": 0}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpo-agent-endpoint", daemon=True)
        self._thread.start()
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post("/e/{session}/v1/chat/completions", self._chat_completions)
        app.router.add_post("/e/{session}/v1/completions", self._completions)
        app.router.add_get("/e/{session}/v1/models", self._models)
        app.router.add_post("/e/{session}/rl/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None)
        self.port = asyncio.run_coroutine_threadsafe(self._start(host), self._loop).result(timeout=30)
        self.url = f"http://{host}:{self.port}"

    async def _start(self, host: str) -> int:
        await self._runner.setup()
        # A socket of our own, bound to a free port, so that the port is known (aiohttp's TCPSite publishes none).
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        await web.SockSite(self._runner, sock).start()
        return sock.getsockname()[1]

    def open_session(self, loop: asyncio.AbstractEventLoop) -> AgentSession:
        """A new episode's session; its calls are posted to `loop` (the episode's event loop)."""
        session = AgentSession(self, loop)
        with self._lock:
            self.sessions[session.id] = session
        return session

    def end_session(self, session: AgentSession) -> None:
        """The episode is over: later calls get 410 (counted in session.late_calls and the stats) while it is among
        the last ENDED_KEPT ended sessions, 404 once forgotten."""
        session.closed = True
        with self._lock:
            self.sessions.pop(session.id, None)
            self._ended[session.id] = session
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def metrics(self) -> dict:
        """Running totals: calls answered, refused (4xx for a malformed request), late (after their episode) and
        undelivered (the client gone before its response was written)."""
        return {f"rollout/agent_{k}": v for k, v in self.stats.items()}

    def close(self) -> None:
        if not self._loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- routes -------------------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> AgentSession:
        with self._lock:
            session = self.sessions.get(request.match_info["session"]) or self._ended.get(
                request.match_info["session"])
        if session is None:
            raise RequestError(404, "no such episode session (its base URL is the episode's own)")
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), session.key.encode()):
            raise RequestError(401, "the API key is not this episode's")
        if session.closed:
            session.late_calls += 1
            self.stats["late"] += 1
            raise RequestError(410, "the episode has ended: a call after it is not trained")
        return session

    @staticmethod
    def _error(error: RequestError) -> web.Response:
        kind = "invalid_request_error" if error.status == 400 else "episode_error"
        return web.json_response({"error": {"message": error.message, "type": kind, "code": error.status}},
                                 status=error.status)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except RequestError as e:
            return self._error(e)
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                              "created": 0, "owned_by": "grpo-jax"}]})

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            body = await self._json(request)
            value = body.get("reward") if isinstance(body, dict) else None
            if not (isinstance(value, int | float) and not isinstance(value, bool) or isinstance(value, dict)):
                raise RequestError(400, "reward: a number, or an object of named numbers")
        except RequestError as e:
            return self._error(e)
        session.posted_reward = value
        return web.json_response({"ok": True})

    @staticmethod
    async def _json(request: web.Request):
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise RequestError(400, f"the body is not JSON ({e})") from None

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_call)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_token_call)

    async def _serve(self, request: web.Request, parse) -> web.StreamResponse:
        """A call: checked, handed to its session, answered once the episode has its turn."""
        try:
            session = self._session(request)
            call = parse(await self._json(request), self.temperature, self.top_p)
        except RequestError as e:
            self.stats["refused"] += 1
            return self._error(e)
        try:
            session.post(call)
        except RequestError as e:
            return self._error(e)
        self.stats["calls"] += 1
        try:
            reply = await asyncio.wrap_future(call.reply)
        except asyncio.CancelledError:
            call.delivered.set_result(False)
            raise
        if reply.error is not None:
            call.delivered.set_result(False)
            return self._error(RequestError(*reply.error))
        if call.prompt_ids is not None:
            body = text_completion_body(reply, int(time.time()))
        else:
            body = completion_body(reply, [f"call_{secrets.token_hex(6)}" for _ in reply.turn.tool_calls],
                                   int(time.time()))
        delivered = False
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if call.stream
                                               else "application/json", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            if call.stream:
                for chunk in stream_chunks(body):
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
            else:
                await response.write(json.dumps(body).encode())
            alive = request.transport is not None and not request.transport.is_closing()
            await response.write_eof()
            delivered = alive
        except ConnectionError:  # the client went away: its turn is not trained
            pass
        finally:
            if not delivered:
                self.stats["undelivered"] += 1
            call.delivered.set_result(delivered)
        return response
