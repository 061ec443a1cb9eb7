"""The actor's programs compiled for a topology: the continuous engine's (decode chunk per bank size, admission,
bank resizes, at the shapes Engine.warm_up compiles), or the static sampler's generate program, and the
evaluation's generate; with an env section, the continuation engine's (decode chunk, extend buckets, compaction).
Each generator class (Engine, Sampler, ContinuationEngine) is built over the run description's abstract actor
weights (RunPlan.actor_params) and slots (RunPlan.engine_slots), as the trainer builds it over real ones, and
publishes its programs with their abstract arguments and calls per step (programs(), rollout.common); this module
compiles them and says what they hold and what would shrink them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from grpo_jax.model.transformer import DTYPES
from grpo_jax.planning.programs import Compiled, Cost, Program, compile_one
from grpo_jax.planning.topology import Topology
from grpo_jax.planning.units import size_text
from grpo_jax.rollout.common import GeneratorProgram, Workload, cache_layout
from grpo_jax.rollout.continuation import ContinuationEngine, TurnState
from grpo_jax.rollout.engine import Engine
from grpo_jax.rollout.episodes import episode_context
from grpo_jax.rollout.sampler import Sampler, SamplerConfig
from grpo_jax.rollout.weight_sync import narrowed
from grpo_jax.run.plan import RunPlan, shard_bytes


def actor_workload(plan: RunPlan) -> Workload:
    """What one learner step asks of one actor's generator: its hosts' samples (episodes with an env section, of
    up to env.max_turns turns), in groups of group_size, prompts up to the learner's prompt bucket."""
    env, expected = plan.config.env, plan.expected_lengths
    return Workload(samples=plan.actor_rows, group_size=plan.config.grpo.group_size, prompt_len=plan.prompt_bucket,
                    turns=1 if env is None else max(1, env.max_turns), expected=expected if expected.given else None)


def abstract_actor(plan: RunPlan) -> tuple[nnx.Module, nnx.Module | None]:
    """The actor's model over abstract weights on the actor mesh, in the dtype it keeps them in, and its abstract
    LoRA adapters (None without LoRA): what a generator is built over here. Token ids (eos, stop, pad) do not
    change the programs' shapes: the generators get placeholders."""
    graphdef, state = plan.actor_params()
    lora = None
    if plan.config.lora.enabled:  # the actor's own base, plus the adapters each sync brings
        adapter_graphdef, adapters = plan.actor_adapters()
        lora = nnx.merge(adapter_graphdef, adapters)
    return nnx.merge(graphdef, state), lora


def _compile(program: GeneratorProgram, topology: Topology) -> Compiled:
    return compile_one(program.jitted, program.args, topology, program.kwargs, label=program.label)


def sampler_program(plan: RunPlan, topology: Topology, learner_held: int,
                    sampler: SamplerConfig | None = None) -> Program:
    """The sampler's generate program for one handout of one actor (Sampler.programs: generate's buckets and row
    split into decode_streams calls): one host's prompts, or every host's for an actor across hosts; over abstract
    weights on the actor mesh. `sampler`: other sampling settings than the config's (evaluation's).

    Cost: the generate program's decode loops stop when every row is done, so their trip counts are not
    known to XLA (which counts each body once). The prefill and a decode step are compiled on their own
    (Sampler.programs' parts, decode_cost) and the decode step is counted for every token up to max_new_tokens:
    the worst case, every row running to the limit."""
    mesh = plan.actor_mesh
    model, lora = abstract_actor(plan)
    generator = Sampler(model, eos_ids=(0,), pad_id=0, config=sampler or plan.config.sampler, adapters=lora)
    generator.close()
    generate, *parts = generator.programs(actor_workload(plan))
    calls = generate.calls_per_step
    whole = _compile(generate, topology)

    state, adapters = generator.state, generator.adapters
    weights = shard_bytes(state)
    other = (calls - 1) * whole.memory.outputs if whole.memory is not None and calls > 1 else 0
    held, held_what = actor_held(plan, state, adapters, learner_held, other,
                                 f"outputs of the other {calls - 1} call(s)")
    hints = sampler_hints(plan, weights, topology)
    if whole.memory is None:
        return Program("sampler generate", mesh.size, None, held, held_what, None, calls, whole.seconds,
                       whole.refusal, hints, actor=True)

    steps = decode_cost(parts, topology)
    return Program("sampler generate", mesh.size, whole.memory, held, held_what, steps.cost, calls,
                   whole.seconds + steps.seconds, "", hints, cost_note=steps.note, actor=True)


def eval_program(plan: RunPlan, topology: Topology, learner_held: int,
                 engine_chunk: Program | None) -> Program:
    """Evaluation during training (eval.every_steps): the static sampler's generate on the actor's devices, at
    the evaluator's shapes (Evaluator: the actor's usual rows per call, eval.max_new_tokens, eval.temperature).
    With the continuous engine it runs while the engine's slots stay in flight (Engine.generate's static
    fallback), so the engine's banks are held beside it. Not part of the step: calls are per evaluation."""
    config = plan.config
    ev = config.eval
    sampler = dataclasses.replace(config.sampler, max_new_tokens=ev.max_new_tokens or config.sampler.max_new_tokens,
                                  temperature=ev.temperature)
    generate = sampler_program(plan, topology, learner_held, sampler)
    held, held_what = generate.held, generate.held_what
    if engine_chunk is not None and engine_chunk.memory is not None:
        # The engine's arguments besides the weights they share (its slot state), and what it holds besides.
        weights = shard_bytes(plan.actor_params()[1])
        held = engine_chunk.held + engine_chunk.memory.arguments - weights
        held_what = f"the engine's slots in flight, {engine_chunk.held_what}"
    rows = ev.num_prompts * (1 + ev.samples) if ev.num_prompts else 0  # 0: all held-out prompts, unknown here
    per_call = plan.actor_rows
    calls = -(-rows // per_call) * generate.calls_per_step
    note = (f"{calls} call(s) per evaluation ({ev.num_prompts} prompts x (1 greedy + {ev.samples} sampled), "
            f"{per_call} rows per generate); not in the step projection") if rows else \
        "eval.num_prompts=0 (every held-out prompt): calls per evaluation unknown here"
    hints = (f"eval.every_steps=0 (now {ev.every_steps}: evaluate RUN_DIR/final_model with grpo-jax eval after "
             "training instead)", *generate.hints)
    return dataclasses.replace(generate, name="eval generate", held=held, held_what=held_what, calls_per_step=calls,
                               actor=False, hints=hints, notes=(*generate.notes, note))



@dataclasses.dataclass(frozen=True)
class _Timed:
    cost: Cost | None
    seconds: float
    note: str


def decode_cost(parts: list[GeneratorProgram], topology: Topology) -> _Timed:
    """Prefill + every decode step of one generate call, from its parts compiled alone (Sampler.programs): the
    prefill, then one decode step times its cost_part (the decode steps of a call). cost is None if the compiler
    refused one of them (`note` says which)."""
    prefill, *decode = parts
    first = _compile(prefill, topology)
    if first.cost is None:
        return _Timed(None, first.seconds, f"the prefill alone was refused: {first.refusal}")
    if not decode:
        return _Timed(first.cost, first.seconds, "")
    step = _compile(decode[0], topology)
    if step.cost is None:
        return _Timed(None, first.seconds + step.seconds, f"one decode step alone was refused: {step.refusal}")
    return _Timed(first.cost + step.cost * decode[0].cost_part, first.seconds + step.seconds, "")


def sampler_hints(plan: RunPlan, weights: int,
                  topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the generate program, the ones that can help first: the weights (per device, in
    the dtype the actor keeps them in, held twice while new ones arrive) before the KV cache and activations."""
    config, model_config = plan.config, plan.model
    cfg, mesh = config.sampler, plan.actor_mesh
    per_host = len(plan.actor_mesh.devices.flat) if plan.shared else None
    spread = (f"a larger mesh.actor.tensor (now {mesh.shape['tensor']}) over more actor devices "
              f"(mesh.actor_devices={config.mesh.actor_devices})")
    if 2 * weights > topology.hbm_bytes:
        kept = narrowed(DTYPES[model_config.param_dtype], DTYPES[model_config.dtype])
        why = (f"the actor's weights (in {kept}: model.param_dtype={model_config.param_dtype}, "
               f"model.dtype={model_config.dtype}) take {size_text(weights)}iB per device, twice while new ones arrive")
        if per_host is not None:  # already every device of the host: no actor layout holds them
            return (f"no actor layout: every host's actor holds a whole copy of the weights on its {per_host} devices; "
                    f"{why}",)
        return (f"{spread}: {why}",)
    return (f"fewer rows per call (grpo.prompts_per_step={config.grpo.prompts_per_step} lower, or "
            f"sampler.decode_streams={cfg.decode_streams} higher)",
            f"a shorter sampler.max_new_tokens={cfg.max_new_tokens} or max_prompt_len={cfg.max_prompt_len} (the KV "
            "cache)", spread)



@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """The continuous engine of one host's actor, with abstract weights: what engine_programs compiles."""

    engine: Engine  # built over abstract weights: only its programs and shape logic are used
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


def engine_setup(plan: RunPlan) -> EngineSetup:
    """The Engine the trainer builds on each host (engine.make_generator: sampler.slots, or that host's
    prompts_per_step / hosts x group_size samples), over abstract weights on the actor mesh, and its slot state
    per bank size in the layout the engine's programs return it in (Engine.slot_state_shape: the KV ring as
    rollout.common.cache_layout lays it out on the actor mesh, its heads split over `tensor`, each KV head
    repeated where their number does not divide it; every other field replicated)."""
    config = plan.config
    model, lora = abstract_actor(plan)
    engine = Engine(model, eos_ids=(0,), pad_id=0, config=config.sampler, slots=plan.engine_slots, adapters=lora,
                    mesh=plan.actor_mesh)
    engine.close()
    sizes, plens, rows = engine.program_shapes(config.grpo.group_size)
    return EngineSetup(engine, engine.state, engine.head, engine.adapters,
                       {size: engine.slot_state_shape(size) for size in sizes}, sizes, plens, rows)


def actor_held(plan: RunPlan, state, adapters, learner_held: int, other: int = 0,
               other_what: str = "") -> tuple[int, str]:
    """Bytes the actor's devices hold beside a generation program, and what they are: the next weights (with
    LoRA, adapters), which the learner delivers while the old ones still sample; `other` (other_what); with shared
    chips, the learner's parameters and optimizer state (learner_held)."""
    held, held_what = shard_bytes(state), "the next weights, delivered while sampling"
    if adapters is not None:
        held, held_what = shard_bytes(adapters), "the next adapters, delivered while sampling"
    if other:
        held, held_what = held + other, f"{held_what}, {other_what}"
    if plan.shared:
        held, held_what = held + learner_held, f"{held_what}, the learner's parameters and optimizer state"
    return held, held_what


def _worst(compiled: list) -> Compiled:
    """The one that needs the most memory (a refusal first)."""
    return max(compiled, key=lambda c: math.inf if c.memory is None else c.memory.total)



def engine_programs(plan: RunPlan, topology: Topology,
                    setup: EngineSetup, learner_held: int) -> list[Program]:
    """The continuous engine's programs (Engine.programs: its own jitted functions at the shapes Engine.warm_up
    compiles, with their calls per step) on one host's actor mesh:

    - `engine chunk`: a decode chunk of sampler.chunk_steps steps, for every bank size (full, and halved while
      draining); the report shows the full bank, the largest;
    - `engine admission`: prefill + copy into slots + first token, at the largest prompt bucket a step's prompts
      use and the most prompts one bank takes at a boundary;
    - `engine resize`: a bank halved while draining, or grown back to full (only where banks shrink).

    Cost: one decode step (the chunk program with steps=1: XLA counts a loop body once) times chunk_steps per
    chunk. Time per learner step, every sample decoding to max_new_tokens in lockstep: the calls per step
    Engine.programs gives (the host's samples fill the slots in waves, each an admission per bank it uses and
    the chunks to max_new_tokens); the admission's cost per call averaged over the prompt counts used; banks run
    one after the other."""
    config = plan.config
    cfg, mesh = config.sampler, plan.actor_mesh
    engine, state, head, adapters = setup.engine, setup.state, setup.head, setup.adapters
    full = engine.bank_slots
    work = actor_workload(plan)
    generated = engine.programs(work)
    chunk_shapes = [p for p in generated if p.name == "engine chunk" and not p.cost_part]
    chunk_step = next(p for p in generated if p.name == "engine chunk" and p.cost_part and not p.at_expected)
    expected_step = next((p for p in generated if p.name == "engine chunk" and p.at_expected), None)
    admissions = [p for p in generated if p.name == "engine admission"]
    resizes = [p for p in generated if p.name == "engine resize"]

    weights = shard_bytes(state)
    head_bytes = shard_bytes(head)
    # The other banks' slot states stay on the same devices.
    other_banks = (engine.num_banks - 1) * setup.bank_bytes
    held, held_what = actor_held(plan, state, adapters, learner_held, other_banks,
                                 f"the other {engine.num_banks - 1} bank(s)' slot state")
    hints = engine_hints(plan, engine, weights, topology)
    samples = plan.actor_rows
    chunk_calls = chunk_shapes[0].calls_per_step  # the full bank's, every sample to max_new_tokens
    expected_calls = chunk_shapes[0].expected_calls_per_step  # at the expected lengths (None: not given)

    programs = []
    # The decode chunk, for every bank size.
    chunks = [_compile(p, topology) for p in chunk_shapes]
    worst = _worst(chunks)
    seconds = sum(c.seconds for c in chunks)
    notes = []
    if len(chunk_shapes) > 1:
        notes.append(f"compiled for banks of {', '.join(str(p.shape[0]) for p in chunk_shapes)} slots (halved while "
                     "draining); the largest memory shown")
    cost, cost_note, worst_cost = None, "", None
    if worst.memory is not None:
        step = _compile(chunk_step, topology)
        seconds += step.seconds
        if step.cost is None:
            cost_note = f"one decode step alone was refused: {step.refusal}"
        else:
            cost = step.cost * chunk_step.cost_part
            in_flight = (f", as many at once as {engine.bank_pages} pages of {engine.page_size} positions hold"
                         if engine.paged else "")
            notes.append(f"one decode step x chunk_steps={cfg.chunk_steps} per call; {chunk_calls} call(s) per step: "
                         f"{samples} samples in {engine.num_banks} bank(s) of {full} slots{in_flight}, every one "
                         f"decoding to max_new_tokens={cfg.max_new_tokens}")
        if cost is not None and expected_step is not None:
            at_expected = _compile(expected_step, topology)
            seconds += at_expected.seconds
            if at_expected.cost is not None:
                cost, worst_cost = at_expected.cost * expected_step.cost_part, cost
        if cost is not None and expected_calls is not None:
            reads = (f"; a decode step reads the {engine.expected_keys(work)} keys a sequence holds on average"
                     if worst_cost is not None else "")
            notes.append(f"at the expected lengths ({engine.expected_lengths(work).describe()}): {expected_calls} "
                         f"call(s) per step, slots refilled as samples end{reads}")
    programs.append(Program("engine chunk", mesh.size, worst.memory, held, held_what, cost,
                            chunk_calls if expected_calls is None else expected_calls, seconds, worst.refusal, hints,
                            cost_note, actor=True, notes=tuple(notes), worst_cost=worst_cost,
                            worst_calls=None if expected_calls is None else chunk_calls))

    # The admission: prefill, copy into slots, first token; the largest shapes for memory, those used for cost.
    most = admissions[0]
    used = sorted((p for p in admissions if p.calls_per_step), key=lambda p: p.shape[0])
    largest = _compile(most, topology)
    seconds, cost, cost_note = largest.seconds, None, ""
    if largest.memory is not None:
        cost = Cost(0.0, 0.0, 0.0)
        for program in used:
            compiled = largest if program is most else _compile(program, topology)
            if compiled is not largest:
                seconds += compiled.seconds
            if compiled.cost is None:
                cost, cost_note = None, f"the admission of {program.shape[0]} prompts was refused: {compiled.refusal}"
                break
            cost = cost + compiled.cost * program.calls_per_step
    calls = sum(p.calls_per_step for p in used)
    if cost is not None:
        cost = cost * (1 / max(calls, 1))  # per call, averaged over the row counts used
    rows, plen = most.shape
    notes = (f"{rows} prompts of {plen} tokens (the most one bank takes at a boundary) for memory; "
             f"{calls} call(s) per step ({', '.join(f'{p.calls_per_step} x {p.shape[0]} prompts' for p in used)}: "
             "one prefill per group)",)
    programs.append(Program("engine admission", mesh.size, largest.memory, held, held_what, cost, calls, seconds,
                            largest.refusal, hints, cost_note, actor=True, notes=notes))

    # Bank resizes while draining: halved one step at a time, and back to full from every size.
    if resizes:
        compiled = [_compile(p, topology) for p in resizes]
        worst = _worst(compiled)
        # Not an argument of a resize, but on its devices: the weights and head it decodes with.
        resize_held = held + weights + head_bytes
        resize_what = "the engine's weights and head, " + held_what
        pairs = ", ".join(f"{a} -> {b}" for a, b in (p.shape for p in resizes))
        notes = (f"{len(resizes)} programs ({pairs} slots); not in the step projection (with every sample decoding "
                 "to max_new_tokens, no bank drains)",)
        programs.append(Program("engine resize", mesh.size, worst.memory, resize_held, resize_what, worst.cost, 0,
                                sum(r.seconds for r in compiled), worst.refusal, hints, actor=True, notes=notes))
    return programs


def engine_hints(plan: RunPlan, engine: Engine, weights: int,
                 topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the engine's programs: the weights first (as sampler_hints), then the slots' KV
    rings and the admission's prefill."""
    cfg = plan.config.sampler
    hints = sampler_hints(plan, weights, topology)
    if 2 * weights > topology.hbm_bytes:
        return hints
    now = f"now {engine.num_slots}" + ("" if cfg.slots else ": 0 means prompts_per_step / hosts x group_size")
    if engine.paged:
        room = [f"fewer sampler.kv_pages (now {engine.bank_pages} per bank of {engine.page_size} positions each)",
                f"fewer sampler.slots ({now})"]
    else:
        room = [f"fewer sampler.slots ({now}; each holds a KV ring of max_prompt_len + max_new_tokens = "
                f"{engine.ring} positions)"]
    hints = [*room,
             f"a shorter sampler.max_new_tokens={cfg.max_new_tokens} or max_prompt_len={cfg.max_prompt_len}",
             hints[-1]]
    kv, tensor = plan.model.num_kv_heads, plan.actor_mesh.shape["tensor"]
    if tensor > 1 and cache_layout(plan.model, plan.actor_mesh)[1].spec == PartitionSpec():
        hints.append(f"a mesh.actor.tensor that divides num_kv_heads={kv} or is a multiple of it dividing "
                     f"num_heads={plan.model.num_heads} (now {tensor}: every actor device holds the whole KV ring "
                     "of its slots)")
    return tuple(hints)



@dataclasses.dataclass(frozen=True)
class ContinuationSetup:
    """The continuation engine of one host's actor (a run with an env section), with abstract weights: what
    continuation_programs compiles."""

    engine: ContinuationEngine  # built over abstract weights: only its programs and shapes are used
    state: object  # abstract weights on the actor mesh
    head: jax.ShapeDtypeStruct  # the vocab-major head, sharded as the actor's
    adapters: object  # abstract LoRA adapters, or None
    turn: TurnState  # ShapeDtypeStructs with the engine's shardings (ContinuationEngine.turn_state_shape)
    widths: list  # the extend buckets (ContinuationEngine.append_buckets)

    @property
    def state_bytes(self) -> int:
        """Per device: the rows' TurnState (their KV caches above all), on the actor's devices for the whole run."""
        return shard_bytes(self.turn)


def continuation_setup(plan: RunPlan) -> ContinuationSetup:
    """The ContinuationEngine the trainer builds on each host (episodes.make_episode_runner: sampler.slots or that
    host's samples per step as rows, episode_context as context), over abstract weights on the actor mesh, and its
    TurnState in the layout its programs return it in (the KV cache as rollout.common.cache_layout lays it out on
    the actor mesh, every other field replicated)."""
    config = plan.config
    model, lora = abstract_actor(plan)
    engine = ContinuationEngine(model, stop_ids=(0,), pad_id=0, config=config.sampler, rows=plan.engine_slots,
                                context=episode_context(config.env, config.sampler), adapters=lora,
                                mesh=plan.actor_mesh)
    return ContinuationSetup(engine, engine.state, engine.head, engine.adapters, engine.turn_state_shape(),
                             engine.append_buckets)


def continuation_programs(plan: RunPlan, topology: Topology, setup: ContinuationSetup,
                          learner_held: int) -> list[Program]:
    """The continuation engine's programs (ContinuationEngine.programs: its own jitted functions, with their calls
    per step) on one host's actor mesh, for a run with an env section:

    - `continuation decode`: a chunk of sampler.chunk_steps decode steps of every row;
    - `continuation extend <width>`: appended ids prefilled into every row, at the widest bucket (the whole
      context at once: the most memory) and at the smallest (a turn's appended ids: the common case), and at the
      opening prompt's bucket (sampler.max_prompt_len) when it is neither;
    - `continuation compact`: every row's keys moved to the front of its cache (a gather, no model compute).

    Cost: the decode chunk as one decode step (steps=1: XLA counts a loop body once) times chunk_steps. Time per
    learner step, a floor that leaves out the environment (its steps run on the host, between the turns): the
    host's samples run as episodes in waves of engine.rows; in each, every episode takes env.max_turns turns and
    samples sampler.max_new_tokens tokens split evenly over them (each turn's first token drawn by its extend,
    a turn's last partial chunk counted whole); one extend per turn, the opening at the prompt's bucket and the
    others at the smallest. The widest extend and the compaction (when the clock reaches the last column) are
    not in the projection."""
    config = plan.config
    cfg, env, mesh = config.sampler, config.env, plan.actor_mesh
    engine, state, head, adapters = setup.engine, setup.state, setup.head, setup.adapters
    rows = engine.rows
    generated = engine.programs(actor_workload(plan))
    decode_chunk = next(p for p in generated if p.name == "continuation decode" and not p.cost_part)
    decode_step = next(p for p in generated if p.name == "continuation decode" and p.cost_part)
    extends = [p for p in generated if p.name.startswith("continuation extend ")]
    compact_program = next(p for p in generated if p.name == "continuation compact")

    weights = shard_bytes(state)
    held, held_what = actor_held(plan, state, adapters, learner_held)
    hints = continuation_hints(plan, engine, weights, topology)
    waves = engine.waves(plan.actor_rows)
    chunk_calls = decode_chunk.calls_per_step
    common = "; the environment's steps (on the host, between turns) are not counted"
    programs = []

    decode = _compile(decode_chunk, topology)
    seconds, cost, cost_note, notes = decode.seconds, None, "", ()
    if decode.memory is not None:
        step = _compile(decode_step, topology)
        seconds += step.seconds
        if step.cost is None:
            cost_note = f"one decode step alone was refused: {step.refusal}"
        else:
            cost = step.cost * decode_step.cost_part
            notes = (f"one decode step of {rows} rows x chunk_steps={cfg.chunk_steps} per call; {chunk_calls} call(s) "
                     f"per step: {plan.actor_rows} episodes in {waves} wave(s), each env.max_turns={env.max_turns} "
                     f"turns sampling max_new_tokens={cfg.max_new_tokens} tokens in all{common}",)
    programs.append(Program("continuation decode", mesh.size, decode.memory, held, held_what, cost, chunk_calls,
                            seconds, decode.refusal, hints, cost_note, actor=True, notes=notes))

    smallest, widest, opening = setup.widths[0], setup.widths[-1], engine.opening_bucket
    for program in extends:
        width, n = program.shape[1], program.calls_per_step
        compiled = _compile(program, topology)
        roles = [role for w, role in ((widest, "the widest bucket (the whole context at once): the most memory"),
                                      (opening, f"the opening prompt's bucket (sampler.max_prompt_len="
                                                f"{cfg.max_prompt_len})"),
                                      (smallest, "the smallest bucket (a turn's appended ids)")) if w == width]
        calls_text = f"{n} call(s) per step{common}" if n else "not in the step projection"
        notes = ("; ".join([*roles, calls_text]),)
        programs.append(Program(program.name, mesh.size, compiled.memory, held, held_what,
                                compiled.cost, n, compiled.seconds, compiled.refusal, hints, actor=True, notes=notes))

    compact = _compile(compact_program, topology)
    # Not an argument of the compaction, but on its devices: the weights and head the other programs use.
    compact_held = held + weights + shard_bytes(head)
    programs.append(Program("continuation compact", mesh.size, compact.memory, compact_held,
                            "the engine's weights and head, " + held_what, compact.cost, 0, compact.seconds,
                            compact.refusal, hints, actor=True,
                            notes=(f"when the clock reaches the last of {engine.columns} columns; not in the step "
                                   "projection",)))
    return programs


def continuation_hints(plan: RunPlan, engine: ContinuationEngine, weights: int,
                       topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the continuation engine's programs: the weights first (as sampler_hints), then the
    rows' KV caches (engine.columns each: twice the context's bucket)."""
    config = plan.config
    cfg, env = config.sampler, config.env
    hints = sampler_hints(plan, weights, topology)
    if 2 * weights > topology.hbm_bytes:
        return hints
    now = f"now {engine.rows}" + ("" if cfg.slots else ": 0 means prompts_per_step / hosts x group_size")
    return (f"fewer sampler.slots ({now}; each row holds a KV cache of {engine.columns} columns, twice the bucket of "
            f"its context of {engine.context} tokens)",
            f"a smaller env.max_total_tokens={env.max_total_tokens} or sampler.max_prompt_len + max_new_tokens "
            f"({cfg.max_prompt_len} + {cfg.max_new_tokens}): the context", hints[-1])
