"""The run description: from a config and a device set, how a run lays out every program it executes.

One place decides, for the trainer (real arrays, this process's devices) and for `grpo-jax compile`
(abstract arrays, a TPU topology's devices), so that the two cannot disagree:

- the device cut and the meshes: the actor's (one per host, or one across hosts) and the learner's (one
  across hosts), refused in one line (ConfigError) when the config cannot be laid out on the devices;
- a step's shapes: each host's prompts, the learner's rows, its fixed prompt and completion buckets, the engine's
  slots, the replay buffer's capacity; with packing (optim.packing) the packed row counts a run may use
  (packed_row_sizes: at most optim.packing_buckets learner programs over a run), the largest (every completion
  at max_new_tokens) for memory and the one at the expected fill (optim.expected_*_len) for the projected time;
- the layouts: parameters and optimizer state on the learner mesh, the batch split over data x fsdp, the
  actor's copy of the weights on the actor mesh in the dtype it keeps (weight_sync.narrowed);
- the programs with their arguments: the learner step (as algorithm.learner jits it, with the arguments the
  trainer passes), the weight sync (its WeightSync), and the actor's generator (engine or sampler: its own
  class builds its programs, over the plan's actor weights and slots).

`tests/test_plan.py` builds a trainer for several configs and checks that the arguments of its programs
carry exactly the shardings and shapes this description gives the compile command.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.algorithm.batch import BatchLayout, pack_layout, packed_row_sizes, packed_rows_for
from grpo_jax.algorithm.learner import TrainBatch, jit_train_step, make_optimizer, make_train_step
from grpo_jax.algorithm.lengths import ExpectedLengths, expected_lengths
from grpo_jax.errors import ConfigError
from grpo_jax.model.lora import LoraConfig, init_adapters
from grpo_jax.model.transformer import DTYPES, ModelConfig, abstract_model
from grpo_jax.parallel.distributed import by_process
from grpo_jax.parallel.sharding import (
    DeviceCut,
    batch_sharding,
    batch_split_problem,
    cut_devices,
    make_mesh,
    state_shardings,
)
from grpo_jax.rollout.weight_sync import WeightSync, narrowed
from grpo_jax.run.config import Config
from grpo_jax.run.metrics import length_history


def run_model_config(config: Config) -> ModelConfig:
    """The policy's ModelConfig as the trainer builds it: the checkpoint's config.json for the architecture
    (no weights are read), the config's model section for how to run it (hf.RUN_SETTINGS)."""
    if not config.model_path:
        return config.model
    from grpo_jax.model.hf import RUN_SETTINGS, checkpoint_config
    return dataclasses.replace(checkpoint_config(config.model_path),
                               **{key: getattr(config.model, key) for key in RUN_SETTINGS})


@dataclasses.dataclass(frozen=True)
class LearnerStep:
    """The learner step as the trainer runs it: the jitted program and the (abstract) arguments it takes."""

    jitted: object
    args: tuple  # parameters, optimizer state, batch, reference, frozen base, dropout key, learner-step index

    @property
    def params(self):
        return self.args[0]

    def args_with(self, batch: TrainBatch) -> tuple:
        """The step's arguments with another (abstract) batch."""
        return (*self.args[:2], batch, *self.args[3:])

    @property
    def opt_state(self):
        return self.args[1]

    @property
    def reference(self):
        return self.args[3]

    @property
    def frozen(self):
        return self.args[4]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    config: Config
    model: ModelConfig  # the policy's architecture (run_model_config)
    processes: int  # hosts (JAX processes)
    cut: DeviceCut  # which devices sample (the actor) and which update (the learner)
    learner_mesh: Mesh  # one mesh across every host's learner devices
    actor_mesh: Mesh  # this host's actor devices, or every host's when the actor spans the hosts

    @classmethod
    def build(cls, config: Config, devices, this_host: int = 0, process_word: str = "process") -> RunPlan:
        """The plan for `devices` (jax.Device objects of every process: this process's jax.devices(), or a
        topology's). `this_host`: whose actor devices make the actor mesh (an actor per host); every host is
        cut the same way. ConfigError, one line, for a config these devices cannot run."""
        hosts = by_process(list(devices))
        processes = len(hosts)
        if config.grpo.prompts_per_step % processes:
            raise ConfigError(f"grpo.prompts_per_step={config.grpo.prompts_per_step}: must divide evenly over the "
                              f"{processes} {process_word}es (each trains its share of every step)")
        try:
            cut = cut_devices(hosts, config.mesh.actor_devices, config.mesh.actor, this_host=this_host)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if cut.actor_spans_hosts and config.actor_across_hosts_problems():
            raise ConfigError("; ".join(config.actor_across_hosts_problems()))
        try:
            learner_mesh = make_mesh(config.mesh.learner, cut.learner)
            actor_mesh = make_mesh(config.mesh.actor, cut.actor, tensor_across_hosts=cut.actor_spans_hosts)
        except ValueError as e:
            where = " across hosts" if cut.actor_spans_hosts else f" per {process_word}" if processes > 1 else ""
            raise ConfigError(f"mesh: {e} (actor: {len(cut.actor)} device(s){where}, "
                              f"learner: {len(cut.learner)})") from e
        # Each process feeds its own rows of the batch, split over data x fsdp in process order.
        local_rows = config.grpo.prompts_per_step // processes * config.grpo.group_size
        problem = batch_split_problem(learner_mesh, processes, local_rows, process=process_word)
        if problem:
            raise ConfigError(problem)
        plan = cls(config, run_model_config(config), processes, cut, learner_mesh, actor_mesh)
        problem = plan.micro_batch_problem() or plan.experts_problem()
        if problem:
            raise ConfigError(problem)
        return plan

    def experts_problem(self) -> str | None:
        """Why this run cannot train this model's experts as configured, or None."""
        if self.model.replays_routing and self.config.sampler.engine != "continuous":
            return (f"sampler.engine={self.config.sampler.engine!r}: routing replay (model.routing_replay, the default "
                    "for a mixture of experts) records each token's experts in the continuous engine; set "
                    "sampler.engine=continuous, or model.routing_replay=false to let the learner's router choose")
        mlp = sorted({"gate", "up", "down"} & set(self.config.lora.targets))
        if self.model.num_experts and self.config.lora.enabled and mlp:
            return (f"lora.targets={list(self.config.lora.targets)}: {mlp} are not adapted in a model with experts "
                    "(its experts train only with the full model, and PEFT reads these names as the experts'); "
                    "use targets [q, k, v, o]")
        return None

    def micro_batch_problem(self) -> str | None:
        """Why optim.micro_batch_tokens does not fit this run's rows, or None."""
        optim, length = self.config.optim, self.row_length
        if not optim.micro_batch_tokens:
            return None
        if optim.micro_batch_tokens < length:
            return (f"optim.micro_batch_tokens={optim.micro_batch_tokens}: below one learner row of {length} tokens "
                    f"(prompt bucket {self.prompt_bucket} + completion bucket {self.completion_bucket}); set at "
                    f"least {length}, or 0")
        mini_rows = self.rows // optim.mini_batches
        if not self.packing and mini_rows % self.micro_rows:
            return (f"optim.micro_batch_tokens={optim.micro_batch_tokens}: {self.micro_rows} rows of {length} tokens "
                    f"per micro-batch must divide the {mini_rows} rows of a mini-batch (optim.packing=false); set a "
                    f"multiple of {length} whose row count divides {mini_rows}")
        return None

    # -- a step's shapes --------------------------------------------------------------------------------

    @property
    def actor_spans_hosts(self) -> bool:
        return self.cut.actor_spans_hosts

    @property
    def shared(self) -> bool:
        """mesh.actor_devices=0: the actor samples on the learner's devices (they take turns)."""
        return self.cut.shared

    @property
    def local_prompts(self) -> int:
        """Each process's groups per step (its handout size)."""
        return self.config.grpo.prompts_per_step // self.processes

    @property
    def rows(self) -> int:
        """The learner's rows per step, all processes: prompts_per_step x group_size."""
        return self.config.grpo.prompts_per_step * self.config.grpo.group_size

    @property
    def actors(self) -> int:
        """How many actors sample a step's prompts between them: one per host, or the one spanning them all."""
        return 1 if self.actor_spans_hosts else self.processes

    @property
    def actor_rows(self) -> int:
        """The samples one actor generates per step: its hosts' prompts x group_size."""
        return self.rows // self.actors

    @property
    def actor_devices_per_host(self) -> int:
        return self.actor_mesh.size // (self.processes if self.actor_spans_hosts else 1)

    @property
    def engine_slots(self) -> int:
        """The continuous engine's slots: sampler.slots, or one step's samples of this process."""
        return self.config.sampler.slots or self.local_prompts * self.config.grpo.group_size

    @property
    def prompt_bucket(self) -> int:
        """The learner's fixed prompt width (no recompiles): the data marks longer prompts as bad rows."""
        return min(self.config.data.max_prompt_len, self.config.sampler.max_prompt_len)

    @property
    def completion_bucket(self) -> int:
        return self.config.sampler.max_new_tokens

    @property
    def row_length(self) -> int:
        """Tokens per learner row, padded or packed: prompt bucket + completion bucket."""
        return self.prompt_bucket + self.completion_bucket

    @property
    def micro_rows(self) -> int:
        """Learner rows per micro-batch (0: a whole mini-batch)."""
        return self.config.optim.micro_batch_rows(self.row_length)

    # -- packed rows (optim.packing) --------------------------------------------------------------------

    @property
    def packing(self) -> bool:
        return self.config.optim.packing

    @property
    def packed_row_unit(self) -> int:
        """Each process's packed row count is a multiple of this: of the mini-batches (each has its rows, see
        batch.pack_layout), of the rows a micro-batch takes from every process's share of a mini-batch, and of
        the process's batch devices (data x fsdp / processes)."""
        mini, micro = self.config.optim.mini_batches, self.micro_rows or 1
        local_devices = max(self.learner_mesh.shape["data"] * self.learner_mesh.shape["fsdp"] // self.processes, 1)
        return math.lcm(mini * micro // math.gcd(micro, self.processes), local_devices)

    @property
    def sequences_per_sample(self) -> int:
        """The learner sequences one sample can make: 1, or with a multi-turn environment (config.env) its
        max_turns (a trajectory is cut into at most one segment per assistant turn; replay_buffer.Segments)."""
        env = self.config.env
        return 1 if env is None else max(1, int(env.max_turns))

    @property
    def trains_segments(self) -> bool:
        """Whether a sample's trajectory may be cut into several learner sequences (a multi-turn environment,
        config.env), so that the learner batch says which sequences are one trajectory (TrainBatch.trajectories,
        one per packed sequence slot)."""
        return self.config.env is not None

    @property
    def packed_row_sizes(self) -> tuple[int, ...]:
        """The packed row counts (per process) a run may use, smallest first: the largest holds the worst case,
        every sequence alone in a row (with an environment, sequences_per_sample of them per sample)."""
        mini, unit = self.config.optim.mini_batches, self.packed_row_unit
        local_sequences = self.local_prompts * self.config.grpo.group_size * self.sequences_per_sample
        most = -(-mini * -(-local_sequences // mini) // unit) * unit
        return packed_row_sizes(most, unit, self.config.optim.packing_buckets)

    def packed_rows(self, needed: int) -> int:
        """The per-process packed row count a step uses when the process that needs the most needs `needed`."""
        return packed_rows_for(needed, self.packed_row_sizes)

    def batch_layout(self, process_index: int, pad_id: int) -> BatchLayout:
        """How process `process_index` lays out its groups of a step as learner rows (algorithm.batch)."""
        step_sequences = self.local_prompts * self.config.grpo.group_size
        return BatchLayout(group_size=self.config.grpo.group_size, mini_batches=self.config.optim.mini_batches,
                           step_sequences=step_sequences, first_sequence=process_index * step_sequences,
                           prompt_len=self.prompt_bucket, completion_len=self.completion_bucket, packing=self.packing,
                           trains_segments=self.trains_segments, replays_routing=self.model.replays_routing,
                           pad_id=pad_id)

    @functools.cached_property
    def expected_lengths(self) -> ExpectedLengths:
        """The lengths a step's sequences are expected to have, each at most its bucket (algorithm.lengths:
        optim.expected_lengths_from, a previous run's logged lengths; else optim.expected_*_len; else the
        buckets). ConfigError, one line naming the key and the file, for a run directory without them."""
        optim = self.config.optim
        history = None
        if optim.expected_lengths_from:
            try:
                history = length_history(optim.expected_lengths_from)
            except (OSError, ValueError) as e:
                raise ConfigError(f"optim.expected_lengths_from={optim.expected_lengths_from!r}: {e}") from None
        return expected_lengths(prompt_bucket=self.prompt_bucket, completion_bucket=self.completion_bucket,
                                expected_prompt_len=optim.expected_prompt_len,
                                expected_completion_len=optim.expected_completion_len, history=history)

    @property
    def learner_rows(self) -> int:
        """The learner batch's rows, all processes, at their most: one per sequence, or the largest packed size."""
        return self.processes * self.packed_row_sizes[-1] if self.packing else self.rows

    @property
    def expected_learner_rows(self) -> int:
        """The learner batch's rows, all processes, when the sequences have the expected lengths (packed: each
        process's sequences, their completions spread over the profile (ExpectedLengths.for_sequences), packed by
        batch.pack_layout, then rounded up to a size; padded: one per sequence)."""
        if not self.packing:
            return self.rows
        lengths = self.expected_lengths
        sequences = self.local_prompts * self.config.grpo.group_size
        layout = pack_layout([lengths.prompt] * sequences, lengths.for_sequences(sequences), self.row_length,
                             self.completion_bucket, self.config.optim.mini_batches)
        return self.processes * self.packed_rows(layout.rows)

    @property
    def buffer_capacity(self) -> int:
        """Groups each process's replay buffer holds (the admission rule never needs more)."""
        grpo = self.config.grpo
        return self.config.trainer.buffer_capacity or self.local_prompts * (grpo.max_staleness + 2)

    # -- layouts ----------------------------------------------------------------------------------------

    @property
    def replicated(self) -> NamedSharding:
        """Whole on every learner device: optimizer step counts, keys, scalars."""
        return NamedSharding(self.learner_mesh, PartitionSpec())

    @property
    def batch_sharding(self) -> NamedSharding:
        """The learner batch's rows over data x fsdp (committed on one process too: an uncommitted batch leaves
        the layout to the compiler, which may keep whole-batch tensors on every learner device)."""
        return batch_sharding(self.learner_mesh)

    def learner_shardings(self, state):
        """Where the learner keeps parameters (or adapters) of this structure."""
        return state_shardings(state, self.learner_mesh)

    def actor_shardings(self, state):
        """Where the actor keeps its copy of them."""
        return state_shardings(state, self.actor_mesh)

    @property
    def actor_dtype(self):
        """The compute dtype: the actor keeps (and is sent) float weights in it when it is narrower."""
        return DTYPES[self.model.dtype]

    def weight_sync(self) -> WeightSync:
        """The learner-to-actor resharding (grouped stages on several hosts, the cast on the way)."""
        return WeightSync(self.actor_dtype)

    def learner_options(self) -> dict:
        """How the learner scores tokens: under the distribution the sampler draws from (algorithm.sampling)."""
        sampler = self.config.sampler
        return {"temperature": sampler.temperature, "top_k": sampler.top_k, "top_p": sampler.top_p}

    # -- abstract state (compile; restore targets) ------------------------------------------------------

    def abstract_params(self, mesh: Mesh | None = None):
        """(graphdef, state) of the policy with ShapeDtypeStructs, sharded on `mesh` (the learner's) as
        sharding.shard_module places real ones."""
        return _placed(abstract_model(self.model), mesh or self.learner_mesh)

    def abstract_adapters(self, mesh: Mesh | None = None, lora: LoraConfig | None = None):
        """(graphdef, state) of the LoRA adapters: A like its weight's input, B like its output, rank whole."""
        lora = lora or self.config.lora
        return _placed(nnx.eval_shape(lambda: init_adapters(self.model, lora)), mesh or self.learner_mesh)

    def actor_params(self):
        """(graphdef, state) of the actor's weights: on the actor mesh, in the dtype the actor keeps."""
        graphdef, state = self.abstract_params(self.actor_mesh)
        return graphdef, _narrowed(state, self.actor_dtype)

    def actor_adapters(self):
        graphdef, state = self.abstract_adapters(self.actor_mesh)
        return graphdef, _narrowed(state, self.actor_dtype)

    def abstract_opt_state(self, optimizer: optax.GradientTransformation, params):
        """The optimizer state's shapes as the trainer places it: a moment (zeros_like of a parameter) has its
        parameter's sharding; anything else (step counts) is replicated on the learner mesh."""
        by_path = {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
        shapes = jax.eval_shape(optimizer.init, params)

        def place(path, leaf):
            for start in range(len(path)):
                param = by_path.get(path[start:])
                if param is not None and param.shape == leaf.shape:
                    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param.sharding)
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self.replicated)

        return jax.tree_util.tree_map_with_path(place, shapes)

    def abstract_batch(self, rows: int | None = None, sharding: NamedSharding | None = None) -> TrainBatch:
        """A TrainBatch of ShapeDtypeStructs as the trainer lays it out: batch.pack_sequences's packed rows with
        optim.packing, else batch.pack_batch's (default: the most rows a step can have, learner_rows, split as
        the trainer commits them)."""
        rows = self.learner_rows if rows is None else rows
        length = self.row_length

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self.batch_sharding)

        model = self.model
        routing = sds((rows, length - 1, *model.routing_shape), jnp.int32) if model.replays_routing else None
        if self.packing:
            trajectories = sds((rows, length // 2), jnp.int32) if self.trains_segments else None
            return TrainBatch(tokens=sds((rows, length), jnp.int32), input_mask=sds((rows, length), jnp.int32),
                              loss_mask=sds((rows, length - 1), jnp.float32),
                              advantages=sds((rows, length // 2), jnp.float32),
                              behaviour_logprobs=sds((rows, length - 1), jnp.float32),
                              scored_positions=sds((rows, self.completion_bucket), jnp.int32), routing=routing,
                              trajectories=trajectories)
        return TrainBatch(tokens=sds((rows, length), jnp.int32), input_mask=sds((rows, length), jnp.bool_),
                          loss_mask=sds((rows, length - 1), jnp.float32), advantages=sds((rows,), jnp.float32),
                          behaviour_logprobs=sds((rows, length - 1), jnp.float32),
                          completion_len=self.completion_bucket, routing=routing)

    # -- the learner step -------------------------------------------------------------------------------

    @functools.cached_property
    def learner_step(self) -> LearnerStep:
        """The learner step over abstract arguments, built as Learner builds it (make_train_step with
        learner_options, jit_train_step): with LoRA only the adapters train (and have moments); the frozen
        base, never donated, is the KL reference too; without LoRA a KL penalty has a reference copy."""
        config = self.config
        graphdef, params = self.abstract_params()
        base_graphdef, frozen, dropout_key = None, None, None
        if config.lora.enabled:
            base_graphdef, frozen = graphdef, params
            graphdef, params = self.abstract_adapters()
            if config.lora.dropout > 0:
                dropout_key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.replicated)
        optimizer = make_optimizer(config.optim)
        opt_state = self.abstract_opt_state(optimizer, params)
        reference = params if config.loss.needs_reference and frozen is None else None
        step = make_train_step(graphdef, optimizer, config.loss, config.optim,
                               graphdef if reference is not None else None, base_graphdef=base_graphdef,
                               **self.learner_options())
        jitted = jit_train_step(step, params, opt_state)
        step_index = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)  # sets the rate
        return LearnerStep(jitted, (params, opt_state, self.abstract_batch(), reference, frozen, dropout_key,
                                    step_index))


def _placed(module: nnx.Module, mesh: Mesh):
    graphdef, state = nnx.split(module)
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda s, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.get_value().dtype, sharding=s)),
                         shardings, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return graphdef, state


def _narrowed(state, compute):
    """Float leaves in `compute` where it is narrower than their own (weight_sync.narrowed), as the trainer's
    weight sync delivers them and the actor keeps them."""
    def narrow(v):
        x = v.get_value()
        return v.replace(jax.ShapeDtypeStruct(x.shape, narrowed(x.dtype, compute), sharding=x.sharding))

    return jax.tree.map(narrow, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_bytes(tree) -> int:
    """Bytes of one device's shard of every abstract (or real) array in `tree` (the largest shard: replicated
    and unevenly split dimensions included)."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))
