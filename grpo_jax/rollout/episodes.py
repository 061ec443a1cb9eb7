"""Episodes: multi-turn environments run over the continuation engine, token-in/token-out.

EpisodeRunner.run(rows, seeds, keys) runs one episode per row to its end and returns an EpisodeResult each:

    make the environment (env.name's factory), reset(row, seed) -> messages -> the renderer's opening ids
    extend: every episode's opening ids are prefilled, its first token drawn
    repeat until no episode goes on:
        decode chunks; an episode whose turn ended (a stop id) is parsed (Trajectory.add_turn) and its
          environment step starts at once on the event loop, while the other rows decode on
        once every turn has ended: wait for the steps; each episode's new messages become ids
          (Trajectory.add_step: appended to its sequence, or a new segment where the template cannot extend)
        extend: only those ids are prefilled (after the turn's stop id, which was sampled but not yet fed);
          the engine kept each row's keys/values meanwhile
    reward() for every episode that did not fail, then close() for every environment (always)

Limits (EnvConfig, SamplerConfig): at most env.max_turns assistant turns (then the episode is truncated); one
sequence (segment) holds at most `context` = min(env.max_total_tokens, sampler.max_prompt_len +
sampler.max_new_tokens) tokens, of which the opening prompt at most sampler.max_prompt_len and the sampled ones
at most sampler.max_new_tokens. A turn is cut off at the room left, and an episode whose environment answer leaves
no room for another turn ends before that answer (Trajectory.take_back_step): both are truncated, and trained
with their reward, as a single-turn completion at its token limit is (env/truncated counts them).

Failures fail that episode, never the run (EpisodeResult.failure, a ledger drop reason when a group cannot be
trained): `env_error` (the factory, reset, step or reward raised, or returned something malformed),
`env_timeout` (a call took longer than env.step_timeout_s), `context_limit` (the opening prompt does not fit
sampler.max_prompt_len or leaves no room for a turn). close() failures are logged only.

Environment calls run on one asyncio event loop on a thread of its own, at most env.concurrency at once, each
within env.step_timeout_s; the driving thread (the actor) waits for them only when every turn has ended.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.environment import (
    EnvConfig,
    Environment,
    StepResult,
    make_environment,
    renderer_family,
    reward_parts,
)
from grpo_jax.envs.render import Renderer, make_renderer
from grpo_jax.envs.trajectory import Trajectory
from grpo_jax.rollout.continuation import ContinuationEngine, Drawn
from grpo_jax.rollout.sampler import SamplerConfig

logger = logging.getLogger("grpo_jax.rollout.episodes")

ENV_FAILURES = ("env_error", "env_timeout", "context_limit")  # EpisodeResult.failure, and ledger drop reasons
DETAIL_CHARS = 300
TIMEOUT_GRACE_S = 5.0  # beyond step_timeout_s, for a call that blocks the event loop itself


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


class _Episode:
    """The driving thread's view of one running episode."""

    def __init__(self, row: dict, seed: int, key: np.ndarray):
        self.row, self.seed, self.key = row, seed, key
        self.result = EpisodeResult(trajectory=None)
        self.env: Environment | None = None
        self.fed = 0  # tokens of the current segment in the engine's cache
        self.sampled_in_segment = 0
        self.turn: tuple[list, list, list] = ([], [], [])  # ids, log-probs, versions of the turn being sampled
        self.pending: concurrent.futures.Future | None = None  # its environment step, running
        self.over = False  # no more turns (ended, truncated or failed)

    def fail(self, reason: str, detail: str) -> None:
        self.result.failure, self.result.detail = reason, _one_line(detail)
        self.over = True


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


class EpisodeRunner:
    """Runs batches of episodes (module docstring). One thread calls run(); close() when done."""

    def __init__(self, engine: ContinuationEngine, renderer: Renderer, env_config: EnvConfig,
                 factory: Callable[[], Environment], *, max_prompt_len: int, max_new_tokens: int,
                 reprefill: bool = False):
        """reprefill: prefill every turn's whole sequence again instead of continuing it (what the continuation
        saves, measured by tools/bench_multiturn.py; the episodes are the same)."""
        self.engine, self.renderer, self.config, self.factory = engine, renderer, env_config, factory
        self.reprefill = reprefill
        self.context = min(env_config.max_total_tokens, engine.context)
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpo-env-loop", daemon=True)
        self._thread.start()
        self._slots = asyncio.Semaphore(env_config.concurrency)  # binds to self.loop at its first use there
        self.stats = collections.Counter()

    def close(self) -> None:
        """Stop the event loop's thread (idempotent)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    # -- the actor's generator: weights and metrics are the engine's --

    @property
    def state(self):
        return self.engine.state

    @property
    def version(self) -> int:
        return self.engine.version

    def update_params(self, state, version: int | None = None) -> None:
        self.engine.update_params(state, version)

    def metrics(self) -> dict:
        """Running totals: the engine's programs and tokens (rollout/continuation_*), turns, segments cut."""
        return {**self.engine.metrics(), **{f"rollout/episode_{k}": v for k, v in self.stats.items()}}

    # -- environment calls --

    def _call(self, episode: _Episode, what: str, call: Callable) -> concurrent.futures.Future:
        """call() (a coroutine function) on the event loop, within the step timeout; its time counted."""
        timeout = self.config.step_timeout_s

        async def run():
            async with self._slots:
                start = time.perf_counter()
                try:
                    return await asyncio.wait_for(call(), timeout)
                finally:
                    episode.result.env_seconds += time.perf_counter() - start

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        future.what = what
        return future

    def _wait(self, episode: _Episode, future: concurrent.futures.Future):
        """The call's value, or None after failing the episode with env_timeout / env_error."""
        try:
            return future.result(timeout=self.config.step_timeout_s + TIMEOUT_GRACE_S)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            episode.fail("env_timeout", f"{future.what} took longer than env.step_timeout_s="
                                        f"{self.config.step_timeout_s}")
        except Exception as e:  # noqa: BLE001 - whatever the environment raises fails this episode only
            episode.fail("env_error", f"{future.what} raised {type(e).__name__}: {e}")
        return None

    # -- one batch --

    def run(self, rows: Sequence[dict], seeds: Sequence[int], keys: np.ndarray,
            between_calls: Callable[[], None] | None = None,
            stopped: Callable[[], bool] | None = None) -> list[EpisodeResult] | None:
        """One episode per row (seeds[i] for reset, keys[i] raw key data for its draws), at most engine.rows.
        between_calls() runs before every device program (to adopt new weights); stopped() is checked after
        each: True abandons the batch (returns None; the environments are closed)."""
        if not 0 < len(rows) <= self.engine.rows or not len(rows) == len(seeds) == len(keys):
            raise ValueError(f"run: 1..{self.engine.rows} rows with one seed and one key each "
                             f"({len(rows)}, {len(seeds)}, {len(keys)})")
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
        """Make each environment and reset it (concurrently), then render the opening ids."""
        for e in episodes:
            try:
                e.env = self.factory()
                if not isinstance(e.env, Environment):
                    raise TypeError(f"the factory returned a {type(e.env).__name__}, not an Environment")
            except Exception as exc:  # noqa: BLE001 - a factory that fails fails its episode
                e.fail("env_error", f"making the environment raised {type(exc).__name__}: {exc}")
        resets = {id(e): self._call(e, "reset()", lambda e=e: e.env.reset(e.row, e.seed)) for e in episodes
                  if not e.over}
        for e in episodes:
            if e.over:
                continue
            messages = self._wait(e, resets[id(e)])
            if e.over:
                continue
            try:
                e.result.trajectory = Trajectory(self.renderer, messages, e.env.tools)
            except (ValueError, TypeError) as exc:
                e.fail("env_error", f"reset() returned messages the renderer refuses: {exc}")
                continue
            length = len(e.result.trajectory.current_ids)
            if length > self.max_prompt_len or length >= self.context:
                e.fail("context_limit", f"the opening prompt has {length} tokens; sampler.max_prompt_len="
                                        f"{self.max_prompt_len}, context {self.context}")

    def _room(self, e: _Episode) -> int:
        """Tokens the episode may sample in its next turn."""
        return min(self.context - len(e.result.trajectory.current_ids), self.max_new_tokens - e.sampled_in_segment)

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
            ids += drawn.tokens[r, :n].tolist()
            logprobs += drawn.logprobs[r, :n].tolist()
            versions += [drawn.version] * n
            e.fed += n if len(ids) > n else n - 1  # every sampled token but the newest has been fed
            if drawn.ended[r]:
                self._end_turn(e)

    def _end_turn(self, e: _Episode) -> None:
        trajectory = e.result.trajectory
        ids, logprobs, versions = e.turn
        e.turn = ([], [], [])
        e.sampled_in_segment += len(ids)
        turn = trajectory.add_turn(ids, logprobs, versions)
        self.stats["turns"] += 1
        if trajectory.ended:  # cut off at its room, or an end-of-text id
            e.over = True
        elif trajectory.turns >= self.config.max_turns:
            trajectory.mark_truncated()
            e.over = True
        else:
            e.pending = self._call(e, "step()", lambda: e.env.step(turn))

    def _steps(self, episodes: list[_Episode]) -> tuple[list, list]:
        """Wait for the running steps; the ids each continuing episode appends (None: it does not go on) and
        whether they start a new segment."""
        appended, restart = [None] * len(episodes), [False] * len(episodes)
        for r, e in enumerate(episodes):
            if e.pending is None:
                continue
            future, e.pending = e.pending, None
            result = self._wait(e, future)
            if e.over:
                continue
            if not isinstance(result, StepResult):
                e.fail("env_error", f"step() returned a {type(result).__name__}, not a StepResult")
                continue
            if result.reward is not None:
                e.result.step_rewards.append(float(result.reward))
            if result.done:
                e.over = True
                continue
            trajectory = e.result.trajectory
            try:
                new_segment = trajectory.add_step(result.messages, tool_errors=result.tool_errors)
            except (ValueError, TypeError) as exc:
                e.fail("env_error", f"step() returned messages the renderer refuses: {exc}")
                continue
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
        """close() every environment made, concurrently; failures are logged, the results stand."""
        for e in episodes:
            if e.pending is not None:
                e.pending.cancel()
        calls = [(e, self._call(e, "close()", e.env.close)) for e in episodes if e.env is not None]
        for e, future in calls:
            try:
                future.result(timeout=self.config.step_timeout_s + TIMEOUT_GRACE_S)
            except Exception as exc:  # noqa: BLE001 - a failing close() must not lose the episode
                self.stats["close_errors"] += 1
                logger.warning("environment close() raised %s: %s", type(exc).__name__, _one_line(str(exc)))


def episode_context(env_config: EnvConfig, sampler_config: SamplerConfig) -> int:
    """The most tokens one sequence (segment) of an episode holds: the continuation engine's context."""
    return min(env_config.max_total_tokens, sampler_config.max_prompt_len + sampler_config.max_new_tokens)


def make_episode_runner(env_config: EnvConfig, sampler_config: SamplerConfig, model, tokenizer: Tokenizer, *,
                        rows: int, adapters=None, version: int = 0) -> EpisodeRunner:
    """The actor's generator for a run with an environment: the renderer of env.renderer (or the model's family),
    a ContinuationEngine of `rows` rows (sampler.slots when set) with the renderer's stop ids, and the runner.
    One environment is made here, so that a factory that cannot make one stops the run before any compute."""
    make_environment(env_config)
    renderer = make_renderer(renderer_family(env_config, model.config.architecture), tokenizer,
                             **env_config.renderer_options)
    engine = ContinuationEngine(model, renderer.stop_ids, tokenizer.pad_id, sampler_config,
                                rows=sampler_config.slots or rows, context=episode_context(env_config, sampler_config),
                                adapters=adapters, version=version)
    return EpisodeRunner(engine, renderer, env_config, lambda: make_environment(env_config),
                         max_prompt_len=sampler_config.max_prompt_len, max_new_tokens=sampler_config.max_new_tokens)
