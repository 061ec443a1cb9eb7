"""The asynchronous GRPO trainer: `grpo-jax train CONFIG`.

Threads and data path:

    Grain iterator -> Collector (ordinals, snapshots) -> actor thread (grpo_jax.rollout.actor: sampler on the
    actor mesh, rewards, advantages) -> ReplayBuffer (finished groups + weight version) -> learner loop
    (main thread, learner mesh) -> new weights resharded onto the actor mesh.

The weight version is the number of learner steps done (each of optim.mini_batches x optim.epochs
updates). A group generated with version v and trained at step k (version k before the step) has
staleness k - v <= grpo.max_staleness; the buffer's
admission rule keeps the actor from generating groups that could not be trained within the bound, and
a group that grows too stale anyway is generated again (never silently evicted). max_staleness 0 is
synchronous, on-policy GRPO through the same code.

Every prompt handed out ends in the ledger (RUN_DIR/events.jsonl) as trained or dropped with a reason.

Checkpoints and resume (grpo_jax.state.checkpoint; ../shared/reference/frontier-restore.md is binding): every
checkpoint.every_steps steps and/or every_seconds, the learner saves, as one Orbax step, its parameters and
optimizer state, the replay buffer (taken first), then the collector state (frontier, the iterator snapshot
at or before the cut, exact accounting above it, ledger line covered). `train` on a run directory that
holds checkpoints resumes from the newest good one. SIGTERM/SIGINT finish or abandon the current step,
save, and exit with EXIT_PREEMPTED; a second signal exits at once.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from grpo_jax.algorithm.batch import (  # group_rows .. row_validity: also importable from here, as before
    Sequences,
    assemble,
    group_routing,  # noqa: F401
    group_rows,  # noqa: F401
    group_sequences,  # noqa: F401
    groups_trained,
    padding_metrics,
    row_validity,  # noqa: F401
    rows_needed,
    sequences_of,
)
from grpo_jax.algorithm.learner import Learner, TrainBatch
from grpo_jax.algorithm.lengths import length_quantiles
from grpo_jax.algorithm.rewards import RewardSuite
from grpo_jax.cleanup import run_all
from grpo_jax.config_io import ConfigError, config_to_dict, save_config
from grpo_jax.data.collector import Prompt
from grpo_jax.data.pipeline import make_data_iterator
from grpo_jax.data.tokenizer import Tokenizer, load_tokenizer
from grpo_jax.errors import RunDirError, TrainerError, UserError
from grpo_jax.model.lora import base_identity, init_adapters, save_peft_adapter
from grpo_jax.model.transformer import Transformer, create_model
from grpo_jax.parallel.distributed import HostAgreement
from grpo_jax.parallel.sharding import shard_module
from grpo_jax.rollout.actor import Actor, ActorLimits
from grpo_jax.rollout.engine import make_generator
from grpo_jax.rollout.episodes import make_episode_runner
from grpo_jax.rollout.weight_sync import WeightSync
from grpo_jax.run.config import Config
from grpo_jax.run.evaluation import EvalDuringTraining, Evaluator, held_out_records
from grpo_jax.run.metrics import MetricsWriter
from grpo_jax.run.plan import RunPlan
from grpo_jax.run.resume import (  # pack_process_state, unpack_process_state: also importable from here
    DataState,
    DataStateSpec,
    check_resumable,
    fresh_data_state,
    group_fits,
    pack_process_state,
    resume_facts,
    resumed_data_state,
    unpack_process_state,
)
from grpo_jax.run.signals import StopSignals
from grpo_jax.state.checkpoint import Checkpoints, Restored
from grpo_jax.state.ledger import Ledger, ledger_file
from grpo_jax.state.replay_buffer import (
    ArrayPool,
    Group,
    ReplayBufferClosed,
    ReplayBufferTimeout,
)
from grpo_jax.state.run_lock import RunDirLock

logger = logging.getLogger("grpo_jax.run.trainer")

# `grpo-jax train` exits with this after a SIGTERM/SIGINT once its checkpoint is committed (EX_TEMPFAIL:
# "try again"; run the same command to resume). A second signal exits at once with 128 + the signal.
EXIT_PREEMPTED = 75


# ------------------------------------------------------------------------------------------ set-up


def load_policy(config: Config, tokenizer: Tokenizer) -> Transformer:
    if config.model_path:
        # The architecture comes from the checkpoint's config.json; the model section only chooses how to run
        # it (RUN_SETTINGS). Master weights in model.param_dtype whatever the checkpoint holds: bfloat16
        # weights and AdamW moments would round most updates at a small lr to nothing.
        from grpo_jax.model.hf import RUN_SETTINGS, architecture_conflicts, checkpoint_config, load_hf_model
        conflicts = architecture_conflicts(config.model, checkpoint_config(config.model_path))
        if conflicts:
            raise ConfigError(f"model.{', model.'.join(conflicts)}: with model_path the architecture comes from "
                              f"{config.model_path}/config.json; remove these keys from the model section (only "
                              f"{', '.join('model.' + key for key in RUN_SETTINGS)} apply to a checkpoint)")
        model, _ = load_hf_model(config.model_path, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                                 remat=config.model.remat)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ConfigError(f"tokenizer={config.tokenizer!r}: {tokenizer.vocab_size} tokens, more than the "
                              f"vocab_size {model.config.vocab_size} of {config.model_path}/config.json")
        return model
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size}: must be at least the tokenizer's "
                          f"vocabulary size {tokenizer.vocab_size} (tokenizer={config.tokenizer!r})")
    return create_model(config.model, seed=config.seed)


def plan_run(config: Config) -> RunPlan:
    """This process's run description (run.plan.RunPlan): every host is cut the same way. The actor gets the
    first mesh.actor_devices of each host's own devices (all of them when 0, shared with the learner): one
    sampler per host when mesh.actor fits them, one actor mesh across all hosts' actor devices when it only fits
    those together. The learner gets the rest of every host's devices, as one mesh spanning all hosts."""
    plan = RunPlan.build(config, jax.devices(), this_host=jax.process_index())
    per_host = len(plan.cut.actor) // plan.processes, len(plan.cut.learner) // plan.processes
    if plan.actor_spans_hosts and jax.default_backend() == "cpu" and min(per_host) > 1:
        # Seen with 2 processes (2 actor + 2 learner devices each, or 2 + 3): both programs stop at their first
        # collective and never return. One side with one device per process runs (tests/test_multiprocess.py).
        raise ConfigError(
            f"mesh.actor_devices={config.mesh.actor_devices}: an actor mesh across hosts on the CPU backend needs one "
            f"device per process on the actor's or on the learner's side (here {per_host[0]} and {per_host[1]}): "
            "XLA's CPU client deadlocks when the actor's and the learner's programs, each over several devices "
            "of every process, run at once (a limit of the CPU client). Use mesh.actor_devices=1, or one learner "
            "device per process")
    if jax.default_backend() == "cpu" and plan.model.scan_layers is True and min(per_host) > 1:
        # Seen in one process with 8 devices shared: the step's while loop and the actor's program each stop at a
        # collective that 7 of 8 devices reached, and XLA aborts after 40 s.
        raise ConfigError(
            f"model.scan_layers=true: on the CPU backend the learner's layers can be scanned only when the actor or "
            f"the learner has one device per process (here {per_host[0]} and {per_host[1]}): XLA's CPU client "
            "starves its threads when a scanned step's collectives run beside the actor's. Use "
            "model.scan_layers=auto (a loop on CPU, scanned on TPU and GPU) or mesh.actor_devices=1")
    return plan


def weights_copy(state, shardings, sync: WeightSync, may_alias=False):
    """The learner's weights placed on the actor's layout, as a separate copy: the learner donates its
    buffers to the next step, so the actor must never hold the same ones (may_alias: weights that are
    never donated, the frozen LoRA base, may share the learner's buffers where both layouts agree).

    By resharding (weight_sync.WeightSync), never through a whole copy on any device: on several processes
    jitted programs on the learner mesh first give every host the blocks its actor devices need (a whole
    copy, for an actor per host) spread over its own learner devices, in the compute dtype when narrower
    than the weights' (which halves the bytes moved), a few groups of leaves at a time; then each host
    assembles every shard of its actor's layout on its actor devices from the slices of those that overlap it."""
    return sync(state, shardings, may_alias=may_alias)


def replica_digest(state) -> int:
    """A 31-bit hash of this host's whole copy of the weights, to compare across processes (HostAgreement
    carries int32)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return int.from_bytes(h.digest()[:4], "little") >> 1


# ------------------------------------------------------------------------------------------ trainer


def sample_lengths(group: Group) -> np.ndarray:
    """Per sample, the tokens the model sampled (the length/* metrics): a completion's length, or the sum of a
    trajectory's segment masks (environment tokens are not the model's)."""
    if not group.segmented:
        return np.array([len(c) for c in group.completions], np.int64)
    trajectory = np.asarray(group.segments.trajectory, np.int64).reshape(-1)
    sampled = np.array([np.sum(np.asarray(m, np.float32)) for m in group.segments.masks], np.int64)
    return np.bincount(trajectory, weights=sampled, minlength=len(group.rewards)).astype(np.int64)


def sequence_tokens(group: Group, group_size: int) -> int:
    """The tokens of the group's learner sequences (prompts, completions, environment tokens): the tokens_per_s
    count."""
    if not group.segmented:
        return int(sum(len(c) for c in group.completions) + len(group.prompt["prompt_ids"]) * group_size)
    return int(sum(len(p) + len(c) for p, c in zip(group.segments.prompts, group.completions)))


# The order close() releases what the trainer opened: the last checkpoint's save commits (and its ledger line is
# written) before the ledger closes; the lock goes last, so no other trainer starts on a run directory still in use.
CLOSE_ORDER = ("checkpoints", "ledger", "sampler", "iterator", "rewards", "eval_rewards", "run_lock")


class Trainer:
    def __init__(self, config: Config, run_dir: str | pathlib.Path | None = None):
        self._closers: dict[str, Callable[[], None]] = {}  # what _opened registered, by CLOSE_ORDER name
        try:
            self._start(config, run_dir)
        except BaseException as e:
            self.close(e)  # a refused start leaves no Grain worker, thread, open file or lock behind
            raise

    def _start(self, config: Config, run_dir: str | pathlib.Path | None) -> None:
        self.config = config
        self.run_dir = pathlib.Path(run_dir or config.run_dir)
        self.processes, self.process_index = jax.process_count(), jax.process_index()
        # Creates the run directory; refuses one that another `grpo-jax train` holds or that cannot be written.
        self.run_lock = RunDirLock(self.run_dir, self.process_index)
        self._opened("run_lock", self.run_lock.release)
        self.run_lock.acquire()
        if self.process_index == 0:
            for warning in config.warnings():
                logger.warning("config: %s", warning)
        self.tokenizer = load_tokenizer(config.tokenizer, config.model_path)
        self.plan = plan = plan_run(config)
        self.local_prompts = plan.local_prompts  # this process's groups per step
        self.learner_mesh, self.actor_mesh = plan.learner_mesh, plan.actor_mesh
        self.actor_spans_hosts = plan.actor_spans_hosts
        if plan.actor_spans_hosts:
            logger.info("actor: one mesh across %d hosts, %s over %d devices; every host's prompts sampled as one "
                        "batch", self.processes, dict(self.actor_mesh.shape), len(plan.cut.actor))

        policy = shard_module(load_policy(config, self.tokenizer), self.learner_mesh)
        reference, adapters = None, None
        if config.lora.enabled:
            # Only the adapters train; the frozen base is also the KL reference (no second copy of the weights).
            adapters = shard_module(init_adapters(policy.config, config.lora, config.seed), self.learner_mesh)
            self.base_identity = base_identity(config.model_path, policy.config, config.seed)
        elif config.loss.needs_reference:
            reference = shard_module(load_policy(config, self.tokenizer), self.learner_mesh)
        self.learner = Learner(policy, config.optim, config.loss, reference_model=reference, adapters=adapters,
                               dropout_seed=config.seed, **plan.learner_options())
        self.replicated = plan.replicated
        self.learner.opt_state = jax.tree.map(self._committed, self.learner.opt_state)
        self.agreement = HostAgreement(plan.cut.learner, timeout_s=config.trainer.collective_timeout())
        self._replicate = None  # the final model's export gathers one weight at a time (a sync never does)
        if self.processes > 1:
            self._replicate = jax.jit(lambda tree: tree, out_shardings=self.replicated)
        # The actor gets (and keeps) the weights in the compute dtype when it is narrower than param_dtype.
        self.weight_sync = plan.weight_sync()
        self.base_key = jax.random.key(config.seed)
        self.version = 0

        # Each JAX process reads its own shard of the stream (one process here; several on a pod).
        self.iterator = make_data_iterator(config.data, self.tokenizer, shard_index=self.process_index,
                                           shard_count=self.processes,
                                           sampler_max_prompt_len=config.sampler.max_prompt_len)
        self._opened("iterator", self.iterator.close)
        # Held-out prompts (process 0 evaluates), read now so that a bad eval source stops the start early.
        self.evaluation: EvalDuringTraining | None = None
        eval_records = None
        if config.eval.every_steps and self.process_index == 0:
            eval_records = held_out_records(config, self.tokenizer)
        grpo = config.grpo
        # One fixed learner shape for the run (no recompiles): the data marks prompts over either limit bad_row.
        self.prompt_bucket, self.completion_bucket = plan.prompt_bucket, plan.completion_bucket
        self.batch_layout = plan.batch_layout(self.process_index, self.tokenizer.pad_id)
        self.buffer_capacity = plan.buffer_capacity
        self.checkpoints = Checkpoints(self.run_dir, config.checkpoint)
        self._opened("checkpoints", self.checkpoints.close)
        self.run_lock.watch(self.checkpoints.directory)  # deleted under the run: _train_loop saves again and stops
        self.resumed_from: int | None = None
        restored = self.checkpoints.load_latest(self._abstract_state, self._check_resumable,
                                                open_own_state=self._open_own_state, agree=self.agreement.gather)
        self.preempted = False
        self.already_done = restored is not None and restored.step >= config.trainer.max_steps
        self.export_missing = False
        if self.already_done:
            # Nothing to train: leave the ledger (and the finished run's audit) exactly as it is.
            self.version = self.resumed_from = restored.step
            # A kill after the last checkpoint committed but before final_model/ was written: train() writes it
            # from the checkpoint's weights. (hf.save_hf_model writes config.json last.)
            missing = config.trainer.save_final_model and not (self.run_dir / "final_model" / "config.json").exists()
            self.export_missing = bool(self.agreement.gather([missing]).any())
            if self.export_missing:
                self.learner.params = restored.state["params"]
            else:
                self.close()
            return
        if restored is None:
            self._take_data_state(fresh_data_state(self._data_state_spec(), self.iterator, self._ledger_opened))
        else:
            self._resume(restored)
        if self.process_index == 0:  # only now: a start refused above leaves the run directory as it was
            save_config(config, self.run_dir / "config.yaml")

        self.actor_shardings = self.plan.actor_shardings(self.learner.params)
        actor_model = nnx.merge(self.learner.graphdef, weights_copy(self.learner.params, self.actor_shardings,
                                                                    self.weight_sync))
        actor_adapters = None
        if self.learner.frozen is not None:  # LoRA: the actor's own copy of the base, once; syncs bring adapters
            frozen = self.learner.frozen
            actor_adapters, actor_model = actor_model, nnx.merge(self.learner.base_graphdef, weights_copy(
                frozen, self.plan.actor_shardings(frozen), self.weight_sync, may_alias=True))
        if config.env is not None:  # episodes of an environment, scored by its reward()
            self.sampler = make_episode_runner(config.env, config.sampler, actor_model, self.tokenizer,
                                               rows=self.plan.engine_slots, adapters=actor_adapters,
                                               version=self.version)
            self.rewards = None
        else:  # sampler.engine: the continuous Engine (slots default: one step's samples) or the static Sampler.
            self.sampler = make_generator(actor_model, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id,
                                          config=config.sampler, adapters=actor_adapters,
                                          slots=self.plan.engine_slots, version=self.version)
            self.rewards = RewardSuite(config.rewards, timeout_s=config.trainer.reward_timeout_s)
            self._opened("rewards", self.rewards.close)
        self._opened("sampler", self.sampler.close)
        limits = ActorLimits(max_steps=config.trainer.max_steps, group_timeout_s=config.trainer.group_timeout_s,
                             reward_error_handouts=config.trainer.reward_error_handouts)
        self.actor = Actor(config.grpo, limits, self.sampler, self.tokenizer, self.collector, self.buffer,
                           self.rewards, self.base_key, version=self.version,
                           lockstep=HostAgreement(plan.cut.actor, timeout_s=config.trainer.collective_timeout())
                           if plan.actor_spans_hosts else None)
        if eval_records is not None:
            # Its own reward suite, so eval timeouts stay out of the training reward metrics.
            eval_rewards = RewardSuite(config.rewards, timeout_s=config.trainer.reward_timeout_s)
            self._opened("eval_rewards", eval_rewards.close)
            evaluator = Evaluator(config, self.tokenizer, eval_records, eval_rewards,
                                  batch_rows=self.local_prompts * grpo.group_size)
            self.evaluation = EvalDuringTraining(evaluator, self.actor, self.sampler)
        self.stop_signals = StopSignals()
        self._frontier_of_save: dict[int, tuple[int, dict | None]] = {}

    def close(self, failure: BaseException | None = None) -> None:
        """Release what the trainer opened: checkpoint manager, ledger file, sampler threads, data iterator
        (Grain threads and worker processes) and the run-directory lock, each even if closing another fails.
        Idempotent; train() calls it at the end, __init__ when start-up fails. `failure`: the error already
        on its way out, which close() must not hide (its own failures are then logged, not raised). Each resource
        registered itself as it opened (_opened); they close in CLOSE_ORDER."""
        run_all([self._closers[name] for name in CLOSE_ORDER if name in self._closers], failure)

    def _opened(self, name: str, closer: Callable[[], None]) -> None:
        """Register what close() calls for a resource just opened (a second one of a name replaces the first, which
        its opener closed: the ledger of a new chain)."""
        assert name in CLOSE_ORDER, name
        self._closers[name] = closer

    def nothing_trained_error(self) -> TrainerError | None:
        """For a run that ended without a step: an error when it dropped every prompt it handed out (e.g. every
        row of a finite dataset is bad), so that such a run does not end as if it had succeeded."""
        counts = self.collector.counts()
        if counts["trained"] or not counts["dropped"]:
            return None
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(counts["dropped"].items()))
        first = f"; first bad row: {self.actor.first_bad_row}" if self.actor.first_bad_row else ""
        return TrainerError(f"nothing was trained: every one of the {sum(counts['dropped'].values())} prompts handed "
                            f"out was dropped ({reasons}){first}; the drop lines of "
                            f"{self.run_dir / ledger_file(self.process_index, self.processes)} say why for each")

    # -- start and resume ----------------------------------------------------------------------------

    def _data_state_spec(self) -> DataStateSpec:
        grpo = self.config.grpo
        return DataStateSpec(run_dir=self.run_dir, process_index=self.process_index, process_count=self.processes,
                             handout_size=self.local_prompts, buffer_capacity=self.buffer_capacity,
                             max_staleness=grpo.max_staleness, prompts_per_step=grpo.prompts_per_step,
                             snapshot_ring=self.config.checkpoint.snapshot_ring,
                             load_replay_buffer=self.config.checkpoint.load_replay_buffer)

    def _take_data_state(self, state: DataState) -> None:
        self.ledger, self.buffer, self.collector = state.ledger, state.buffer, state.collector

    def _ledger_opened(self, ledger: Ledger) -> None:
        self._opened("ledger", ledger.close)

    def _committed(self, x):
        """A single-device leaf (optax's step count is made uncommitted, on one device) replicated on the
        learner mesh, so that it never clashes with the sharded parameters, across processes too."""
        if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
            return jax.device_put(np.asarray(x), self.replicated)
        return x

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

    def _open_own_state(self, restored: Restored) -> None:
        """Several processes: this process's collector and buffer are its row of the restored `processes`
        array (load_latest calls this, so that a row off its checksum sets the step aside on every process)."""
        if "processes" not in restored.state:
            return
        length = restored.meta["process_state_bytes"][self.process_index]
        row = np.asarray(restored.state["processes"].addressable_data(0))[0, :length]
        restored.collector, restored.buffer_arrays = unpack_process_state(
            row, sealed=restored.meta.get("process_state_sealed", False))

    def _resume_facts(self) -> dict:
        """What a checkpoint records and a resume must match (run.resume.resume_facts)."""
        return resume_facts(self.config, self.iterator.fingerprint, self.processes,
                            self.base_identity if self.config.lora.enabled else None)

    def _check_resumable(self, meta: dict) -> None:
        """Refuse, with the reason, a checkpoint this config cannot resume exactly (run.resume.check_resumable)."""
        check_resumable(meta, self._resume_facts(), self.config,
                        where=f"checkpoint step {meta['step']} in {self.checkpoints.directory}")

    def _resume(self, restored: Restored) -> None:
        step, meta = restored.step, restored.meta
        state = restored.state
        self.learner.params, self.learner.opt_state = state["params"], state["opt_state"]
        # Placed like a fresh key (default device): keys derived from it go to the actor's jit.
        self.base_key = jax.random.wrap_key_data(np.asarray(state["rng"].addressable_data(0)))
        self.learner.steps_done = int(meta["learner"]["steps_done"])
        # Before mini-batches every step was one update.
        self.learner.updates_done = int(meta["learner"].get("updates_done", self.learner.steps_done))
        self.learner.nonfinite_total = int(meta["learner"]["nonfinite_total"])
        self.version = step
        self.resumed_from = step
        # The restored step is on disk: a stop before the first new step must not save it again (Orbax refuses).
        self.checkpoints.last_saved_step = step
        self._take_data_state(resumed_data_state(self._data_state_spec(), self.iterator, restored,
                                                 fits=self._group_fits, gather=self.agreement.gather,
                                                 on_ledger=self._ledger_opened))

    def _group_fits(self, group: Group) -> str | None:
        """Why a restored group cannot be trained under this config (run.resume.group_fits); None: it can."""
        return group_fits(group, self.prompt_bucket, self.completion_bucket, self.plan.row_length)

    # -- saving -------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Start an async save of the current state (step = weight version). The buffer's state is taken
        first, then the collector's (see Collector.checkpoint_state for why this order)."""
        pool = ArrayPool()
        buffer_state = self.buffer.to_state(pool)
        collector_state = self.collector.checkpoint_state(buffer_state["ordinals"])
        meta = {"facts": self._resume_facts(), "weight_version": self.version,
                "learner": {"steps_done": self.learner.steps_done, "updates_done": self.learner.updates_done,
                            "nonfinite_total": self.learner.nonfinite_total},
                "frontier_ordinal": collector_state["frontier_ordinal"],
                # All processes' groups (meta is written by process 0 only), for the group-size check.
                "buffered_groups": int(self.agreement.gather([len(buffer_state["ordinals"])]).sum())}
        own = {"collector": collector_state, "buffer": buffer_state}
        state, arrays = self._saved_state(), pool.arrays()
        if self.processes > 1:
            # Orbax writes JSON from the primary process only: each process's collector and buffer go
            # into row p of one global array instead (an .npz of JSON bytes and the buffer's arrays).
            state["processes"], meta["process_state_bytes"] = self.agreement.rows(pack_process_state(own, arrays))
            meta["process_state_sealed"] = True
            own, arrays = {"per_process": True}, ArrayPool().arrays()
        self.checkpoints.save(self.version, state, arrays, own, meta)
        self._frontier_of_save[self.version] = (collector_state["frontier_ordinal"], collector_state["ledger_covers"])

    def _record_commits(self, steps: list[int]) -> None:
        """The ledger's checkpoint line, written once the step is committed on disk."""
        for step in steps:
            frontier, covers = self._frontier_of_save.pop(step)
            if self.ledger.failed is not None:
                # The step is committed and resumable (it covers only lines synced before it); the ledger takes no
                # line after its failed one, so the audit's frontier stays at the previous checkpoint line.
                logger.warning("checkpoint step %d is committed, but its ledger line cannot be written (%s)", step,
                               self.ledger.failed)
                continue
            self.ledger.checkpoint(step, frontier, covers)

    # -- the loop -----------------------------------------------------------------------------------

    # How often processes waiting for a step's groups agree on whether to stop: a stop signal on any process
    # abandons the step on all of them within about this long (see _take_step_groups).
    STOP_ROUND_S = 0.5

    def _take_step_groups(self, step: int) -> list[Group] | None:
        """Block until a full step of groups is there (requeueing any that grew too stale); [] when the data
        is exhausted. None: a stop signal came while waiting, and the step is abandoned (groups already taken
        go back into the buffer, so the checkpoint holds them).

        Several processes wait in lockstep rounds of about STOP_ROUND_S, each ending with one small gather
        ("stop?", "have my groups?"): a signal on any process abandons the step on all of them together, and
        a process that has its groups waits for the others' instead of starting the collective step."""
        deadline = time.monotonic() + self.config.trainer.group_timeout_s
        groups = None
        while True:
            if self.evaluation is not None and self.evaluation.pending:
                # The actor is evaluating, not generating: the wait for groups counts from its return.
                deadline = time.monotonic() + self.config.trainer.group_timeout_s
            if groups is None:
                groups = self._try_take_groups(step, deadline)
            stop, all_ready = self.stop_signals.received is not None, groups is not None
            if self.processes > 1:
                agreed = self.agreement.gather([stop, groups is not None])
                stop, all_ready = bool(agreed[:, 0].any()), bool(agreed[:, 1].all())
                if stop and self.stop_signals.received is None:
                    self.stop_signals.stop()  # another process was signalled: stop here with it
            if stop:
                if groups:
                    self.buffer.put_back(groups, self.version)
                return None
            if all_ready:
                return groups
            if groups is not None:
                time.sleep(self.STOP_ROUND_S / 10)  # ready: wait for the other processes' next round

    def _try_take_groups(self, step: int, deadline: float) -> list[Group] | None:
        """One wait of at most STOP_ROUND_S for this process's groups of the step: the groups (a full step,
        or what is left at the end of the data, possibly []), or None if they are not there yet."""
        timeout = self.config.trainer.group_timeout_s
        try:
            taken = self.buffer.take(self.local_prompts, self.version,
                                     timeout=max(min(deadline - time.monotonic(), self.STOP_ROUND_S), 0.01))
        except ReplayBufferClosed as e:
            # the actor stopped the run saying why (failing rewards, a full disk)
            if isinstance(e.__cause__, UserError):
                raise e.__cause__ from None
            raise TrainerError(f"the actor thread failed, so step {step} cannot get its groups: "
                               f"{e.__cause__!r}") from e.__cause__
        except ReplayBufferTimeout:
            if time.monotonic() < deadline:
                return None
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
        if not taken.drained:
            return None
        unfinished = self.collector.counts()["unfinished"]
        if not unfinished:
            return []
        # The data is exhausted but groups are being generated again (they grew too stale).
        if time.monotonic() >= deadline:
            raise TrainerError(f"the data is exhausted and {unfinished} prompt(s) being generated again did not "
                               f"arrive within trainer.group_timeout_s={timeout}s for step {step} "
                               f"(actor alive: {self.actor.is_alive()})")
        time.sleep(0.05)
        return None

    def _sync_weights(self) -> dict:
        start = time.perf_counter()
        state = weights_copy(self.learner.params, self.actor_shardings, self.weight_sync)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        self.actor.push_weights(state, self.version)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))  # as sent: in the compute dtype when narrower
        metrics = {"sync/seconds": seconds, "sync/bytes": nbytes}
        # One actor per host: every host's copy must be the same. (Across hosts there is one copy.)
        if self.processes > 1 and self.config.trainer.check_replicas and not self.actor_spans_hosts:
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
            if self.export_missing:
                logger.warning("%s is missing (the run stopped before writing it): writing it from checkpoint "
                               "step %d", self.run_dir / "final_model", self.version)
                try:
                    self._export_final_model()
                except BaseException as e:
                    self.close(e)
                    raise
                self.close()
            return []
        writer = None
        if self.process_index == 0:  # one metrics file per run (it reports process 0's groups)
            try:
                writer = MetricsWriter(self.run_dir, cfg.trainer.max_steps, start_step=self.version,
                                       progress=cfg.trainer.progress, tensorboard=cfg.trainer.tensorboard,
                                       wandb=cfg.trainer.wandb, run_config=config_to_dict(cfg))
            except BaseException as e:
                self.close(e)  # e.g. W&B refused to start: release the run directory's lock and the data workers
                raise
        history = []
        completed = False
        failure: BaseException | None = None  # the error on its way out, which no cleanup step may hide
        try:
            with self.stop_signals:
                try:
                    if self.evaluation is not None and self.version == 0:
                        self.evaluation.request(0)  # the baseline, before the actor generates anything
                    self.actor.start()
                    history = self._train_loop(writer)
                    if self.preempted or (cfg.checkpoint.save_at_end and history):
                        if self.checkpoints.last_saved_step != self.version:
                            self.save_checkpoint()
                        self._record_commits(self.checkpoints.wait())
                    # Only now: a failed final save leaves the leftovers to the resume, not to run_ended drops.
                    completed = not self.preempted
                    if completed and self.evaluation is not None:
                        self._finish_evaluations(writer)
                except BaseException as e:
                    failure = e
                    raise
                finally:
                    steps = []
                    if self.evaluation is not None:
                        steps.append(self.evaluation.cancel)  # a stop or an error does not wait for an evaluation
                    steps.append(self.actor.stop)
                    # Saves already started still commit and get their ledger line, even after an error.
                    steps.append(lambda: self._record_commits(self.checkpoints.wait()))
                    if completed:
                        steps.append(self._account_leftovers)
                    if writer is not None:
                        if self.evaluation is not None:
                            steps.append(lambda: self._write_evaluations(writer))  # those finished before a stop too
                        steps.append(writer.close)
                    run_all(steps, failure)
            if self.preempted:
                logger.warning("stopped by %s after step %d; checkpoint step %d is committed: run the same command "
                               "to resume", signal.Signals(self.stop_signals.received).name, self.version, self.version)
            if self.actor.error is not None and not history:
                if isinstance(self.actor.error, UserError):
                    raise self.actor.error
                raise TrainerError(f"the actor thread failed: {self.actor.error!r}") from self.actor.error
            if completed and not history:
                error = self.nothing_trained_error()
                if error is not None:
                    raise error
            if completed and history and cfg.trainer.save_final_model:
                self._export_final_model()
        except BaseException as e:
            failure = failure or e
            raise
        finally:
            self.close(failure)  # after the export: the run directory stays locked until final_model/ is written
        return history

    def _export_final_model(self) -> None:
        """RUN_DIR/final_model in Hugging Face layout, so `grpo-jax generate --model RUN_DIR/final_model` and
        transformers load it; from the learner's parameters (the actor's copy can lag them by a step). With
        LoRA, final_model is the base with the adapters merged in, and RUN_DIR/final_adapter the adapters alone
        in PEFT's format (for peft.PeftModel.from_pretrained on the base)."""
        cfg = self.config
        model, adapters = self.learner.model(), self.learner.adapters()
        def gathered(leaf) -> np.ndarray:
            return np.asarray(self._replicate(leaf).addressable_data(0))
        # Sharded across hosts: every process joins the gather of each weight in turn (one weight whole on a
        # device at a time, never the model), and process 0 writes. The adapters are small: gathered at once.
        fetch = jax.device_get if self._replicate is None else gathered
        if self._replicate is not None and adapters is not None:
            graphdef, state = nnx.split(adapters)
            adapters = nnx.merge(graphdef, jax.tree.map(fetch, state))
        from grpo_jax.model.hf import checkpoint_config, save_hf_model
        # Default: the dtype the weights came in (the checkpoint's, or param_dtype from scratch).
        export_dtype = cfg.trainer.export_dtype or (
            checkpoint_config(cfg.model_path).param_dtype if cfg.model_path else cfg.model.param_dtype)
        try:
            save_hf_model(model, self.run_dir / "final_model", tokenizer=self.tokenizer, dtype=export_dtype,
                          fetch=fetch, write=self.process_index == 0)
            if adapters is not None and self.process_index == 0:
                save_peft_adapter(adapters, model.config, self.run_dir / "final_adapter",
                                  base_model_path=cfg.model_path)
        except OSError as e:
            # config.json is written last: a resume of the finished run sees it missing and exports again.
            steps = self.checkpoints.steps()
            resume = (f"the last committed checkpoint is step {steps[-1]}: free space and run the same command to "
                      + ("write final_model/ from it" if steps[-1] == self.version else "resume from it")
                      ) if steps else "no checkpoint is committed: free space and run the same command again"
            raise RunDirError(f"cannot write the final model to {self.run_dir} ({e.strerror or e}: {e.filename}); "
                              f"{resume}") from e

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
                break  # a stop signal while waiting (on any process): every process abandons this step
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
            stop, due, lock_lost, moved = self.agreement.gather([self.stop_signals.received is not None,
                                                                 self.checkpoints.due(self.version),
                                                                 self.run_lock.is_lost(),
                                                                 bool(self.run_lock.moved())]).any(axis=0)
            # Another start took a process's run lock, or its lock or flock file was deleted (run_lock.py): every
            # process stops before saving.
            self.run_lock.check(lost_elsewhere=bool(lock_lost))
            if stop and self.stop_signals.received is None:
                self.stop_signals.stop()  # another process was signalled: stop here with it
            self.preempted = bool(stop)
            # moved: checkpoints/ was deleted under the run, and its steps with it: save this step again, then stop.
            if (due and not stop) or moved:
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
            if self.evaluation is not None:
                if self.version % cfg.eval.every_steps == 0:
                    self.evaluation.request(self.version)
                self._write_evaluations(writer)
            history.append(metrics)
            if moved:
                self._record_commits(self.checkpoints.wait())
                raise RunDirError(
                    f"the checkpoint directory {self.checkpoints.directory} was deleted or replaced while this run "
                    "saved into it (by hand, or by a program the run started?), and the steps it held with it; this "
                    f"run saved step {self.version} there again and stops: find what removed it, then run the same "
                    f"command to resume from step {self.version}")
            if stop:
                break
        return history

    def _finish_evaluations(self, writer: MetricsWriter) -> None:
        """At the end of a completed run: evaluate the final weights too, and wait for the evaluations still to
        run (the actor is idle by now)."""
        if self.version % self.config.eval.every_steps:
            self.evaluation.request(self.version)
        if not self.evaluation.wait(self.config.trainer.group_timeout_s):
            logger.warning("evaluations still running after trainer.group_timeout_s=%ss at the end of the run: "
                           "abandoned", self.config.trainer.group_timeout_s)
        self._write_evaluations(writer)

    def _write_evaluations(self, writer: MetricsWriter) -> None:
        for row in self.evaluation.finished():
            writer.write_eval(row)

    def learner_batch(self, groups: list[Group]) -> tuple[TrainBatch, dict, Sequences]:
        """This process's part of a step's learner batch (NumPy), its padding metrics, and the sequences it was
        laid out from (for groups_trained): algorithm.batch's hand-off. Packed, every process feeds the same
        number of rows: the most any needs, agreed (gathers run in the same order everywhere: every process
        learns every step), rounded up to one of RunPlan.packed_row_sizes."""
        layout = self.batch_layout
        sequences = sequences_of(groups, layout)
        rows = rows_needed(sequences, layout)
        if layout.packing:
            rows = self.plan.packed_rows(int(self.agreement.gather([rows]).max()))
        return assemble(sequences, layout, rows), padding_metrics(sequences, layout, rows), sequences

    def _learn(self, groups: list[Group], step: int) -> dict:
        g = self.config.grpo.group_size
        batch, padding, sequences = self.learner_batch(groups)
        batch = self.device_batch(batch)
        learn_start = time.perf_counter()
        metrics, applied = self.learner.step(batch)
        metrics.update(padding)
        learn_seconds = time.perf_counter() - learn_start
        self.version += 1
        trained = groups_trained(sequences, self.batch_layout, applied)
        for grp, ok in zip(groups, trained):
            if not ok:  # none of its updates was applied: it trained nothing, so it is not recorded as trained
                self.collector.mark_dropped(grp.ordinal, "nonfinite_update")
        groups = [grp for grp, ok in zip(groups, trained) if ok]
        ordinals = [grp.ordinal for grp in groups]
        versions = [grp.weight_version for grp in groups]
        self.collector.mark_trained(ordinals, step=self.version, weight_versions=versions)
        diverged = self.learner.diverged(self.version)
        if diverged is not None:
            raise diverged
        metrics.update(self._sync_weights())
        staleness = [step - v for v in versions] or [0]
        if groups:
            rewards = np.concatenate([grp.rewards if grp.valid is None else grp.rewards[grp.valid] for grp in groups])
            lengths = np.concatenate([sample_lengths(grp) for grp in groups])
            prompt_lengths = [len(grp.prompt["prompt_ids"]) for grp in groups]
        else:  # several processes, the end of the data: this one only padded
            rewards, lengths, prompt_lengths = np.array([np.nan]), np.array([0]), [0]
        kl = metrics.get("kl/mean", metrics.get("tis/mismatch_kl", 0.0))
        counts = self.collector.counts()
        metrics.update({
            "step": self.version, "reward/mean": float(rewards.mean()), "reward/max": float(rewards.max()),
            "reward/min": float(rewards.min()), "kl": float(kl),
            "staleness/mean": float(np.mean(staleness)), "staleness/max": int(np.max(staleness)),
            "staleness/values": staleness, "length/mean": float(lengths.mean()), "length/max": int(lengths.max()),
            "length/quantiles": length_quantiles(lengths), "prompt_length/mean": float(np.mean(prompt_lengths)),
            "time/learner_s": learn_seconds,
            "zero_variance_groups": int(sum(grp.zero_variance for grp in groups)),
            "frontier": counts["frontier"], "dropped": sum(counts["dropped"].values()),
            "actor/tokens_per_s": self.actor.generated_tokens / max(self.actor.generate_seconds, 1e-9),
            "_tokens": sum(sequence_tokens(grp, g) for grp in groups),
        })
        if self.rewards is not None:
            metrics.update(self.rewards.metrics())  # reward/timed_out_samples, reward/stuck_threads
        metrics.update(self.actor.metrics(groups))  # version spread in groups, engine occupancy, tokens/s per device
        return metrics

    def device_batch(self, batch):
        """A packed batch (this process's rows, NumPy) as the learner step takes it: committed to the plan's
        batch sharding; on several processes, this process's rows of the global batch."""
        sharding = self.plan.batch_sharding
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)

    def _account_leftovers(self) -> None:
        """Prompts handed out but not trained when the run stops are dropped with reason run_ended, so the
        ledger of a finished run accounts for every ordinal it handed out."""
        for ordinal in self.collector.outstanding():
            self.collector.mark_dropped(ordinal, "run_ended")


def train(config: Config, run_dir: str | pathlib.Path | None = None) -> list[dict]:
    return Trainer(config, run_dir).train()
