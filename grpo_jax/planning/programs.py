"""The programs of a run compiled for a topology: one function per program, each returning a Program (per-device
memory, cost per call, calls per step, the settings that would shrink it).

Every program and its arguments come from the run description (run.plan.RunPlan), the one the trainer runs
from: the learner step (RunPlan.learner_step) and the weight sync (RunPlan.weight_sync) here; the generators' in
actor_programs.py, which their own classes publish (programs(), rollout.common) over the plan's actor weights. What is
specific to compiling for a topology lives here: compile_one (lower, compile, read memory and cost; an
out-of-memory refusal becomes an answer), the roofline, the costing of loop bodies on their own (XLA counts a
loop body once whatever its trip count), and the hints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model.transformer import DTYPES
from grpo_jax.planning import compile_cache, hlo_cost
from grpo_jax.planning.topology import Topology
from grpo_jax.planning.units import size_text
from grpo_jax.rollout.weight_sync import narrowed
from grpo_jax.run.plan import RunPlan, shard_bytes


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

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds)

    def __mul__(self, times: float) -> Cost:
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
    breakdown: hlo_cost.Breakdown | None = None  # the learner step's FLOPs and bytes by part (the report's
    # "where the bytes go")
    # cost and calls_per_step are at the expected lengths (optim.expected_*_len); these at the maximum (every
    # completion at max_new_tokens) where they differ (None: the same), for the worst-case projection.
    worst_cost: Cost | None = None
    worst_calls: int | None = None

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
class Compiled:
    memory: Memory | None
    cost: Cost | None  # XLA's cost analysis: each loop body counted once
    refusal: str
    seconds: float
    breakdown: hlo_cost.Breakdown | None = None  # every loop counted as often as it runs, split by part


# Set in the compiling child process (see compile_run): compile_one appends a line here as each program starts
# and another as it ends (_record_progress), so that the parent shows the compile's progress as it goes and
# names the program being compiled when libtpu kills the child.
PROGRESS: pathlib.Path | None = None
# Testing hook, honoured only in the child: compile_one os.abort()s at the program with this label, as libtpu
# does on a failed internal check.
ABORT_AT_ENV = "GRPO_JAX_COMPILE_ABORT_AT"
RAISE_AT_ENV = "GRPO_JAX_COMPILE_RAISE_AT"  # tests: the child raises there, as a program it cannot trace would


def _record_progress(event: str, label: str, seconds: float = 0.0) -> None:
    """One line of PROGRESS, written whole: event ("start" or "end"), label, the program's compile seconds (at its
    end) and this process's peak host memory so far in bytes, tab-separated (compile.read_progress reads it)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB
    with open(PROGRESS, "a") as f:
        f.write(f"{event}\t{' '.join(label.split())}\t{seconds:.3f}\t{peak}\n")


def compile_one(jitted, args: tuple, topology: Topology, static: dict | None = None, label: str = "") -> Compiled:
    """Lower and compile; a RESOURCE_EXHAUSTED refusal by the compiler becomes `refusal`. A program compiled
    before on this topology is not compiled again: its figures come from the compile cache (compile_cache.py)
    and `seconds` is the lookup's time. `label` names the program (or the loop body compiled alone for its
    cost) in the progress lines and in a crash report."""
    if PROGRESS is not None:
        _record_progress("start", label)
        if label and os.environ.get(ABORT_AT_ENV) == label:
            os.abort()
        if label and os.environ.get(RAISE_AT_ENV) == label:
            raise NotImplementedError(f"{RAISE_AT_ENV}={label}: raised for a test")
    start = time.perf_counter()
    lowered = jitted.lower(*args, **(static or {}))
    key = compile_cache.program_key(lowered, args, topology.name)
    entry = compile_cache.load(key)
    if entry is not None:
        seconds = time.perf_counter() - start
        if PROGRESS is not None:
            _record_progress("cached", label, entry.seconds)
    else:
        entry = _compile(lowered, start)
        compile_cache.store(key, entry)
        seconds = entry.seconds
        if PROGRESS is not None:
            _record_progress("end", label, seconds)
    if entry.refusal:
        return Compiled(None, None, entry.refusal, seconds)
    breakdown = hlo_cost.Breakdown.from_dict(entry.breakdown) if entry.breakdown else None
    return Compiled(Memory(**entry.memory), roofline(entry.flops, entry.bytes, topology), "", seconds, breakdown)


def _compile(lowered: jax.stages.Lowered, start: float) -> compile_cache.Entry:
    """XLA's figures for a lowered program (`start`: when its lowering began, counted in its seconds)."""
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError; only the out-of-memory refusal is an answer
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return compile_cache.Entry(None, None, None, _refusal_line(str(e)), time.perf_counter() - start)
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = Memory(stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                    stats.temp_size_in_bytes, stats.generated_code_size_in_bytes)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    flops, nbytes = float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))
    breakdown = hlo_cost.program_cost(compiled.as_text()).as_dict()
    return compile_cache.Entry(dataclasses.asdict(memory), flops, nbytes, "", seconds, breakdown)


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
    return f"{size_text(need - have)} over"


def learner_program(plan: RunPlan, topology: Topology, actor_held: int,
                    actor_what: str = "the actor's copy of the weights") -> tuple[Program, dict]:
    """The learner step (RunPlan.learner_step: the program and arguments the trainer runs), compiled.

    Memory: at the most rows a step can have (RunPlan.learner_rows; packed: every completion at
    max_new_tokens). Cost: at the expected rows (RunPlan.expected_learner_rows: the same without packing or
    without optim.expected_*_len; else the step compiled again at those rows), read from the compiled program
    with every loop counted as often as it runs (hlo_cost.py; XLA's own cost analysis counts each loop body
    once), and split by part for the report's "where the bytes go"."""
    learner, mesh = plan.learner_step, plan.learner_mesh
    params, opt_state, reference, frozen = learner.params, learner.opt_state, learner.reference, learner.frozen
    whole = compile_one(learner.jitted, learner.args, topology, label="learner step")
    rows, expected_rows = plan.learner_rows, plan.expected_learner_rows
    notes = ()
    if plan.packing:
        notes = (f"packed rows of {plan.row_length} tokens: memory at {rows} rows (every completion at "
                 f"max_new_tokens), time at {expected_rows} (sequences of {plan.expected_lengths.describe()}; "
                 "optim.expected_prompt_len / expected_completion_len / expected_lengths_from; none: the "
                 "buckets)",)

    held, held_what = 0, ""
    if plan.shared:
        held, held_what = actor_held, actor_what
    state_bytes = {"params": shard_bytes(params), "opt_state": shard_bytes(opt_state),
                   "reference": shard_bytes(reference) if reference is not None else 0,
                   "frozen": shard_bytes(frozen) if frozen is not None else 0}
    hints = learner_hints(plan, sum(state_bytes.values()) + held, topology)
    if whole.memory is None:
        return Program("learner step", mesh.size, None, held, held_what, None, 1, whole.seconds, whole.refusal,
                       hints, notes=notes), state_bytes

    def uncosted(seconds: float, why: str, refusal: str):
        # The whole step compiled (its memory stands) but a part compiled for its cost was refused.
        return (Program("learner step", mesh.size, whole.memory, held, held_what, None, 1, seconds, "", hints,
                        cost_note=f"{why} was refused: {refusal}", notes=notes), state_bytes)

    seconds = whole.seconds
    costed = whole
    if expected_rows != rows:
        costed = compile_one(learner.jitted, learner.args_with(plan.abstract_batch(expected_rows)), topology,
                             label="learner step (at the expected rows, for its cost)")
        seconds += costed.seconds
        if costed.cost is None:
            return uncosted(seconds, "the step at the expected rows", costed.refusal)
    # The step's loops (updates, micro-batches, log-prob chunks) counted as often as they run (hlo_cost.py).
    breakdown = costed.breakdown
    cost = roofline(breakdown.flops, breakdown.bytes, topology)
    note = ()
    if breakdown.uncounted_loops:
        note = (f"{breakdown.uncounted_loops} loop(s) of the step whose trip count the compiled program does "
                "not show are counted once",)
    worst = None  # the step at the most rows, for the worst-case projection
    if costed is not whole and whole.breakdown is not None:
        worst = roofline(whole.breakdown.flops, whole.breakdown.bytes, topology)
    return (Program("learner step", mesh.size, whole.memory, held, held_what, cost, 1, seconds, "", hints,
                    notes=notes + note, breakdown=breakdown, worst_cost=worst), state_bytes)


def learner_hints(plan: RunPlan, state: int, topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the learner step, the ones that can help first: activations do not matter while
    the parameters and moments (`state`, per device) alone exceed the device."""
    config, model_config = plan.config, plan.model
    optim, mesh = config.optim, plan.learner_mesh
    more = ("a larger slice" if plan.shared
            else f"mesh.actor_devices={config.mesh.actor_devices} lower, or a larger slice")
    spread = f"a larger mesh.learner.fsdp (now {mesh.shape['fsdp']}) over more learner devices ({more})"
    if plan.shared:  # the actor's copy of the weights shares these devices
        spread += "; or mesh.actor_devices > 0, the actor's copy of the weights on devices of its own"
    reference = (["loss.kl_coef=0 (no reference copy)"]
                 if config.loss.needs_reference and not config.lora.enabled else [])
    if state > topology.hbm_bytes:
        lora = [] if config.lora.enabled else ["lora.rank=16 (adapters on a frozen base: no moments for its weights)"]
        return (f"{spread}: parameters and optimizer state alone take {size_text(state)}iB per device",
                *reference, *lora)
    hints = [] if model_config.remat else ["model.remat=true"]
    mini_rows = plan.learner_rows // optim.mini_batches
    micro = plan.micro_rows or mini_rows
    new, vocab = config.sampler.max_new_tokens, model_config.vocab_size
    positions = min(optim.logprob_chunk or new, new)  # the completion positions whose logits exist at once
    if micro > 1:
        smaller = next(m for m in range(micro // 2, 0, -1) if mini_rows % m == 0)
        key, value = ("micro_batch_tokens", smaller * plan.row_length) if optim.micro_batch_tokens else \
            ("micro_batch_size", smaller)
        hints.append(f"optim.{key}={value} or lower (now {micro} rows: one micro-batch's float32 logits "
                     f"chunk, [{micro}, {positions}, {vocab}], is {size_text(4 * micro * positions * vocab)}iB before "
                     "any split)")
    if positions > 16:
        hints.append(f"optim.logprob_chunk={positions // 2} (now {optim.logprob_chunk}: the completion positions "
                     "whose logits exist at once)")
    return (*hints, spread, *reference)


def sync_parts(plan: RunPlan, topology: Topology, learner_state: dict, actor_weights: int,
               actor_what: str = "the actor's copy of the weights") -> tuple[list[Program], list[Transfer]]:
    """The learner's new weights onto the actor's layout after every step (trainer.weights_copy with the
    plan's WeightSync); with LoRA the adapters only (the actor holds its own copy of the frozen base, sent once
    at the start).

    One host: each actor shard put together from the learner's shards (device-to-device copies, cast to the
    compute dtype on the way), a transfer. Several hosts: first `weight sync stage`, the jitted programs on the
    learner mesh (WeightSync.stage_program, one per group of leaves, WeightSync.group_slices, run one after the
    other) that reshard the parameters so that every host holds, spread over its own learner devices and in the
    dtype the actor keeps, what its actor devices need: a whole copy for an actor per host, its own block of
    every leaf for an actor spanning the hosts; the report shows the group that needs the most memory, and the
    time of all of them. Then each host's copy from those shards onto its actor devices, a transfer."""
    model_config, lora = plan.model, plan.config.lora
    compute = plan.actor_dtype
    params = plan.learner_step.params  # the trained parameters (the adapters with LoRA), as the learner holds them
    _, actor = plan.actor_adapters() if lora.enabled else plan.actor_params()
    actor_in = shard_bytes(actor)
    n_learner = plan.learner_mesh.size
    local_learner = n_learner // plan.processes  # each host's learner devices
    # Every actor device receives its shard; a host's learner devices send them between them.
    seconds = max(actor_in, actor_in * plan.actor_devices_per_host / local_learner) / topology.ici_bandwidth
    if plan.processes == 1:
        return [], [Transfer("weight sync copy", actor_in, seconds,
                             f"each actor shard put together from the learner's shards (in {_dtypes(actor)}), "
                             "device-to-device at the ICI figure")]
    leaves = jax.tree.leaves(params)
    targets = [x.sharding for x in jax.tree.leaves(actor)]  # the actor's plan, leaf for leaf
    sync = plan.weight_sync()
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
    if plan.shared:
        held += actor_weights
        held_what += ", " + actor_what
    cost = None
    if not refused and all(c.cost is not None for c in compiled):
        # Each learner device receives (about) its whole output shard over ICI, most of it from other hosts.
        cost = Cost(sum(c.cost.flops for c in compiled), sum(c.cost.bytes for c in compiled),
                    sum(max(c.cost.seconds, c.memory.outputs / topology.ici_bandwidth) for c in compiled))
    staged = sum(math.prod(x.shape) * narrowed(x.dtype, compute).itemsize for x in leaves)
    what = "adapters" if lora.enabled else "parameters"
    if plan.actor_spans_hosts:
        hints = [f"more learner devices (now {n_learner}, {local_learner} per host): each host's block of the {what} "
                 f"(about {size_text(staged / plan.processes)}iB of {size_text(staged)}iB in {_dtypes(actor)} when the "
                 "actor splits every leaf over the hosts) is spread over its own learner devices"]
    else:
        fewer = "" if plan.shared else f" (mesh.actor_devices={plan.actor_devices_per_host} lower)"
        hints = [f"more learner devices per host (now {local_learner}{fewer}): each host's whole copy of the "
                 f"{what} ({size_text(staged)}iB, in {_dtypes(actor)}) is spread over its own learner devices"]
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
