"""The actor's programs compiled for a topology: the continuous engine's (decode chunk per bank size, admission,
bank resizes, at the shapes Engine.warm_up compiles), or the static sampler's generate program, and the
evaluation's generate; with an env section, the continuation engine's (decode chunk, extend buckets, compaction).
Each is built by its own class (Engine, Sampler, ContinuationEngine) over the run description's abstract actor
weights (RunPlan.actor_params) and slots (RunPlan.engine_slots), as the trainer builds it over real ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.model.transformer import DTYPES, ModelConfig, positions_from_mask
from grpo_jax.parallel.sharding import DEFAULT_RULES, spec_for
from grpo_jax.planning.programs import Compiled, Cost, Program, compile_one
from grpo_jax.planning.topology import Topology
from grpo_jax.planning.units import size_text
from grpo_jax.rollout.continuation import MIN_APPEND_BUCKET, ContinuationEngine, TurnState
from grpo_jax.rollout.engine import Engine, SlotState
from grpo_jax.rollout.episodes import episode_context
from grpo_jax.rollout.sampler import Sampler, SamplerConfig, _bucket, _phase_ends, cache_layout, vocab_major_head
from grpo_jax.rollout.weight_sync import narrowed
from grpo_jax.run.plan import RunPlan, shard_bytes


def sampler_program(plan: RunPlan, topology: Topology, learner_held: int,
                    sampler: SamplerConfig | None = None) -> Program:
    """The sampler's generate program for one handout of one actor (Sampler.generate's buckets and row split
    into decode_streams calls): one host's prompts, or every host's for an actor across hosts; over abstract
    weights on the actor mesh. Another sampler or engine replaces this function.

    Cost: the generate program's decode loops stop when every row is done, so their trip counts are not
    known to XLA (which counts each body once). The prefill and a decode step are compiled on their own
    (decode_cost) and the decode step is counted for every token up to max_new_tokens: the worst case,
    every row running to the limit. `sampler`: other sampling settings than the config's (evaluation's)."""
    config, cfg, mesh = plan.config, sampler or plan.config.sampler, plan.actor_mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    graphdef, state = plan.actor_params()
    adapter_graphdef, adapters = None, None
    if config.lora.enabled:  # the actor's own base, plus the adapters each sync brings
        adapter_graphdef, adapters = plan.actor_adapters()
    sampler, head = _abstract_sampler(graphdef, state, cfg, adapter_graphdef, adapters)
    head = jax.ShapeDtypeStruct(
        head.shape, head.dtype,
        sharding=NamedSharding(mesh, spec_for(("vocab", "embed"), head.shape, mesh, DEFAULT_RULES)))
    rows = plan.actor_rows
    calls = min(cfg.decode_streams, rows)
    batch = _bucket(-(-rows // calls), cfg.min_batch_bucket)
    plen = min(_bucket(plan.prompt_bucket, cfg.min_prompt_bucket), cfg.max_prompt_len)
    new_bucket = _bucket(cfg.max_new_tokens, 1)
    greedy = cfg.temperature == 0
    static = dict(new_bucket=new_bucket, greedy=greedy, top_k=0 if greedy else cfg.top_k,
                  use_top_p=(not greedy) and cfg.top_p < 1)

    # An actor across hosts gets every host's rows split over data x fsdp where they divide (as the weights'
    # fsdp; each host then places only the rows its own devices hold); an actor per host, from its own
    # process, replicated.
    rows_sharding = replicated
    if plan.actor_spans_hosts and batch % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0:
        rows_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def sds(shape, dtype, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    args = (state, head, sds((batch, plen), jnp.int32, rows_sharding), sds((batch, plen), jnp.bool_, rows_sharding),
            sds((batch,), jnp.bool_, rows_sharding), sds(keys.shape, keys.dtype, rows_sharding), sds((), jnp.int32),
            sds((), jnp.float32), sds((), jnp.float32))
    whole = compile_one(sampler._generate, args, topology, dict(static, adapters=adapters), label="sampler generate")

    weights = shard_bytes(state)
    other = (calls - 1) * whole.memory.outputs if whole.memory is not None and calls > 1 else 0
    held, held_what = actor_held(plan, state, adapters, learner_held, other,
                                 f"outputs of the other {calls - 1} call(s)")
    hints = sampler_hints(plan, weights, topology)
    if whole.memory is None:
        return Program("sampler generate", mesh.size, None, held, held_what, None, calls, whole.seconds,
                       whole.refusal, hints, actor=True)

    steps = decode_cost(graphdef, plan.model, state, head, cfg, static, batch, plen, new_bucket, mesh, topology,
                        adapter_graphdef, adapters)
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


class _AbstractSampler(Sampler):
    """A Sampler over abstract weights (jax.ShapeDtypeStructs with their shardings, as nnx.eval_shape and
    actor_params give them): its vocab-major head is a shape too. Built outside any trace, so that the Sampler
    reads its weights' shardings (e.g. whether its mesh spans hosts) as it does from real ones."""

    def _vocab_major_head(self, state):
        return jax.eval_shape(functools.partial(vocab_major_head, self.graphdef), state)


def _abstract_sampler(graphdef, state, cfg, adapter_graphdef=None,
                      adapters=None) -> tuple[Sampler, jax.ShapeDtypeStruct]:
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
    heads, cache_sharding = cache_layout(model_cfg, mesh)
    shape = (batch, heads, length, model_cfg.resolved_head_dim)
    cache = tuple((sds(shape, DTYPES[model_cfg.dtype], cache_sharding),) * 2 for _ in range(model_cfg.num_layers))
    # The cache is updated in place, as in the generate loop: donated, and returned with the same plan.
    jitted = jax.jit(decode, donate_argnums=(5,), out_shardings=((replicated, replicated), cache_sharding))
    step = compile_one(jitted, (state, head, sds((batch, 1), jnp.int32), sds((batch, 1), jnp.int32),
                                sds((batch, length), jnp.bool_), cache, sds((), jnp.int32), *scalars, adapters),
                       topology, label="sampler generate (one decode step alone, for its cost)")
    if step.cost is None:
        return _Timed(None, first.seconds + step.seconds, f"one decode step alone was refused: {step.refusal}")
    return _Timed(first.cost + step.cost * steps, first.seconds + step.seconds, "")


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


def engine_setup(plan: RunPlan) -> EngineSetup:
    """The Engine the trainer builds on each host (engine.make_generator: sampler.slots, or that host's
    prompts_per_step / hosts x group_size samples), built under eval_shape over abstract weights on the actor
    mesh, and its slot state per bank size in the layout the engine's programs return it in
    (Engine.slot_shardings: the KV ring as sampler.cache_layout lays it out on the actor mesh, its heads split
    over `tensor`, each KV head repeated where their number does not divide it; every other field
    replicated)."""
    config, cfg, mesh = plan.config, plan.config.sampler, plan.actor_mesh
    graphdef, state = plan.actor_params()
    adapter_graphdef, adapters = None, None
    if config.lora.enabled:
        adapter_graphdef, adapters = plan.actor_adapters()
    group = config.grpo.group_size
    slots = plan.engine_slots
    made = []

    def build(state, adapters):
        lora = None if adapters is None else nnx.merge(adapter_graphdef, adapters)
        engine = Engine(nnx.merge(graphdef, state), eos_ids=(0,), pad_id=0, config=cfg, slots=slots, adapters=lora,
                        mesh=mesh)
        made.append(engine)
        sizes = engine.program_shapes(group)[0]
        return engine._head, {size: engine._empty_state_impl(size, engine.ring) for size in sizes}

    head, banks = jax.eval_shape(build, state, adapters)
    engine = made[0]
    engine.close()
    engine.state, engine._head, engine.adapters = state, head, adapters  # no tracer outlives eval_shape
    head = jax.ShapeDtypeStruct(
        head.shape, head.dtype,
        sharding=NamedSharding(mesh, spec_for(("vocab", "embed"), head.shape, mesh, DEFAULT_RULES)))

    def place(bank: SlotState) -> SlotState:
        return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), bank,
                            engine.slot_shardings)

    sizes, plens, rows = engine.program_shapes(group)
    return EngineSetup(engine, graphdef, state, head, adapters, {size: place(b) for size, b in banks.items()},
                       sizes, plens, rows)


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
    config = plan.config
    cfg, mesh = config.sampler, plan.actor_mesh
    engine, state, head, adapters = setup.engine, setup.state, setup.head, setup.adapters
    full = engine.bank_slots
    replicated = NamedSharding(mesh, PartitionSpec())
    static = engine.sampling.static

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    scalars = (sds((), jnp.float32), sds((), jnp.float32))
    weights = shard_bytes(state)
    head_bytes = shard_bytes(head)
    # The other banks' slot states stay on the same devices.
    other_banks = (engine.num_banks - 1) * setup.bank_bytes
    held, held_what = actor_held(plan, state, adapters, learner_held, other_banks,
                                 f"the other {engine.num_banks - 1} bank(s)' slot state")
    hints = engine_hints(plan, engine, weights, topology)

    # When every sample decodes to max_new_tokens, the slots fill and empty in waves.
    group = config.grpo.group_size
    samples = plan.actor_rows
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
    plen = min(_bucket(plan.prompt_bucket, cfg.min_prompt_bucket), cfg.max_prompt_len)

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


def engine_hints(plan: RunPlan, engine: Engine, weights: int,
                 topology: Topology) -> tuple[str, ...]:
    """Settings that shrink the engine's programs: the weights first (as sampler_hints), then the slots' KV
    rings and the admission's prefill."""
    cfg = plan.config.sampler
    hints = sampler_hints(plan, weights, topology)
    if 2 * weights > topology.hbm_bytes:
        return hints
    now = f"now {engine.num_slots}" + ("" if cfg.slots else ": 0 means prompts_per_step / hosts x group_size")
    hints = [f"fewer sampler.slots ({now}; each holds a KV ring of max_prompt_len + max_new_tokens = {engine.ring} "
             f"positions)",
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

    engine: ContinuationEngine  # built under eval_shape: only its jitted programs and shapes are used
    state: object  # abstract weights on the actor mesh
    head: jax.ShapeDtypeStruct  # the vocab-major head, sharded as the actor's
    adapters: object  # abstract LoRA adapters, or None
    turn: TurnState  # ShapeDtypeStructs with the engine's shardings (ContinuationEngine.state_shardings)
    widths: list  # the extend buckets: powers of two from MIN_APPEND_BUCKET to engine.columns // 2

    @property
    def state_bytes(self) -> int:
        """Per device: the rows' TurnState (their KV caches above all), on the actor's devices for the whole run."""
        return shard_bytes(self.turn)


def continuation_setup(plan: RunPlan) -> ContinuationSetup:
    """The ContinuationEngine the trainer builds on each host (episodes.make_episode_runner: sampler.slots or that
    host's samples per step as rows, episode_context as context), built under eval_shape over abstract weights on
    the actor mesh, and its TurnState in the layout its programs return it in (the KV cache as
    sampler.cache_layout lays it out on the actor mesh, every other field replicated). Token ids (stop, pad) do
    not change the programs' shapes."""
    config, mesh = plan.config, plan.actor_mesh
    graphdef, state = plan.actor_params()
    adapter_graphdef, adapters = None, None
    if config.lora.enabled:
        adapter_graphdef, adapters = plan.actor_adapters()
    made = []

    def build(state, adapters):
        lora = None if adapters is None else nnx.merge(adapter_graphdef, adapters)
        engine = ContinuationEngine(nnx.merge(graphdef, state), stop_ids=(0,), pad_id=0, config=config.sampler,
                                    rows=plan.engine_slots, context=episode_context(config.env, config.sampler),
                                    adapters=lora, mesh=mesh)
        made.append(engine)
        return engine._head, engine._turn

    head, turn = jax.eval_shape(build, state, adapters)
    engine = made[0]
    engine.state, engine._head, engine.adapters = state, head, adapters  # no tracer outlives eval_shape
    head = jax.ShapeDtypeStruct(
        head.shape, head.dtype,
        sharding=NamedSharding(mesh, spec_for(("vocab", "embed"), head.shape, mesh, DEFAULT_RULES)))
    turn = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), turn,
                        engine.state_shardings)
    engine._turn = turn
    widths = [MIN_APPEND_BUCKET]
    while widths[-1] < engine.columns // 2:
        widths.append(2 * widths[-1])
    return ContinuationSetup(engine, state, head, adapters, turn, widths)


def continuation_programs(plan: RunPlan, topology: Topology, setup: ContinuationSetup,
                          learner_held: int) -> list[Program]:
    """The continuation engine's programs (ContinuationEngine._decode, _extend, _compact: its own jitted
    functions) on one host's actor mesh, for a run with an env section:

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
    engine, state, head, adapters, turn = setup.engine, setup.state, setup.head, setup.adapters, setup.turn
    rows = engine.rows
    replicated = NamedSharding(mesh, PartitionSpec())
    static = engine.sampling.static

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    scalars = (sds((), jnp.float32), sds((), jnp.float32))
    weights = shard_bytes(state)
    held, held_what = actor_held(plan, state, adapters, learner_held)
    hints = continuation_hints(plan, engine, weights, topology)

    # Every episode: max_turns turns sharing max_new_tokens sampled tokens, in waves of `rows` episodes.
    waves = -(-plan.actor_rows // rows)
    turns = max(1, env.max_turns)
    per_turn = -(-max(cfg.max_new_tokens - turns, 0) // turns)  # decode steps of one turn
    chunk_calls = waves * turns * -(-per_turn // cfg.chunk_steps)
    opening = min(_bucket(cfg.max_prompt_len, MIN_APPEND_BUCKET), setup.widths[-1])
    common = "; the environment's steps (on the host, between turns) are not counted"
    programs = []

    decode = compile_one(engine._decode, (state, head, adapters, turn, *scalars), topology,
                         dict(static, steps=cfg.chunk_steps), label="continuation decode")
    seconds, cost, cost_note, notes = decode.seconds, None, "", ()
    if decode.memory is not None:
        step = compile_one(engine._decode, (state, head, adapters, turn, *scalars), topology, dict(static, steps=1),
                           label="continuation decode (one decode step alone, for its cost)")
        seconds += step.seconds
        if step.cost is None:
            cost_note = f"one decode step alone was refused: {step.refusal}"
        else:
            cost = step.cost * cfg.chunk_steps
            notes = (f"one decode step of {rows} rows x chunk_steps={cfg.chunk_steps} per call; {chunk_calls} call(s) "
                     f"per step: {plan.actor_rows} episodes in {waves} wave(s), each env.max_turns={env.max_turns} "
                     f"turns sampling max_new_tokens={cfg.max_new_tokens} tokens in all{common}",)
    programs.append(Program("continuation decode", mesh.size, decode.memory, held, held_what, cost, chunk_calls,
                            seconds, decode.refusal, hints, cost_note, actor=True, notes=notes))

    def extend(width: int) -> Compiled:
        row_args = (sds((rows, width), jnp.int32), sds((rows, width), jnp.bool_), sds((rows,), jnp.bool_),
                    sds((rows, 2), jnp.uint32), sds((rows,), jnp.int32))
        return compile_one(engine._extend, (state, head, adapters, turn, *row_args, *scalars), topology, static,
                           label=f"continuation extend {width}")

    smallest, widest = setup.widths[0], setup.widths[-1]
    calls = dict.fromkeys((widest, opening, smallest), 0)  # width -> calls per step
    calls[opening] += waves
    calls[smallest] += waves * (turns - 1)
    for width, n in calls.items():
        compiled = extend(width)
        roles = [role for w, role in ((widest, "the widest bucket (the whole context at once): the most memory"),
                                      (opening, f"the opening prompt's bucket (sampler.max_prompt_len="
                                                f"{cfg.max_prompt_len})"),
                                      (smallest, "the smallest bucket (a turn's appended ids)")) if w == width]
        calls_text = f"{n} call(s) per step{common}" if n else "not in the step projection"
        notes = ("; ".join([*roles, calls_text]),)
        programs.append(Program(f"continuation extend {width}", mesh.size, compiled.memory, held, held_what,
                                compiled.cost, n, compiled.seconds, compiled.refusal, hints, actor=True, notes=notes))

    compact = compile_one(engine._compact, (turn,), topology, label="continuation compact")
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
