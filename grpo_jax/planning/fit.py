"""`grpo-jax compile CONFIG --topology NAME --fit`: search layouts for one that fits the slice, fastest first.

A layout is the settings that decide where a run's memory goes and how fast its step is, not what it learns:
the actor/learner device split (mesh.actor_devices), the actor's fsdp x tensor, the learner's data x fsdp x
tensor, optim.micro_batch_size, sampler.slots (the continuous engine), sampler.kv_pages (its page budget, with
sampler.kv_cache: paged) and model.remat. The search:

1. enumerate_layouts (pure: integers in, no devices, no compiling) lists every combination of a bounded set
   of values per setting that can be laid out at all: the device counts divide, every host keeps a learner
   device, the tensor axis divides the attention heads and the MLP and stays on one host, the batch and each
   micro-batch split evenly over the learner's data x fsdp (sharding.rows_split_problem), the engine's slots
   divide a host's samples (or are the config's). Settings the user sets on the command line are held.
2. estimate (pure) gives each a rough per-device memory (parameters, gradients and AdamW moments split over
   fsdp x tensor, saved activations of one micro-batch, the actor's two copies of the weights and its KV
   cache) and a rough roofline step time; search_order puts the layouts estimated to fit first, fastest
   first, then the others, smallest first, the device layouts taking turns in each group. The estimate only
   orders the compiles: the verdicts and the ranking come from the compiled programs.
3. fit compiles up to `limit` of them in that order with the compile command's own path
   (compile.compile_run, each in its own compiling child), after the config loader and the run description
   (RunPlan.build) have accepted the layout, and ranks those that fit by the projected step time.

Searched values: mesh.actor_devices 0 (shared) and the powers of two below a host's device count; the actor
mesh (one per host; an actor across hosts is not searched) tensor x fsdp with data 1; the learner every
data x fsdp x tensor; optim.micro_batch_size the mini-batch halved down to one row per learner batch split;
sampler.slots a host's samples per step, halved twice; with paged KV, sampler.kv_pages per bank what the bank's
rings would hold, halved twice while a whole sequence fits (and the config's own); model.remat off and on.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from grpo_jax.config_io import load_config
from grpo_jax.errors import UserError
from grpo_jax.model.transformer import DTYPES, ModelConfig, abstract_model
from grpo_jax.parallel.sharding import rows_split_problem
from grpo_jax.planning.compile import compile_run
from grpo_jax.planning.programs import refusal_excess
from grpo_jax.planning.report import Report
from grpo_jax.planning.topology import Topology, tpu_topology
from grpo_jax.planning.units import size_text, time_text
from grpo_jax.rollout.common import cache_heads
from grpo_jax.run.config import Config
from grpo_jax.run.plan import RunPlan, run_model_config

DEFAULT_LIMIT = 12  # compiles per --fit run: each costs seconds (tiny models) to tens of minutes (70B) on a CPU

# The settings --fit chooses; an override of one of them (or of a section holding it) on the command line holds
# it fixed.
SEARCHED = ("mesh.actor_devices", "mesh.actor.data", "mesh.actor.fsdp", "mesh.actor.tensor", "mesh.learner.data",
            "mesh.learner.fsdp", "mesh.learner.tensor", "optim.micro_batch_size", "sampler.slots", "sampler.kv_pages",
            "model.remat")


class NothingFits(UserError):
    """No layout searched by --fit fits the slice (or none could be laid out)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    actor_devices: int  # per host; 0: the actor samples on the learner's devices
    actor: tuple[int, int, int]  # the actor mesh's (data, fsdp, tensor)
    learner: tuple[int, int, int]  # the learner mesh's (data, fsdp, tensor)
    micro_batch_size: int
    slots: int  # the continuous engine's slots per host; 0 with the static sampler (not searched)
    remat: bool
    kv_pages: int = 0  # pages per bank of the paged engine (sampler.kv_pages resolved); 0 without paged KV

    def overrides(self) -> list[str]:
        """The key=value words that select this layout, for grpo-jax train / compile."""
        words = [f"mesh.actor_devices={self.actor_devices}"]
        words += [f"mesh.actor.{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor"), self.actor)]
        words += [f"mesh.learner.{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor"), self.learner)]
        words.append(f"optim.micro_batch_size={self.micro_batch_size}")
        if self.slots:
            words.append(f"sampler.slots={self.slots}")
        if self.kv_pages:
            words.append(f"sampler.kv_pages={self.kv_pages}")
        words.append(f"model.remat={str(self.remat).lower()}")
        return words

    def label(self) -> str:
        actor = "shared" if self.actor_devices == 0 else f"{self.actor_devices}/host"
        _, actor_fsdp, actor_tensor = self.actor
        data, fsdp, tensor = self.learner
        slots = (f" slots {self.slots}" if self.slots else "") + (f" pages {self.kv_pages}" if self.kv_pages else "")
        return (f"actor {actor} fsdp {actor_fsdp} tensor {actor_tensor} | learner data {data} fsdp {fsdp} "
                f"tensor {tensor} | micro {self.micro_batch_size}{slots} remat {'on' if self.remat else 'off'}")


@dataclasses.dataclass(frozen=True)
class SliceShape:
    """What the search needs of a slice: its hosts and devices, and one device's figures."""

    hosts: int
    devices_per_host: int
    hbm_bytes: float
    peak_flops: float
    hbm_bandwidth: float

    @classmethod
    def of(cls, topology: Topology) -> SliceShape:
        return cls(topology.processes, len(topology.devices) // topology.processes, topology.hbm_bytes,
                   topology.peak_flops, topology.hbm_bandwidth)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def halvings(start: int, floor: int, count: int) -> list[int]:
    """start, start / 2, ... while whole and at least floor, at most `count` values."""
    values = []
    while len(values) < count and start >= floor and start >= 1:
        values.append(start)
        if start % 2:
            break
        start //= 2
    return values


def pinned_keys(overrides: list[str]) -> frozenset[str]:
    """The searched settings named by command-line overrides (`mesh.learner={...}` names all three of its axes)."""
    keys = [word.split("=", 1)[0].strip() for word in overrides]
    return frozenset(s for s in SEARCHED for k in keys if s == k or s.startswith(k + "."))


def enumerate_layouts(config: Config, model: ModelConfig, hosts: int, devices_per_host: int,
                      pinned: frozenset[str] = frozenset()) -> list[Layout]:
    """Every layout of the search space that can be laid out on `hosts` x `devices_per_host` devices (see the
    module docstring), with the `pinned` settings at the config's values."""
    grpo, optim = config.grpo, config.optim
    rows = grpo.prompts_per_step * grpo.group_size
    if grpo.prompts_per_step % hosts or rows % optim.mini_batches:
        return []  # RunPlan.build / Config.validate refuse every layout, with their own messages
    host_rows = rows // hosts
    mini_rows = rows // optim.mini_batches
    engine = config.sampler.engine == "continuous"

    def splits_model(tensor: int) -> bool:
        """A tensor axis that splits the attention heads and the MLP: one that does not leaves those weights
        whole on every device of the axis (sharding.spec_for replicates them), tensor-way duplicated work. The
        KV heads may stay whole (a model with fewer KV heads than the axis: the known trade-off)."""
        return model.num_heads % tensor == 0 and model.intermediate_size % tensor == 0

    def page_choices(slots: int) -> list[int]:
        """The paged engine's pages per bank searched for `slots` slots (see the module docstring); [0] without
        paged KV. A pinned sampler.kv_pages holds the config's, resolved (0: what the rings would hold)."""
        sampler = config.sampler
        if not (engine and sampler.kv_cache == "paged"):
            return [0]
        bank_slots = sampler.banks(slots)[1]
        if "sampler.kv_pages" in pinned:
            return [sampler.pages_per_bank(bank_slots)]
        rings = dataclasses.replace(sampler, kv_pages=0).pages_per_bank(bank_slots)
        choices = halvings(rings, sampler.pages_per_sequence, 3)
        if sampler.kv_pages and sampler.kv_pages not in choices:
            choices.append(sampler.kv_pages)
        return choices

    def held(key: str, values: list) -> list:
        """The config's value for a pinned setting (when it is one of `values`), else `values`."""
        if key not in pinned:
            return values
        section, _, name = key.rpartition(".")
        current = config
        for part in section.split("."):
            current = getattr(current, part)
        value = getattr(current, name)
        if key == "optim.micro_batch_size" and value == 0:
            value = mini_rows  # 0: the whole mini-batch
        if key in ("mesh.actor.fsdp", "mesh.learner.fsdp") and value == -1:
            return values  # -1: whatever the other axes leave, which every candidate satisfies
        return [v for v in values if v == value]

    actor_choices = [0] + [n for n in halvings(devices_per_host // 2, 1, devices_per_host) if n < devices_per_host]
    remat_choices = held("model.remat", [False, True])
    layouts = []
    for actor_devices in held("mesh.actor_devices", sorted(actor_choices)):
        actor_count = actor_devices or devices_per_host
        learner_per_host = devices_per_host - actor_devices
        learner_count = learner_per_host * hosts
        actor_meshes = [(1, actor_count // t, t) for t in divisors(actor_count) if splits_model(t)]
        actor_meshes = [m for m in actor_meshes if m[0] in held("mesh.actor.data", [m[0]])
                        and m[1] in held("mesh.actor.fsdp", [m[1]]) and m[2] in held("mesh.actor.tensor", [m[2]])]
        learner_meshes = []
        # The tensor axis stays on one host (sharding.make_mesh); data x fsdp takes the rest.
        for tensor in divisors(learner_per_host):
            if not splits_model(tensor):
                continue
            for data in divisors(learner_count // tensor):
                learner_meshes.append((data, learner_count // tensor // data, tensor))
        learner_meshes = [m for m in learner_meshes if m[0] in held("mesh.learner.data", [m[0]])
                          and m[1] in held("mesh.learner.fsdp", [m[1]])
                          and m[2] in held("mesh.learner.tensor", [m[2]])]
        slot_choices = [0]
        if engine:
            slot_choices = halvings(host_rows, 1, 3)
            if config.sampler.slots and config.sampler.slots not in slot_choices:
                slot_choices.append(config.sampler.slots)
            slot_choices = held("sampler.slots", slot_choices)
        for actor, learner in itertools.product(actor_meshes, learner_meshes):
            splits = learner[0] * learner[1]
            if rows_split_problem(splits, hosts, host_rows):
                continue
            # A micro-batch that does not split over data x fsdp is computed whole on every learner device.
            micro_choices = [m for m in halvings(mini_rows, splits, 16) if m % splits == 0]
            if optim.micro_batch_size and optim.micro_batch_size not in micro_choices \
                    and optim.micro_batch_size % splits == 0:
                micro_choices.append(optim.micro_batch_size)
            for micro, slots, remat in itertools.product(held("optim.micro_batch_size", micro_choices),
                                                         slot_choices, remat_choices):
                layouts += [Layout(actor_devices, actor, learner, micro, slots, remat, pages)
                            for pages in page_choices(slots)]
    return layouts


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Rough figures for ordering the compiles, not verdicts: per-device bytes of the busiest device of each
    side (with a shared actor both are the same devices) and a roofline step time."""

    learner_bytes: float
    actor_bytes: float
    seconds: float
    fits: bool

    @property
    def peak_bytes(self) -> float:
        return max(self.learner_bytes, self.actor_bytes)


def estimate(config: Config, model: ModelConfig, param_count: int, layout: Layout, shape: SliceShape) -> Estimate:
    """Memory per device and step time of `layout`, from the config's shapes alone (see Estimate). Collectives,
    attention's FLOPs and XLA's temporaries beyond those named here are not counted."""
    grpo, optim, sampler = config.grpo, config.optim, config.sampler
    param_size = np.dtype(DTYPES[model.param_dtype]).itemsize
    compute_size = np.dtype(DTYPES[model.dtype]).itemsize
    hidden, layers = model.hidden_size, model.num_layers
    rows = grpo.prompts_per_step * grpo.group_size
    mini_rows = rows // optim.mini_batches
    micro = layout.micro_batch_size or mini_rows
    prompt = min(config.data.max_prompt_len, sampler.max_prompt_len)
    length = prompt + sampler.max_new_tokens
    data, fsdp, tensor = layout.learner
    learner_count = data * fsdp * tensor
    _, actor_fsdp, actor_tensor = layout.actor
    actor_count = actor_fsdp * actor_tensor

    # Learner: weights, gradients and two moments (LoRA: only the frozen weights count), split over fsdp x tensor
    # (data replicates them); one micro-batch's saved activations: with remat each layer's input, without it
    # about the inputs of every matmul, the MLP's activations and the attention scores.
    state = param_count * param_size * (1 if config.lora.enabled else 4) / (fsdp * tensor)
    rows_per_device = micro / (data * fsdp)
    if layout.remat:
        per_token = layers * hidden + (6 * hidden + 3 * model.intermediate_size + model.num_heads * length) / tensor
    else:
        per_token = layers * (6 * hidden + 3 * model.intermediate_size + model.num_heads * length) / tensor
    activations = rows_per_device * length * per_token * compute_size
    positions = min(optim.logprob_chunk or sampler.max_new_tokens, sampler.max_new_tokens)
    logits = 3 * rows_per_device * positions * model.vocab_size * 4 / tensor  # float32 logits, softmax, gradient
    learner_bytes = state + activations + logits

    # Actor: the weights and the next ones (in the compute dtype), and the KV cache of the sequences decoding at
    # once (laid out as rollout.common.cache_layout lays them out: split over tensor, each KV head repeated where
    # their number does not divide it); the engine's chunk holds about one more bank.
    # With paged KV the full-attention layers' cache is the banks' pools, and as many sequences decode at once
    # as the pools hold at the longest (sliding-window layers keep a ring per slot).
    host_rows = rows // shape.hosts
    sequences = layout.slots or host_rows
    banks = sampler.banks(sequences)[0]
    heads = cache_heads(model.num_kv_heads, model.num_heads, actor_tensor)
    heads_per_device = heads // actor_tensor if heads % actor_tensor == 0 else heads
    per_key = 2 * heads_per_device * model.resolved_head_dim * compute_size  # one layer's key and value
    sequence_keys = model.keys_over_layers(length)
    if layout.kv_pages:
        full_layers = model.num_layers - model.layer_types.count("sliding_attention")
        pooled = banks * layout.kv_pages * sampler.page_size  # positions the pools hold
        in_flight = min(sequences, max(1, pooled // length))
        kv = (pooled * full_layers + sequences * (sequence_keys - full_layers * length)) * per_key
    else:
        in_flight = sequences
        kv = sequences * sequence_keys * per_key
    live_kv = in_flight * sequence_keys * per_key
    weights = param_count * compute_size / actor_count
    actor_bytes = 2 * weights + kv * (1 + 1 / banks)
    if layout.actor_devices == 0:
        learner_bytes = actor_bytes = learner_bytes + actor_bytes

    # Time: the learner's matmul FLOPs (6 per weight per trained token, 2 more with remat, 2 per forward pass)
    # against its reads of the gathered weights once per micro-batch pass; the actor's decode steps, each
    # reading its weights and half the KV cache.
    tokens = rows * length
    forwards = (optim.updates_per_step > 1) + config.loss.needs_reference
    active = param_count - model.inactive_expert_params  # a token's FLOPs: its experts only
    flops = active * tokens * ((6 + 2 * layout.remat) * optim.epochs + 2 * forwards)
    micro_passes = optim.epochs * rows // micro * 3 + forwards * rows // micro
    weight_reads = micro_passes * param_count * compute_size / tensor
    learner_seconds = max(flops / learner_count / shape.peak_flops, weight_reads / shape.hbm_bandwidth)
    waves = -(-host_rows // in_flight)
    step_flops = 2 * active * in_flight / actor_count
    step_bytes = param_count * compute_size / actor_tensor + live_kv / 2
    actor_seconds = waves * sampler.max_new_tokens * max(step_flops / shape.peak_flops,
                                                         step_bytes / shape.hbm_bandwidth)
    overlapped = layout.actor_devices > 0 and grpo.max_staleness > 0
    seconds = max(learner_seconds, actor_seconds) if overlapped else learner_seconds + actor_seconds
    fits = max(learner_bytes, actor_bytes) <= shape.hbm_bytes
    return Estimate(learner_bytes, actor_bytes, seconds, fits)


def own_layout(plan: RunPlan) -> Layout:
    """The layout the config itself names (its mesh, micro-batch, slots, pages and remat), in the search's terms, as
    the run description resolves the config's defaults (micro-batch 0: the mini-batch; slots 0: a host's samples;
    kv_pages 0: what the rings would hold)."""
    config, mesh = plan.config, plan.config.mesh
    slots = plan.engine_slots if config.sampler.engine == "continuous" else 0
    paged = slots and config.sampler.kv_cache == "paged"
    pages = config.sampler.pages_per_bank(config.sampler.banks(slots)[1]) if paged else 0
    micro = plan.micro_rows or plan.rows // config.optim.mini_batches

    def axes(m) -> tuple[int, int, int]:
        return m.data, m.fsdp, m.tensor

    return Layout(mesh.actor_devices, axes(mesh.actor), axes(mesh.learner), micro, slots, config.model.remat, pages)


def search_order(layouts: list[Layout], estimates: list[Estimate]) -> list[tuple[Layout, Estimate]]:
    """The layouts estimated to fit first, fastest first; then the others, smallest first. Within each group the
    device layouts (the split and both meshes) take turns, each with its own layouts in that order: a small
    limit then compiles several meshes, each with its best-estimated micro-batch, slots and remat, rather than
    the variations of one mesh, which the rough estimate often cannot tell apart."""
    pairs = list(zip(layouts, estimates))
    fitting = sorted((p for p in pairs if p[1].fits), key=lambda p: p[1].seconds)
    others = sorted((p for p in pairs if not p[1].fits), key=lambda p: p[1].peak_bytes)
    return mesh_turns(fitting) + mesh_turns(others)


def device_layout(layout: Layout) -> tuple:
    return layout.actor_devices, layout.actor, layout.learner


def mesh_turns(pairs: list[tuple[Layout, Estimate]]) -> list[tuple[Layout, Estimate]]:
    """`pairs` reordered so that each device layout's first comes first (in the order of `pairs`), then each
    one's second, and so on."""
    by_mesh: dict[tuple, list] = {}
    for pair in pairs:
        by_mesh.setdefault(device_layout(pair[0]), []).append(pair)
    turns = itertools.zip_longest(*by_mesh.values())
    return [pair for turn in turns for pair in turn if pair is not None]


@dataclasses.dataclass(frozen=True)
class Attempt:
    layout: Layout
    estimate: Estimate
    report: Report | None  # None when it did not compile
    reason: str  # why it does not fit or was not compiled; "" when it fits
    seconds: float  # compile wall time

    @property
    def fits(self) -> bool:
        return not self.reason


@dataclasses.dataclass(frozen=True)
class Search:
    layouts: int  # in the search space that can be laid out
    attempts: list[Attempt]  # compiled, in search order


def parameter_count(model: ModelConfig) -> int:
    """The model's parameters, from its shapes (nothing allocated)."""
    abstract = abstract_model(model)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract)))


def does_not_fit_reason(report: Report) -> str:
    """'' when every program fits; else each program over, in a few words."""
    hbm = report.topology.hbm_bytes
    over = []
    for p in report.programs:
        if p.memory is None:
            excess = refusal_excess(p.refusal)
            over.append(f"{p.name} refused by the compiler{' (' + excess + ')' if excess else ''}")
        elif p.total > hbm:
            over.append(f"{p.name} {size_text(p.total)}iB > {size_text(hbm)}iB")
    return ", ".join(over)


def one_line(error: BaseException) -> str:
    """An exception as one line: its first line, and its last when there are more (the compiling child's
    output ends with the exception that stopped it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def fit(config_path: str, overrides: list[str], topology_name: str, chips_per_host: str = "",
        limit: int = DEFAULT_LIMIT, *, isolate: bool = True, progress: Callable[[str], None] = print) -> Search:
    """Compile up to `limit` layouts of the search space in search_order; how many there were and every
    compile attempt, in order.

    The config is `config_path` with `overrides` (those naming a searched setting hold it fixed) and each
    layout's overrides after them, loaded by the config loader as `grpo-jax compile` loads it. A layout the
    loader or the run description refuses is skipped (no compile); one that fails to compile or does not fit
    is kept with its one-line reason. `progress` gets one line per compile."""
    config = load_config(Config, config_path, overrides)
    topology = tpu_topology(topology_name, chips_per_host)
    shape = SliceShape.of(topology)
    model = run_model_config(config)
    param_count = parameter_count(model)
    layouts = enumerate_layouts(config, model, shape.hosts, shape.devices_per_host, pinned_keys(overrides))
    order = search_order(layouts, [estimate(config, model, param_count, x, shape) for x in layouts])
    # The config's own layout first, when it is in the search space: the ranking then says whether any layout
    # searched beats it.
    try:
        own = own_layout(RunPlan.build(config, topology.devices, process_word="host"))
    except UserError:  # the config's own layout cannot be laid out here: the search alone
        own = None
    first = [pair for pair in order if pair[0] == own]
    order = first + [pair for pair in order if pair[0] != own]
    progress(f"{len(layouts)} layouts can be laid out on {topology_name}; compiling up to {limit}: "
             + ("the config's own first, then " if first else "") +
             "those estimated to fit first, fastest first, the device layouts taking turns")
    attempts = []
    planned = min(limit, len(order))
    for layout, guess in order:
        if len(attempts) == limit:
            break
        try:
            candidate = load_config(Config, config_path, [*overrides, *layout.overrides()])
            RunPlan.build(candidate, topology.devices, process_word="host")
        except UserError as e:  # the loader's or the run description's own rule; nothing compiled
            progress(f"  skipped {layout.label()}: {one_line(e)}")
            continue
        start = time.perf_counter()
        try:
            report = compile_run(candidate, topology_name, chips_per_host, config_path, isolate=isolate)
            reason = does_not_fit_reason(report)
        except Exception as e:  # noqa: BLE001 - a layout that does not compile is an answer about that layout
            report, reason = None, f"did not compile: {one_line(e)}"
        attempt = Attempt(layout, guess, report, reason, time.perf_counter() - start)
        attempts.append(attempt)
        if report is None:
            verdict = reason  # did not compile: ...
        elif reason:
            verdict = f"does not fit: {reason}"
        elif report.step is None:
            verdict = "fits, no time estimate"
        else:
            verdict = f"fits, projected step {time_text(report.step.seconds)}"
        progress(f"[{len(attempts)}/{planned}] {layout.label()}: {verdict} ({attempt.seconds:.0f} s)")
    return Search(len(layouts), attempts)


def ranked(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts that fit, by projected step time (those without one last); on a tie, the one whose sides
    leave each other more slack (the smaller sum of learner and actor time), then the one needing less memory."""
    def key(attempt: Attempt) -> tuple:
        step = attempt.report.step
        peak = max(p.total for p in attempt.report.programs)
        if step is None:
            return (math.inf, math.inf, peak)
        return (step.seconds, step.learner_seconds + step.actor_seconds, peak)

    return sorted((a for a in attempts if a.fits), key=key)


def format_fit(attempts: list[Attempt], topology_name: str) -> str:
    """The fitting layouts, best first, each with the overrides that select it; then those that did not fit."""
    best = ranked(attempts)
    lines = [f"{len(best)} of {len(attempts)} layouts compiled fit on {topology_name}, fastest projected step first "
             "(roofline lower bounds: see the compile report)",
             f"{'rank':<5}{'step':>10}{'learner':>10}{'actor':>10}{'MFU':>7}{'tokens/s':>11}{'peak':>8}  layout"]
    for rank, attempt in enumerate(best, start=1):
        step = attempt.report.step
        peak = max(p.total for p in attempt.report.programs)
        if step is None:
            figures = f"{'-':>10}{'-':>10}{'-':>10}{'-':>7}{'-':>11}"
        else:
            figures = (f"{time_text(step.seconds):>10}{time_text(step.learner_seconds):>10}"
                       f"{time_text(step.actor_seconds):>10}{100 * step.mfu:>6.1f}%"
                       f"{step.tokens / step.seconds:>11,.0f}")
        lines.append(f"{rank:<5}{figures}{size_text(peak) + 'iB':>8}  {attempt.layout.label()}")
        lines.append(f"     {' '.join(attempt.layout.overrides())}")
    misfits = [a for a in attempts if not a.fits]
    if misfits:
        lines.append("did not fit:")
        lines += [f"  {a.layout.label()}: {a.reason}" for a in misfits]
    return "\n".join(lines)


def nothing_fits_message(search: Search, topology_name: str) -> str:
    attempts = search.attempts
    if not attempts:
        return (f"no layout to search on {topology_name}: none of the search space can be laid out with these "
                "settings (see grpo-jax compile without --fit for the reason)")
    closest = min(attempts, key=lambda a: a.estimate.peak_bytes)
    return (f"none of the {len(attempts)} layouts compiled (of {search.layouts} that can be laid out) fits on "
            f"{topology_name}; the smallest by the estimate, {closest.layout.label()}: {closest.reason}; try a "
            "larger slice, a higher --fit-limit, or lora.rank > 0")
