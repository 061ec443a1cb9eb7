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

Checkpoints and resume (grpo_jax.checkpoint; ../shared/reference/frontier-restore.md is binding): every
checkpoint.every_steps steps and/or every_seconds, the learner saves, as one Orbax step, its parameters and
optimizer state, the replay buffer (taken first), then the collector state (frontier, the iterator snapshot
at or before the cut, exact accounting above it, ledger line covered). `train` on a run directory that
holds checkpoints resumes from the newest good one. SIGTERM/SIGINT finish or abandon the current step,
save, and exit with EXIT_PREEMPTED; a second signal exits at once.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.advantages import group_advantages
from grpo_jax.checkpoint import Checkpoints, Restored
from grpo_jax.collector import Collector, Prompt
from grpo_jax.config import Config
from grpo_jax.config_io import ConfigError, save_config
from grpo_jax.data import DataError, make_data_iterator
from grpo_jax.distributed import HostAgreement, by_process
from grpo_jax.errors import CheckpointError
from grpo_jax.learner import Learner, pack_batch
from grpo_jax.ledger import Ledger, global_ordinal, ledger_file
from grpo_jax.metrics import MetricsWriter
from grpo_jax.model import Transformer, create_model
from grpo_jax.replay_buffer import ArrayPool, Group, ReplayBuffer, ReplayBufferClosed, ReplayBufferTimeout
from grpo_jax.rewards import RewardSuite
from grpo_jax.sampler import Sampler
from grpo_jax.sharding import batch_sharding, make_mesh, shard_module, state_shardings
from grpo_jax.tokenizer import Tokenizer

logger = logging.getLogger("grpo_jax.trainer")

# `grpo-jax train` exits with this after a SIGTERM/SIGINT once its checkpoint is committed (EX_TEMPFAIL:
# "try again"; run the same command to resume). A second signal exits at once with 128 + the signal.
EXIT_PREEMPTED = 75


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
        raise ConfigError(f"model.vocab_size={config.model.vocab_size}: must be at least the tokenizer's "
                          f"vocabulary size {tokenizer.vocab_size} (tokenizer={config.tokenizer!r})")
    return create_model(config.model, seed=config.seed)


def split_devices(config: Config) -> tuple[list, list]:
    """(actor devices, learner devices): disjoint slices, or the same devices when actor_devices is 0.

    Several processes (hosts): every host is cut the same way. The actor gets the first actor_devices of
    each host's own devices and samples there on its own (one sampler per host, no cross-host traffic);
    the learner gets the rest of every host's devices, as one mesh spanning all hosts."""
    local = jax.local_devices()
    n = config.mesh.actor_devices
    if n >= len(local):
        raise ConfigError(f"mesh.actor_devices={n}: leaves no device for the learner ({len(local)} devices"
                          f"{' per process' if jax.process_count() > 1 else ''}; use 0 to share all devices "
                          "between actor and learner)")
    if n == 0:
        return local, jax.devices()
    return local[:n], [d for host in by_process(jax.devices()) for d in host[n:]]


def group_key(base_key: jax.Array, ordinal: int, regenerations: int) -> jax.Array:
    """A group's sampling key depends only on the run's base key, its ordinal and its regeneration count,
    never on thread timing or on which other prompts share its batch (so a resumed run draws the same)."""
    return jax.random.fold_in(jax.random.fold_in(base_key, ordinal), regenerations)


def weights_copy(state, shardings, replicate=None):
    """The learner's weights placed on the actor's layout, as a separate copy: the learner donates its
    buffers to the next step, so the actor must never hold the same ones.

    Several processes: `replicate` (jitted on the learner mesh) first gathers the full weights onto every
    learner device, then each host copies its local replica onto its own actor devices. (JAX cannot
    reshard between two device sets across processes; the gather needs one full copy of the parameters
    per learner device for a moment.)"""
    if replicate is None:
        return jax.device_put(state, shardings, may_alias=False)
    local_copy = jax.tree.map(lambda x: x.addressable_data(0), replicate(state))
    return jax.device_put(local_copy, shardings, may_alias=False)


def replica_digest(state) -> int:
    """A 31-bit hash of this host's whole copy of the weights, to compare across processes (HostAgreement
    carries int32)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return int.from_bytes(h.digest()[:4], "little") >> 1


def pack_process_state(own: dict, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """One process's collector + buffer state as bytes (an .npz: JSON bytes plus plain arrays; loading it
    with allow_pickle=False never runs code)."""
    out = io.BytesIO()
    np.savez(out, __json__=np.frombuffer(json.dumps(own).encode("utf-8"), np.uint8), **arrays)
    return np.frombuffer(out.getvalue(), np.uint8)


def unpack_process_state(data: np.ndarray) -> tuple[dict, dict[str, np.ndarray]]:
    try:
        with np.load(io.BytesIO(data.tobytes()), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        own = json.loads(arrays.pop("__json__").tobytes().decode("utf-8"))
    except (ValueError, OSError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"this process's saved collector/buffer state is unreadable: {e}") from e
    return own, arrays


# ------------------------------------------------------------------------------------------ actor


class Actor:
    """Background thread: handouts -> G completions per prompt -> rewards -> groups into the buffer."""

    def __init__(self, config: Config, sampler: Sampler, tokenizer: Tokenizer, collector: Collector,
                 buffer: ReplayBuffer, rewards: RewardSuite, base_key: jax.Array, version: int = 0):
        self.config = config
        self.base_key = base_key
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
        # Keys from the global ordinal (with several processes the collector counts this process's own).
        n, index = jax.process_count(), jax.process_index()
        keys = jnp.stack([jax.random.split(group_key(self.base_key, global_ordinal(p.ordinal, index, n),
                                                     p.record.get("regenerations", 0)), g)
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


class StopSignals:
    """SIGTERM/SIGINT handling for a preemptible run: the first signal asks the learner to stop after the
    current step (and save); a second exits the process at once. Only the main thread can install signal
    handlers; elsewhere (a trainer run from a worker thread) this does nothing and stop() still works."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            # Nothing more is written; the last committed checkpoint is where a resume starts.
            os.write(2, f"grpo-jax: second {signal.Signals(signum).name}: exiting at once\n".encode())
            os._exit(128 + signum)
        self.received = signum
        logger.warning("received %s: finishing the current step, then saving a checkpoint and exiting "
                       "(send it again to exit at once)", signal.Signals(signum).name)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a preemption stop without a signal (tests, embedding code)."""
        self.received = signum


class Trainer:
    def __init__(self, config: Config, run_dir: str | pathlib.Path | None = None):
        self.config = config
        self.run_dir = pathlib.Path(run_dir or config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.processes, self.process_index = jax.process_count(), jax.process_index()
        if self.process_index == 0:
            save_config(config, self.run_dir / "config.yaml")
        self.tokenizer = load_tokenizer(config)
        if config.grpo.prompts_per_step % self.processes:
            raise ConfigError(f"grpo.prompts_per_step={config.grpo.prompts_per_step}: must divide evenly over the "
                              f"{self.processes} JAX processes (each trains its share of every step)")
        self.local_prompts = config.grpo.prompts_per_step // self.processes  # this process's groups per step
        actor_devices, learner_devices = split_devices(config)
        try:
            self.learner_mesh = make_mesh(config.mesh.learner, learner_devices)
            self.actor_mesh = make_mesh(config.mesh.actor, actor_devices)
        except ValueError as e:
            raise ConfigError(f"mesh: {e} (actor: {len(actor_devices)} device(s)"
                              f"{' on this host' if self.processes > 1 else ''}, learner: {len(learner_devices)})") from e
        if self.processes > 1:
            # Each process feeds its own rows of the batch, which is split over data x fsdp in process order.
            splits = self.learner_mesh.shape["data"] * self.learner_mesh.shape["fsdp"]
            rows = self.local_prompts * config.grpo.group_size
            if splits % self.processes or rows % (splits // self.processes):
                raise ConfigError(
                    f"mesh.learner: the batch is split {splits} ways (data x fsdp) over {self.processes} processes; "
                    f"each process's {rows} rows (prompts_per_step / processes x group_size) must split evenly "
                    "over its share of those devices")

        policy = shard_module(load_policy(config, self.tokenizer), self.learner_mesh)
        reference = None
        if config.loss.needs_reference:
            reference = shard_module(load_policy(config, self.tokenizer), self.learner_mesh)
        self.learner = Learner(policy, config.optim, config.loss, reference_model=reference)
        self.replicated = jax.sharding.NamedSharding(self.learner_mesh, jax.sharding.PartitionSpec())
        self.learner.opt_state = jax.tree.map(self._committed, self.learner.opt_state)
        self.agreement = HostAgreement(learner_devices)
        self._replicate = None
        if self.processes > 1:
            self._replicate = jax.jit(lambda tree: tree, out_shardings=self.replicated)
        self.base_key = jax.random.key(config.seed)
        self.version = 0

        # Each JAX process reads its own shard of the stream (one process here; several on a pod).
        self.iterator = make_data_iterator(config.data, self.tokenizer, shard_index=self.process_index,
                                           shard_count=self.processes)
        grpo = config.grpo
        self.buffer_capacity = config.trainer.buffer_capacity or self.local_prompts * (grpo.max_staleness + 2)
        self.checkpoints = Checkpoints(self.run_dir, config.checkpoint)
        self.resumed_from: int | None = None
        restored = self.checkpoints.load_latest(self._abstract_state, self._check_resumable)
        self.preempted = False
        self.already_done = restored is not None and restored.step >= config.trainer.max_steps
        if self.already_done:
            # Nothing to train: leave the ledger (and the finished run's audit) exactly as it is.
            self.version = self.resumed_from = restored.step
            self.checkpoints.close()
            return
        if restored is None:
            self._start_fresh()
        else:
            self._resume(restored)

        self.actor_shardings = state_shardings(self.learner.params, self.actor_mesh)
        actor_model = nnx.merge(self.learner.graphdef, weights_copy(self.learner.params, self.actor_shardings,
                                                                    self._replicate))
        self.sampler = Sampler(actor_model, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id,
                               config=config.sampler)
        self.rewards = RewardSuite(config.rewards, timeout_s=config.trainer.reward_timeout_s)
        self.actor = Actor(config, self.sampler, self.tokenizer, self.collector, self.buffer, self.rewards,
                           self.base_key, version=self.version)
        # One fixed learner shape for the run (no recompiles): no prompt can be longer than both limits,
        # since the data marks longer ones bad_row and the sampler refuses them.
        self.prompt_bucket = min(config.data.max_prompt_len, config.sampler.max_prompt_len)
        self.completion_bucket = config.sampler.max_new_tokens
        self.stop_signals = StopSignals()
        self._frontier_of_save: dict[int, tuple[int, dict | None]] = {}

    # -- start and resume ----------------------------------------------------------------------------

    def _new_buffer(self, learner_version: int) -> ReplayBuffer:
        grpo = self.config.grpo
        return ReplayBuffer(self.buffer_capacity, grpo.max_staleness, self.local_prompts,
                            learner_version=learner_version)

    def _new_collector(self, ledger: Ledger) -> Collector:
        return Collector(self.iterator, handout_size=self.local_prompts,
                         snapshot_ring=self.config.checkpoint.snapshot_ring, ledger=ledger)

    def _new_ledger(self, resumed_from: dict | None = None) -> Ledger:
        return Ledger(self.run_dir, resumed_from=resumed_from, process_index=self.process_index,
                      process_count=self.processes)

    def _committed(self, x):
        """A single-device leaf (optax's step count is made uncommitted, on one device) replicated on the
        learner mesh, so that it never clashes with the sharded parameters, across processes too."""
        if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
            return jax.device_put(np.asarray(x), self.replicated)
        return x

    def _start_fresh(self) -> None:
        if (self.run_dir / ledger_file(self.process_index, self.processes)).exists():
            logger.warning("%s has a ledger but no usable checkpoint: starting from scratch; the ledger starts a "
                           "new chain and the audit counts only this start", self.run_dir)
        self.ledger = self._new_ledger()
        self.buffer = self._new_buffer(0)
        self.collector = self._new_collector(self.ledger)

    def _saved_state(self) -> dict:
        return {"params": self.learner.params, "opt_state": self.learner.opt_state,
                "rng": np.asarray(jax.random.key_data(self.base_key))}  # host copy: the same on every process

    def _abstract_state(self, meta: dict) -> Any:
        """Where restored arrays go: like the live ones, except that host and single-device leaves (the base
        key) become replicated on the learner mesh, so every process can read them."""
        def abstract(x):
            sharding = getattr(x, "sharding", None)
            if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
                sharding = self.replicated
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        state = jax.tree.map(abstract, self._saved_state())
        if "process_state_bytes" in meta:
            longest = max(meta["process_state_bytes"])
            state["processes"] = jax.ShapeDtypeStruct((len(meta["process_state_bytes"]), longest), np.uint8,
                                                      sharding=self.agreement.row_sharding)
        return state

    def _resume_facts(self) -> dict:
        """What a checkpoint records and a resume must match (besides the tensor layout)."""
        return {"data_fingerprint": self.iterator.fingerprint, "worker_count": self.config.data.worker_count,
                "process_count": self.processes, "group_size": self.config.grpo.group_size}

    def _check_resumable(self, meta: dict) -> None:
        """Refuse, with the reason, a checkpoint this config cannot resume exactly (see Checkpoints)."""
        facts, step = meta.get("facts", {}), meta["step"]
        where = f"checkpoint step {step} in {self.checkpoints.directory}"
        now = self._resume_facts()
        if facts.get("data_fingerprint") != now["data_fingerprint"] and not self.config.checkpoint.allow_data_change:
            raise CheckpointError(
                f"{where} was written for another dataset, tokenizer, prompt format or shuffle (data fingerprint "
                f"{facts.get('data_fingerprint')}, now {now['data_fingerprint']}). Resume with the original data "
                "config, start a new run directory, or set checkpoint.allow_data_change=true to keep the weights "
                "and optimizer and start a new data stream")
        if facts.get("data_fingerprint") == now["data_fingerprint"]:
            if facts.get("worker_count") != now["worker_count"]:
                raise CheckpointError(
                    f"{where} was written with data.worker_count={facts.get('worker_count')}, this config has "
                    f"{now['worker_count']}: Grain cannot restore its iterator under another worker count (set "
                    f"data.worker_count={facts.get('worker_count')})")
            if facts.get("process_count") != now["process_count"]:
                raise CheckpointError(
                    f"{where} was written by {facts.get('process_count')} JAX process(es), this run has "
                    f"{now['process_count']}: each process's data shard and iterator state would differ")
        if (self.config.checkpoint.load_replay_buffer and meta.get("buffered_groups")
                and facts.get("group_size") != now["group_size"]):
            raise CheckpointError(
                f"{where} holds groups of {facts.get('group_size')} completions, grpo.group_size is now "
                f"{now['group_size']}: set checkpoint.load_replay_buffer=false to generate them again")

    def _resume(self, restored: Restored) -> None:
        step, meta = restored.step, restored.meta
        state = restored.state
        self.learner.params, self.learner.opt_state = state["params"], state["opt_state"]
        # Placed like a fresh key (default device): keys derived from it go to the actor's jit.
        self.base_key = jax.random.wrap_key_data(np.asarray(state["rng"].addressable_data(0)))
        if "processes" in state:  # several processes: this process's collector and buffer are its row
            length = meta["process_state_bytes"][self.process_index]
            restored.collector, restored.buffer_arrays = unpack_process_state(
                np.asarray(state["processes"].addressable_data(0))[0, :length])
        self.learner.steps_done = int(meta["learner"]["steps_done"])
        self.learner.nonfinite_total = int(meta["learner"]["nonfinite_total"])
        self.version = step
        self.resumed_from = step
        saved_collector = restored.collector.get("collector", {})
        if meta["facts"]["data_fingerprint"] != self.iterator.fingerprint:
            logger.warning("resuming weights and optimizer from step %d with another dataset/tokenizer/prompt "
                           "format (checkpoint.allow_data_change): the data stream starts at ordinal 0 and the "
                           "ledger starts a new chain", step)
            self.ledger = self._new_ledger()
            self.buffer = self._new_buffer(step)
            self.collector = self._new_collector(self.ledger)
            return
        if "frontier_ordinal" not in saved_collector:
            self._resume_without_ordinals(step, saved_collector)
            return
        self.ledger = self._new_ledger(resumed_from={"step": step, **saved_collector["ledger_covers"]})
        if self.config.checkpoint.load_replay_buffer:
            grpo = self.config.grpo
            self.buffer = ReplayBuffer.from_state(
                restored.collector["buffer"], self.buffer_capacity, grpo.max_staleness, self.local_prompts,
                pool=ArrayPool(restored.buffer_arrays), learner_version=step)
        else:
            self.buffer = self._new_buffer(step)
        try:
            self.collector = Collector.restore(
                self.iterator, saved_collector, self.buffer.ordinals(), handout_size=self.local_prompts,
                snapshot_ring=self.config.checkpoint.snapshot_ring, ledger=self.ledger)
        except DataError as e:
            raise CheckpointError(f"checkpoint step {step}: {e}") from e
        where = (self.process_index, self.processes)  # ordinals in the log are global, as in the ledger
        logger.info("resumed from checkpoint step %d: frontier ordinal %d, %d group(s) restored into the buffer, "
                    "the data stream goes back to ordinal %d", step, global_ordinal(self.collector.frontier, *where),
                    len(self.buffer), global_ordinal(saved_collector["resume_base_ordinal"], *where))

    def _resume_without_ordinals(self, step: int, saved_collector: dict) -> None:
        """A checkpoint from before ordinals (it holds only the iterator's live position): resume there,
        with the old lossy behaviour, and say what is lost."""
        in_flight = (self.config.grpo.max_staleness + 1) * self.config.grpo.prompts_per_step
        logger.warning(
            "checkpoint step %d has no ordinal data (an older format): the data stream resumes at the "
            "iterator's live position at save time, so the prompts that were being generated or waiting in "
            "the replay buffer then are lost (up to %d with this config) and cannot be counted; the ledger "
            "starts a new chain. Checkpoints written from now on are exact.", step, in_flight)
        try:
            self.iterator.set_state(saved_collector["iterator_state"]["json"])
        except (KeyError, TypeError, DataError) as e:
            raise CheckpointError(f"checkpoint step {step}: unusable iterator state in an older-format "
                                  f"collector record ({e})") from e
        self.ledger = self._new_ledger()
        self.buffer = self._new_buffer(step)
        self.collector = self._new_collector(self.ledger)

    # -- saving -------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Start an async save of the current state (step = weight version). The buffer's state is taken
        first, then the collector's (see Collector.checkpoint_state for why this order)."""
        pool = ArrayPool()
        buffer_state = self.buffer.to_state(pool)
        collector_state = self.collector.checkpoint_state(buffer_state["ordinals"])
        meta = {"facts": self._resume_facts(), "weight_version": self.version,
                "learner": {"steps_done": self.learner.steps_done, "nonfinite_total": self.learner.nonfinite_total},
                "frontier_ordinal": collector_state["frontier_ordinal"],
                # All processes' groups (meta is written by process 0 only), for the group-size check.
                "buffered_groups": int(self.agreement.gather([len(buffer_state["ordinals"])]).sum())}
        own = {"collector": collector_state, "buffer": buffer_state}
        state, arrays = self._saved_state(), pool.arrays()
        if self.processes > 1:
            # Orbax writes JSON from the primary process only: each process's collector and buffer go
            # into row p of one global array instead (an .npz of JSON bytes and the buffer's arrays).
            state["processes"], meta["process_state_bytes"] = self.agreement.rows(pack_process_state(own, arrays))
            own, arrays = {"per_process": True}, ArrayPool().arrays()
        self.checkpoints.save(self.version, state, arrays, own, meta)
        self._frontier_of_save[self.version] = (collector_state["frontier_ordinal"], collector_state["ledger_covers"])

    def _record_commits(self, steps: list[int]) -> None:
        """The ledger's checkpoint line, written once the step is committed on disk."""
        for step in steps:
            frontier, covers = self._frontier_of_save.pop(step)
            self.ledger.checkpoint(step, frontier, covers)

    # -- the loop -----------------------------------------------------------------------------------

    def _take_step_groups(self, step: int) -> list[Group] | None:
        """Block until a full step of groups is there (requeueing any that grew too stale). None: a stop
        signal came while waiting (the step is abandoned)."""
        timeout = self.config.trainer.group_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if self.stop_signals.received is not None and self.processes == 1:
                return None  # several processes agree on stopping at the step's end instead (_train_loop)
            try:
                # Short waits, so a stop signal is seen within half a second.
                taken = self.buffer.take(self.local_prompts, self.version,
                                         timeout=max(min(deadline - time.monotonic(), 0.5), 0.01))
            except ReplayBufferClosed as e:
                raise TrainerError(f"the actor thread failed, so step {step} cannot get its groups: "
                                   f"{e.__cause__!r}") from e.__cause__
            except ReplayBufferTimeout:
                if time.monotonic() < deadline:
                    continue
                counts = self.collector.counts()
                raise TrainerError(
                    f"no full step of {self.local_prompts} groups arrived within "
                    f"trainer.group_timeout_s={timeout}s for step {step} (buffer holds {len(self.buffer.ordinals())}, "
                    f"actor alive: {self.actor.is_alive()}, unfinished prompts: {counts['unfinished']}, "
                    f"trained: {counts['trained']}, dropped: {counts['dropped']})") from None
            for group in taken.too_stale:
                record = dict(group.prompt, regenerations=group.regenerations + 1)
                self.collector.requeue(Prompt(group.ordinal, record))
            if taken.groups and (len(taken.groups) == self.local_prompts or taken.drained):
                return taken.groups
            if taken.drained:
                return []

    def _sync_weights(self) -> dict:
        start = time.perf_counter()
        state = weights_copy(self.learner.params, self.actor_shardings, self._replicate)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        self.actor.push_weights(state, self.version)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        metrics = {"sync/seconds": seconds, "sync/bytes": nbytes}
        if self.processes > 1 and self.config.trainer.check_replicas:
            digests = self.agreement.gather([replica_digest(state)])[:, 0].tolist()
            metrics["replica_digests"] = digests
            if len(set(digests)) > 1:
                raise TrainerError(f"after step {self.version} the processes hold different parameters "
                                   f"(digests {digests})")
        return metrics

    def train(self) -> list[dict]:
        """Train to trainer.max_steps (or the end of the data). After a stop signal: save, set
        `preempted`, and return what was trained."""
        cfg = self.config
        if self.already_done:
            logger.warning("checkpoint step %d in %s already reaches trainer.max_steps=%d: nothing to train "
                           "(raise trainer.max_steps to go on)", self.version, self.run_dir, cfg.trainer.max_steps)
            return []
        writer = None
        if self.process_index == 0:  # one metrics file per run (it reports process 0's groups)
            writer = MetricsWriter(self.run_dir, cfg.trainer.max_steps, start_step=self.version,
                                   progress=cfg.trainer.progress, tensorboard=cfg.trainer.tensorboard)
        history = []
        completed = False
        with self.stop_signals:
            try:
                self.actor.start()
                history = self._train_loop(writer)
                completed = not self.preempted
                if self.preempted or (cfg.checkpoint.save_at_end and history):
                    if self.checkpoints.last_saved_step != self.version:
                        self.save_checkpoint()
                    self._record_commits(self.checkpoints.wait())
            finally:
                self.actor.stop()
                # Saves already started still commit and get their ledger line, even after an error.
                self._record_commits(self.checkpoints.wait())
                if completed:
                    self._account_leftovers()
                if writer is not None:
                    writer.close()
                self.ledger.close()
                self.checkpoints.close()
        if self.preempted:
            logger.warning("stopped by %s after step %d; checkpoint step %d is committed: run the same command "
                           "to resume", signal.Signals(self.stop_signals.received).name, self.version, self.version)
        if self.actor.error is not None and not history:
            raise TrainerError(f"the actor thread failed: {self.actor.error!r}") from self.actor.error
        if completed and history and cfg.trainer.save_final_model and self.process_index == 0:
            # Hugging Face layout, so `grpo-jax generate --model RUN_DIR/final_model` and transformers load it.
            # From the actor's copy: it holds the final weights whole on this host, even across processes.
            from grpo_jax.hf import save_hf_model
            save_hf_model(nnx.merge(self.learner.graphdef, self.sampler.state), self.run_dir / "final_model",
                          tokenizer=self.tokenizer)
        return history

    def _train_loop(self, writer: MetricsWriter) -> list[dict]:
        cfg = self.config
        history = []
        start_time = time.perf_counter()
        last = start_time
        for step in range(self.version, cfg.trainer.max_steps):
            wait_start = time.perf_counter()
            groups = self._take_step_groups(step)
            if groups is None:
                self.preempted = True
                break  # stop signal while waiting (one process): abandon this step
            # Several processes: train while any still has groups (the others pad with empty rows).
            if not self.agreement.gather([len(groups)]).any():
                logger.info("data exhausted after %d steps", step)
                break
            wait_seconds = time.perf_counter() - wait_start
            metrics = self._learn(groups, step)
            self._record_commits(self.checkpoints.poll())
            save_seconds = 0.0
            # Every process must take the same decisions (a save is collective): agree on any's wish, and
            # act on the agreed values only; a signal that arrives after this gather counts at the next step.
            stop, due = self.agreement.gather([self.stop_signals.received is not None,
                                               self.checkpoints.due(self.version)]).any(axis=0)
            if stop and self.stop_signals.received is None:
                self.stop_signals.stop()  # another process was signalled: stop here with it
            self.preempted = bool(stop)
            if due and not stop:
                save_start = time.perf_counter()
                self.save_checkpoint()
                save_seconds = time.perf_counter() - save_start
            now = time.perf_counter()
            metrics.update({"time/step_s": now - last, "time/wait_s": wait_seconds,
                            "time/elapsed_s": now - start_time, "time/checkpoint_s": save_seconds})
            metrics["tokens_per_s"] = metrics.pop("_tokens") / max(now - last, 1e-9)
            last = now
            if writer is not None:
                writer.write(metrics)
            history.append(metrics)
            if stop:
                break
        return history

    def _learn(self, groups: list[Group], step: int) -> dict:
        g = self.config.grpo.group_size
        prompts, completions, logprobs, advantages = group_rows(groups, g)
        full = self.local_prompts * g
        if len(prompts) < full:  # the last step of a finite dataset: pad with rows that train nothing
            missing = full - len(prompts)
            prompts += [prompts[0] if prompts else [self.tokenizer.pad_id]] * missing
            completions += [[]] * missing
            logprobs += [np.zeros(0, np.float32)] * missing
            advantages = np.concatenate([advantages, np.zeros(missing, np.float32)])
        batch = pack_batch(prompts, completions, logprobs, advantages, self.tokenizer.pad_id,
                           self.prompt_bucket, self.completion_bucket)
        if self.processes > 1:  # this process's rows of the global batch
            sharding = batch_sharding(self.learner_mesh)
            batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)
        learn_start = time.perf_counter()
        metrics = self.learner.step(batch)
        learn_seconds = time.perf_counter() - learn_start
        self.version += 1
        ordinals = [grp.ordinal for grp in groups]
        versions = [grp.weight_version for grp in groups]
        self.collector.mark_trained(ordinals, step=self.version, weight_versions=versions)
        metrics.update(self._sync_weights())
        staleness = [step - v for v in versions] or [0]
        if groups:
            rewards = np.concatenate([grp.rewards[grp.extras["valid"]] for grp in groups])
            lengths = np.array([len(c) for grp in groups for c in grp.completions])
        else:  # several processes, the end of the data: this one only padded
            rewards, lengths = np.array([np.nan]), np.array([0])
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
