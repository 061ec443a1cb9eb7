"""Ahead-of-time compilation for a TPU topology, without a TPU: `grpo-jax compile CONFIG --topology NAME`.

With libtpu installed (`pip install 'jax[tpu]'`), `jax.experimental.topologies` describes the devices of
any TPU slice (e.g. `v5e:2x4`, or `v5p:4x4x4` with its 16 hosts) on a machine that has none, and XLA
compiles for them. This module lays a config out on such a topology exactly as the trainer would (actor
devices cut from each host, one learner mesh across hosts, the same parameter and optimizer-state
shardings), compiles every program a run executes over abstract parameters (shapes only, no weights),
and reports per-device memory, cost and a roofline estimate of time:

- the learner step (learner.make_train_step, jitted as Learner does): mini-batches, epochs, micro-batch
  accumulation, the proximal and reference forward passes, the optimizer update;
- the actor: with sampler.engine=continuous (the default), the engine's own jitted programs (decode chunk per
  bank size, admission, bank resizes) at the shapes Engine.warm_up compiles; with sampler.engine=static, the
  sampler's generate program (prefill + phased decode loop), for the rows one handout gives an actor (one
  host's prompts; every host's for an actor mesh spanning the hosts, sharding.cut_devices);
- the weight sync (weight_sync.WeightSync). On several hosts its first step is a jitted program on the
  learner mesh per group of leaves, compiled here (`weight sync stage`): it reshards the parameters so that
  every host holds, spread over its own learner devices, what its actor devices need (a whole copy for an
  actor per host; its own block of every leaf for an actor spanning the hosts), cast to model.dtype when that
  is narrower than model.param_dtype. Then each host assembles its actor's shards from those (one host: from
  the learner's shards, casting on the way): device-to-device copies between disjoint device sets, a transfer,
  not a program: its bytes are counted and its time estimated from the chip's ICI bandwidth. The actor keeps
  its weights (with LoRA the frozen base and the adapters) in that narrowed dtype, as the trainer does, and
  the actor's programs and memory figures here are sized so.

Times are rooflines: for each program max(FLOPs / peak, bytes / HBM bandwidth) per device, from XLA's
cost analysis. XLA counts a loop body once whatever its trip count, so each loop body (a micro-batch's
gradient, a decode step) is costed by its own program and multiplied by its trip count. Collectives,
host work and kernel overheads are not counted: these are lower bounds, and the step projection is the
time the chips could not beat on this layout.

libtpu aborts the process on some layouts (a failed internal check), so compile_run compiles in one child
process and turns its death by a signal into a one-line CompilerCrash naming the program being compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import pathlib
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from grpo_jax.run.config import Config
from grpo_jax.parallel.distributed import by_process
from grpo_jax.rollout.engine import Engine, SlotState
from grpo_jax.errors import ConfigError, UserError
from grpo_jax.algorithm.learner import TrainBatch, make_optimizer, make_train_step, token_logprobs
from grpo_jax.model.lora import LoraConfig, init_adapters
from grpo_jax.model.transformer import DTYPES, ModelConfig, Transformer, positions_from_mask
from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.rollout.sampler import Sampler, _bucket, _phase_ends, vocab_major_head
from grpo_jax.parallel.sharding import (DEFAULT_RULES, batch_sharding, batch_split_problem, cut_devices, make_mesh, spec_for,
                               state_shardings)
from grpo_jax.rollout.weight_sync import WeightSync, narrowed

GIB = 1024 ** 3


class TopologyError(UserError):
    """An unknown topology name, or no TPU compiler (libtpu) installed."""


class DoesNotFit(UserError):
    """A program needs more memory per device than the chip has (or the compiler refused it)."""

    exit_code = 4


class CompilerCrash(UserError):
    """libtpu's compiler killed the compiling process (a signal, e.g. SIGABRT on a failed internal check): a
    compiler bug on this layout, not a memory verdict."""

    exit_code = 5


# ------------------------------------------------------------------------------------------ chips


@dataclasses.dataclass(frozen=True)
class Chip:
    """Figures of one TPU chip (a device may be half a chip: see Topology.devices_per_chip)."""

    name: str
    hbm_bytes: float  # what XLA lets programs use: the nominal capacity less what libtpu reserves
    peak_flops: float  # dense bfloat16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s into one chip: half the bidirectional per-chip figure


# By jax's device_kind. Usable HBM: the "available HBM" of the compiler's own out-of-memory refusals
# (libtpu 0.0.42, from jax[tpu]==0.10.2), per device: v4 15.25G (a device is one of a chip's two
# TensorCores), v5e 15.75G, v5p 95.74G, v6e 31.25G. The rest, from Google's published figures:
# - v4: https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s); ICI from
#   https://jax-ml.github.io/scaling-book/tpus/ (4.5e10 B/s one way per link, 6 links in a 3D torus).
# - v5e: https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GiB at 819 GB/s, 400 GB/s ICI
#   bidirectional per chip).
# - v5p: https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB at 2765 GB/s, 1200 GB/s ICI
#   bidirectional per chip).
# - v6e: https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB at 1638 GB/s, 800 GB/s ICI
#   bidirectional per chip).
CHIPS = {
    "TPU v4": Chip("TPU v4", 2 * 15.25 * GIB, 275e12, 1200e9, 6 * 45e9),
    "TPU v5 lite": Chip("TPU v5e", 15.75 * GIB, 197e12, 819e9, 400e9 / 2),
    "TPU v5": Chip("TPU v5p", 95.74 * GIB, 459e12, 2765e9, 1200e9 / 2),
    "TPU v6 lite": Chip("TPU v6e", 31.25 * GIB, 918e12, 1638e9, 800e9 / 2),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple
    chip: Chip
    devices_per_chip: int  # 2 where each TensorCore is its own device (v4 topologies here)

    @property
    def processes(self) -> int:
        return len({d.process_index for d in self.devices})

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_bytes / self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        return self.chip.peak_flops / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip

    @property
    def ici_bandwidth(self) -> float:
        return self.chip.ici_bandwidth / self.devices_per_chip


def tpu_topology(name: str, chips_per_host: str = "") -> Topology:
    """The devices of a TPU slice named like `v5e:2x4` or `v5p:2x2x2`, described by libtpu (no TPU needed).

    Hosts: `chips_per_host` like "2x4"; by default libtpu's (4 chips per host), except that a v5e or v6e slice
    of up to 8 chips is one host, as Cloud TPU provisions v5litepod-8 and v6e-8."""
    from jax.experimental import topologies

    examples = "e.g. v5e:2x4, v5p:2x2x2, v4:2x2x4, v6e:2x4"
    shape = re.fullmatch(r"(v[0-9a-z]+):(\d+(?:x\d+)+)", name)
    if not shape:
        raise TopologyError(f"--topology {name}: expected VERSION:AxB or VERSION:AxBxC ({examples})")
    dims = [int(n) for n in shape.group(2).split("x")]
    if not chips_per_host and shape.group(1) in ("v5e", "v6e") and math.prod(dims) <= 8:
        chips_per_host = shape.group(2)
    options = {}
    if chips_per_host:
        if not re.fullmatch(r"\d+(x\d+){0,2}", chips_per_host):
            raise TopologyError(f"--chips-per-host {chips_per_host}: expected AxB or AxBxC, e.g. 2x2")
        bounds = [int(n) for n in chips_per_host.split("x")]
        options["chips_per_host_bounds"] = tuple(bounds + [1] * (3 - len(bounds)))
    # libtpu takes /tmp/libtpu_lockfile for one process per TPU host; compiling drives no TPU, so it need not
    # wait for (or block) another process that loaded libtpu. Read when libtpu loads, at the first description.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, **options).devices)
    except Exception as e:  # noqa: BLE001 - jax raises bare RuntimeError/ValueError from the plugin
        if not _has_libtpu():
            raise TopologyError(f"--topology {name}: the TPU compiler is not installed; install it with "
                                f"pip install 'jax[tpu]=={jax.__version__}'") from e
        raise TopologyError(f"--topology {name}{' --chips-per-host ' + chips_per_host if chips_per_host else ''}: "
                            f"libtpu cannot describe it ({examples}): {str(e).splitlines()[0]}") from e
    kind = devices[0].device_kind
    if kind not in CHIPS:
        raise TopologyError(f"--topology {name}: no chip figures for {kind!r} (known: {', '.join(CHIPS)})")
    return Topology(name, devices, CHIPS[kind], max(len(devices) // math.prod(dims), 1))


def _has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


# ------------------------------------------------------------------------------------------ reports


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of one compiled program (XLA's memory_analysis)."""

    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments (counted once)
    temporaries: int
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per-device FLOPs and HBM bytes of one call, and its roofline time on the topology's devices."""

    flops: float
    bytes: float
    seconds: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds)

    def __mul__(self, times: float) -> "Cost":
        return Cost(self.flops * times, self.bytes * times, self.seconds * times)


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    devices: int  # devices it runs on (the sampler: its actor mesh, one host's or one across hosts)
    memory: Memory | None  # None when the compiler refused it
    held: int  # per-device bytes alive on the same devices outside the program (see held_what)
    held_what: str
    cost: Cost | None  # per call, loops counted; None when refused
    calls_per_step: int
    compile_seconds: float  # this program and the loop-body programs that cost it
    refusal: str = ""  # the compiler's own words when it refused (RESOURCE_EXHAUSTED)
    hints: tuple[str, ...] = ()  # settings that make it smaller
    cost_note: str = ""  # why cost is None although the program compiled
    actor: bool = False  # the actor's (sampling) time per step is the sum of cost x calls over these
    notes: tuple[str, ...] = ()  # printed under the table

    @property
    def total(self) -> int | None:
        return None if self.memory is None else self.memory.total + self.held


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Bytes moved between device sets outside any compiled program (jax.device_put)."""

    name: str
    bytes_per_device: int  # into each receiving device
    seconds: float
    how: str


@dataclasses.dataclass(frozen=True)
class StepProjection:
    learner_seconds: float  # learner step + weight sync (the learner thread waits for both)
    actor_seconds: float  # sampling one step's groups (every host at once)
    overlapped: bool  # actor and learner on disjoint devices with max_staleness >= 1
    seconds: float
    tokens: int  # prompt + completion tokens per step (padded buckets: every completion at max_new_tokens)
    model_flops: float  # per step, all chips: 6N per trained token, 2N per forward token, attention included
    mfu: float


@dataclasses.dataclass(frozen=True)
class Report:
    config_path: str
    topology: Topology
    model: ModelConfig
    param_count: int
    layout: str
    programs: tuple[Program, ...]
    transfers: tuple[Transfer, ...]
    step: StepProjection | None  # None when a program does not fit

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)


# ------------------------------------------------------------------------------------------ layout


@dataclasses.dataclass(frozen=True)
class Layout:
    # One host's actor devices (every host samples alike, its own prompts); with actor_spans_hosts, the actor
    # devices of every host, process-major: one actor, sampling every host's prompts together.
    actor_mesh: jax.sharding.Mesh
    learner_mesh: jax.sharding.Mesh
    shared: bool  # mesh.actor_devices=0: the actor samples on the learner's devices
    processes: int
    actor_spans_hosts: bool = False

    @property
    def actors(self) -> int:
        """How many actors sample a step's prompts between them: one per host, or the one spanning them all."""
        return 1 if self.actor_spans_hosts else self.processes

    @property
    def actor_devices_per_host(self) -> int:
        return self.actor_mesh.size // (self.processes if self.actor_spans_hosts else 1)


def actor_rows(config: Config, layout: Layout) -> int:
    """The rows (samples) one actor generates per step: its hosts' prompts x group_size; every host's when it
    spans them, else prompts_per_step / hosts."""
    return config.grpo.prompts_per_step // layout.actors * config.grpo.group_size


def run_layout(config: Config, devices: tuple) -> Layout:
    """The trainer's device cut and meshes (trainer.split_devices and Trainer.__init__, with sharding.cut_devices),
    for the devices of a topology rather than those of this process: host 0's devices stand for every host's
    (for an actor per host; an actor that spans the hosts is the same mesh on every one)."""
    hosts = by_process(devices)
    processes = len(hosts)
    if config.grpo.prompts_per_step % processes:
        raise ConfigError(f"grpo.prompts_per_step={config.grpo.prompts_per_step}: must divide evenly over the "
                          f"{processes} hosts (each trains its share of every step)")
    try:
        cut = cut_devices(hosts, config.mesh.actor_devices, config.mesh.actor)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cut.actor_spans_hosts and config.actor_across_hosts_problems():
        raise ConfigError("; ".join(config.actor_across_hosts_problems()))
    actor, learner = cut.actor, cut.learner
    try:
        learner_mesh = make_mesh(config.mesh.learner, learner)
        actor_mesh = make_mesh(config.mesh.actor, actor, tensor_across_hosts=cut.actor_spans_hosts)
    except ValueError as e:
        where = " across hosts" if cut.actor_spans_hosts else " per host"
        raise ConfigError(f"mesh: {e} (actor: {len(actor)} device(s){where}, learner: {len(learner)})") from e
    # As Trainer.__init__: each host feeds its own rows of the batch, split over data x fsdp in host order.
    problem = batch_split_problem(learner_mesh, processes, config.grpo.prompts_per_step // processes
                                  * config.grpo.group_size, process="host")
    if problem:
        raise ConfigError(problem)
    return Layout(actor_mesh, learner_mesh, cut.shared, processes, cut.actor_spans_hosts)


def run_model_config(config: Config) -> ModelConfig:
    """The policy's ModelConfig as the trainer builds it: the checkpoint's config.json for the architecture
    (no weights are read), the config's model section for how to run it (hf.RUN_SETTINGS)."""
    if not config.model_path:
        return config.model
    from grpo_jax.model.hf import RUN_SETTINGS, checkpoint_config
    return dataclasses.replace(checkpoint_config(config.model_path),
                               **{key: getattr(config.model, key) for key in RUN_SETTINGS})


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def abstract_params(model_config: ModelConfig, mesh: jax.sharding.Mesh):
    """(graphdef, state) of the model with ShapeDtypeStructs sharded as sharding.shard_module places them."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model_config, nnx.Rngs(0))))
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda s, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.get_value().dtype, sharding=s)),
                         shardings, state, is_leaf=_is_variable)
    return graphdef, state


def abstract_adapters(model_config: ModelConfig, lora: LoraConfig, mesh: jax.sharding.Mesh):
    """(graphdef, state) of LoRA adapters (lora.Adapters) with ShapeDtypeStructs sharded as the trainer places
    them (sharding.shard_module: A like its weight's input, B like its output, the rank replicated)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: init_adapters(model_config, lora)))
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda s, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.get_value().dtype, sharding=s)),
                         shardings, state, is_leaf=_is_variable)
    return graphdef, state


def actor_state(state, model_config: ModelConfig):
    """The actor's copy of an abstract `state` (abstract_params / abstract_adapters on the actor mesh): float
    leaves in model.dtype where it is narrower than their own (weight_sync.narrowed), as the trainer's weight
    sync delivers and the actor keeps them."""
    compute = DTYPES[model_config.dtype]

    def narrow(v):
        x = v.get_value()
        return v.replace(jax.ShapeDtypeStruct(x.shape, narrowed(x.dtype, compute), sharding=x.sharding))

    return jax.tree.map(narrow, state, is_leaf=_is_variable)


def actor_params(model_config: ModelConfig, mesh: jax.sharding.Mesh):
    """(graphdef, state) of the actor's weights: abstract_params in the dtype the actor keeps (actor_state)."""
    graphdef, state = abstract_params(model_config, mesh)
    return graphdef, actor_state(state, model_config)


def actor_adapters(model_config: ModelConfig, lora: LoraConfig, mesh: jax.sharding.Mesh):
    """(graphdef, state) of the actor's LoRA adapters, in the dtype the actor keeps (actor_state)."""
    graphdef, state = abstract_adapters(model_config, lora, mesh)
    return graphdef, actor_state(state, model_config)


def abstract_opt_state(optimizer: optax.GradientTransformation, params, replicated: NamedSharding):
    """The optimizer state's shapes with the trainer's shardings: a moment (zeros_like of a parameter) has
    its parameter's sharding; anything else (step counts) is replicated on the learner mesh (Trainer._committed)."""
    by_path = {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = jax.eval_shape(optimizer.init, params)

    def place(path, leaf):
        for start in range(len(path)):
            param = by_path.get(path[start:])
            if param is not None and param.shape == leaf.shape:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param.sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)

    return jax.tree_util.tree_map_with_path(place, shapes)


def shard_bytes(tree) -> int:
    """Bytes of one device's shard of every abstract array in `tree` (the largest shard: replicated and
    unevenly split dimensions included)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def full_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------------------------------ compiling


@dataclasses.dataclass(frozen=True)
class Compiled:
    memory: Memory | None
    cost: Cost | None
    refusal: str
    seconds: float


# Set in the compiling child process (see compile_run): each compile_one first appends its label here, so
# that the parent can name the program being compiled when libtpu kills the child.
_PROGRESS: pathlib.Path | None = None
# Testing hook, honoured only in the child: compile_one os.abort()s at the program with this label, as libtpu
# does on a failed internal check.
ABORT_AT_ENV = "GRPO_JAX_COMPILE_ABORT_AT"


def compile_one(jitted, args: tuple, topology: Topology, static: dict | None = None, label: str = "") -> Compiled:
    """Lower and compile; a RESOURCE_EXHAUSTED refusal by the compiler becomes `refusal`. `label` names the
    program (or the loop body compiled alone for its cost) in a crash report."""
    if _PROGRESS is not None:
        with open(_PROGRESS, "a") as f:
            f.write(label.replace("\n", " ") + "\n")
        if label and os.environ.get(ABORT_AT_ENV) == label:
            os.abort()
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*args, **(static or {})).compile()
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError; only the out-of-memory refusal is an answer
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return Compiled(None, None, _refusal_line(str(e)), time.perf_counter() - start)
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = Memory(stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                    stats.temp_size_in_bytes, stats.generated_code_size_in_bytes)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    flops, nbytes = float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))
    return Compiled(memory, roofline(flops, nbytes, topology), "", seconds)


def roofline(flops: float, nbytes: float, topology: Topology) -> Cost:
    return Cost(flops, nbytes, max(flops / topology.peak_flops, nbytes / topology.hbm_bandwidth))


def _refusal_line(message: str) -> str:
    """The compiler's out-of-memory sentence, on one line, without its status code and final period."""
    text = " ".join(message.split())
    text = text[text.find("RESOURCE_EXHAUSTED"):].removeprefix("RESOURCE_EXHAUSTED:").strip()
    end = text.find(". ", text.find("exceeds"))
    return text[:end if end > 0 else 300].rstrip(".")


def refusal_excess(refusal: str) -> str:
    """'X over' from the compiler's '(NG) exceeds available HBM (MG)', or '' when it says otherwise."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    found = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", refusal)
    if not found:
        return ""
    need = float(found.group(1)) * units[found.group(2)]
    have = float(found.group(3)) * units[found.group(4)]
    return f"{_size(need - have)} over"


# ------------------------------------------------------------------------------------------ the learner


def learner_program(config: Config, model_config: ModelConfig, layout: Layout, topology: Topology,
                    actor_held: int, actor_what: str = "the actor's copy of the weights") -> tuple[Program, dict]:
    """The learner step, jitted as Learner does (make_train_step, donating parameters and moments), over
    abstract parameters, optimizer state, reference and batch with the trainer's shardings.

    Cost: XLA counts each loop body once, so the step's count is one forward micro-batch per forward pass
    (proximal, reference) + one gradient micro-batch + one optimizer update. The forward micro-batch and
    the update are compiled on their own; the gradient micro-batch is the rest of the step's count."""
    mesh = layout.learner_mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    optim, grpo = config.optim, config.grpo
    graphdef, params = abstract_params(model_config, mesh)
    base_graphdef, frozen, dropout_key = None, None, None
    if config.lora.enabled:
        # As Learner with adapters: only they train (and have moments); the frozen base is an argument of the
        # step, never donated, and is the KL reference too.
        base_graphdef, frozen = graphdef, params
        graphdef, params = abstract_adapters(model_config, config.lora, mesh)
        if config.lora.dropout > 0:
            dropout_key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    optimizer = make_optimizer(optim)
    opt_state = abstract_opt_state(optimizer, params, replicated)
    reference = params if config.loss.needs_reference and frozen is None else None
    step = make_train_step(graphdef, optimizer, config.loss, optim, graphdef if reference is not None else None,
                           temperature=config.sampler.temperature, base_graphdef=base_graphdef,
                           top_k=config.sampler.top_k, top_p=config.sampler.top_p)
    rows = grpo.prompts_per_step * grpo.group_size
    prompt_bucket = min(config.data.max_prompt_len, config.sampler.max_prompt_len)
    completion = config.sampler.max_new_tokens
    # The trainer commits the batch split over data x fsdp, on one process as on several (Trainer._learn).
    batch = abstract_batch(rows, prompt_bucket, completion, batch_sharding(mesh))
    # As Learner._step jits it: parameters and moments donated, and returned with the shardings they came in.
    shardings = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt_state), None, None)
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=shardings)
    step_index = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)  # sets the rate (Learner.step_arguments)
    whole = compile_one(jitted, (params, opt_state, batch, reference, frozen, dropout_key, step_index), topology,
                        label="learner step")

    held, held_what = 0, ""
    if layout.shared:
        held, held_what = actor_held, actor_what
    state_bytes = {"params": shard_bytes(params), "opt_state": shard_bytes(opt_state),
                   "reference": shard_bytes(reference) if reference is not None else 0,
                   "frozen": shard_bytes(frozen) if frozen is not None else 0}
    hints = learner_hints(config, model_config, layout, sum(state_bytes.values()) + held, topology)
    if whole.memory is None:
        return Program("learner step", mesh.size, None, held, held_what, None, 1, whole.seconds, whole.refusal,
                       hints), state_bytes

    micro = optim.micro_batch_size
    forward_rows = micro or rows
    forward_passes = (optim.updates_per_step > 1) + config.loss.needs_reference
    seconds = whole.seconds
    forward = Cost(0.0, 0.0, 0.0)
    if forward_passes:
        micro_batch = abstract_batch(forward_rows, prompt_bucket, completion, _rows_sharding(forward_rows, mesh))

        def forward_logprobs(p, f, b):
            model, adapters = (nnx.merge(graphdef, p), None) if f is None else \
                (nnx.merge(base_graphdef, f), nnx.merge(graphdef, p))
            return token_logprobs(model, b.tokens, b.input_mask, last=b.completion_len,
                                  temperature=config.sampler.temperature or 1.0, adapters=adapters,
                                  top_k=config.sampler.top_k, top_p=config.sampler.top_p)[0]

        compiled = compile_one(jax.jit(forward_logprobs), (params, frozen, micro_batch), topology,
                               label="learner step (a forward micro-batch alone, for its cost)")
        seconds += compiled.seconds
        if compiled.cost is None:
            return (Program("learner step", mesh.size, whole.memory, held, held_what, None, 1, seconds, "", hints,
                            cost_note=f"a forward micro-batch alone was refused: {compiled.refusal}"), state_bytes)
        forward = compiled.cost

    def update(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), params)
    compiled = compile_one(jax.jit(update, donate_argnums=(1, 2)), (grads, opt_state, params), topology,
                           label="learner step (the optimizer update alone, for its cost)")
    seconds += compiled.seconds
    if compiled.cost is None:
        return (Program("learner step", mesh.size, whole.memory, held, held_what, None, 1, seconds, "", hints,
                        cost_note=f"the optimizer update alone was refused: {compiled.refusal}"), state_bytes)
    optimizer_cost = compiled.cost
    gradient = roofline(max(whole.cost.flops - optimizer_cost.flops - forward_passes * forward.flops, 0.0),
                        max(whole.cost.bytes - optimizer_cost.bytes - forward_passes * forward.bytes, 0.0), topology)
    mini_rows = rows // optim.mini_batches
    gradient_micros = optim.updates_per_step * (mini_rows // micro if micro else 1)
    cost = (forward * (forward_passes * (rows // forward_rows)) + gradient * gradient_micros
            + optimizer_cost * optim.updates_per_step)
    return Program("learner step", mesh.size, whole.memory, held, held_what, cost, 1, seconds, "", hints), state_bytes


def abstract_batch(rows: int, prompt_len: int, completion_len: int, sharding: NamedSharding) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs, as learner.pack_batch lays it out."""
    length = prompt_len + completion_len

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return TrainBatch(tokens=sds((rows, length), jnp.int32), input_mask=sds((rows, length), jnp.bool_),
                      loss_mask=sds((rows, length - 1), jnp.float32), advantages=sds((rows,), jnp.float32),
                      behaviour_logprobs=sds((rows, length - 1), jnp.float32), completion_len=completion_len)


def _rows_sharding(rows: int, mesh) -> NamedSharding:
    splits = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % splits == 0:
        return batch_sharding(mesh)
    return NamedSharding(mesh, PartitionSpec())


def learner_hints(config: Config, model_config: ModelConfig, layout: Layout, state: int,
                  topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the learner step, the ones that can help first: activations do not matter while
    the parameters and moments (`state`, per device) alone exceed the device."""
    optim, mesh = config.optim, layout.learner_mesh
    more = "a larger slice" if layout.shared else f"mesh.actor_devices={config.mesh.actor_devices} lower, or a larger slice"
    spread = f"a larger mesh.learner.fsdp (now {mesh.shape['fsdp']}) over more learner devices ({more})"
    if layout.shared:  # the actor's copy of the weights shares these devices
        spread += "; or mesh.actor_devices > 0, the actor's copy of the weights on devices of its own"
    reference = ["loss.kl_coef=0 (no reference copy)"] if config.loss.needs_reference and not config.lora.enabled else []
    if state > topology.hbm_bytes:
        lora = [] if config.lora.enabled else ["lora.rank=16 (adapters on a frozen base: no moments for its weights)"]
        return (f"{spread}: parameters and optimizer state alone take {_size(state)}iB per device", *reference, *lora)
    hints = [] if model_config.remat else ["model.remat=true"]
    mini_rows = config.grpo.prompts_per_step * config.grpo.group_size // optim.mini_batches
    micro = optim.micro_batch_size or mini_rows
    if micro > 1:
        smaller = next(m for m in range(micro // 2, 0, -1) if mini_rows % m == 0)
        new, vocab = config.sampler.max_new_tokens, model_config.vocab_size
        hints.append(f"optim.micro_batch_size={smaller} or lower (now {micro}: one micro-batch's float32 logits, "
                     f"[{micro}, {new}, {vocab}], are {_size(4 * micro * new * vocab)}iB before any split)")
    return (*hints, spread, *reference)


# ------------------------------------------------------------------------------------------ the sampler


def sampler_program(config: Config, model_config: ModelConfig, layout: Layout, topology: Topology,
                    learner_held: int) -> Program:
    """The sampler's generate program for one handout of one actor (Sampler.generate's buckets and row split
    into decode_streams calls): one host's prompts, or every host's for an actor across hosts; over abstract
    weights on the actor mesh. Another sampler or engine replaces this function.

    Cost: the generate program's decode loops stop when every row is done, so their trip counts are not
    known to XLA (which counts each body once). The prefill and a decode step are compiled on their own
    (decode_cost) and the decode step is counted for every token up to max_new_tokens: the worst case,
    every row running to the limit."""
    cfg, mesh = config.sampler, layout.actor_mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    graphdef, state = actor_params(model_config, mesh)
    adapter_graphdef, adapters = None, None
    if config.lora.enabled:  # the actor's own base, plus the adapters each sync brings
        adapter_graphdef, adapters = actor_adapters(model_config, config.lora, mesh)
    sampler, head = _abstract_sampler(graphdef, state, cfg, adapter_graphdef, adapters)
    head = jax.ShapeDtypeStruct(head.shape, head.dtype,
                                sharding=NamedSharding(mesh, spec_for(("vocab", "embed"), head.shape, mesh, DEFAULT_RULES)))
    rows = actor_rows(config, layout)
    calls = min(cfg.decode_streams, rows)
    batch = _bucket(-(-rows // calls), cfg.min_batch_bucket)
    longest = min(config.data.max_prompt_len, cfg.max_prompt_len)
    plen = min(_bucket(longest, cfg.min_prompt_bucket), cfg.max_prompt_len)
    new_bucket = _bucket(cfg.max_new_tokens, 1)
    greedy = cfg.temperature == 0
    static = dict(new_bucket=new_bucket, greedy=greedy, top_k=0 if greedy else cfg.top_k,
                  use_top_p=(not greedy) and cfg.top_p < 1)

    # An actor across hosts gets every host's rows split over data x fsdp where they divide (as the weights'
    # fsdp; each host then places only the rows its own devices hold); an actor per host, from its own
    # process, replicated.
    rows_sharding = replicated
    if layout.actor_spans_hosts and batch % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0:
        rows_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def sds(shape, dtype, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    args = (state, head, sds((batch, plen), jnp.int32, rows_sharding), sds((batch, plen), jnp.bool_, rows_sharding),
            sds((batch,), jnp.bool_, rows_sharding), sds(keys.shape, keys.dtype, rows_sharding), sds((), jnp.int32),
            sds((), jnp.float32), sds((), jnp.float32))
    whole = compile_one(sampler._generate, args, topology, dict(static, adapters=adapters), label="sampler generate")

    weights = shard_bytes(state)
    # The learner delivers new weights (with LoRA, adapters) while the actor still samples with the old ones.
    held, held_what = weights, "the next weights, delivered while sampling"
    if adapters is not None:
        held, held_what = shard_bytes(adapters), "the next adapters, delivered while sampling"
    if whole.memory is not None and calls > 1:
        held += (calls - 1) * whole.memory.outputs
        held_what += f", outputs of the other {calls - 1} call(s)"
    if layout.shared:
        held += learner_held
        held_what += ", the learner's parameters and optimizer state"
    hints = sampler_hints(config, model_config, layout, weights, topology)
    if whole.memory is None:
        return Program("sampler generate", mesh.size, None, held, held_what, None, calls, whole.seconds,
                       whole.refusal, hints, actor=True)

    steps = decode_cost(graphdef, model_config, state, head, cfg, static, batch, plen, new_bucket, mesh, topology,
                        adapter_graphdef, adapters)
    return Program("sampler generate", mesh.size, whole.memory, held, held_what, steps.cost, calls,
                   whole.seconds + steps.seconds, "", hints, cost_note=steps.note, actor=True)


def eval_program(config: Config, model_config: ModelConfig, layout: Layout, topology: Topology, learner_held: int,
                 engine_chunk: Program | None) -> Program:
    """Evaluation during training (eval.every_steps): the static sampler's generate on the actor's devices, at
    the evaluator's shapes (Evaluator: the actor's usual rows per call, eval.max_new_tokens, eval.temperature).
    With the continuous engine it runs while the engine's slots stay in flight (Engine.generate's static
    fallback), so the engine's banks are held beside it. Not part of the step: calls are per evaluation."""
    ev = config.eval
    sampler = dataclasses.replace(config.sampler, max_new_tokens=ev.max_new_tokens or config.sampler.max_new_tokens,
                                  temperature=ev.temperature)
    generate = sampler_program(dataclasses.replace(config, sampler=sampler), model_config, layout, topology,
                               learner_held)
    held, held_what = generate.held, generate.held_what
    if engine_chunk is not None and engine_chunk.memory is not None:
        # The engine's arguments besides the weights they share (its slot state), and what it holds besides.
        weights = shard_bytes(actor_params(model_config, layout.actor_mesh)[1])
        held = engine_chunk.held + engine_chunk.memory.arguments - weights
        held_what = f"the engine's slots in flight, {engine_chunk.held_what}"
    rows = ev.num_prompts * (1 + ev.samples) if ev.num_prompts else 0  # 0: all held-out prompts, unknown here
    per_call = actor_rows(config, layout)
    calls = -(-rows // per_call) * generate.calls_per_step
    note = (f"{calls} call(s) per evaluation ({ev.num_prompts} prompts x (1 greedy + {ev.samples} sampled), "
            f"{per_call} rows per generate); not in the step projection") if rows else \
        "eval.num_prompts=0 (every held-out prompt): calls per evaluation unknown here"
    hints = (f"eval.every_steps=0 (now {ev.every_steps}: evaluate RUN_DIR/final_model with grpo-jax eval after "
             "training instead)", *generate.hints)
    return dataclasses.replace(generate, name="eval generate", held=held, held_what=held_what, calls_per_step=calls,
                               actor=False, hints=hints, notes=(*generate.notes, note))


class _AbstractSampler(Sampler):
    """A Sampler over abstract weights (jax.ShapeDtypeStructs with their shardings, as nnx.eval_shape and
    actor_params give them): its vocab-major head is a shape too. Built outside any trace, so that the Sampler
    reads its weights' shardings (e.g. whether its mesh spans hosts) as it does from real ones."""

    def _vocab_major_head(self, state):
        return jax.eval_shape(functools.partial(vocab_major_head, self.graphdef), state)


def _abstract_sampler(graphdef, state, cfg, adapter_graphdef=None, adapters=None) -> tuple[Sampler, jax.ShapeDtypeStruct]:
    """A Sampler for abstract weights, and the shape of its vocab-major head; only its jitted program is used
    afterwards, with abstract arguments. Token ids (eos, pad) do not change the program's shapes."""
    lora = None if adapters is None else nnx.merge(adapter_graphdef, adapters)
    sampler = _AbstractSampler(nnx.merge(graphdef, state), eos_ids=(0,), pad_id=0, config=cfg, adapters=lora)
    return sampler, sampler._head


@dataclasses.dataclass(frozen=True)
class _Timed:
    cost: Cost | None
    seconds: float
    note: str


def decode_cost(graphdef, model_cfg: ModelConfig, state, head, cfg, static: dict, batch: int, plen: int,
                new_bucket: int, mesh, topology: Topology, adapter_graphdef=None, adapters=None) -> _Timed:
    """Prefill + every decode step of one generate call: the loop bodies of Sampler._generate_impl, from the
    same model and sampling code, compiled on their own. A decode step costs a + b x (cache length): one step
    compiled at the steps-weighted mean cache length of the phases, times the number of steps, is the sum
    over the phases. cost is None if the compiler refused one of them (`note` says which)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    sample = functools.partial(sample_logits, vocab_major=True, greedy=static["greedy"], top_k=static["top_k"],
                               use_top_p=static["use_top_p"])

    def head_logits(head, h):
        return jnp.einsum("ve,be->vb", head, h, preferred_element_type=jnp.float32)

    def lora(adapters):
        return None if adapters is None else nnx.merge(adapter_graphdef, adapters)

    def prefill(state, head, tokens, mask, u, temperature, top_p, adapters):
        model = nnx.merge(graphdef, state)
        hidden, cache = model.hidden_states(tokens, positions_from_mask(mask), mask,
                                            model.init_cache(*tokens.shape), 0, adapters=lora(adapters))
        return sample(head_logits(head, hidden[:, -1]), u, temperature, top_p), cache

    def decode(state, head, prev, positions, key_mask, cache, slot, u, temperature, top_p, adapters):
        model = nnx.merge(graphdef, state)
        hidden, cache = model.hidden_states(prev, positions, key_mask, cache, slot, adapters=lora(adapters))
        return sample(head_logits(head, hidden[:, 0]), u, temperature, top_p), cache

    def sds(shape, dtype, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    scalars = (sds((batch,), jnp.float32), sds((), jnp.float32), sds((), jnp.float32))
    first = compile_one(jax.jit(prefill), (state, head, sds((batch, plen), jnp.int32),
                                          sds((batch, plen), jnp.bool_), *scalars, adapters), topology,
                        label="sampler generate (the prefill alone, for its cost)")
    if first.cost is None:
        return _Timed(None, first.seconds, f"the prefill alone was refused: {first.refusal}")
    steps, weighted, start = 0, 0, 1
    for end in _phase_ends(new_bucket, cfg.decode_phases):
        phase_steps = max(min(end, cfg.max_new_tokens) - start, 0)
        steps, weighted, start = steps + phase_steps, weighted + phase_steps * (plen + end), max(start, end)
    if not steps:
        return _Timed(first.cost, first.seconds, "")
    length = round(weighted / steps)
    shape = (batch, model_cfg.num_kv_heads, length, model_cfg.resolved_head_dim)
    cache_sharding = kv_cache_sharding(mesh, model_cfg.num_kv_heads)
    cache = tuple((sds(shape, DTYPES[model_cfg.dtype], cache_sharding),) * 2 for _ in range(model_cfg.num_layers))
    # The cache is updated in place, as in the generate loop: donated, and returned with the same layout.
    jitted = jax.jit(decode, donate_argnums=(5,), out_shardings=((replicated, replicated), cache_sharding))
    step = compile_one(jitted, (state, head, sds((batch, 1), jnp.int32), sds((batch, 1), jnp.int32),
                                sds((batch, length), jnp.bool_), cache, sds((), jnp.int32), *scalars, adapters),
                       topology, label="sampler generate (one decode step alone, for its cost)")
    if step.cost is None:
        return _Timed(None, first.seconds + step.seconds, f"one decode step alone was refused: {step.refusal}")
    return _Timed(first.cost + step.cost * steps, first.seconds + step.seconds, "")


def kv_cache_sharding(mesh: jax.sharding.Mesh, kv_heads: int) -> NamedSharding:
    """The KV cache's layout in the generate loop, as the compiler chooses it: KV heads split over the tensor
    axis; with fewer KV heads than tensor devices, each head on the group of tensor/kv_heads devices whose query
    heads use it. (A decode step handed the cache replicated instead copies all of it every step.)"""
    t = mesh.shape["tensor"]
    if kv_heads % t == 0:
        return NamedSharding(mesh, PartitionSpec(None, "tensor"))
    if t % kv_heads:
        return NamedSharding(mesh, PartitionSpec())
    grouped = jax.sharding.Mesh(mesh.devices.reshape(mesh.shape["data"], mesh.shape["fsdp"], kv_heads, t // kv_heads),
                                ("data", "fsdp", "kv_heads", "kv_replicas"), axis_types=(AxisType.Auto,) * 4)
    return NamedSharding(grouped, PartitionSpec(None, "kv_heads"))


def sampler_hints(config: Config, model_config: ModelConfig, layout: Layout, weights: int,
                  topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the generate program, the ones that can help first: the weights (per device, in
    the dtype the actor keeps them in, held twice while new ones arrive) before the KV cache and activations."""
    cfg, mesh = config.sampler, layout.actor_mesh
    per_host = len(layout.actor_mesh.devices.flat) if layout.shared else None
    spread = (f"a larger mesh.actor.tensor (now {mesh.shape['tensor']}) over more actor devices "
              f"(mesh.actor_devices={config.mesh.actor_devices})")
    if 2 * weights > topology.hbm_bytes:
        kept = narrowed(DTYPES[model_config.param_dtype], DTYPES[model_config.dtype])
        why = (f"the actor's weights (in {kept}: model.param_dtype={model_config.param_dtype}, "
               f"model.dtype={model_config.dtype}) take {_size(weights)}iB per device, twice while new ones arrive")
        if per_host is not None:  # already every device of the host: no actor layout holds them
            return (f"no actor layout: every host's actor holds a whole copy of the weights on its {per_host} devices; "
                    f"{why}",)
        return (f"{spread}: {why}",)
    return (f"fewer rows per call (grpo.prompts_per_step={config.grpo.prompts_per_step} lower, or "
            f"sampler.decode_streams={cfg.decode_streams} higher)",
            f"a shorter sampler.max_new_tokens={cfg.max_new_tokens} or max_prompt_len={cfg.max_prompt_len} (the KV "
            "cache)", spread)


# ------------------------------------------------------------------------------------------ the continuous engine


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """The continuous engine of one host's actor, with abstract weights: what engine_programs compiles."""

    engine: Engine  # built under eval_shape: only its jitted programs and shape logic are used
    graphdef: object
    state: object  # abstract weights on the actor mesh
    head: jax.ShapeDtypeStruct  # the vocab-major head, sharded as the actor's
    adapters: object  # abstract LoRA adapters, or None
    banks: dict  # bank size -> SlotState of ShapeDtypeStructs with the engine's shardings
    sizes: list  # bank sizes: full, then halved while draining (Engine.program_shapes)
    plens: list  # prompt buckets
    rows: list  # admission row counts

    @property
    def bank_bytes(self) -> int:
        """Per device: one full bank's slot state (its KV ring above all)."""
        return shard_bytes(self.banks[self.engine.bank_slots])

    @property
    def state_bytes(self) -> int:
        """Per device: the slot state of every bank, which stays on the actor's devices for the whole run."""
        return self.engine.num_banks * self.bank_bytes


def engine_setup(config: Config, model_config: ModelConfig, layout: Layout) -> EngineSetup:
    """The Engine the trainer builds on each host (engine.make_generator: sampler.slots, or that host's
    prompts_per_step / hosts x group_size samples), built under eval_shape over abstract weights on the actor
    mesh, and its slot state per bank size with the layout the engine's programs give it (a bank starts
    uncommitted and keeps the layout its first admission returns; observed on a CPU mesh): the KV ring's heads
    split over `tensor` when their number divides it, else the ring replicated on every actor device (the
    grouped layout of kv_cache_sharding is no NamedSharding of the actor mesh, so a program cannot return it);
    every other field replicated."""
    cfg, mesh = config.sampler, layout.actor_mesh
    graphdef, state = actor_params(model_config, mesh)
    adapter_graphdef, adapters = None, None
    if config.lora.enabled:
        adapter_graphdef, adapters = actor_adapters(model_config, config.lora, mesh)
    group = config.grpo.group_size
    slots = cfg.slots or actor_rows(config, layout)
    made = []

    def build(state, adapters):
        lora = None if adapters is None else nnx.merge(adapter_graphdef, adapters)
        engine = Engine(nnx.merge(graphdef, state), eos_ids=(0,), pad_id=0, config=cfg, slots=slots, adapters=lora)
        made.append(engine)
        sizes = engine.program_shapes(group)[0]
        return engine._head, {size: engine._empty_state_impl(size, engine.ring) for size in sizes}

    head, banks = jax.eval_shape(build, state, adapters)
    engine = made[0]
    engine.close()
    engine.state, engine._head, engine.adapters = state, head, adapters  # no tracer outlives eval_shape
    head = jax.ShapeDtypeStruct(head.shape, head.dtype,
                                sharding=NamedSharding(mesh, spec_for(("vocab", "embed"), head.shape, mesh, DEFAULT_RULES)))
    replicated = NamedSharding(mesh, PartitionSpec())
    split = model_config.num_kv_heads % mesh.shape["tensor"] == 0
    cache_sharding = NamedSharding(mesh, PartitionSpec(None, "tensor")) if split else replicated

    def place(bank: SlotState) -> SlotState:
        def sds(x, sharding):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return SlotState(cache=jax.tree.map(lambda x: sds(x, cache_sharding), bank.cache),
                         **{f: sds(getattr(bank, f), replicated) for f in SlotState._fields if f != "cache"})

    sizes, plens, rows = engine.program_shapes(group)
    return EngineSetup(engine, graphdef, state, head, adapters, {size: place(b) for size, b in banks.items()},
                       sizes, plens, rows)


def _worst(compiled: list) -> Compiled:
    """The one that needs the most memory (a refusal first)."""
    return max(compiled, key=lambda c: math.inf if c.memory is None else c.memory.total)


def engine_programs(config: Config, model_config: ModelConfig, layout: Layout, topology: Topology,
                    setup: EngineSetup, learner_held: int) -> list[Program]:
    """The continuous engine's programs (Engine._chunk, _admit, _resize: the engine's own jitted functions)
    at the shapes Engine.warm_up compiles, on one host's actor mesh:

    - `engine chunk`: a decode chunk of sampler.chunk_steps steps, for every bank size (full, and halved while
      draining); the report shows the full bank, the largest;
    - `engine admission`: prefill + copy into slots + first token, at the largest prompt bucket a step's prompts
      use and the most prompts one bank takes at a boundary;
    - `engine resize`: a bank halved while draining, or grown back to full (only where banks shrink).

    Cost: one decode step (the chunk program with steps=1: XLA counts a loop body once) times chunk_steps per
    chunk. Time per learner step, every sample decoding to max_new_tokens in lockstep: the host's samples
    (prompts_per_step / hosts x group_size) fill the slots in waves; each wave is one admission per bank it
    uses (one prefill per group) and ceil((max_new_tokens - 1) / chunk_steps) chunks per bank (the first token
    comes from the admission; a last partial chunk is counted whole); banks run one after the other."""
    cfg, mesh = config.sampler, layout.actor_mesh
    engine, state, head, adapters = setup.engine, setup.state, setup.head, setup.adapters
    full = engine.bank_slots
    replicated = NamedSharding(mesh, PartitionSpec())
    static = engine.sampling.static

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    scalars = (sds((), jnp.float32), sds((), jnp.float32))
    weights = shard_bytes(state)
    head_bytes = shard_bytes(head)
    # The learner delivers new weights (with LoRA, adapters) while the engine still decodes with the old ones;
    # the other banks' slot states stay on the same devices.
    held, held_what = weights, "the next weights, delivered while sampling"
    if adapters is not None:
        held, held_what = shard_bytes(adapters), "the next adapters, delivered while sampling"
    if engine.num_banks > 1:
        held += (engine.num_banks - 1) * setup.bank_bytes
        held_what += f", the other {engine.num_banks - 1} bank(s)' slot state"
    if layout.shared:
        held += learner_held
        held_what += ", the learner's parameters and optimizer state"
    hints = engine_hints(config, model_config, layout, engine, weights, topology)

    # When every sample decodes to max_new_tokens, the slots fill and empty in waves.
    group = config.grpo.group_size
    samples = actor_rows(config, layout)
    chunks_per_wave = max(-(-(cfg.max_new_tokens - 1) // cfg.chunk_steps), 1)
    chunk_calls, admissions, start = 0, {}, 0  # admissions: rows -> calls
    while start < samples:
        wave = min(samples - start, engine.num_slots)
        for first in range(start, start + wave, full):
            last = min(first + full, start + wave)  # this bank's samples [first, last)
            groups = (last - 1) // group - first // group + 1
            rows = min(_bucket(groups, 1), full)
            admissions[rows] = admissions.get(rows, 0) + 1
            chunk_calls += chunks_per_wave
        start += wave

    programs = []
    # The decode chunk, for every bank size.
    chunks = [compile_one(engine._chunk, (state, head, adapters, setup.banks[size], *scalars), topology,
                          dict(static, steps=cfg.chunk_steps), label=f"engine chunk ({size} slots)")
              for size in setup.sizes]
    worst = _worst(chunks)
    seconds = sum(c.seconds for c in chunks)
    notes = []
    if len(setup.sizes) > 1:
        notes.append(f"compiled for banks of {', '.join(map(str, setup.sizes))} slots (halved while draining); "
                     "the largest memory shown")
    cost, cost_note = None, ""
    if worst.memory is not None:
        step = compile_one(engine._chunk, (state, head, adapters, setup.banks[full], *scalars), topology,
                           dict(static, steps=1), label="engine chunk (one decode step alone, for its cost)")
        seconds += step.seconds
        if step.cost is None:
            cost_note = f"one decode step alone was refused: {step.refusal}"
        else:
            cost = step.cost * cfg.chunk_steps
            notes.append(f"one decode step x chunk_steps={cfg.chunk_steps} per call; {chunk_calls} call(s) per step: "
                         f"{samples} samples in {engine.num_banks} bank(s) of {full} slots, every one decoding to "
                         f"max_new_tokens={cfg.max_new_tokens}")
    programs.append(Program("engine chunk", mesh.size, worst.memory, held, held_what, cost, chunk_calls, seconds,
                            worst.refusal, hints, cost_note, actor=True, notes=tuple(notes)))

    # The admission: prefill, copy into slots, first token; the largest shapes for memory, those used for cost.
    longest = min(config.data.max_prompt_len, cfg.max_prompt_len)
    plen = min(_bucket(longest, cfg.min_prompt_bucket), cfg.max_prompt_len)

    def admit(rows: int, label: str) -> Compiled:
        slot_args = (sds((full,), jnp.int32), sds((full,), jnp.int32), sds((full, 2), jnp.uint32),
                     sds((full,), jnp.int32))
        return compile_one(engine._admit, (state, head, adapters, setup.banks[full], sds((rows, plen), jnp.int32),
                                           sds((rows, plen), jnp.bool_), *slot_args, *scalars), topology, static,
                           label=label)

    largest = admit(setup.rows[-1], "engine admission")
    seconds, cost, cost_note = largest.seconds, None, ""
    if largest.memory is not None:
        cost = Cost(0.0, 0.0, 0.0)
        for rows, calls in sorted(admissions.items()):
            compiled = largest if rows == setup.rows[-1] else admit(
                rows, f"engine admission ({rows} prompts, for its cost)")
            if compiled is not largest:
                seconds += compiled.seconds
            if compiled.cost is None:
                cost, cost_note = None, f"the admission of {rows} prompts was refused: {compiled.refusal}"
                break
            cost = cost + compiled.cost * calls
    calls = sum(admissions.values())
    if cost is not None:
        cost = cost * (1 / max(calls, 1))  # per call, averaged over the row counts used
    notes = (f"{setup.rows[-1]} prompts of {plen} tokens (the most one bank takes at a boundary) for memory; "
             f"{calls} call(s) per step ({', '.join(f'{n} x {r} prompts' for r, n in sorted(admissions.items()))}: "
             "one prefill per group)",)
    programs.append(Program("engine admission", mesh.size, largest.memory, held, held_what, cost, calls, seconds,
                            largest.refusal, hints, cost_note, actor=True, notes=notes))

    # Bank resizes while draining: halved one step at a time, and back to full from every size.
    pairs = list(zip(setup.sizes, setup.sizes[1:])) + [(size, full) for size in setup.sizes[1:]]
    if pairs:
        resizes = [compile_one(engine._resize, (setup.banks[a], sds((b,), jnp.int32)), topology,
                               label=f"engine resize ({a} -> {b} slots)") for a, b in pairs]
        worst = _worst(resizes)
        # Not an argument of a resize, but on its devices: the weights and head it decodes with.
        resize_held = held + weights + head_bytes
        resize_what = "the engine's weights and head, " + held_what
        notes = (f"{len(pairs)} programs ({', '.join(f'{a} -> {b}' for a, b in pairs)} slots); not in the step "
                 "projection (with every sample decoding to max_new_tokens, no bank drains)",)
        programs.append(Program("engine resize", mesh.size, worst.memory, resize_held, resize_what, worst.cost, 0,
                                sum(r.seconds for r in resizes), worst.refusal, hints, actor=True, notes=notes))
    return programs


def engine_hints(config: Config, model_config: ModelConfig, layout: Layout, engine: Engine, weights: int,
                 topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the engine's programs: the weights first (as sampler_hints), then the slots' KV
    rings and the admission's prefill."""
    cfg = config.sampler
    hints = sampler_hints(config, model_config, layout, weights, topology)
    if 2 * weights > topology.hbm_bytes:
        return hints
    now = f"now {engine.num_slots}" + ("" if cfg.slots else ": 0 means prompts_per_step / hosts x group_size")
    hints = [f"fewer sampler.slots ({now}; each holds a KV ring of max_prompt_len + max_new_tokens = {engine.ring} "
             f"positions)", f"a shorter sampler.max_new_tokens={cfg.max_new_tokens} or max_prompt_len={cfg.max_prompt_len}",
             hints[-1]]
    kv, tensor = model_config.num_kv_heads, layout.actor_mesh.shape["tensor"]
    if kv % tensor:
        hints.append(f"a mesh.actor.tensor that divides num_kv_heads={kv} (now {tensor}: every actor device holds the "
                     "whole KV ring of its slots)")
    return tuple(hints)


# ------------------------------------------------------------------------------------------ the weight sync


def sync_parts(model_config: ModelConfig, layout: Layout, topology: Topology, learner_state: dict,
               actor_weights: int, lora: LoraConfig = LoraConfig(),
               actor_what: str = "the actor's copy of the weights") -> tuple[list[Program], list[Transfer]]:
    """The learner's new weights onto the actor's layout after every step (trainer.weights_copy with the
    trainer's weight_sync.WeightSync); with LoRA the adapters only (the actor holds its own copy of the frozen
    base, sent once at the start).

    One host: each actor shard put together from the learner's shards (device-to-device copies, cast to the
    compute dtype on the way), a transfer. Several hosts: first `weight sync stage`, the jitted programs on the
    learner mesh (WeightSync.stage_program, one per group of leaves, WeightSync.group_slices, run one after the
    other) that reshard the parameters so that every host holds, spread over its own learner devices and in the
    dtype the actor keeps, what its actor devices need: a whole copy for an actor per host, its own block of
    every leaf for an actor spanning the hosts; the report shows the group that needs the most memory, and the
    time of all of them. Then each host's copy from those shards onto its actor devices, a transfer."""
    compute = DTYPES[model_config.dtype]
    if lora.enabled:
        _, params = abstract_adapters(model_config, lora, layout.learner_mesh)
        _, actor = actor_adapters(model_config, lora, layout.actor_mesh)
    else:
        _, params = abstract_params(model_config, layout.learner_mesh)
        _, actor = actor_params(model_config, layout.actor_mesh)
    actor_in = shard_bytes(actor)
    n_learner = layout.learner_mesh.size
    local_learner = n_learner // layout.processes  # each host's learner devices
    # Every actor device receives its shard; a host's learner devices send them between them.
    seconds = max(actor_in, actor_in * layout.actor_devices_per_host / local_learner) / topology.ici_bandwidth
    if layout.processes == 1:
        return [], [Transfer("weight sync copy", actor_in, seconds,
                             f"each actor shard put together from the learner's shards (in {_dtypes(actor)}), "
                             "device-to-device at the ICI figure")]
    leaves = jax.tree.leaves(params)
    targets = [x.sharding for x in jax.tree.leaves(actor)]  # the actor's layout, leaf for leaf
    sync = WeightSync(compute)
    copy = Transfer("weight sync copy", actor_in, seconds,
                    f"on each host, each actor shard put together from the host's staged shards (in "
                    f"{_dtypes(actor)}), device-to-device at the ICI figure")
    groups = [(leaves[g], targets[g]) for g in sync.group_slices(leaves)]
    programs = [(sync.stage_program(part, part_targets), part) for part, part_targets in groups]
    programs = [(program, part) for program, part in programs if program is not None]
    if not programs:  # already staged as the actor needs it, in its dtype: nothing to stage
        return [], [copy]
    compiled = [compile_one(program, (part,), topology, label=f"weight sync stage (group {k + 1} of {len(programs)})")
                for k, (program, part) in enumerate(programs)]
    refused = [c for c in compiled if c.memory is None]
    worst = refused[0] if refused else max(compiled, key=lambda c: c.memory.total)
    held = learner_state["opt_state"] + learner_state["reference"] + learner_state["frozen"]
    held_what = "optimizer state" + (" and reference" if learner_state["reference"] else "") + \
        (" and the frozen base" if learner_state["frozen"] else "")
    if layout.shared:
        held += actor_weights
        held_what += ", " + actor_what
    cost = None
    if not refused and all(c.cost is not None for c in compiled):
        # Each learner device receives (about) its whole output shard over ICI, most of it from other hosts.
        cost = Cost(sum(c.cost.flops for c in compiled), sum(c.cost.bytes for c in compiled),
                    sum(max(c.cost.seconds, c.memory.outputs / topology.ici_bandwidth) for c in compiled))
    staged = sum(math.prod(x.shape) * narrowed(x.dtype, compute).itemsize for x in leaves)
    what = "adapters" if lora.enabled else "parameters"
    if layout.actor_spans_hosts:
        hints = [f"more learner devices (now {n_learner}, {local_learner} per host): each host's block of the {what} "
                 f"(about {_size(staged / layout.processes)}iB of {_size(staged)}iB in {_dtypes(actor)} when the "
                 "actor splits every leaf over the hosts) is spread over its own learner devices"]
    else:
        fewer = "" if layout.shared else f" (mesh.actor_devices={layout.actor_devices_per_host} lower)"
        hints = [f"more learner devices per host (now {local_learner}{fewer}): each host's whole copy of the "
                 f"{what} ({_size(staged)}iB, in {_dtypes(actor)}) is spread over its own learner devices"]
    if narrowed(DTYPES[model_config.param_dtype], compute) == np.dtype(DTYPES[model_config.param_dtype]):
        hints.append(f"a model.dtype narrower than model.param_dtype (now {model_config.dtype} and "
                     f"{model_config.param_dtype}): the staged copy is then in the compute dtype")
    notes = ()
    if len(compiled) > 1:
        notes = (f"{len(compiled)} programs, one per group of leaves, run one after the other: memory of the "
                 f"largest, time of all",)
    stage = Program("weight sync stage", n_learner, worst.memory, held, held_what, cost, 1,
                    sum(c.seconds for c in compiled), worst.refusal, tuple(hints), notes=notes)
    return [stage], [copy]


def _dtypes(tree) -> str:
    """The float dtypes of an abstract tree's leaves, e.g. 'bfloat16'."""
    names = sorted({np.dtype(x.dtype).name for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)})
    return "/".join(names) or "its own dtypes"


# ------------------------------------------------------------------------------------------ the step


def model_flops_per_step(config: Config, model: ModelConfig, param_count: int) -> float:
    """Useful FLOPs of one GRPO step, all hosts: 2 per weight per token forward (6 with the backward), plus
    attention (4 x layers x heads x head_dim per token per key attended), at the padded bucket lengths.
    Remat's recomputation and replicated work are not useful FLOPs. With LoRA the base's weights get no
    gradient: 4 per weight per trained token (forward and input gradient); the adapters' few FLOPs are
    not counted."""
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    prompt = min(config.data.max_prompt_len, config.sampler.max_prompt_len)
    new = config.sampler.max_new_tokens
    head = model.hidden_size * model.vocab_size
    body = param_count - head * (1 if model.tie_embeddings else 2)  # the embedding lookup does no matmul
    attention = 4 * model.num_layers * model.num_heads * model.resolved_head_dim

    def forward(tokens: int, scored: int, keys: float) -> float:
        return 2 * body * tokens + attention * tokens * keys + 2 * head * scored

    length = prompt + new - 1
    learner_row = forward(length, new, length / 2)
    optim = config.optim
    extra_forwards = (optim.updates_per_step > 1) + config.loss.needs_reference
    learner = rows * learner_row * (3 * optim.epochs + extra_forwards)
    if config.lora.enabled:
        learner -= rows * optim.epochs * (2 * body * length + 2 * head * new)  # no weight gradients
    sampler = rows * (forward(prompt, 1, prompt / 2) + (new - 1) * forward(1, 1, prompt + new / 2))
    return learner + sampler


def project_step(config: Config, model: ModelConfig, param_count: int, layout: Layout, topology: Topology,
                 programs: list[Program], transfers: list[Transfer]) -> StepProjection | None:
    if any(p.cost is None for p in programs):
        return None
    learner = next(p for p in programs if p.name == "learner step")
    stages = sum(p.cost.seconds for p in programs if p.name == "weight sync stage")
    learner_seconds = learner.cost.seconds + stages + sum(t.seconds for t in transfers)
    actor_seconds = sum(p.cost.seconds * p.calls_per_step for p in programs if p.actor)
    overlapped = not layout.shared and config.grpo.max_staleness > 0
    seconds = max(learner_seconds, actor_seconds) if overlapped else learner_seconds + actor_seconds
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    tokens = rows * (min(config.data.max_prompt_len, config.sampler.max_prompt_len) + config.sampler.max_new_tokens)
    flops = model_flops_per_step(config, model, param_count)
    mfu = flops / (seconds * len(topology.devices) * topology.peak_flops)
    return StepProjection(learner_seconds, actor_seconds, overlapped, seconds, tokens, flops, mfu)


# ------------------------------------------------------------------------------------------ the command


def compile_run(config: Config, topology_name: str, chips_per_host: str = "", config_path: str = "", *,
                isolate: bool = True) -> Report:
    """Lay `config` out on the topology as the trainer would and compile every program of a run.

    isolate: compile in a child process (one for the whole run), so that libtpu killing it (it aborts on some
    layouts: a failed internal check, SIGABRT) becomes a CompilerCrash naming the program being compiled
    instead of the end of this process. The child sends back the report; its output is kept from the
    terminal (it is quoted when it fails)."""
    if not isolate:
        return _compile_run(config, topology_name, chips_per_host, config_path)
    with tempfile.TemporaryDirectory(prefix="grpo-jax-compile-") as tmp:
        work = pathlib.Path(tmp)
        (work / "args.pkl").write_bytes(pickle.dumps((config, topology_name, chips_per_host, config_path)))
        with open(work / "output", "wb") as output:
            child = subprocess.Popen([sys.executable, "-c", "from grpo_jax.planning.compile import _child_main; _child_main()",
                                      str(work)], stdin=subprocess.DEVNULL, stdout=output, stderr=output)
            try:
                code = child.wait()
            except BaseException:  # interrupted: take the child down with us
                child.kill()
                child.wait()
                raise
        result = work / "result.pkl"
        if code == 0 and result.exists():
            kind, value = pickle.loads(result.read_bytes())
            if kind == "error":
                raise value
            # Described devices do not pickle: the child sends the report without its topology, described again
            # here (libtpu describes a slice without compiling anything, which is what crashes).
            return dataclasses.replace(value, topology=tpu_topology(topology_name, chips_per_host))
        progress = (work / "progress").read_text().splitlines() if (work / "progress").exists() else []
        program = progress[-1] if progress else ""
        text = (work / "output").read_text(errors="replace")
    if code < 0:
        raise CompilerCrash(crash_message(program, -code, text))
    raise RuntimeError(f"grpo-jax compile: the compiling process exited with code {code}"
                       f"{' while compiling ' + program if program else ''}; its output:\n{text[-20000:]}")


def crash_message(program: str, signum: int, output: str) -> str:
    """One line: the program whose compile killed the process, the signal, libtpu's failed check if it printed
    one, that this is a compiler bug (not a memory verdict), and the layouts to try instead."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    check = next((" ".join(line[line.find("Check failed"):].split())[:200] for line in output.splitlines()
                  if "Check failed" in line), "")
    where = program or "the first program"
    if signum == signal.SIGKILL:
        return (f"{where}: the compiling process was killed (SIGKILL) while compiling it, most likely by the "
                "system for want of host memory (not a verdict on the TPU's memory): compile on a machine with "
                "more RAM")
    base = where.split(" (")[0]
    if base.startswith(("learner", "weight sync")):
        layouts = ("another learner layout (mesh.learner.fsdp / mesh.learner.tensor / mesh.learner.data), or "
                   "mesh.actor_devices=0 (the actor on the learner's devices, which changes the learner's mesh)")
    else:
        layouts = "another actor layout (mesh.actor.tensor, mesh.actor_devices, or mesh.actor_devices=0)"
    return (f"{where}: libtpu's compiler crashed while compiling it ({name}{': ' + check if check else ''}); a bug in "
            f"the TPU compiler on this layout, not a memory verdict: try {layouts}")


def _child_main() -> None:
    """The compiling child of compile_run: argv[1] is its work directory (args.pkl in; progress, result.pkl out)."""
    global _PROGRESS
    work = pathlib.Path(sys.argv[1])
    _PROGRESS = work / "progress"
    config, topology_name, chips_per_host, config_path = pickle.loads((work / "args.pkl").read_bytes())
    try:
        report = _compile_run(config, topology_name, chips_per_host, config_path)
        result = ("report", dataclasses.replace(report, topology=None))  # its devices do not pickle
    except UserError as e:
        result = ("error", e)
    (work / "result.pkl").write_bytes(pickle.dumps(result))


def _compile_run(config: Config, topology_name: str, chips_per_host: str = "", config_path: str = "") -> Report:
    topology = tpu_topology(topology_name, chips_per_host)
    model = run_model_config(config)
    layout = run_layout(config, topology.devices)
    _, actor_weights = actor_params(model, layout.actor_mesh)
    param_count = sum(math.prod(x.shape) for x in jax.tree.leaves(actor_weights))
    # What the other side keeps on shared devices (mesh.actor_devices=0): the actor's weights and head, and the
    # continuous engine's slot state.
    head_bytes = model.vocab_size * model.hidden_size * np.dtype(DTYPES[model.dtype]).itemsize
    actor_bytes = shard_bytes(actor_weights) + head_bytes // layout.actor_mesh.shape["tensor"]
    actor_what = "the actor's copy of the weights"
    setup = None
    if config.sampler.engine == "continuous":
        setup = engine_setup(config, model, layout)
        actor_bytes += setup.state_bytes
        actor_what += " and its engine's slot state"
    # A persistent compilation cache cannot load executables compiled for a described topology (there is no
    # TPU client): it would only write entries and warn.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        learner, learner_state = learner_program(config, model, layout, topology, actor_bytes, actor_what)
        if setup is not None:
            actor = engine_programs(config, model, layout, topology, setup, sum(learner_state.values()))
        else:
            actor = [sampler_program(config, model, layout, topology, sum(learner_state.values()))]
        if config.eval.every_steps:
            chunk = next((p for p in actor if p.name == "engine chunk"), None)
            actor.append(eval_program(config, model, layout, topology, sum(learner_state.values()), chunk))
        stage, transfers = sync_parts(model, layout, topology, learner_state, actor_bytes, config.lora, actor_what)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    programs = [learner, *actor, *stage]
    step = project_step(config, model, param_count, layout, topology, programs, transfers)
    return Report(config_path, topology, model, param_count, describe_layout(layout), tuple(programs),
                  tuple(transfers), step)


def describe_layout(layout: Layout) -> str:
    def axes(mesh) -> str:
        return ", ".join(f"{name} {size}" for name, size in mesh.shape.items())

    if layout.actor_spans_hosts:
        actor = (f"actor (one across all {layout.processes} hosts, every host's prompts): {layout.actor_mesh.size} "
                 f"device(s), {layout.actor_devices_per_host} per host")
    else:
        actor = "actor (every host): " + ("the learner's devices" if layout.shared else
                                          f"{layout.actor_mesh.size} device(s)")
    return (f"{actor}, {{{axes(layout.actor_mesh)}}}; learner: {layout.learner_mesh.size} "
            f"device(s) over {layout.processes} host(s), {{{axes(layout.learner_mesh)}}}")


def _size(n: float | None) -> str:
    """Bytes, short: 15.8G, 412M, 36K."""
    if n is None:
        return "-"
    for unit, scale in (("T", 2 ** 40), ("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}" if abs(n) < 100 * scale else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}"


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _count(n: float | None) -> str:
    """FLOPs, short: 1.2P, 35T, 980G."""
    if n is None:
        return "-"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_report(report: Report) -> str:
    t, m = report.topology, report.model
    hosts = f"{t.processes} host{'s' if t.processes > 1 else ''}"
    lines = [
        f"{report.config_path or 'config'} on {t.name}: {len(t.devices)} {t.chip.name} devices, {hosts}; per device "
        f"{_size(t.hbm_bytes)}iB HBM, {t.peak_flops / 1e12:.0f} TFLOP/s bf16, {t.hbm_bandwidth / 1e9:.0f} GB/s HBM, "
        f"{t.ici_bandwidth / 1e9:.0f} GB/s ICI in",
        f"model: {m.architecture}, {_count(report.param_count)} parameters, {m.num_layers} layers, weights "
        f"{m.param_dtype}, compute {m.dtype}, remat {str(m.remat).lower()}",
        report.layout,
        "",
        "per device (bytes in K/M/G/T of 2^10/2^20/2^30/2^40): memory (args + out - alias + temp + code + held = total), "
        "FLOPs and HBM bytes per call",
        f"{'program':<20}{'devices':>8}{'args':>7}{'out':>7}{'alias':>7}{'temp':>7}{'code':>7}{'held':>7}"
        f"{'total':>7}{'HBM':>7}{'fits':>6}{'FLOPs':>8}{'bytes':>8}{'roofline':>11}{'calls':>6}{'compile':>9}",
    ]
    for p in report.programs:
        mem, cost = p.memory, p.cost
        fits = "no" if p.total is None or p.total > t.hbm_bytes else "yes"
        lines.append(
            f"{p.name:<20}{p.devices:>8}{_size(mem and mem.arguments):>7}{_size(mem and mem.outputs):>7}"
            f"{_size(mem and mem.aliased):>7}{_size(mem and mem.temporaries):>7}{_size(mem and mem.code):>7}"
            f"{_size(p.held):>7}{_size(p.total):>7}{_size(t.hbm_bytes):>7}{fits:>6}"
            f"{_count(cost and cost.flops):>8}{_size(cost and cost.bytes):>8}{_time(cost and cost.seconds):>11}"
            f"{p.calls_per_step:>6}{p.compile_seconds:>8.1f}s")
    for p in report.programs:
        if p.held:
            lines.append(f"  {p.name}: held = {p.held_what}")
        if p.refusal:
            lines.append(f"  {p.name}: refused by the compiler: {p.refusal}")
        if p.cost_note:
            lines.append(f"  {p.name}: no time estimate: {p.cost_note}")
        for note in p.notes:
            lines.append(f"  {p.name}: {note}")
    for x in report.transfers:
        lines.append(f"{x.name}: {_size(x.bytes_per_device)}iB into each actor device, {_time(x.seconds)} ({x.how}; "
                     "a transfer, not a compiled program)")
    s = report.step
    lines.append("")
    if s is None:
        lines.append("projected step: none (a program does not fit, or has no time estimate)")
    else:
        mode = "overlapped: disjoint devices, max_staleness >= 1" if s.overlapped else "one after the other"
        lines.append(f"projected step: {_time(s.seconds)} (learner + weight sync {_time(s.learner_seconds)}, actor "
                     f"{_time(s.actor_seconds)}; {mode}); {s.tokens / s.seconds:,.0f} tokens/s ({s.tokens:,} prompt + "
                     f"completion tokens per step at the bucket lengths); MFU {100 * s.mfu:.1f}% "
                     f"({_count(s.model_flops)} model FLOPs per step)")
    lines.append("roofline = max(FLOPs / peak, bytes / HBM bandwidth) per loop body, times its trip count (decode: "
                 "every row to max_new_tokens); collectives and host work are not counted: a lower bound")
    return "\n".join(lines)


def check_fits(report: Report) -> None:
    """DoesNotFit, one line: each program that does not fit, by how much, and the settings that would help."""
    t = report.topology
    problems = []
    for p in report.programs:
        if p.memory is None:
            excess = refusal_excess(p.refusal)
            problems.append(f"{p.name} refused by the compiler{', ' + excess if excess else ''} ({p.refusal}); "
                            "try " + ", ".join(p.hints))
        elif p.total > t.hbm_bytes:
            problems.append(f"{p.name} needs {_size(p.total)}iB per device, {_size(p.total - t.hbm_bytes)}iB over the "
                            f"{_size(t.hbm_bytes)}iB of a {t.chip.name} device; try " + ", ".join(p.hints))
    if problems:
        raise DoesNotFit(f"does not fit on {t.name}: " + "; ".join(problems))
