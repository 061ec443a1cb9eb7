"""The asynchronous GRPO trainer: `grpo-jax train CONFIG`.

Threads and data path:

    Grain iterator -> Collector (ordinals, snapshots) -> actor thread (sampler on the actor mesh,
    rewards, advantages) -> ReplayBuffer (finished groups + weight version) -> learner loop (main
    thread, learner mesh) -> new weights resharded onto the actor mesh.

The learner's weight version is the number of updates applied. A group generated with version v and
trained at step k (version k before the update) has staleness k - v <= grpo.max_staleness; the buffer's
admission rule keeps the actor from generating groups that could not be trained within the bound, and
a group that grows too stale anyway is generated again (never silently evicted). max_staleness 0 is
synchronous, on-policy GRPO through the same code.

Every prompt handed out ends in the ledger (RUN_DIR/events.jsonl) as trained or dropped with a reason.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.advantages import group_advantages
from grpo_jax.collector import Collector, Prompt
from grpo_jax.config import Config
from grpo_jax.config_io import save_config
from grpo_jax.data import make_data_iterator
from grpo_jax.learner import Learner, pack_batch
from grpo_jax.ledger import Ledger
from grpo_jax.metrics import MetricsWriter
from grpo_jax.model import Transformer, create_model
from grpo_jax.replay_buffer import Group, ReplayBuffer, ReplayBufferClosed, ReplayBufferTimeout
from grpo_jax.rewards import RewardSuite
from grpo_jax.sampler import Sampler
from grpo_jax.sharding import make_mesh, shard_module, state_shardings
from grpo_jax.tokenizer import Tokenizer

logger = logging.getLogger("grpo_jax.trainer")


class TrainerError(RuntimeError):
    """The run cannot go on (the actor died, no groups arrive); the message says what was waited for."""


# ------------------------------------------------------------------------------------------ set-up


def load_tokenizer(config: Config) -> Tokenizer:
    if config.tokenizer == "byte":
        return Tokenizer.byte_level()
    if config.tokenizer == "synthetic":
        from grpo_jax.tasks import SYNTHETIC_ALPHABET
        return Tokenizer.char_level(SYNTHETIC_ALPHABET)
    return Tokenizer.from_dir(config.tokenizer or config.model_path)


def load_policy(config: Config, tokenizer: Tokenizer) -> Transformer:
    if config.model_path:
        from grpo_jax.hf import load_hf_model
        model, _ = load_hf_model(config.model_path, dtype=config.model.dtype)
        return model
    if tokenizer.vocab_size > config.model.vocab_size:
        from grpo_jax.config_io import ConfigError
        raise ConfigError(f"model.vocab_size={config.model.vocab_size}: must be at least the tokenizer's "
                          f"vocabulary size {tokenizer.vocab_size} (tokenizer={config.tokenizer!r})")
    return create_model(config.model, seed=config.seed)


def split_devices(config: Config) -> tuple[list, list]:
    """(actor devices, learner devices): disjoint slices, or the same devices when actor_devices is 0."""
    devices = jax.devices()
    n = config.mesh.actor_devices
    if n == 0:
        return devices, devices
    if n >= len(devices):
        from grpo_jax.config_io import ConfigError
        raise ConfigError(f"mesh.actor_devices={n}: leaves no device for the learner ({len(devices)} devices; "
                          "use 0 to share all devices between actor and learner)")
    return devices[:n], devices[n:]


def group_key(seed: int, ordinal: int, regenerations: int) -> jax.Array:
    """A group's sampling key depends only on the run seed, its ordinal and its regeneration count, never
    on thread timing or on which other prompts share its batch."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), ordinal), regenerations)


def weights_copy(state, shardings):
    """The learner's weights placed on the actor's layout, as a separate copy: the learner donates its
    buffers to the next step, so the actor must never hold the same ones."""
    return jax.device_put(state, shardings, may_alias=False)


# ------------------------------------------------------------------------------------------ actor


class Actor:
    """Background thread: handouts -> G completions per prompt -> rewards -> groups into the buffer."""

    def __init__(self, config: Config, sampler: Sampler, tokenizer: Tokenizer, collector: Collector,
                 buffer: ReplayBuffer, rewards: RewardSuite, version: int = 0):
        self.config = config
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.collector = collector
        self.buffer = buffer
        self.rewards = rewards
        self._version = version
        self._pending: tuple[Any, int] | None = None  # (state, version) pushed by the learner
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.generated_tokens = 0
        self.generate_seconds = 0.0
        self.failed_samples = 0
        self._thread = threading.Thread(target=self._run, name="grpo-actor", daemon=True)

    # -- called from the learner thread --

    def start(self) -> None:
        self._thread.start()

    def push_weights(self, state, version: int) -> None:
        with self._cond:
            self._pending = (state, version)
            self._cond.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread --

    def _adopt_pending_weights(self) -> None:
        with self._cond:
            if self._pending is not None:
                state, self._version = self._pending
                self._pending = None
                self.sampler.update_params(state)

    def _wait_for_newer_weights(self) -> None:
        with self._cond:
            if self._pending is None and not self._stop.is_set():
                self._cond.wait(timeout=0.5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._adopt_pending_weights()
                prompts = self.collector.take_requeued()
                if not prompts and self.collector.exhausted:
                    break
                room = self.buffer.admissible(self._version, self.config.trainer.max_steps)
                if room == 0:
                    # Either every remaining step is covered, or more would break the staleness bound
                    # until the learner moves on; both clear when new weights arrive.
                    if prompts:
                        self._requeue_back(prompts)
                    self._wait_for_newer_weights()
                    continue
                if prompts:
                    self._requeue_back(prompts[room:])
                    prompts = prompts[:room]
                    self.buffer.reserve(len(prompts), self._version)
                else:
                    size = min(room, self.collector.handout_size)
                    self.buffer.reserve(size, self._version)
                    prompts = self.collector.handout(size)
                    if size > len(prompts):
                        self.buffer.release(size - len(prompts))
                self._process(prompts)
            if self.collector.exhausted and not self._stop.is_set():
                self.buffer.close()  # no more input: the learner trains what is left, then ends
        except BaseException as e:  # noqa: BLE001 - any failure must reach the learner, not vanish
            self.error = e
            logger.exception("actor thread failed")
            self.buffer.close(error=e)

    def _requeue_back(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            self.collector.requeue(prompt)

    def _process(self, prompts: list[Prompt]) -> None:
        good = []
        for prompt in prompts:
            if prompt.bad_row:
                self.collector.mark_dropped(prompt.ordinal, "bad_row")
                self.buffer.release(1)
            else:
                good.append(prompt)
        if not good:
            return
        cfg = self.config.grpo
        g = cfg.group_size
        version = self._version
        keys = jnp.stack([jax.random.split(group_key(self.config.seed, p.ordinal, p.record.get("regenerations", 0)), g)
                          for p in good]).reshape(-1)
        prompt_ids = [list(map(int, p.record["prompt_ids"])) for p in good for _ in range(g)]
        start = time.perf_counter()
        result = self.sampler.generate(prompt_ids, keys)
        self.generate_seconds += time.perf_counter() - start
        if self._stop.is_set():
            return  # abandoned: these prompts stay unfinished and the run's end accounts for them
        lengths = result.lengths
        self.generated_tokens += int(lengths.sum())
        texts = [self.tokenizer.decode(result.tokens[i, :lengths[i]]) for i in range(len(prompt_ids))]
        records = [p.record["row"] for p in good for _ in range(g)]
        scored = self.rewards.score(records, texts, [int(n) for n in lengths])
        self.failed_samples += scored.num_failed
        for error in scored.errors[:3]:
            logger.warning("reward: %s", error)
        rewards = scored.rewards.reshape(len(good), g)
        valid = ~scored.failed.reshape(len(good), g)
        overlong = np.array([r == "length" for r in result.finish_reasons]).reshape(len(good), g)
        advantages, zero_var = group_advantages(rewards, valid=valid, baseline=cfg.baseline,
                                                scale_by_std=cfg.scale_by_std)
        advantages, zero_var = np.asarray(advantages), np.asarray(zero_var)
        for i, prompt in enumerate(good):
            rows = slice(i * g, (i + 1) * g)
            reason = None
            if valid[i].sum() < 2:
                reason = "reward_error"
            elif overlong[i].all():
                reason = "overlong"
            elif cfg.filter_zero_variance and zero_var[i]:
                reason = "zero_variance"
            if reason:
                self.collector.mark_dropped(prompt.ordinal, reason)
                self.buffer.release(1)
                continue
            group = Group(
                ordinal=prompt.ordinal, prompt=prompt.record,
                completions=[result.tokens[j, :lengths[j]].astype(np.int32) for j in range(rows.start, rows.stop)],
                behaviour_logprobs=[result.logprobs[j, :lengths[j]].astype(np.float32)
                                    for j in range(rows.start, rows.stop)],
                rewards=rewards[i].astype(np.float32), weight_version=version,
                regenerations=int(prompt.record.get("regenerations", 0)),
                extras={"advantages": advantages[i].astype(np.float32), "valid": valid[i],
                        "zero_variance": bool(zero_var[i])})
            self.collector.mark_finished(prompt.ordinal)
            self.buffer.put(group)


# ------------------------------------------------------------------------------------------ trainer


def group_rows(groups: list[Group], group_size: int):
    """Flatten groups into learner rows: prompts, completions, behaviour log-probs, advantages."""
    prompts, completions, logprobs, advantages = [], [], [], []
    for group in groups:
        ids = [int(t) for t in group.prompt["prompt_ids"]]
        for j in range(group_size):
            prompts.append(ids)
            completions.append([int(t) for t in group.completions[j]])
            logprobs.append(np.asarray(group.behaviour_logprobs[j]))
            advantages.append(float(group.extras["advantages"][j]))
    return prompts, completions, logprobs, np.asarray(advantages, np.float32)


class Trainer:
    def __init__(self, config: Config, run_dir: str | pathlib.Path | None = None):
        self.config = config
        self.run_dir = pathlib.Path(run_dir or config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, self.run_dir / "config.yaml")
        self.tokenizer = load_tokenizer(config)
        actor_devices, learner_devices = split_devices(config)
        self.learner_mesh = make_mesh(config.mesh.learner, learner_devices)
        self.actor_mesh = make_mesh(config.mesh.actor, actor_devices)

        policy = shard_module(load_policy(config, self.tokenizer), self.learner_mesh)
        reference = None
        if config.loss.needs_reference:
            reference = shard_module(load_policy(config, self.tokenizer), self.learner_mesh)
        self.learner = Learner(policy, config.optim, config.loss, reference_model=reference)
        self.actor_shardings = state_shardings(self.learner.params, self.actor_mesh)
        actor_model = nnx.merge(self.learner.graphdef, weights_copy(self.learner.params, self.actor_shardings))
        self.sampler = Sampler(actor_model, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id,
                               config=config.sampler)
        self.version = 0

        # Each JAX process reads its own shard of the stream (one process here; several on a pod).
        self.iterator = make_data_iterator(config.data, self.tokenizer, shard_index=jax.process_index(),
                                           shard_count=jax.process_count())
        self.ledger = Ledger(self.run_dir)
        grpo = config.grpo
        self.collector = Collector(self.iterator, handout_size=grpo.prompts_per_step, ledger=self.ledger)
        capacity = config.trainer.buffer_capacity or grpo.prompts_per_step * (grpo.max_staleness + 2)
        self.buffer = ReplayBuffer(capacity, grpo.max_staleness, grpo.prompts_per_step)
        self.rewards = RewardSuite(config.rewards, timeout_s=config.trainer.reward_timeout_s)
        self.actor = Actor(config, self.sampler, self.tokenizer, self.collector, self.buffer, self.rewards)
        # One fixed learner shape for the run (no recompiles): no prompt can be longer than both limits,
        # since the data marks longer ones bad_row and the sampler refuses them.
        self.prompt_bucket = min(config.data.max_prompt_len, config.sampler.max_prompt_len)
        self.completion_bucket = config.sampler.max_new_tokens

    def _take_step_groups(self, step: int) -> list[Group]:
        """Block until a full step of groups is there (requeueing any that grew too stale)."""
        timeout = self.config.trainer.group_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                taken = self.buffer.take(self.config.grpo.prompts_per_step, self.version, timeout=max(remaining, 0.01))
            except ReplayBufferClosed as e:
                raise TrainerError(f"the actor thread failed, so step {step} cannot get its groups: "
                                   f"{e.__cause__!r}") from e.__cause__
            except ReplayBufferTimeout:
                counts = self.collector.counts()
                raise TrainerError(
                    f"no full step of {self.config.grpo.prompts_per_step} groups arrived within "
                    f"trainer.group_timeout_s={timeout}s for step {step} (buffer holds {len(self.buffer.ordinals())}, "
                    f"actor alive: {self.actor.is_alive()}, unfinished prompts: {counts['unfinished']}, "
                    f"trained: {counts['trained']}, dropped: {counts['dropped']})") from None
            for group in taken.too_stale:
                record = dict(group.prompt, regenerations=group.regenerations + 1)
                self.collector.requeue(Prompt(group.ordinal, record))
            if taken.groups and (len(taken.groups) == self.config.grpo.prompts_per_step or taken.drained):
                return taken.groups
            if taken.drained:
                return []

    def _sync_weights(self) -> dict:
        start = time.perf_counter()
        state = weights_copy(self.learner.params, self.actor_shardings)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        self.actor.push_weights(state, self.version)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        return {"sync/seconds": seconds, "sync/bytes": nbytes}

    def train(self) -> list[dict]:
        cfg = self.config
        writer = MetricsWriter(self.run_dir, cfg.trainer.max_steps, progress=cfg.trainer.progress,
                               tensorboard=cfg.trainer.tensorboard)
        history = []
        self.actor.start()
        start_time = time.perf_counter()
        last = start_time
        try:
            for step in range(self.version, cfg.trainer.max_steps):
                wait_start = time.perf_counter()
                groups = self._take_step_groups(step)
                if not groups:
                    logger.info("data exhausted after %d steps", step)
                    break
                wait_seconds = time.perf_counter() - wait_start
                metrics = self._learn(groups, step)
                now = time.perf_counter()
                metrics.update({"time/step_s": now - last, "time/wait_s": wait_seconds,
                                "time/elapsed_s": now - start_time})
                metrics["tokens_per_s"] = metrics.pop("_tokens") / max(now - last, 1e-9)
                last = now
                writer.write(metrics)
                history.append(metrics)
        finally:
            self.actor.stop()
            self._account_leftovers()
            writer.close()
            self.ledger.close()
        if self.actor.error is not None and not history:
            raise TrainerError(f"the actor thread failed: {self.actor.error!r}") from self.actor.error
        if history and cfg.trainer.save_final_model:
            # Hugging Face layout, so `grpo-jax generate --model RUN_DIR/final_model` and transformers load it.
            from grpo_jax.hf import save_hf_model
            save_hf_model(self.learner.model(), self.run_dir / "final_model", tokenizer=self.tokenizer)
        return history

    def _learn(self, groups: list[Group], step: int) -> dict:
        g = self.config.grpo.group_size
        prompts, completions, logprobs, advantages = group_rows(groups, g)
        full = self.config.grpo.prompts_per_step * g
        if len(prompts) < full:  # the last step of a finite dataset: pad with rows that train nothing
            missing = full - len(prompts)
            prompts += [prompts[0]] * missing
            completions += [[]] * missing
            logprobs += [np.zeros(0, np.float32)] * missing
            advantages = np.concatenate([advantages, np.zeros(missing, np.float32)])
        batch = pack_batch(prompts, completions, logprobs, advantages, self.tokenizer.pad_id,
                           self.prompt_bucket, self.completion_bucket)
        learn_start = time.perf_counter()
        metrics = self.learner.step(batch)
        learn_seconds = time.perf_counter() - learn_start
        self.version += 1
        ordinals = [grp.ordinal for grp in groups]
        versions = [grp.weight_version for grp in groups]
        self.collector.mark_trained(ordinals, step=self.version, weight_versions=versions)
        metrics.update(self._sync_weights())
        staleness = [step - v for v in versions]
        rewards = np.concatenate([grp.rewards[grp.extras["valid"]] for grp in groups])
        lengths = np.array([len(c) for grp in groups for c in grp.completions])
        kl = metrics.get("kl/mean", metrics.get("tis/mismatch_kl", 0.0))
        counts = self.collector.counts()
        metrics.update({
            "step": self.version, "reward/mean": float(rewards.mean()), "reward/max": float(rewards.max()),
            "reward/min": float(rewards.min()), "kl": float(kl),
            "staleness/mean": float(np.mean(staleness)), "staleness/max": int(np.max(staleness)),
            "staleness/values": staleness, "length/mean": float(lengths.mean()), "length/max": int(lengths.max()),
            "time/learner_s": learn_seconds, "zero_variance_groups": int(sum(grp.extras["zero_variance"] for grp in groups)),
            "frontier": counts["frontier"], "dropped": sum(counts["dropped"].values()),
            "actor/tokens_per_s": self.actor.generated_tokens / max(self.actor.generate_seconds, 1e-9),
            "_tokens": int(lengths.sum() + sum(len(grp.prompt["prompt_ids"]) for grp in groups) * g),
        })
        return metrics

    def _account_leftovers(self) -> None:
        """Prompts handed out but not trained when the run stops are dropped with reason run_ended, so the
        ledger of a finished run accounts for every ordinal it handed out."""
        for ordinal in self.collector.outstanding():
            self.collector.mark_dropped(ordinal, "run_ended")


def train(config: Config, run_dir: str | pathlib.Path | None = None) -> list[dict]:
    return Trainer(config, run_dir).train()
