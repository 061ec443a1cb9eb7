"""The actor: a background thread that turns handouts of prompts into finished groups for the learner.

    Collector.handout / take_requeued -> G completions per prompt (Engine or Sampler, on the actor's devices)
    -> rewards (RewardSuite) -> group advantages -> ReplayBuffer.put, or a drop with its reason

Two ways to generate (sampler.engine):
- continuous (grpo_jax.rollout.engine.Engine), streaming: admitted prompts are submitted to the engine as its slots
  free up, the engine decodes one chunk per loop, and each group goes to the buffer (or is dropped) as soon as
  its G samples have finished, whatever the other groups are doing.
- static (grpo_jax.rollout.sampler.Sampler): one handout at a time, generated as one batch and scored together.

Contract with the learner (grpo_jax.run.trainer):
- Admission: before generating, the actor reserves buffer slots with its weight version; it generates only
  prompts that can be trained within grpo.max_staleness (ReplayBuffer.admissible / reserve).
- Weights: the learner hands new weights over with push_weights(state, version); the actor adopts them
  between generation calls (the engine: between decode chunks, with sequences in flight when
  sampler.inflight_updates is on). Every token records the version that drew it (Group.token_versions)
  and a group's weight_version is the OLDEST among its tokens: the staleness bound (learner version -
  weight_version <= max_staleness, checked by ReplayBuffer.take) then holds for every token of the group. The
  admission rule still holds with in-flight updates: tokens are drawn with weights at least as new as the
  version the group was admitted with.
- Every prompt it takes ends as a group in the buffer or as a drop in the ledger (bad_row, reward_error,
  overlong, zero_variance); prompts in flight when it is stopped stay unfinished, for the resume.
- When the data is exhausted it finishes the buffer (ReplayBuffer.finish: no new prompts) and stays: the groups
  still in flight (the engine decodes a group over several chunks) finish and go to the buffer, the learner
  trains them and then a short last step, and groups that grow too stale before they are trained are generated
  again, until the learner stops it.
- A failure closes the buffer with the error, so the learner stops with it instead of waiting. So do rewards
  that keep failing: trainer.reward_error_handouts handouts in a row without a group to train end the actor
  with a TrainerError naming the reward and its last error.
- Random keys depend only on the run's base key, the prompt's global ordinal and its regeneration count.

An actor whose mesh spans hosts (`lockstep`, sharding.cut_devices) is one sampler shared by every process:
each process's actor thread runs the same rounds, and every decision that starts a collective program is
taken on values all processes gathered (distributed.HostAgreement over the actor's devices). A round:
  1. stop? (any process stopping stops every actor thread, so none waits in a collective for it);
  2. weights: the newest version any process has been pushed, adopted by all (a process that has not yet
     been pushed it waits for its own learner thread, which finished the same collective sync step);
  3. each process admits its own prompts as above (its collector, its buffer); the prompts and their keys
     of all processes are gathered, generated as one batch, and each process finishes its own groups.
Each process's ledger, ordinals, buffer and checkpoint state stay its own, exactly as with one actor per host.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from grpo_jax.algorithm.advantages import GRPOConfig, group_advantages
from grpo_jax.algorithm.rewards import RewardSuite
from grpo_jax.data.collector import Collector, Prompt
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.errors import TrainerError, UserError
from grpo_jax.parallel.distributed import HostAgreement
from grpo_jax.plugins import import_object
from grpo_jax.rollout.engine import Engine, GroupResult
from grpo_jax.rollout.episodes import ENV_FAILURES, EpisodeResult, EpisodeRunner
from grpo_jax.rollout.grouping import Drop, Judged, Keep, one_line, verdict
from grpo_jax.rollout.sampler import Sampler
from grpo_jax.state.ledger import global_ordinal
from grpo_jax.state.replay_buffer import EpisodeStats, Group, ReplayBuffer, Segments

logger = logging.getLogger("grpo_jax.rollout.actor")


def group_key(base_key: jax.Array, ordinal: int, regenerations: int) -> jax.Array:
    """A group's sampling key depends only on the run's base key, its ordinal and its regeneration count,
    never on thread timing or on which other prompts share its batch (so a resumed run draws the same)."""
    return jax.random.fold_in(jax.random.fold_in(base_key, ordinal), regenerations)



# Bad rows logged: the first BAD_ROWS_LOGGED, then every BAD_ROWS_LOG_EVERY-th (all are in the ledger).
BAD_ROWS_LOGGED = 10
BAD_ROWS_LOG_EVERY = 1000
# Scoring calls whose failures are logged: the first REWARD_ERRORS_LOGGED, then every REWARD_ERRORS_LOG_EVERY-th.
REWARD_ERRORS_LOGGED = 10
REWARD_ERRORS_LOG_EVERY = 100


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorLimits:
    """What the run allows the actor (from the config's trainer section)."""

    max_steps: int  # the run's last learner step: no prompt is admitted for a step past it
    group_timeout_s: float = 600.0  # across hosts: how long this host's learner may take to hand over weights
    reward_error_handouts: int = 10  # handouts in a row whose groups all fail their rewards stop the run; 0: never


class Actor:
    """Background thread: handouts -> G completions per prompt -> rewards -> groups into the buffer."""

    def __init__(self, grpo: GRPOConfig, limits: ActorLimits, sampler: Sampler | Engine | EpisodeRunner,
                 tokenizer: Tokenizer, collector: Collector, buffer: ReplayBuffer, rewards: RewardSuite | None,
                 base_key: jax.Array,
                 version: int = 0, lockstep: HostAgreement | None = None):
        self.grpo, self.limits = grpo, limits
        self.lockstep = lockstep  # an actor mesh across hosts: rounds in lockstep with the other processes
        self.base_key = base_key
        self.sampler = sampler
        self.streaming = isinstance(sampler, Engine)
        self.episodic = isinstance(sampler, EpisodeRunner)  # episodes of an environment, scored by its reward()
        # env.advantage: the user's function of a group's episode and step rewards, instead of group_advantages
        self.custom_advantage = (import_object(sampler.config.advantage, what="function")
                                 if self.episodic and sampler.config.advantage else None)
        self.env_failures: collections.Counter = collections.Counter()  # failed episodes by reason
        # Its share of the devices: across hosts each process counts only its own groups' tokens.
        self.num_devices = len(jax.tree.leaves(sampler.state)[0].sharding.device_set) // (
            jax.process_count() if lockstep is not None else 1)
        self.tokenizer = tokenizer
        self.collector = collector
        self.buffer = buffer
        self.rewards = rewards
        self._version = version
        self._pending: tuple[Any, int] | None = None  # (state, version) pushed by the learner
        self._pushed: dict[int, Any] = {}  # lockstep: version -> state pushed and not yet adopted
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.generated_tokens = 0
        self.generate_seconds = 0.0
        self.failed_samples = 0
        self.reward_error_calls = 0  # score() calls that failed a sample
        self.reward_error_streak = 0  # groups in a row dropped as reward_error (see _stop_if_rewards_keep_failing)
        self.last_reward_error: str | None = None  # the last such drop's detail
        self.bad_rows = 0
        self.first_bad_row: str | None = None  # "reason: detail (epoch e, dataset_index i)"
        self._side_jobs: collections.deque[tuple[int, Callable[[int], None]]] = collections.deque()  # submit_side_job
        # Both jitted for one fixed shape, a handout of groups (padded): the engine finishes groups a few at a
        # time, and eager ops (or a program per group count) cost more host time than the rest of the bookkeeping.
        g = grpo.group_size
        self._rows = collector.handout_size
        self._advantages = jax.jit(functools.partial(group_advantages, baseline=grpo.baseline,
                                                     scale_by_std=grpo.scale_by_std,
                                                     positive_weight=grpo.positive_weight))
        self._keys = jax.jit(jax.vmap(lambda base, ordinal, regenerations: jax.random.key_data(
            jax.random.split(group_key(base, ordinal, regenerations), g)), in_axes=(None, 0, 0)))
        self._thread = threading.Thread(target=self._run, name="grpo-actor", daemon=True)

    # -- called from the learner thread --

    def start(self) -> None:
        self._thread.start()

    def push_weights(self, state, version: int) -> None:
        with self._cond:
            self._pending = (state, version)
            if self.lockstep is not None:  # adopted at the version all processes agree on, which may lag this
                self._pushed[version] = state
            self._cond.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def metrics(self, groups: list[Group]) -> dict:
        """For a learner step's groups: the spread of weight versions inside each group (newest minus oldest
        token version; > 0 only with in-flight updates), and the generator's throughput so far (tokens/s while
        generating, per actor device) with, for the engine, its slot occupancy and prefill sharing."""
        seconds = max(self.generate_seconds, 1e-9)
        out = {"actor/tokens_per_s_per_device": self.generated_tokens / seconds / self.num_devices}
        spreads = [max(int(v.max()) for v in grp.token_versions if len(v)) - grp.weight_version
                   for grp in groups if grp.token_versions is not None]
        if spreads:
            out.update({"rollout/version_spread_mean": float(np.mean(spreads)),
                        "rollout/version_spread_max": int(np.max(spreads))})
        if self.streaming or self.episodic:
            out.update(self.sampler.metrics())
        if self.episodic:
            out.update(episode_metrics(groups))
            out.update({f"env/failed_{reason}": self.env_failures[reason] for reason in ENV_FAILURES})
        return out

    # -- the thread --

    def _adopt_pending_weights(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        state, version = pending
        if self.episodic:  # used from the next device program, with episodes in flight (tokens record versions)
            self.sampler.update_params(state, version)
            self._version = version
        elif self.streaming:  # with inflight_updates off the engine holds them back until its slots drain
            self.sampler.update_params(state, version)
            self._version = self.sampler.version
        else:
            self.sampler.update_params(state)
            self._version = version

    def _wait_for_newer_weights(self) -> None:
        with self._cond:
            if self._pending is None and not self._stop.is_set():
                self._cond.wait(timeout=0.5)

    def _run(self) -> None:
        try:
            if self.lockstep is not None:
                while self._lockstep_round():
                    pass
                return
            while not self._stop.is_set():
                self._adopt_pending_weights()
                self._run_side_jobs()
                if self.streaming:
                    self._stream_one_chunk()
                    continue
                prompts = self._admit()
                if not prompts:
                    self._wait_for_newer_weights()
                    continue
                self._process(prompts)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the learner, not vanish
            self.error = e
            if not isinstance(e, UserError):  # a user's problem reaches the learner as its one line, no traceback
                logger.exception("actor thread failed")
            self.buffer.close(error=e)

    # -- an actor across hosts: lockstep rounds (see the module docstring) --

    def _lockstep_round(self) -> bool:
        """One round; False when the actor threads stop (on every process together)."""
        with self._cond:
            newest = max(self._pushed, default=-1)
        agreed = self.lockstep.gather([self._stop.is_set(), newest])
        if agreed[:, 0].any():
            return False
        self._adopt_agreed_weights(int(agreed[:, 1].max()))
        prompts = self._keep_good(self._admit())
        if len(prompts) > self._rows:  # requeued prompts can outnumber a handout: the rest wait a round
            self._requeue_back(prompts[self._rows:])
            self.buffer.release(len(prompts) - self._rows)
            prompts = prompts[:self._rows]
        longest = max((len(p.record["prompt_ids"]) for p in prompts), default=0)
        counts = self.lockstep.gather([len(prompts), longest])
        if not counts[:, 0].any():
            self._wait_for_newer_weights()
            return True
        self._generate_across_hosts(prompts, counts[:, 0].tolist(), int(counts[:, 1].max()))
        return True

    def _adopt_agreed_weights(self, version: int) -> None:
        """Adopt `version` (the newest any process has been pushed) once this process has it too."""
        if version <= self._version:
            return
        timeout = self.limits.group_timeout_s
        with self._cond:
            # This process's learner finished the same collective sync step; its push follows shortly.
            if not self._cond.wait_for(lambda: version in self._pushed, timeout=timeout):
                raise RuntimeError(f"another process's actor adopted weight version {version}, which this process's "
                                   f"learner did not hand over within trainer.group_timeout_s={timeout}s")
            state = self._pushed[version]
            self._pushed = {v: s for v, s in self._pushed.items() if v > version}
            self._pending = None
        self.sampler.update_params(state)
        self._version = version

    def _generate_across_hosts(self, prompts: list[Prompt], counts: list[int], longest: int) -> None:
        """Generate every process's prompts as one batch and finish this process's groups. Each process sends
        a fixed-size row: per prompt its length, tokens (padded to `longest`) and its G keys."""
        g = self.grpo.group_size
        width = 1 + longest + 2 * g
        mine = np.zeros((self._rows, width), np.int32)
        keys = self._sample_keys(prompts).reshape(len(prompts), 2 * g).view(np.int32) if prompts else None
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt.record["prompt_ids"], np.int32)
            mine[i, 0], mine[i, 1:1 + len(ids)], mine[i, 1 + longest:] = len(ids), ids, keys[i]
        rows = self.lockstep.gather(mine.reshape(-1)).reshape(len(counts), self._rows, width)
        every = [row for p, n in enumerate(counts) for row in rows[p, :n]]
        prompt_ids = [list(map(int, row[1:1 + row[0]])) for row in every for _ in range(g)]
        all_keys = np.stack([row[1 + longest:] for row in every]).view(np.uint32).reshape(-1, 2)
        version = self._version
        start = time.perf_counter()
        result = self.sampler.generate(prompt_ids, all_keys)
        self.generate_seconds += time.perf_counter() - start
        if self._stop.is_set() or not prompts:
            return  # abandoned (the run's end accounts for them), or this round generated only other hosts' rows
        first = sum(counts[:jax.process_index()]) * g  # this process's rows
        self._finish_static(prompts, result, version, first)

    def _admit(self) -> list[Prompt]:
        """Prompts to generate now, each with a buffer slot reserved at the current weight version: those sent
        back to be generated again first, else a new handout. [] when none may start."""
        prompts = self.collector.take_requeued()
        if not prompts and self.collector.exhausted:
            # No new prompts: the learner trains a short last step once the groups still reserved (in the engine,
            # or generated again) have arrived. Stay, to finish those and to generate again any group that grows
            # too stale before it is trained (a prompt, not a run_ended drop).
            self.buffer.finish()
            return []
        room = self.buffer.admissible(self._version, self.limits.max_steps)
        if room == 0:
            # Either every remaining step is covered, or more would break the staleness bound until the
            # learner moves on; both clear when new weights arrive.
            self._requeue_back(prompts)
            return []
        if prompts:
            self._requeue_back(prompts[room:])
            prompts = prompts[:room]
            self.buffer.reserve(len(prompts), self._version)
            return prompts
        size = min(room, self.collector.handout_size)
        self.buffer.reserve(size, self._version)
        prompts = self.collector.handout(size)
        if size > len(prompts):
            self.buffer.release(size - len(prompts))
            if not prompts:
                self.buffer.finish()  # the data ran out just now (see above)
        return prompts

    def _stream_one_chunk(self) -> None:
        """Streaming (the engine): top up the engine's queue with admitted prompts while it could not fill its
        free slots (plus one group) at the next chunk boundary, decode one chunk, and finish every group whose
        samples have all ended."""
        engine = self.sampler
        if engine.waiting_samples < engine.free_slots + self.grpo.group_size:
            prompts = self._keep_good(self._admit())
            if prompts:
                for prompt, keys in zip(prompts, self._sample_keys(prompts)):
                    engine.submit(prompt.record["prompt_ids"], keys, tag=prompt)
        if not engine.busy:
            self._wait_for_newer_weights()
            return
        start = time.perf_counter()
        results = engine.step()
        self.generate_seconds += time.perf_counter() - start
        self._version = engine.version  # held-back weights are adopted once the slots have drained
        if self._stop.is_set():
            return  # abandoned: the prompts in flight stay unfinished and the run's end accounts for them
        if results:
            self._finish([r.tag for r in results], results)

    # -- side jobs: work other than training groups that must run on the actor's devices (evaluation) --

    def submit_side_job(self, job: Callable[[int], None], min_version: int = 0) -> None:
        """Queue job(weight_version) to run on the actor thread between two generation calls, once the actor
        holds weights of at least `min_version` (any pushed before the call are adopted first; weights the
        engine holds back until its slots drain arrive then), so it shares the actor's devices without racing
        its sampler. Thread-safe; jobs run in the order submitted, a job waiting for its weights holding back
        those after it. The actor generates nothing while a job runs; the learner goes on with the groups
        already buffered. A job that raises fails the actor like any other error. Jobs still queued when the
        actor stops are not run: a job that must finish is waited for before stop()."""
        with self._cond:
            self._side_jobs.append((int(min_version), job))
            self._cond.notify_all()

    def _run_side_jobs(self) -> None:
        while not self._stop.is_set():
            self._adopt_pending_weights()  # a job queued behind another may ask for weights pushed meanwhile
            with self._cond:
                if not self._side_jobs or self._side_jobs[0][0] > self._version:
                    return
                _, job = self._side_jobs.popleft()
            job(self._version)

    def _drop_bad_row(self, prompt: Prompt) -> None:
        """Drop a row the data path marked bad, with its reason in the ledger; the first BAD_ROWS_LOGGED and
        then every BAD_ROWS_LOG_EVERY-th are logged (a dataset of bad rows must not flood the log)."""
        detail = f"{prompt.bad_row}: {prompt.record.get('detail', '')}"
        where = f"epoch {prompt.epoch}, dataset_index {prompt.dataset_index}"
        self.bad_rows += 1
        if self.first_bad_row is None:
            self.first_bad_row = f"{detail} ({where})"
        if self.bad_rows <= BAD_ROWS_LOGGED or self.bad_rows % BAD_ROWS_LOG_EVERY == 0:
            logger.warning("bad row dropped (%s): %s [%d so far; logged: the first %d, then every %d-th]", where,
                           detail, self.bad_rows, BAD_ROWS_LOGGED, BAD_ROWS_LOG_EVERY)
        self.collector.mark_dropped(prompt.ordinal, "bad_row", detail=detail)
        self.buffer.release(1)

    def _requeue_back(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            self.collector.requeue(prompt)

    def _keep_good(self, prompts: list[Prompt]) -> list[Prompt]:
        """The prompts to generate; rows the data path marked bad are dropped here."""
        good = []
        for prompt in prompts:
            if prompt.bad_row:
                self._drop_bad_row(prompt)
            else:
                good.append(prompt)
        return good

    def _sample_keys(self, prompts: list[Prompt]) -> np.ndarray:
        """[prompts, G, 2] raw key data: sample j of a prompt gets split(group_key(base, global ordinal,
        regenerations), G)[j] (with several processes the collector counts this process's own ordinals), so what
        a sample draws does not depend on where or when it is generated."""
        n, index = jax.process_count(), jax.process_index()
        out = [np.zeros((0, self.grpo.group_size, 2), np.uint32)]
        for start in range(0, len(prompts), self._rows):
            part = prompts[start:start + self._rows]
            ordinals = np.zeros(self._rows, np.uint32)
            regenerations = np.zeros(self._rows, np.uint32)
            ordinals[:len(part)] = [global_ordinal(p.ordinal, index, n) for p in part]
            regenerations[:len(part)] = [p.record.get("regenerations", 0) for p in part]
            out.append(np.asarray(self._keys(self.base_key, ordinals, regenerations))[:len(part)])
        return np.concatenate(out)

    def _group_advantages(self, rewards: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """group_advantages over [groups, G], in padded blocks of a handout (one compiled shape)."""
        advantages, zero_var = [], []
        for start in range(0, len(rewards), self._rows):
            r = np.zeros((self._rows, rewards.shape[1]), np.float32)
            v = np.zeros(r.shape, bool)
            n = len(rewards[start:start + self._rows])
            r[:n], v[:n] = rewards[start:start + n], valid[start:start + n]
            a, z = jax.device_get(self._advantages(r, v))
            advantages.append(a[:n])
            zero_var.append(z[:n])
        return np.concatenate(advantages), np.concatenate(zero_var)

    def _process(self, prompts: list[Prompt]) -> None:
        """Static: generate a handout as one batch, then finish its groups together."""
        good = self._keep_good(prompts)
        if not good:
            return
        if self.episodic:
            self._process_episodes(good)
            return
        g = self.grpo.group_size
        version = self._version
        keys = self._sample_keys(good).reshape(-1, 2)
        prompt_ids = [list(map(int, p.record["prompt_ids"])) for p in good for _ in range(g)]
        start = time.perf_counter()
        result = self.sampler.generate(prompt_ids, keys)
        self.generate_seconds += time.perf_counter() - start
        if self._stop.is_set():
            return  # abandoned: these prompts stay unfinished and the run's end accounts for them
        self._finish_static(good, result, version, 0)

    def _finish_static(self, prompts: list[Prompt], result, version: int, first: int) -> None:
        """Finish `prompts` from a static generate, whose rows first, first + 1, ... are theirs (G per prompt)."""
        g = self.grpo.group_size
        rows = [range(first + i * g, first + (i + 1) * g) for i in range(len(prompts))]
        self._finish(prompts, [GroupResult(
            tag=prompt, tokens=[result.tokens[j, :result.lengths[j]] for j in rows[i]],
            logprobs=[result.logprobs[j, :result.lengths[j]] for j in rows[i]],
            versions=[np.full(result.lengths[j], version, np.int32) for j in rows[i]],
            finish_reasons=[result.finish_reasons[j] for j in rows[i]]) for i, prompt in enumerate(prompts)])

    def _finish(self, prompts: list[Prompt], results: list[GroupResult]) -> None:
        """Score finished groups and put each into the buffer, or drop it with its reason (grouping.verdict). Stops
        the run when the rewards keep failing (see _stop_if_rewards_keep_failing)."""
        g = self.grpo.group_size
        lengths = [len(t) for r in results for t in r.tokens]
        self.generated_tokens += sum(lengths)
        texts = [self.tokenizer.decode(t) for r in results for t in r.tokens]
        records = [p.record["row"] for p in prompts for _ in range(g)]
        scored = self.rewards.score(records, texts, lengths)
        self.failed_samples += scored.num_failed
        self._log_reward_errors(scored)
        rewards = scored.rewards.reshape(len(prompts), g)
        valid = ~scored.failed.reshape(len(prompts), g)
        advantages, _ = self._group_advantages(rewards, valid)
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            judged = Judged(valid=valid[i], rewards=rewards[i], advantages=advantages[i],
                            failure_detail=self._reward_error_detail(scored, slice(i * g, (i + 1) * g)),
                            overlong=np.array([reason == "length" for reason in result.finish_reasons]))
            outcome = self._settle(prompt, judged)
            if outcome is None:
                continue
            group = Group(
                ordinal=prompt.ordinal, prompt=prompt.record,
                completions=[np.asarray(t, np.int32) for t in result.tokens],
                behaviour_logprobs=[np.asarray(lp, np.float32) for lp in result.logprobs],
                rewards=rewards[i].astype(np.float32), weight_version=result.oldest_version,
                regenerations=int(prompt.record.get("regenerations", 0)), advantages=outcome.advantages,
                valid=valid[i], zero_variance=outcome.zero_variance, token_versions=result.versions,
                routing=result.routing)
            self.collector.mark_finished(prompt.ordinal)
            self.buffer.put(group)
        self._stop_if_rewards_keep_failing()

    def _settle(self, prompt: Prompt, judged: Judged) -> Keep | None:
        """grouping.verdict on one finished group: a drop goes to the ledger (and the reward-error streak) here, and
        None is returned; a group to train comes back as its Keep."""
        outcome = verdict(judged, filter_zero_variance=self.grpo.filter_zero_variance,
                          custom_advantage=self.custom_advantage,
                          custom_advantage_name=self.sampler.config.advantage if self.custom_advantage else "")
        self._count_reward_errors(isinstance(outcome, Drop) and outcome.scoring_failed,
                                  outcome.detail if isinstance(outcome, Drop) else None)
        if isinstance(outcome, Drop):
            self.collector.mark_dropped(prompt.ordinal, outcome.reason, detail=outcome.detail)
            self.buffer.release(1)
            return None
        return outcome

    # -- episodes of an environment --

    def _process_episodes(self, prompts: list[Prompt]) -> None:
        """G episodes per prompt, as many prompts at once as the runner has rows for; new weights are adopted
        between device programs (each token records its version)."""
        g = self.grpo.group_size
        per_batch = max(self.sampler.engine.rows // g, 1)
        for start in range(0, len(prompts), per_batch):
            part = prompts[start:start + per_batch]
            keys = self._sample_keys(part).reshape(-1, 2)
            rows = [p.record["row"] for p in part for _ in range(g)]
            # One seed per prompt, from its first sample's key (the same on a regeneration): the G episodes of a
            # group face the same task instance (an environment's hidden state comes from the seed), so that
            # group-relative advantages compare answers to the same question. env.shared_seed=false: each
            # episode's own key.
            first = [i - i % g if self.sampler.config.shared_seed else i for i in range(len(keys))]
            seeds = [int(keys[j][0]) << 32 | int(keys[j][1]) for j in first]
            began = time.perf_counter()
            results = self.sampler.run(rows, seeds, keys, between_calls=self._adopt_pending_weights,
                                       stopped=self._stop.is_set)
            self.generate_seconds += time.perf_counter() - began
            if results is None or self._stop.is_set():
                return  # abandoned: these prompts (and the rest) stay unfinished, for the resume
            self._finish_episodes(part, results)

    def _finish_episodes(self, prompts: list[Prompt], results: list[EpisodeResult]) -> None:
        """Put each prompt's G episodes into the buffer as one group, or drop it (grouping.verdict): fewer than 2
        episodes that did not fail (the commonest failure is the reason), env.advantage failing on it, then the
        advantages it would train with (env.advantage's when set): advantages that do not fit float32, zero
        variance (every advantage 0)."""
        g = self.grpo.group_size
        episodes = [results[i * g:(i + 1) * g] for i in range(len(prompts))]
        valid = np.array([[e.failure is None for e in eps] for eps in episodes])
        rewards = np.array([[e.reward if e.failure is None else 0.0 for e in eps] for eps in episodes], np.float32)
        advantages, _ = self._group_advantages(rewards, valid)
        for i, (prompt, eps) in enumerate(zip(prompts, episodes)):
            self.generated_tokens += sum(sum(sum(s.loss_mask) for s in e.trajectory.segments)
                                         for e in eps if e.trajectory is not None)
            failed = [e for e in eps if e.failure is not None]
            for e in failed:
                if not self.env_failures[e.failure]:  # a kept group's failures reach no ledger line: say the first
                    logger.warning("an episode failed (%s): %s; later ones are counted in env/failed_%s",
                                   e.failure, e.detail, e.failure)
                self.env_failures[e.failure] += 1
            steps = step_rewards(eps, self.sampler.config.max_turns)
            judged = Judged(valid=valid[i], rewards=rewards[i], advantages=advantages[i], step_rewards=steps)
            if failed:
                judged = dataclasses.replace(
                    judged, failure=collections.Counter(e.failure for e in failed).most_common(1)[0][0],
                    failure_detail=one_line(f"{len(failed)} of {g} episodes failed; first: {failed[0].failure}: "
                                            f"{failed[0].detail}"))
            outcome = self._settle(prompt, judged)
            if outcome is None:
                continue
            self.collector.mark_finished(prompt.ordinal)
            self.buffer.put(episode_group(prompt, eps, rewards[i], outcome.advantages, valid[i],
                                          outcome.zero_variance, steps))
        self._stop_if_rewards_keep_failing()

    # -- rewards that fail --

    def _log_reward_errors(self, scored) -> None:
        """Log a score() call's failures: those of the first REWARD_ERRORS_LOGGED calls with failures, then of every
        REWARD_ERRORS_LOG_EVERY-th (a reward that always fails must not flood the log; the metrics carry each
        reward's failure rate, and the ledger each drop's detail)."""
        if not scored.errors:
            return
        self.reward_error_calls += 1
        n = self.reward_error_calls
        if n <= REWARD_ERRORS_LOGGED or n % REWARD_ERRORS_LOG_EVERY == 0:
            for error in scored.errors[:3]:
                logger.warning("reward: %s [%d scoring calls with failures so far; logged: the first %d, then every "
                               "%d-th]", error, n, REWARD_ERRORS_LOGGED, REWARD_ERRORS_LOG_EVERY)

    @staticmethod
    def _reward_error_detail(scored, rows: slice) -> str:
        """Which reward functions failed samples of these rows, and how (the ledger's detail for the drop)."""
        failing = [label for label, values in scored.per_function.items() if not np.isfinite(values[rows]).all()]
        return one_line("; ".join(f"{label}: {scored.function_errors.get(label, 'failed')}" for label in failing))

    def _count_reward_errors(self, dropped_for_rewards: bool, detail: str | None) -> None:
        """Count the groups in a row dropped as reward_error; any other outcome means the rewards work."""
        if dropped_for_rewards:
            self.reward_error_streak += 1
            self.last_reward_error = detail
        else:
            self.reward_error_streak = 0

    def _stop_if_rewards_keep_failing(self) -> None:
        """Once trainer.reward_error_handouts handouts' worth of groups in a row were all dropped as reward_error, no
        reward works well enough to train anything (a bug in the reward, a verifier that is down): stop the run with
        one line naming the reward and its last error, instead of dropping the whole dataset epoch after epoch. The
        error reaches the learner through the buffer, as an actor failure does; the thread then ends."""
        handouts = self.limits.reward_error_handouts
        if not handouts or self.reward_error_streak < handouts * self._rows:
            return
        self.error = TrainerError(
            f"stopped: none of the last {self.reward_error_streak} prompts could be trained, because "
            + ("the environment failed their episodes (a group needs 2 episodes that did not fail), or env.advantage "
               "failed on them" if self.episodic
               else "the rewards failed on their samples (a group needs 2 scored samples)")
            + f"; last error: {self.last_reward_error}; fix the "
            + ("environment" if self.episodic else "reward")
            + " (each drop's detail in events.jsonl says how it failed), or "
            f"raise trainer.reward_error_handouts (now {handouts} handouts of {self._rows} prompts; 0: never stop "
            "for this)")
        self.buffer.close(error=self.error)
        self._stop.set()


def step_rewards(episodes: list[EpisodeResult], max_turns: int) -> np.ndarray:
    """[G, max_turns] float32: each episode's per-step rewards (StepResult.reward) in turn order, NaN where a step
    gave none or did not happen."""
    out = np.full((len(episodes), max(max_turns, *(len(e.step_rewards) for e in episodes))), np.nan, np.float32)
    for j, episode in enumerate(episodes):
        out[j, :len(episode.step_rewards)] = episode.step_rewards
    return out


def episode_group(prompt: Prompt, episodes: list[EpisodeResult], rewards: np.ndarray, advantages: np.ndarray,
                  valid: np.ndarray, zero_variance: bool, steps: np.ndarray) -> Group:
    """One prompt's G episodes as a Group of segments (replay_buffer's segment layout): each segment of an episode
    that did not fail is one learner sequence, its prompt the tokens before its first sampled one, its completion
    the rest with a mask of the sampled tokens. The group's weight version is its oldest sampled token's. steps:
    step_rewards, kept for the metrics."""
    prompts, completions, masks, logprobs, owner, versions = [], [], [], [], [], []
    for j, episode in enumerate(episodes):
        if episode.failure is not None:
            continue
        for segment in episode.trajectory.segments:
            mask = np.asarray(segment.loss_mask, np.int8)
            sampled = np.flatnonzero(mask)
            if not len(sampled):
                continue
            first, tokens = int(sampled[0]), np.asarray(segment.tokens, np.int32)
            prompts.append(tokens[:first])
            completions.append(tokens[first:])
            masks.append(mask[first:])
            logprobs.append(np.asarray(segment.behaviour_logprobs, np.float32)[first:])
            versions.append(np.asarray(segment.weight_versions, np.int32)[sampled])
            owner.append(j)
    names = sorted({name for e in episodes for name in e.reward_parts})
    parts = np.array([[e.reward_parts.get(name, np.nan) for name in names] for e in episodes], np.float32)
    stats = np.array([[e.turns, *(_trajectory_counts(e)), e.env_seconds] for e in episodes], np.float32)
    return Group(
        ordinal=prompt.ordinal, prompt=prompt.record, completions=completions, behaviour_logprobs=logprobs,
        rewards=rewards.astype(np.float32), weight_version=int(min(v.min() for v in versions)),
        regenerations=int(prompt.record.get("regenerations", 0)), advantages=advantages.astype(np.float32),
        valid=np.asarray(valid, bool), zero_variance=zero_variance, token_versions=versions,
        segments=Segments(prompts=prompts, masks=masks, trajectory=np.asarray(owner, np.int32)),
        episodes=EpisodeStats(stats=stats, reward_parts=parts, reward_part_names=names, step_rewards=steps))


EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "segments", "truncated", "env_seconds")  # episode_stats columns


def _trajectory_counts(episode: EpisodeResult) -> tuple[int, int, int, int]:
    t = episode.trajectory
    if t is None:
        return 0, 0, 0, 0
    return t.tool_calls, t.tool_errors, len(t.segments), int(t.truncated)


def episode_metrics(groups: list[Group]) -> dict:
    """A step's episodes (valid or failed, of the groups trained): per-episode means of EPISODE_STATS
    (env/turns, env/tool_calls, env/tool_errors, env/segments, env/truncated: the share cut off, env/latency_s:
    time in the environment's calls), each named reward part's mean (reward/part_<name>), and, when steps gave
    rewards, env/step_reward (their mean) and env/rewarded_steps (per episode)."""
    stats = [g.episodes.stats for g in groups if g.episodes is not None]
    if not stats:
        return {}
    stats = np.concatenate(stats)
    out = {f"env/{'latency_s' if name == 'env_seconds' else name}": float(stats[:, k].mean())
           for k, name in enumerate(EPISODE_STATS)}
    steps = [np.asarray(g.episodes.step_rewards).ravel() for g in groups if g.episodes is not None]
    steps = np.concatenate(steps) if steps else np.zeros(0)
    if np.isfinite(steps).any():
        out["env/step_reward"] = float(np.nanmean(steps))
        out["env/rewarded_steps"] = float(np.isfinite(steps).sum() / len(stats))
    for g in groups:
        for k, name in enumerate(g.episodes.reward_part_names if g.episodes is not None else ()):
            out.setdefault(f"reward/part_{name}", []).append(np.asarray(g.episodes.reward_parts)[:, k])
    return {k: float(np.nanmean(np.concatenate(v))) if isinstance(v, list) else v for k, v in out.items()}
