"""Episodes: multi-turn environments run over the continuation engine, token-in/token-out.

EpisodeRunner.run(rows, seeds, keys) runs one episode per row to its end and returns an EpisodeResult each:

    make the environment (env.name's factory), reset(its own deep copy of the row, seed) -> messages -> the
      renderer's opening ids (on the render thread)
    extend: every episode's opening ids are prefilled, its first token drawn
    repeat until no episode goes on:
        decode chunks; an episode whose turn ended (a stop id) is parsed (Trajectory.add_turn) and its
          environment step starts at once on the event loop, its answer rendered on the render thread once it
          comes (Trajectory.add_step: appended to its sequence, or a new segment where the template cannot
          extend), while the other rows decode on
        once every turn has ended: wait for the steps
        extend: only the new ids are prefilled (after the turn's stop id, which was sampled but not yet fed);
          the engine kept each row's keys/values meanwhile
    reward() for every episode that did not fail, then close() for every environment (always)

Limits (EnvConfig, SamplerConfig): at most env.max_turns assistant turns (then the episode is truncated); one
sequence (segment) holds at most `context` = min(env.max_total_tokens, sampler.max_prompt_len +
sampler.max_new_tokens) tokens, of which the opening prompt at most sampler.max_prompt_len and the sampled ones
at most sampler.max_new_tokens. A turn is cut off at the room left, and an episode whose environment answer leaves
no room for another turn ends before that answer (Trajectory.take_back_step): both are truncated, and trained
with their reward, as a single-turn completion at its token limit is (env/truncated counts them). A turn cut at
the environment's own limit (Environment.turn_token_limit: an agent call's max_tokens) with room left is not: the
episode goes on, its next step in a new segment.

An environment's messages are sized before they are rendered, at a cost that grows with the context, not with the
messages (token_floor: Tokenizer.min_tokens over growing prefixes): an opening that provably needs more than
sampler.max_prompt_len tokens, or a step's answer that needs more than a whole sequence, fails the episode as
`context_limit` unread; an answer that provably leaves no room for another turn ends the episode truncated, as
above, without rendering it. For a tokenizer whose tokens have no byte bound (min_tokens gives 0) the messages
are judged by their size instead: more than UNBOUNDED_BYTES_PER_TOKEN bytes per token of that limit is
`context_limit`.

Failures fail that episode, never the run (EpisodeResult.failure, a ledger drop reason when a group cannot be
trained): `env_error` (the factory, reset, step or reward raised, or returned something malformed),
`env_timeout` (a call took longer than env.step_timeout_s), `context_limit` (the opening prompt does not fit
sampler.max_prompt_len or leaves no room for a turn; an answer larger than a sequence). close() failures are
logged only.

Where the work runs: environment calls on one asyncio event loop on a thread of its own, at most env.concurrency
at once, each within env.step_timeout_s; their blocking work (Tool.run's plain functions, asyncio.to_thread,
run_in_executor(None, ...)) on the runner's own CallThreads, at most env.concurrency at work; rendering and
tokenizing the environment's messages on one render thread; the driving thread (the actor) waits for them only
when every turn has ended. Python cannot stop a thread: a worker thread still inside a call past its timeout is
stuck and replaced, and a call that holds the event loop itself past the timeout (blocking code in an async
method) gets the loop replaced, failing the episodes on it (env_timeout). Both count as stuck threads
(rollout/episode_stuck_threads; rollout/episode_stuck_calls, rollout/episode_loops_replaced in all); once more
than env.concurrency are stuck at once the run stops (TrainerError) in one line naming the call and where it
hangs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import copy
import dataclasses
import functools
import inspect
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.environment import (
    EnvConfig,
    Environment,
    StepResult,
    TurnTokens,
    agent_function,
    make_environment,
    renderer_family,
    reward_parts,
)
from grpo_jax.envs.render import Renderer, renderer_for_run
from grpo_jax.envs.trajectory import Trajectory
from grpo_jax.errors import ConfigError, TrainerError
from grpo_jax.rollout.continuation import ContinuationEngine, Drawn
from grpo_jax.rollout.grouping import one_line
from grpo_jax.rollout.sampler import SamplerConfig

logger = logging.getLogger("grpo_jax.rollout.episodes")

ENV_FAILURES = ("env_error", "env_timeout", "context_limit")  # EpisodeResult.failure, and ledger drop reasons
# Beyond step_timeout_s, the longest the actor waits for a call that has not started yet (waiting for a free slot)
# or whose loop is busy with untracked work; a call holding the loop past step_timeout_s is told apart at once.
TIMEOUT_GRACE_S = 5.0
POLL_S = 0.05  # how often a waiting actor looks whether the event loop is held
# The bytes per token an environment's messages may have when the tokenizer claims no bound (min_tokens gives 0:
# a word-level tokenizer reads an unknown word of any length as one token); beyond it they are not read.
UNBOUNDED_BYTES_PER_TOKEN = 64
PROBE_CHARS = 1 << 16  # token_floor's first prefix
SEQUENCE = "a whole sequence holds (min(env.max_total_tokens, sampler.max_prompt_len + sampler.max_new_tokens))"


@dataclasses.dataclass
class EpisodeResult:
    """One episode's outcome. A failed episode (failure set) has no reward and trains nothing."""

    trajectory: Trajectory | None  # None when it failed before its opening ids
    reward: float = math.nan  # the sum of reward_parts
    reward_parts: dict = dataclasses.field(default_factory=dict)
    step_rewards: list = dataclasses.field(default_factory=list)  # StepResult.reward of each step that gave one
    failure: str | None = None  # one of ENV_FAILURES
    detail: str | None = None  # what failed, one line
    env_seconds: float = 0.0  # time spent in the environment's calls

    @property
    def turns(self) -> int:
        return 0 if self.trajectory is None else self.trajectory.turns


def token_floor(tokenizer: Tokenizer, text: str, limit: int) -> int | None:
    """A lower bound on the tokens `text` takes inside a render (one token of slack), from Tokenizer.min_tokens of
    ever longer prefixes: it stops once the bound passes `limit`, so a huge text costs about `limit` tokens' worth
    of normalizing, not its length. None when the tokenizer claims no bound (min_tokens is 0 for text)."""
    end = PROBE_CHARS
    while True:
        # A prefix can end inside what the normalizer composes (a base character before its combining mark), and
        # the text sits between the template's own: the slack of one token covers both.
        prefix = text[:end]
        floor = tokenizer.min_tokens(prefix)
        if floor == 0 and prefix:
            return None
        if end >= len(text) or floor - 1 > limit:
            return max(floor - 1, 0)
        end *= 4


def _text_bytes(text: str, cap: int) -> int:
    """len(text.encode()) when it is at most `cap`; some number above `cap` otherwise (without encoding it all)."""
    return len(text) if len(text) > cap else len(text.encode("utf-8", "surrogatepass"))


class _EpisodeFailure(Exception):
    """What fails an episode (reason: one of ENV_FAILURES), raised where it is found (a call, the render thread)."""

    def __init__(self, reason: str, detail: str, stuck: int = 0):
        super().__init__(detail)
        self.reason, self.detail = reason, detail
        self.stuck = stuck  # worker threads the call left stuck


@dataclasses.dataclass(frozen=True)
class _Answer:
    """A step's result as the render thread left it: new_segment as Trajectory.add_step returned it, or None when
    the answer provably leaves no room for another turn (not rendered)."""

    result: StepResult
    new_segment: bool | None


class _Episode:
    """The driving thread's view of one running episode."""

    def __init__(self, row: dict, seed: int, key: np.ndarray):
        self.row, self.seed, self.key = row, seed, key
        self.result = EpisodeResult(trajectory=None)
        self.env: Environment | None = None
        self.loop: _EventLoop | None = None  # where its environment's calls run
        self.fed = 0  # tokens of the current segment in the engine's cache
        self.sampled_in_segment = 0
        self.turn: tuple[list, list, list] = ([], [], [])  # ids, log-probs, versions of the turn being sampled
        self.pending: concurrent.futures.Future | None = None  # its environment step, running
        self.over = False  # no more turns (ended, truncated or failed)
        self.closed = False  # its batch is over: the render thread leaves its trajectory alone

    def fail(self, reason: str, detail: str) -> None:
        if self.result.failure is None:  # the first reason stands
            self.result.failure, self.result.detail = reason, one_line(detail)
        self.over = True


@dataclasses.dataclass(eq=False)
class _Call:
    """One environment call in flight: the episode and what was called ("step()")."""

    episode: _Episode
    what: str


# The call the running code belongs to: set in each call's task, read where its blocking work is submitted.
_CALLER: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("grpo_env_call", default=None)


def _where(thread: threading.Thread, caller_code) -> str:
    """' at file:line' of the frame that code `caller_code` called on `thread` (the user's function, where it
    is now), or ''."""
    frame = sys._current_frames().get(thread.ident)  # noqa: SLF001 - documented; used for one diagnostic line
    child = None
    while frame is not None and frame.f_code is not caller_code:
        child, frame = frame, frame.f_back
    if frame is None or child is None:
        return ""
    return f" at {child.f_code.co_filename}:{child.f_lineno}"


def _function_name(fn) -> str:
    """The user's function inside the partials that submit it (asyncio.to_thread's: partial(context.run, fn))."""
    while isinstance(fn, functools.partial):
        inner = fn.func
        fn = fn.args[0] if isinstance(getattr(inner, "__self__", None), contextvars.Context) and fn.args else inner
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _Work:
    __slots__ = ("fn", "future", "caller", "thread", "stuck")

    def __init__(self, fn, future, caller):
        self.fn, self.future, self.caller = fn, future, caller
        self.thread: threading.Thread | None = None
        self.stuck = False


class CallThreads(concurrent.futures.ThreadPoolExecutor):
    """The worker threads of the environments' blocking work, the event loops' default executor: Tool.run's plain
    functions (asyncio.to_thread) and an environment's run_in_executor(None, ...) run here, at most `size` at
    once. Python cannot stop a thread: one still inside the work of a call the runner gave up on (abandon) is
    stuck, leaves the count, and another takes its place; once its function returns, it serves again or ends.
    Threads end when there is no work. (A ThreadPoolExecutor because asyncio's set_default_executor takes no other
    kind; none of its own machinery is used.)"""

    def __init__(self, size: int):
        super().__init__(max_workers=size)
        self.size = size
        self._lock = threading.Lock()
        self._queue: collections.deque[_Work] = collections.deque()
        self._running: set[_Work] = set()
        self._busy = 0  # threads that are not stuck
        self._stuck: list[_Work] = []

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            self._queue.append(_Work(functools.partial(fn, *args, **kwargs), future, _CALLER.get()))
            self._start_if_room()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing: an event loop's close() calls it, and these threads serve the runner's next loops too; they
        end by themselves when there is no work."""

    def _start_if_room(self) -> None:
        if self._queue and self._busy < self.size:
            self._busy += 1
            threading.Thread(target=self._serve, name="grpo-env-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._busy -= 1
                    return
                work = self._queue.popleft()
                work.thread = threading.current_thread()
                self._running.add(work)
            if work.future.set_running_or_notify_cancel():
                try:
                    result = work.fn()
                except BaseException as e:  # noqa: BLE001 - the caller's to handle, as ThreadPoolExecutor does
                    work.future.set_exception(e)
                else:
                    work.future.set_result(result)
            with self._lock:
                self._running.discard(work)
                if not work.stuck:
                    continue
                self._stuck.remove(work)
                if not (self._queue and self._busy < self.size):
                    return
                self._busy += 1  # back in the count, in place of the thread that replaced it

    def abandon(self, caller: _Call) -> list[str]:
        """The runner gave up on `caller`: its work still running is stuck from now on (its threads replaced).
        Returns where each such thread is ("fetch at tools.py:12"). Its work not started is cancelled by asyncio
        with the call's task."""
        said = []
        with self._lock:
            for work in self._running:
                if work.caller is caller and not work.stuck:
                    work.stuck = True
                    self._stuck.append(work)
                    self._busy -= 1
                    said.append(self._describe(work))
            self._start_if_room()
        return said

    def stuck(self) -> list[str]:
        """Where each stuck thread is."""
        with self._lock:
            return [self._describe(work) for work in self._stuck]

    @staticmethod
    def _describe(work: _Work) -> str:
        return _function_name(work.fn) + (_where(work.thread, CallThreads._serve.__code__) if work.thread else "")


class _Marked:
    """Awaits an environment call (call: a coroutine function), marking on its loop which call the loop runs
    whenever it runs this one's code: a call that holds the loop (blocking code) can be named."""

    def __init__(self, env_loop: _EventLoop, record: _Call, call: Callable):
        self.env_loop, self.record, self.call = env_loop, record, call

    def __await__(self):
        env_loop, record = self.env_loop, self.record
        env_loop.enter(record)
        try:
            awaitable = self.call()
        finally:
            env_loop.leave()
        if not inspect.isawaitable(awaitable):
            raise _EpisodeFailure("env_error", f"{record.what} returned a {type(awaitable).__name__}, not a "
                                               "coroutine: define it with `async def`")
        steps = awaitable.__await__()
        send, value = steps.send, None
        while True:
            env_loop.enter(record)
            try:
                signal = send(value)
            except StopIteration as done:
                return done.value
            finally:
                env_loop.leave()
            try:
                value, send = (yield signal), steps.send
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as e:  # noqa: BLE001 - thrown in by the task (a cancellation): the call's to handle
                value, send = e, steps.throw


class _EventLoop:
    """An asyncio event loop on a thread of its own, where the environments' calls run, and the call whose code it
    is running now (inside, since): a call holding it past the timeout is told apart from a slow one."""

    def __init__(self, executor: CallThreads, concurrency: int, drain_s: float):
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(executor)
        self.slots = asyncio.Semaphore(concurrency)  # binds to self.loop at its first use there
        self.inside: _Call | None = None
        self.since = 0.0
        self.blocked_by: str | None = None  # once replaced: why the calls on it failed
        self.drain_s = drain_s
        self.thread = threading.Thread(target=self._serve, name="grpo-env-loop", daemon=True)
        self.thread.start()

    def enter(self, record: _Call) -> None:
        self.inside, self.since = record, time.monotonic()

    def leave(self) -> None:
        self.inside = None

    def held_s(self) -> float:
        """How long the call it runs now has held the loop (0 while every call awaits)."""
        inside, since = self.inside, self.since
        return time.monotonic() - since if inside is not None else 0.0

    def stop(self) -> None:
        """End the loop once it runs (a held one: when it is free again), after the calls started on it."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed already
            pass

    def _serve(self) -> None:
        self.loop.run_forever()
        # A replaced loop, free again, lets the calls started on it end (each within its timeout: the close() calls
        # queued on it run here); then, or at once when the runner closes, what is left is cancelled.
        pending = asyncio.all_tasks(self.loop)
        if pending and self.blocked_by is not None:
            _, pending = self.loop.run_until_complete(asyncio.wait(pending, timeout=self.drain_s))
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        self.loop.close()


class EpisodeRunner:
    """Runs batches of episodes (module docstring). One thread calls run(); close() when done."""

    def __init__(self, engine: ContinuationEngine, renderer: Renderer, env_config: EnvConfig,
                 factory: Callable[[], Environment], *, max_prompt_len: int, max_new_tokens: int,
                 reprefill: bool = False, closing: Sequence[Callable[[], None]] = (),
                 more_metrics: Callable[[], dict] | None = None):
        """reprefill: prefill every turn's whole sequence again instead of continuing it (what the continuation
        saves, measured by tools/bench_multiturn.py; the episodes are the same); closing: what close() also
        stops (an agent endpoint); more_metrics: totals of its own for metrics() (the agent endpoint's)."""
        self.closing, self.more_metrics = list(closing), more_metrics
        self.engine, self.renderer, self.config, self.factory = engine, renderer, env_config, factory
        self.reprefill = reprefill
        self.context = min(env_config.max_total_tokens, engine.context)
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.threads = CallThreads(env_config.concurrency)
        self._render = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-env-render")
        self._loop = self._new_loop()
        self._replaced: list[_EventLoop] = []  # loops replaced because a call held them; alive while it does
        self.stats = collections.Counter()

    def _new_loop(self) -> _EventLoop:
        return _EventLoop(self.threads, self.config.concurrency, self.config.step_timeout_s + TIMEOUT_GRACE_S)

    def close(self) -> None:
        """Stop the event loops and the render thread (idempotent). Stuck threads cannot be stopped: they are
        daemons."""
        for env_loop in (self._loop, *self._replaced):
            env_loop.stop()
        self._loop.thread.join(timeout=10)
        self._render.shutdown(wait=False)
        while self.closing:
            self.closing.pop()()

    # -- the actor's generator: weights and metrics are the engine's --

    @property
    def state(self):
        return self.engine.state

    @property
    def version(self) -> int:
        return self.engine.version

    def update_params(self, state, version: int | None = None) -> None:
        self.engine.update_params(state, version)

    def stuck_threads(self) -> int:
        """Threads now inside a call the runner gave up on: worker threads, and replaced loops still held."""
        return len(self.threads.stuck()) + sum(env_loop.thread.is_alive() for env_loop in list(self._replaced))

    def metrics(self) -> dict:
        """Running totals: the engine's programs and tokens (rollout/continuation_*), turns, segments cut, answers
        truncated at the context, stuck calls and replaced loops; and the threads stuck now."""
        return {**self.engine.metrics(), **{f"rollout/episode_{k}": v for k, v in dict(self.stats).items()},
                "rollout/episode_stuck_threads": self.stuck_threads(),
                **(self.more_metrics() if self.more_metrics is not None else {})}

    # -- environment calls --

    def _call(self, episode: _Episode, what: str, call: Callable,
              then: Callable | None = None) -> concurrent.futures.Future:
        """call() (a coroutine function of the environment) on the episode's event loop, within the step timeout,
        its time counted; then then(value), if given, on the render thread (the trainer's work: not timed). The
        future's failures are _EpisodeFailures."""
        env_loop = episode.loop
        if env_loop.blocked_by is not None:
            future = concurrent.futures.Future()
            future.set_exception(_EpisodeFailure("env_timeout", f"{what}: {env_loop.blocked_by}"))
        else:
            future = asyncio.run_coroutine_threadsafe(self._run_call(env_loop, _Call(episode, what), call, then),
                                                      env_loop.loop)
        future.what = what
        return future

    async def _run_call(self, env_loop: _EventLoop, record: _Call, call: Callable, then: Callable | None):
        _CALLER.set(record)
        timeout = self.config.step_timeout_s
        async with env_loop.slots:
            start = time.perf_counter()
            task = asyncio.ensure_future(self._inside(env_loop, record, call))
            try:
                done, _ = await asyncio.wait({task}, timeout=timeout)
            except BaseException:  # cancelled: the runner no longer waits for it
                task.cancel()
                raise
            finally:
                record.episode.result.env_seconds += time.perf_counter() - start
            if not done:
                # Cancelled, and no longer waited for: a call that ignores the cancellation goes on alone, holding
                # no slot; a thread inside its blocking work cannot be stopped, and is replaced.
                task.cancel()
                stuck = self.threads.abandon(record)
                detail = f"{record.what} took longer than env.step_timeout_s={timeout}"
                if stuck:
                    detail += (f"; its thread in {', '.join(stuck)} cannot be stopped and goes on outside the "
                               f"pool ({len(self.threads.stuck())} stuck now)")
                raise _EpisodeFailure("env_timeout", detail, stuck=len(stuck))
        try:
            value = task.result()
        except _EpisodeFailure:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the environment raises fails this episode only
            raise _EpisodeFailure("env_error", f"{record.what} raised {type(e).__name__}: {e}") from e
        if then is None:
            return value
        return await asyncio.get_running_loop().run_in_executor(self._render, then, value)

    @staticmethod
    async def _inside(env_loop: _EventLoop, record: _Call, call: Callable):
        try:
            return await _Marked(env_loop, record, call)
        except (SystemExit, KeyboardInterrupt) as e:  # asyncio re-raises these, ending the loop's thread
            raise RuntimeError(f"{type(e).__name__}({e})") from e

    def _wait(self, episode: _Episode, future: concurrent.futures.Future):
        """The call's value, or None after failing the episode with the reason found. A loop that one call has held
        past env.step_timeout_s is replaced (_replace_loop) at once."""
        give_up = time.monotonic() + self.config.step_timeout_s + TIMEOUT_GRACE_S
        env_loop = episode.loop
        while episode.result.failure is None:
            try:
                return future.result(timeout=POLL_S)
            except TimeoutError:
                pass
            except _EpisodeFailure as failure:
                episode.fail(failure.reason, failure.detail)
                if failure.stuck:
                    self.stats["stuck_calls"] += 1
                    self._stop_if_too_many_stuck()
                return None
            except concurrent.futures.CancelledError:
                episode.fail("env_error", f"{future.what} was cancelled")
                return None
            if env_loop.blocked_by is not None:
                episode.fail("env_timeout", f"{future.what}: {env_loop.blocked_by}")
            elif env_loop.held_s() > self.config.step_timeout_s or not env_loop.thread.is_alive():
                self._replace_loop(env_loop)
            elif time.monotonic() > give_up:
                episode.fail("env_timeout", f"{future.what} did not finish within env.step_timeout_s="
                                            f"{self.config.step_timeout_s} (+{TIMEOUT_GRACE_S} s)")
        future.cancel()
        return None

    def _replace_loop(self, env_loop: _EventLoop) -> None:
        """A call holds `env_loop` (blocking code in an async method, or the loop's thread died): the episodes on it
        fail, and later episodes get a new loop. The held one ends once it is free again."""
        if env_loop.blocked_by is not None:
            return
        culprit = env_loop.inside
        if culprit is None:
            what, where = "its thread died", ""
        else:
            what = f"{culprit.what} held it over env.step_timeout_s={self.config.step_timeout_s}"
            where = _where(env_loop.thread, _Marked.__await__.__code__)
        env_loop.blocked_by = f"the event loop was lost: {what}{where}"
        if culprit is not None and not culprit.episode.closed:
            culprit.episode.fail("env_timeout", f"{culprit.what} held the event loop over env.step_timeout_s="
                                                f"{self.config.step_timeout_s}{where}: blocking code in an async "
                                                "method (time.sleep, a request without await, a long computation); "
                                                "await it instead (asyncio.to_thread(fn, ...))")
        logger.warning("environment: %s; the episodes on that loop fail (env_timeout), later ones run on a new one",
                       env_loop.blocked_by)
        self._replaced.append(env_loop)
        if env_loop is self._loop:
            self._loop = self._new_loop()
        self.stats["loops_replaced"] += 1
        self._stop_if_too_many_stuck()

    def _stop_if_too_many_stuck(self) -> None:
        """More stuck threads than env.concurrency: a call that never returns would take a thread per episode."""
        self._replaced = [env_loop for env_loop in self._replaced if env_loop.thread.is_alive()]
        stuck = self.threads.stuck()
        total = len(stuck) + len(self._replaced)
        if total <= self.config.concurrency:
            return
        by_function: dict[str, list[str]] = {}
        for where in stuck:
            by_function.setdefault(where.split(" at ")[0], []).append(where)
        named = [f"{len(wheres)} in {wheres[0]}" for wheres in sorted(by_function.values(), key=len, reverse=True)]
        named += [f"1 event loop ({env_loop.blocked_by})" for env_loop in self._replaced]
        raise TrainerError(
            f"stopped: {total} threads are stuck in environment calls past env.step_timeout_s="
            f"{self.config.step_timeout_s}, more than env.concurrency={self.config.concurrency}: "
            + "; ".join(named[:3])
            + ". Python cannot stop a thread: give the blocking call a timeout of its own, make the tool async, or "
              "await blocking code with asyncio.to_thread")

    # -- one batch --

    def run(self, rows: Sequence[dict], seeds: Sequence[int], keys: np.ndarray,
            between_calls: Callable[[], None] | None = None,
            stopped: Callable[[], bool] | None = None) -> list[EpisodeResult] | None:
        """One episode per row (seeds[i] for reset, keys[i] raw key data for its draws), at most engine.rows.
        Each reset gets its own deep copy of its row: the G episodes of a group share one, which the caller keeps.
        between_calls() runs before every device program (to adopt new weights); stopped() is checked after
        each: True abandons the batch (returns None; the environments are closed). TrainerError when more threads
        are stuck in environment calls than env.concurrency."""
        if not 0 < len(rows) <= self.engine.rows or not len(rows) == len(seeds) == len(keys):
            raise ValueError(f"run: 1..{self.engine.rows} rows with one seed and one key each "
                             f"({len(rows)}, {len(seeds)}, {len(keys)})")
        self._stop_if_too_many_stuck()
        episodes = [_Episode(row, int(seed), np.asarray(key, np.uint32)) for row, seed, key in zip(rows, seeds, keys)]
        between_calls = between_calls or (lambda: None)
        stopped = stopped or (lambda: False)
        try:
            self._open(episodes)
            self.engine.reset()
            appended = [None if e.over else e.result.trajectory.current_ids for e in episodes]
            restart = [a is not None for a in appended]
            while any(a is not None for a in appended):
                between_calls()
                self._absorb(episodes, self._extend(episodes, appended, restart))
                while self.engine.any_active:
                    if stopped():
                        return None
                    between_calls()
                    self._absorb(episodes, self.engine.decode())
                if stopped():
                    return None
                appended, restart = self._steps(episodes)
            self._rewards(episodes)
            return [e.result for e in episodes]
        finally:
            self._close(episodes)

    def _open(self, episodes: list[_Episode]) -> None:
        """Copy each row, make each environment and reset it (concurrently); the opening ids are rendered on the
        render thread as each reset returns."""
        for e in episodes:
            try:
                e.row = copy.deepcopy(e.row)
            except Exception as exc:  # noqa: BLE001 - a row of the user's own that deepcopy refuses fails its episode
                e.fail("env_error", f"the row cannot be copied for reset() ({type(exc).__name__}: {exc})")
                continue
            try:
                e.env = self.factory()
                if not isinstance(e.env, Environment):
                    raise TypeError(f"the factory returned a {type(e.env).__name__}, not an Environment")
            except Exception as exc:  # noqa: BLE001 - a factory that fails fails its episode
                e.fail("env_error", f"making the environment raised {type(exc).__name__}: {exc}")
                continue
            e.loop = self._loop
        resets = {id(e): self._call(e, "reset()", lambda e=e: e.env.reset(e.row, e.seed),
                                    then=functools.partial(self._opening, e)) for e in episodes if not e.over}
        for e in episodes:
            if not e.over:
                e.result.trajectory = self._wait(e, resets[id(e)])

    def _message_floor(self, messages, limit: int, what: str, limit_is: str) -> int:
        """A lower bound on the tokens the messages' contents take (token_floor), or _EpisodeFailure context_limit
        when they provably need more than `limit`, without reading more than about that much of them."""
        if not isinstance(messages, (list, tuple)):
            return 0  # the renderer refuses it
        text = "".join(m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
        tokenizer = self.renderer.tokenizer
        floor = token_floor(tokenizer, text, limit)
        if floor is None:
            cap = limit * UNBOUNDED_BYTES_PER_TOKEN
            size = _text_bytes(text, cap)
            if size > cap:
                raise _EpisodeFailure("context_limit", f"{what} returned {len(text)} characters of messages: more "
                                      f"than {UNBOUNDED_BYTES_PER_TOKEN} bytes per token of the {limit} tokens "
                                      f"{limit_is} (tokenizer {tokenizer.source} claims no bound on a token's bytes, "
                                      "so they are not read); cut what the environment or its tools return")
            return 0
        if floor > limit:
            raise _EpisodeFailure("context_limit", f"{what} returned {len(text)} characters of messages, at least "
                                  f"{floor} tokens: more than the {limit} {limit_is}; cut what the environment or "
                                  "its tools return")
        return floor

    def _opening(self, e: _Episode, messages) -> Trajectory:
        """On the render thread: reset()'s messages as the episode's Trajectory, or an _EpisodeFailure."""
        limit = min(self.max_prompt_len, self.context - 1)
        try:
            self._message_floor(messages, limit, "reset()", "an opening may take (sampler.max_prompt_len, context)")
            trajectory = Trajectory(self.renderer, messages, e.env.tools)
        except (ValueError, TypeError) as exc:
            raise _EpisodeFailure("env_error", f"reset() returned messages the renderer refuses: {exc}") from exc
        length = len(trajectory.current_ids)
        if length > limit:
            raise _EpisodeFailure("context_limit", f"the opening prompt has {length} tokens; sampler.max_prompt_len="
                                                   f"{self.max_prompt_len}, context {self.context}")
        return trajectory

    def _answer(self, e: _Episode, result) -> _Answer:
        """On the render thread: a step's result, its messages added to the trajectory unless the episode ends
        here (done, or provably no room for another turn), or an _EpisodeFailure."""
        if not isinstance(result, StepResult):
            raise _EpisodeFailure("env_error", f"step() returned a {type(result).__name__}, not a StepResult")
        if result.done or e.closed:
            return _Answer(result, None)
        trajectory = e.result.trajectory
        # What the answer may take: the room after the current sequence, or a new segment's (where the template
        # cannot extend, the whole history is rendered again).
        room = max(self.context - len(trajectory.current_ids) - 1, min(self.max_prompt_len, self.context - 1))
        try:
            if self._message_floor(result.history or result.messages, self.context, "step()", SEQUENCE) > room:
                return _Answer(result, None)
            return _Answer(result, trajectory.add_step(result.messages, tool_errors=result.tool_errors,
                                                       history=result.history, prompt=result.prompt))
        except (ValueError, TypeError) as exc:
            raise _EpisodeFailure("env_error", f"step() returned messages the renderer refuses: {exc}") from exc

    def _room_left(self, e: _Episode, pending: int = 0) -> int:
        """Tokens the episode's sequence may still sample, by the run's limits, with `pending` sampled ids not yet
        in its trajectory."""
        return min(self.context - len(e.result.trajectory.current_ids) - pending,
                   self.max_new_tokens - e.sampled_in_segment)

    def _room(self, e: _Episode) -> int:
        """Tokens the episode may sample in its next turn (the environment's own limit too: an agent's max_tokens)."""
        room = self._room_left(e)
        limit = e.env.turn_token_limit()
        return room if limit is None else min(room, limit)

    def _extend(self, episodes: list[_Episode], appended: list, restart: list) -> Drawn:
        rows = self.engine.rows
        pad = rows - len(episodes)
        keys = np.zeros((rows, 2), np.uint32)
        keys[:len(episodes)] = [e.key for e in episodes]
        budgets = [self._room(e) if a is not None else 1 for e, a in zip(episodes, appended)] + [1] * pad
        drawn = self.engine.extend(list(appended) + [None] * pad, list(restart) + [False] * pad, keys, budgets)
        for e, ids, new in zip(episodes, appended, restart):
            if ids is not None:
                e.fed = len(ids) if new else e.fed + len(ids)
        return drawn

    def _absorb(self, episodes: list[_Episode], drawn: Drawn) -> None:
        """Record what a program sampled; an episode whose turn ended is parsed and its step started."""
        for r, e in enumerate(episodes):
            n = int(drawn.count[r])
            if n == 0 or e.over:
                continue
            ids, logprobs, versions = e.turn
            # The turn's room holds whatever the engine returns: a turn past it is cut there (and so truncated),
            # never a sequence longer than the learner's rows.
            room = self._room(e) - len(ids)
            overshoot = n > room
            n = min(n, room)
            ids += drawn.tokens[r, :n].tolist()
            logprobs += drawn.logprobs[r, :n].tolist()
            versions += [drawn.version] * n
            e.fed += n if len(ids) > n else n - 1  # every sampled token but the newest has been fed
            if overshoot:
                self.stats["cut_at_room"] += 1
            if drawn.ended[r] or overshoot:
                self._end_turn(e)

    def _end_turn(self, e: _Episode) -> None:
        trajectory = e.result.trajectory
        ids, logprobs, versions = e.turn
        e.turn = ([], [], [])
        e.sampled_in_segment += len(ids)
        # Cut at the environment's own limit (an agent's max_tokens) with room left: its episode may go on.
        limit = e.env.turn_token_limit()
        capped = limit is not None and len(ids) >= limit and self._room_left(e, len(ids)) > 0
        listens = type(e.env).note_turn is not Environment.note_turn  # copy the sequence's ids only for a listener
        prompt_ids = tuple(trajectory.current_ids) if listens else ()
        turn = trajectory.add_turn(ids, logprobs, versions, capped=capped)
        if listens:
            e.env.note_turn(turn, TurnTokens(prompt_ids=prompt_ids, ids=tuple(ids), logprobs=tuple(logprobs),
                                             versions=tuple(versions)))
        self.stats["turns"] += 1
        if trajectory.ended:  # cut off at its room, or an end-of-text id
            e.over = True
        elif trajectory.turns >= self.config.max_turns:
            trajectory.mark_truncated()
            e.over = True
        else:
            e.pending = self._call(e, "step()", lambda: e.env.step(turn), then=functools.partial(self._answer, e))

    def _steps(self, episodes: list[_Episode]) -> tuple[list, list]:
        """Wait for the running steps; the ids each continuing episode appends (None: it does not go on) and
        whether they start a new segment."""
        appended, restart = [None] * len(episodes), [False] * len(episodes)
        for r, e in enumerate(episodes):
            if e.pending is None:
                continue
            future, e.pending = e.pending, None
            answer = self._wait(e, future)
            if answer is None:
                continue
            result = answer.result
            if result.reward is not None:
                e.result.step_rewards.append(float(result.reward))
            if result.done:
                e.over = True
                continue
            trajectory = e.result.trajectory
            if answer.new_segment is None:  # provably too long for another turn: not rendered
                trajectory.mark_truncated()
                e.over = True
                self.stats["truncated_at_context"] += 1
                continue
            new_segment = answer.new_segment
            ids = trajectory.current_ids
            sampled = 0 if new_segment else e.sampled_in_segment
            too_long = len(ids) > self.max_prompt_len if new_segment else False
            if too_long or min(self.context - len(ids), self.max_new_tokens - sampled) < 1:
                # No room for the environment's answer and another turn: the episode ends before that answer, as
                # max_turns ends one (its segments always fit the learner's rows).
                trajectory.take_back_step()
                e.over = True
                self.stats["truncated_at_context"] += 1
                continue
            if new_segment:
                e.sampled_in_segment = 0
                self.stats["segments_cut"] += 1
            appended[r], restart[r] = (ids, True) if new_segment or self.reprefill else (ids[e.fed:], False)
        return appended, restart

    def _rewards(self, episodes: list[_Episode]) -> None:
        calls = {id(e): self._call(e, "reward()", e.env.reward) for e in episodes if e.result.failure is None}
        for e in episodes:
            if e.result.failure is not None:
                continue
            value = self._wait(e, calls[id(e)])
            if e.result.failure is not None:
                continue
            try:
                parts = reward_parts(value)
            except ValueError as exc:
                e.fail("env_error", str(exc))
                continue
            total = sum(parts.values())
            if not math.isfinite(total):
                e.fail("env_error", f"reward() returned {parts}: not finite")
                continue
            e.result.reward, e.result.reward_parts = float(total), parts

    def _close(self, episodes: list[_Episode]) -> None:
        """close() every environment made, concurrently, on the loop it ran on (a replaced loop runs them once it
        is free again); failures are logged, the results stand."""
        for e in episodes:
            e.closed = True
            if e.pending is not None:
                e.pending.cancel()
        self._render.submit(int).result()  # the render thread has finished what it started for these episodes
        calls = []
        for e in episodes:
            if e.env is None:
                continue
            try:
                calls.append((e, asyncio.run_coroutine_threadsafe(
                    self._run_call(e.loop, _Call(e, "close()"), e.env.close, None), e.loop.loop)))
            except RuntimeError as exc:  # its loop has ended
                logger.warning("environment close() not called: %s", exc)
        give_up = time.monotonic() + self.config.step_timeout_s + TIMEOUT_GRACE_S
        for e, future in calls:
            if e.loop.blocked_by is not None:
                continue
            try:
                while True:
                    try:
                        future.result(timeout=POLL_S)
                        break
                    except TimeoutError:
                        if e.loop.held_s() > self.config.step_timeout_s or not e.loop.thread.is_alive():
                            self._replace_loop(e.loop)
                            break
                        if time.monotonic() > give_up:
                            raise
            except Exception as exc:  # noqa: BLE001 - a failing close() must not lose the episode
                self.stats["close_errors"] += 1
                logger.warning("environment close() failed: %s", one_line(getattr(exc, "detail", None) or
                                                                           f"{type(exc).__name__}: {exc}"))
        for env_loop in self._replaced:
            env_loop.stop()  # once free again, after the close() calls queued on it


def episode_context(env_config: EnvConfig, sampler_config: SamplerConfig) -> int:
    """The most tokens one sequence (segment) of an episode holds: the continuation engine's context."""
    return min(env_config.max_total_tokens, sampler_config.max_prompt_len + sampler_config.max_new_tokens)


def make_episode_runner(env_config: EnvConfig, sampler_config: SamplerConfig, model, tokenizer: Tokenizer, *,
                        rows: int, adapters=None, version: int = 0) -> EpisodeRunner:
    """The actor's generator for a run with an environment (or an agent, env.agent: its episodes through an agent
    endpoint started here, grpo_jax.envs.agent): the renderer of env.renderer (or the model's family), a
    ContinuationEngine of `rows` rows (sampler.slots when set) with the renderer's stop ids, and the runner.
    One environment is made here (the agent function loaded), so that a factory that cannot make one stops the run
    before any compute; and the renderer is checked against the checkpoint's own chat template
    (render.renderer_for_run: env.renderer='' takes the renderer that fits it, an explicit one that does not fit
    is refused in one line)."""
    closing, more_metrics = [], None
    if env_config.agent:
        try:
            import openai  # noqa: F401 - the client each agent is given

            from grpo_jax.envs.agent import AgentEnvironment, check_agent
            from grpo_jax.envs.agent_endpoint import AgentEndpoint
        except ImportError as e:
            raise ConfigError(f"env.agent={env_config.agent!r} needs the agent extra ({e.name} is not installed): "
                              "pip install 'grpo_jax[agent]'") from e

        problems = env_config.validate()
        if problems:
            raise ConfigError("invalid config: " + "; ".join(f"env.{p}" for p in problems))
        run = check_agent(agent_function(env_config.agent))
        endpoint = AgentEndpoint(host=env_config.agent_host, temperature=sampler_config.temperature,
                                 top_p=sampler_config.top_p)
        closing.append(endpoint.close)
        more_metrics = endpoint.metrics

        def factory():
            return AgentEnvironment(run, endpoint)

        with_tools = True  # an agent's tools come with its calls
    else:
        with_tools = bool(make_environment(env_config).tools)

        def factory():
            return make_environment(env_config)

    architecture = model.config.architecture
    renderer = renderer_for_run(renderer_family(env_config, architecture), tokenizer, env_config.renderer_options,
                                explicit=bool(env_config.renderer), with_tools=with_tools,
                                model=f"model.architecture={architecture} (tokenizer {tokenizer.source})")
    engine = ContinuationEngine(model, renderer.stop_ids, tokenizer.pad_id, sampler_config,
                                rows=sampler_config.slots or rows, context=episode_context(env_config, sampler_config),
                                adapters=adapters, version=version)
    return EpisodeRunner(engine, renderer, env_config, factory, max_prompt_len=sampler_config.max_prompt_len,
                         max_new_tokens=sampler_config.max_new_tokens, closing=closing, more_metrics=more_metrics)
