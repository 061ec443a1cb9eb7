"""Continuation engine: sequences that keep their keys/values across turns, for multi-turn episodes.

A multi-turn episode samples an assistant turn, waits for the environment, then goes on from where it was. This
engine keeps every row's KV cache between turns, so that a continued sequence prefills only the ids appended
after its turn (the end-of-turn token it sampled, the template's glue, the environment's messages, the next
generation prompt), never its whole history again. The host side (rollout.episodes) drives it.

- Rows. `rows` sequences, each with its own cache row of `columns` KV columns, a key mask (which columns hold
  one of its keys), its next RoPE position and its PRNG key. Attention is permutation-invariant over keys
  (RoPE is applied before caching), so a row's keys need not be contiguous: only key_mask says which they are.
- One clock. Every program writes columns clock, clock + 1, ... for all rows at once (one dynamic_update_slice,
  as in the static sampler); a row that is not extending or decoding leaves its key mask off there. Every
  marked column is before the clock, so a query at the clock sees exactly its row's marked keys.
- extend(appended, restart): writes each extending row's appended ids right-aligned into the next T columns
  (T: a power-of-two bucket), marks them, and draws the row's first token of its next turn from the last one.
  `restart` clears the row first (a new episode, or a new segment where the renderer cannot extend).
- decode(): up to `chunk_steps` steps for the rows whose turn is going on; a row's turn ends when it samples a
  stop id (end of turn or end of text) or reaches its turn limit. Parked rows (turn ended, the environment
  step running on the host) keep their cache untouched.
- Compaction. The clock advances for all rows, so parked rows leave unmarked columns behind; when the next
  program would pass the last column, compact() moves every row's marked columns to the front (a gather, no
  model compute) and restarts the clock at the longest row.
- Randomness. Row r's k-th sampled token (counted over its whole episode, every turn) draws from
  fold_in(keys[r], k): what an episode samples depends on its key, its history and the weights, not on the rest
  of the batch (up to float noise between batch shapes).
- Weights. update_params(state, version) takes effect at the next program; each program's tokens are returned
  with the version that drew them (in-flight updates, as in the continuous engine).
- Programs (jit once): extend (one per append bucket), decode (one), compact (one), the empty state (one);
  programs() publishes them with abstract arguments for `grpo-jax compile` (rollout.common).

Models with sliding-window layers and routing replay are not supported here (a row's keys are not contiguous,
and routing is not recorded): make_continuation refuses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.errors import ConfigError
from grpo_jax.model.attention import AttentionMask, causal_mask
from grpo_jax.model.transformer import rope_inverse_frequencies
from grpo_jax.parallel.sharding import traced_on
from grpo_jax.rollout.common import (
    GeneratorProgram,
    Sampling,
    Workload,
    abstract_arrays,
    bucket,
    cache_layout,
    check_top_k,
    draw_uniforms,
    is_abstract,
    merged,
    placed,
    replicated,
    vocab_major_head,
    weights_mesh,
    weights_state,
)
from grpo_jax.rollout.sampler import SamplerConfig

MIN_APPEND_BUCKET = 16  # appended ids are padded to powers of two from here (one extend program per bucket)


class TurnState(NamedTuple):
    """The rows on the device (R rows, C columns)."""

    cache: tuple  # per layer (k, v), each [R, heads, C, D]: the keys/values of each row's sequence
    key_mask: jax.Array  # [R, C] bool: the columns that hold a key of the row's current sequence
    position: jax.Array  # [R] int32: RoPE position of the row's next token (tokens in its sequence so far)
    last_token: jax.Array  # [R] int32: the token sampled last, fed at the next decode step
    active: jax.Array  # [R] bool: the row's turn is going on (decode samples for it)
    generated: jax.Array  # [R] int32: tokens the row sampled in its episode: the next draws fold_in(key, generated)
    limit: jax.Array  # [R] int32: `generated` at which the row's current turn stops (its token budget)
    keys: jax.Array  # [R, 2] uint32: raw key data of the row's episode
    clock: jax.Array  # [] int32: the next column to write; every marked column is before it


@dataclasses.dataclass(frozen=True)
class Drawn:
    """What one program sampled (host NumPy): row r's new tokens are tokens[r, :count[r]]."""

    tokens: np.ndarray  # [R, steps] int32
    logprobs: np.ndarray  # [R, steps] float32: under the distribution sampled from
    count: np.ndarray  # [R] int32: tokens each row sampled in this program
    ended: np.ndarray  # [R] bool: the row's turn ended in this program (stop id or its limit)
    version: int  # the weights that drew them


class ContinuationEngine:
    """Rows that decode turn by turn and keep their KV cache between turns (module docstring). One thread drives
    it."""

    def __init__(self, model: nnx.Module, stop_ids: Sequence[int], pad_id: int, config: SamplerConfig, *,
                 rows: int, context: int, adapters: nnx.Module | None = None, version: int = 0,
                 mesh: Mesh | None = None):
        """stop_ids: the ids that end a turn; context: the most tokens one row's sequence may hold."""
        if model.config.has_local_layers:
            raise ConfigError(f"env: {model.config.architecture} has sliding-window layers, which the continuation "
                              "engine does not support (a row's keys are not contiguous); use a model without them")
        if model.config.replays_routing:
            raise ConfigError("env: model.routing_replay is not supported with environments (the continuation "
                              "engine records no routing); set model.routing_replay=false")
        if rows < 1 or context < 2:
            raise ValueError(f"rows={rows}, context={context}: need rows >= 1 and context >= 2")
        self.config = config
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.pad_id = int(pad_id)
        self.rows, self.context = int(rows), int(context)
        self.vocab_size = model.config.vocab_size
        # Room for the longest sequence plus the next program's columns; compaction keeps it there.
        self.columns = 2 * bucket(self.context, MIN_APPEND_BUCKET)
        self.graphdef, self.state = nnx.split(model)
        self._head = vocab_major_head(self.graphdef, self.state)
        self.adapter_graphdef, self.adapters = nnx.split(adapters) if adapters is not None else (None, None)
        self.version = int(version)
        self.sampling = Sampling(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
        mesh = weights_mesh(self.state) if mesh is None else mesh
        self.mesh = mesh
        self.cache_heads, cache_sharding = cache_layout(model.config, mesh)
        self.state_shardings = None
        out = {}
        if mesh is not None:
            replicated = NamedSharding(mesh, PartitionSpec())
            self.state_shardings = TurnState(cache=((cache_sharding,) * 2,) * model.config.num_layers,
                                             **{f: replicated for f in TurnState._fields if f != "cache"})
            out = {"out_shardings": (self.state_shardings, replicated, replicated, replicated)}
        self.num_compilations = 0
        self._extend = jax.jit(traced_on(mesh, self._extend_impl), static_argnames=("greedy", "top_k", "use_top_p"),
                               donate_argnums=(3,), **out)
        self._decode = jax.jit(traced_on(mesh, self._decode_impl),
                               static_argnames=("steps", "greedy", "top_k", "use_top_p"),
                               donate_argnums=(3,), **out)
        self._compact = jax.jit(self._compact_impl, donate_argnums=(0,),
                                **({} if mesh is None else {"out_shardings": self.state_shardings}))
        self._empty = jax.jit(self._empty_impl, static_argnums=(0, 1),
                              **({} if mesh is None else {"out_shardings": self.state_shardings}))
        self.reset()
        self.stats = {"extend_calls": 0, "extend_tokens": 0, "decode_calls": 0, "decode_steps": 0, "compactions": 0}

    # -- weights --

    def update_params(self, model_or_state, version: int | None = None) -> None:
        """New weights (the model or its state; with LoRA, the adapters), used from the next program on."""
        model_or_state = weights_state(model_or_state)
        if self.adapter_graphdef is not None:
            self.adapters = model_or_state
        else:
            self.state, self._head = model_or_state, vocab_major_head(self.graphdef, model_or_state)
        self.version = self.version + 1 if version is None else int(version)

    # -- host calls --

    def reset(self) -> None:
        """Every row empty and idle (a new batch of episodes); abstract rows over abstract weights."""
        self._turn = self.turn_state_shape() if is_abstract(self.state) else self._empty(self.rows, self.columns)
        # Host copies of what the last program left on the device (fetched with its tokens, so that the driving
        # loop needs no extra device sync): the clock (when to compact), which rows' turns go on, their draws.
        self._clock = 0
        self._active = np.zeros(self.rows, bool)
        self._generated = np.zeros(self.rows, np.int32)

    def extend(self, appended: Sequence[Sequence[int] | None], restart: Sequence[bool], keys: np.ndarray,
               turn_tokens: Sequence[int]) -> Drawn:
        """Append ids to rows and draw the first token of each extending row's next turn.

        appended[r]: the ids to append to row r (None or empty: the row is left as it is); restart[r]: clear the row
        first (a new episode after reset(), or a new segment, starts with these ids, which must then be the whole
        sequence); keys: [R, 2] raw key data, taken for restarted rows (the episode's key); turn_tokens[r]: the
        most tokens the row may sample in this turn (>= 1)."""
        if len(appended) != self.rows or len(restart) != self.rows or len(turn_tokens) != self.rows:
            raise ValueError(f"extend: one entry per row ({self.rows})")
        check_top_k(self.sampling.top_k, self.vocab_size, "extend")
        lengths = np.array([len(a) if a is not None else 0 for a in appended], np.int64)
        if not lengths.any():
            raise ValueError("extend: no row has ids to append")
        width = bucket(int(lengths.max()), MIN_APPEND_BUCKET)
        if width > self.columns // 2:
            raise ValueError(f"extend: {int(lengths.max())} ids to append, more than the context of {self.context}")
        tokens = np.full((self.rows, width), self.pad_id, np.int32)
        mask = np.zeros((self.rows, width), bool)
        for r, ids in enumerate(appended):
            if lengths[r]:
                tokens[r, width - lengths[r]:] = np.asarray(ids, np.int32)
                mask[r, width - lengths[r]:] = True
        restart = np.asarray(restart, bool) & (lengths > 0)
        self._make_room(width)
        state, head, adapters = self.state, self._head, self.adapters
        self._turn, token, logprob, _ = self._extend(
            state, head, adapters, self._turn, tokens, mask, restart, np.asarray(keys, np.uint32).reshape(-1, 2),
            np.maximum(np.asarray(turn_tokens, np.int32), 1), *self.sampling.scalars, **self.sampling.static)
        self._clock += width
        self.stats["extend_calls"] += 1
        self.stats["extend_tokens"] += int(lengths.sum())
        token, logprob, self._active, self._generated = (np.asarray(x) for x in jax.device_get(
            (token, logprob, self._turn.active, self._turn.generated)))
        extending = lengths > 0
        return Drawn(tokens=token.astype(np.int32)[:, None], logprobs=logprob.astype(np.float32)[:, None],
                     count=extending.astype(np.int32), ended=extending & ~self._active, version=self.version)

    def decode(self) -> Drawn:
        """One chunk of up to sampler.chunk_steps decode steps for the rows whose turn is going on."""
        steps = self.config.chunk_steps
        self._make_room(steps)
        before, generated = self._active, self._generated
        self._turn, tokens, logprobs, ran = self._decode(
            self.state, self._head, self.adapters, self._turn, *self.sampling.scalars, steps=steps,
            **self.sampling.static)
        tokens, logprobs, ran, self._active, self._generated = (np.asarray(x) for x in jax.device_get(
            (tokens, logprobs, ran, self._turn.active, self._turn.generated)))
        self._clock += int(ran)
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += int(ran)
        return Drawn(tokens=tokens, logprobs=logprobs, count=(self._generated - generated).astype(np.int32),
                     ended=before & ~self._active, version=self.version)

    @property
    def any_active(self) -> bool:
        """Whether some row's turn goes on (after the last program; no device sync)."""
        return bool(self._active.any())

    def _make_room(self, width: int) -> None:
        if self._clock + width > self.columns:
            self._turn = self._compact(self._turn)
            clock = int(jax.device_get(self._turn.clock))
            self._clock = clock
            self.stats["compactions"] += 1
            if clock + width > self.columns:  # cannot happen while every row stays within the context
                raise RuntimeError(f"continuation engine: {clock} + {width} columns exceed {self.columns}")

    def metrics(self) -> dict:
        return {f"rollout/continuation_{k}": v for k, v in self.stats.items()}

    # -- planning --

    @property
    def head(self) -> jax.Array:
        """The vocab-major LM head the programs take (vocab_major_head of the weights)."""
        return self._head

    def turn_state_shape(self) -> TurnState:
        """The rows' TurnState as ShapeDtypeStructs, in the layout the programs return it in (state_shardings)."""
        return placed(jax.eval_shape(lambda: self._empty(self.rows, self.columns)), self.state_shardings)

    @property
    def append_buckets(self) -> list[int]:
        """The extend programs' widths: powers of two from MIN_APPEND_BUCKET to half the columns."""
        widths = [MIN_APPEND_BUCKET]
        while widths[-1] < self.columns // 2:
            widths.append(2 * widths[-1])
        return widths

    @property
    def opening_bucket(self) -> int:
        """The extend width of an episode's opening prompt (up to sampler.max_prompt_len tokens)."""
        return min(bucket(self.config.max_prompt_len, MIN_APPEND_BUCKET), self.append_buckets[-1])

    def waves(self, episodes: int) -> int:
        """The batches of `rows` episodes that `episodes` episodes run in."""
        return -(-episodes // self.rows)

    def programs(self, workload: Workload) -> list[GeneratorProgram]:
        """The engine's programs over abstract arguments, with their calls per step, in this order:

        - "continuation decode": a chunk of chunk_steps decode steps of every row; then one decode step alone
          (steps=1), compiled for its cost (cost_part: chunk_steps);
        - "continuation extend <width>" (shape: (rows, width)): appended ids prefilled into every row, at the widest
          bucket (the whole context at once: the most memory), at the opening prompt's bucket when it is not the
          widest, and at the smallest (a turn's appended ids: the common case);
        - "continuation compact": every row's keys moved to the front of its cache (a gather, no model compute).

        Calls per step, leaving out the environment (its steps run on the host, between turns): workload.samples
        episodes run in waves of `rows`; in each, every episode takes workload.turns turns and samples
        max_new_tokens tokens split evenly over them (each turn's first token drawn by its extend, a turn's last
        partial chunk counted whole); one extend per turn, the opening at its bucket and the others at the
        smallest. The widest extend (unless it is the opening's) and the compaction are in no step's projection."""
        cfg, rows = self.config, self.rows
        waves, turns = self.waves(workload.samples), max(1, workload.turns)
        per_turn = -(-max(cfg.max_new_tokens - turns, 0) // turns)  # decode steps of one turn
        whole = replicated(self.mesh)
        static = self.sampling.static
        state, head, adapters = abstract_arrays((self.state, self._head, self.adapters))
        turn = self.turn_state_shape()

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

        scalars = (sds((), jnp.float32), sds((), jnp.float32))
        weights = (state, head, adapters, turn, *scalars)
        programs = [
            GeneratorProgram(name="continuation decode", label="continuation decode", jitted=self._decode, args=weights,
                             kwargs=dict(static, steps=cfg.chunk_steps), shape=(rows,), donated=(3,),
                             calls_per_step=waves * turns * -(-per_turn // cfg.chunk_steps)),
            GeneratorProgram(name="continuation decode",
                             label="continuation decode (one decode step alone, for its cost)", jitted=self._decode,
                             args=weights, kwargs=dict(static, steps=1), shape=(rows,), donated=(3,),
                             cost_part=cfg.chunk_steps)]
        widths = self.append_buckets
        smallest, widest, opening = widths[0], widths[-1], self.opening_bucket
        calls = dict.fromkeys((widest, opening, smallest), 0)  # width -> calls per step
        calls[opening] += waves
        calls[smallest] += waves * (turns - 1)
        for width, n in calls.items():
            row_args = (sds((rows, width), jnp.int32), sds((rows, width), jnp.bool_), sds((rows,), jnp.bool_),
                        sds((rows, 2), jnp.uint32), sds((rows,), jnp.int32))
            programs.append(GeneratorProgram(
                name=f"continuation extend {width}", label=f"continuation extend {width}", jitted=self._extend,
                args=(state, head, adapters, turn, *row_args, *scalars), kwargs=dict(static), shape=(rows, width),
                donated=(3,), calls_per_step=n))
        programs.append(GeneratorProgram(name="continuation compact", label="continuation compact",
                                         jitted=self._compact, args=(turn,), shape=(rows,), donated=(0,)))
        return programs

    # -- device programs --

    def _empty_impl(self, rows: int, columns: int) -> TurnState:
        self.num_compilations += 1
        model = nnx.merge(self.graphdef, self.state)
        return TurnState(cache=model.init_cache(rows, columns, self.cache_heads),
                         key_mask=jnp.zeros((rows, columns), bool), position=jnp.zeros((rows,), jnp.int32),
                         last_token=jnp.full((rows,), self.pad_id, jnp.int32), active=jnp.zeros((rows,), bool),
                         generated=jnp.zeros((rows,), jnp.int32), limit=jnp.zeros((rows,), jnp.int32),
                         keys=jnp.zeros((rows, 2), jnp.uint32), clock=jnp.zeros((), jnp.int32))

    def _layers(self, model, lora, x, positions, attend, cache, write_index):
        """The model's layers over x [R, T, E] writing columns write_index.. of the cache; attend: which of the C
        columns each query sees."""
        inv_freq = rope_inverse_frequencies(model.config)
        new_cache = []
        for i, layer in enumerate(model.layers):
            x, layer_cache, _ = layer(x, positions, attend, inv_freq, cache[i], write_index,
                                      None if lora is None else lora.layers[i])
            new_cache.append(layer_cache)
        return model.final_norm(x), tuple(new_cache)

    def _sample(self, head, hidden, keys, index, temperature, top_p, greedy, top_k, use_top_p):
        logits = jnp.einsum("ve,re->vr", head, hidden, preferred_element_type=jnp.float32)
        return sample_logits(logits, draw_uniforms(keys, index), temperature, top_p, greedy=greedy, top_k=top_k,
                             use_top_p=use_top_p, vocab_major=True)

    def _extend_impl(self, params, head, adapters, state: TurnState, tokens, mask, restart, keys, turn_tokens,
                     temperature, top_p, *, greedy, top_k, use_top_p):
        self.num_compilations += 1
        model, lora = merged(self.graphdef, params, self.adapter_graphdef, adapters)
        width = tokens.shape[1]
        extending = mask.any(axis=1)
        key_mask = jnp.where(restart[:, None], False, state.key_mask)
        position = jnp.where(restart, 0, state.position)
        generated = state.generated  # reset() starts episodes at 0; a new segment goes on counting its draws
        keys = jnp.where(restart[:, None], keys, state.keys)
        key_mask = jax.lax.dynamic_update_slice(key_mask, mask, (0, state.clock))
        positions = position[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        attend = causal_mask(key_mask, width, state.clock)
        hidden, cache = self._layers(model, lora, model.embed_tokens(tokens), positions, attend, state.cache,
                                     state.clock)
        token, logprob = self._sample(head, hidden[:, -1], keys, generated, temperature, top_p, greedy, top_k,
                                      use_top_p)
        stop = jnp.asarray(self.stop_ids or (-1,), jnp.int32)
        limit = jnp.where(extending, generated + turn_tokens, state.limit)
        new_generated = generated + extending
        active = extending & ~jnp.isin(token, stop) & (new_generated < limit)
        state = TurnState(cache=cache, key_mask=key_mask, position=position + mask.sum(axis=1, dtype=jnp.int32),
                          last_token=jnp.where(extending, token, state.last_token),
                          active=jnp.where(extending, active, state.active), generated=new_generated, limit=limit,
                          keys=keys, clock=state.clock + width)
        return state, jnp.where(extending, token, self.pad_id), jnp.where(extending, logprob, 0.0), state.clock

    def _decode_impl(self, params, head, adapters, state: TurnState, temperature, top_p, *, steps, greedy, top_k,
                     use_top_p):
        self.num_compilations += 1
        model, lora = merged(self.graphdef, params, self.adapter_graphdef, adapters)
        rows, columns = state.key_mask.shape
        stop = jnp.asarray(self.stop_ids or (-1,), jnp.int32)

        def body(carry):
            j, st, out_tokens, out_logprobs = carry
            live = st.active
            key_mask = jax.lax.dynamic_update_slice(st.key_mask, live[:, None], (0, st.clock))
            hidden, cache = self._layers(model, lora, model.embed_tokens(st.last_token[:, None]),
                                         st.position[:, None], AttentionMask(key_mask=key_mask), st.cache,
                                         st.clock)
            token, logprob = self._sample(head, hidden[:, 0], st.keys, st.generated, temperature, top_p, greedy,
                                          top_k, use_top_p)
            token = jnp.where(live, token, self.pad_id)
            out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, j))
            out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, jnp.where(live, logprob, 0.0)[:, None], (0, j))
            generated = st.generated + live
            active = live & ~jnp.isin(token, stop) & (generated < st.limit)
            st = st._replace(cache=cache, key_mask=key_mask, position=st.position + live,
                             last_token=jnp.where(live, token, st.last_token), active=active, generated=generated,
                             clock=st.clock + 1)
            return j + 1, st, out_tokens, out_logprobs

        def cond(carry):
            j, st = carry[:2]
            return (j < steps) & jnp.any(st.active) & (st.clock < columns)

        carry = (jnp.int32(0), state, jnp.full((rows, steps), self.pad_id, jnp.int32),
                 jnp.zeros((rows, steps), jnp.float32))
        j, state, out_tokens, out_logprobs = jax.lax.while_loop(cond, body, carry)
        return state, out_tokens, out_logprobs, j

    def _compact_impl(self, state: TurnState) -> TurnState:
        """Every row's marked columns moved to the front, in order; the clock at the longest row."""
        self.num_compilations += 1
        order = jnp.argsort(~state.key_mask, axis=1, stable=True)
        count = state.key_mask.sum(axis=1, dtype=jnp.int32)
        columns = state.key_mask.shape[1]

        def gather(x):  # [R, heads, C, D] along C
            return jnp.take_along_axis(x, order[:, None, :, None], axis=2)

        return state._replace(cache=jax.tree.map(gather, state.cache),
                              key_mask=jnp.arange(columns)[None, :] < count[:, None], clock=count.max())
