"""Batched autoregressive sampling with a KV cache: one jitted prefill + decode loop per shape bucket.

Design:
- Prompts are left-padded into a length bucket, so every row writes the cache at the same slot each
  step (one dynamic_update_slice for the whole batch); positions count real tokens only.
- Prompt length, batch size and new-token count are bucketed (powers of two) so that a long run with
  varying prompts compiles a handful of programs. Temperature, top-p and max_new_tokens are runtime
  values; greedy and top-k (lax.top_k needs a static k) select the program.
- Parameters are an argument of the jitted function (nnx graphdef/state split, merged inside), so
  `update_params` swaps weights without recompiling. With LoRA adapters (lora.py) the base weights stay
  and `update_params` swaps the adapters alone; they are applied unmerged (two thin matmuls per
  adapted projection), exactly as the learner computes them, and never with dropout.
- Each row has its own PRNG key and draws one uniform per step from fold_in(key, step): a row's
  completion depends only on its prompt, its key and the weights, not on the rest of the batch.
- Tokens are drawn by algorithm.sampling.sample_logits (temperature, top-k, top-p; exact inverse-CDF
  sampling), the distribution the learner's log-probs use too.
- The LM head, the largest cost of a decode step, is computed as head [V, E] @ hidden^T into
  vocab-major logits [V, B], which sampling consumes as they are: XLA:CPU runs that dot faster
  than hidden @ head^T (docs/benchmarks.md). The [V, E] head is kept beside the state (a transposed copy of an untied
  lm_head, made once per weight update).
- The decode loop runs in `decode_phases` loops over a growing KV cache, so attention reads only the
  filled part of the cache plus at most one phase (see _generate_impl).
- Rows are split over `decode_streams` concurrent executions of the same program (see SamplerConfig).
- Weights on a mesh that spans hosts (an actor across hosts, sharding.cut_devices): every process calls
  generate with the same prompts and keys (every host's rows), in the same order as its other calls; the
  rows are split over the mesh's data x fsdp devices, the streams run one after the other (concurrent
  collective programs could start in a different order on each host), and every process gets all rows back.
- programs() publishes the generate program with abstract arguments for `grpo-jax compile`, and its prefill and
  one decode step compiled alone for their cost (rollout.common).

Batch independence is about the randomness: float results of XLA's kernels can differ in the last bits
between batch shapes or paddings, which can flip a draw that lands within rounding of a CDF boundary
(rare with a peaked distribution, more common with a near-uniform one over a large vocab).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.config_io import config_key
from grpo_jax.model.transformer import DTYPES, positions_from_mask
from grpo_jax.parallel.sharding import traced_on
from grpo_jax.rollout.common import (  # SampleResult, cache_layout, weights_mesh, vocab_major_head: also from here
    GeneratorProgram,
    SampleResult,
    Sampling,
    Workload,
    abstract_arrays,
    bucket,
    cache_layout,
    check_top_k,
    checked_config,
    checked_prompts,
    merged,
    replicated,
    vocab_major_head,
    weights_mesh,
    weights_state,
)

MIN_PHASE_STEPS = 16  # shorter decode phases save less attention than their extra loop costs to compile
ENGINES = ("static", "continuous")  # SamplerConfig.engine
KV_CACHES = ("ring", "paged")  # SamplerConfig.kv_cache


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    temperature: float = config_key(1.0, "Sampling temperature; 0: greedy.")
    top_p: float = config_key(1.0, "Nucleus sampling: the smallest set of top tokens holding this much of the mass; "
                                   "1: off.")
    top_k: int = config_key(0, "Sample from the k most likely tokens only; 0: off.")
    max_new_tokens: int = config_key(64, "The most tokens sampled per completion.")
    max_prompt_len: int = config_key(512, "The longest prompt (tokens) the sampler takes.")
    min_prompt_bucket: int = config_key(16, "Prompt lengths are padded to powers of two from here.")
    min_batch_bucket: int = config_key(1, "Batch sizes are padded to powers of two from here.")
    # The decode step is a chain of small ops that XLA's CPU runtime mostly runs one at a time on one core; it
    # overlaps separate executions launched from separate threads (the gain: docs/benchmarks.md).
    decode_streams: int = config_key(2, "Concurrent executions of the decode program, each on a share of the rows. "
                                        "2 gives more tokens/s on 2 cores; use 1 on an accelerator.")
    # Early steps attend over a shorter cache (see Sampler._generate_impl; the gain: docs/benchmarks.md).
    decode_phases: int = config_key(4, "The decode loop is split into up to this many loops (none shorter than "
                                       f"{MIN_PHASE_STEPS} steps) over a growing KV cache, so that early steps attend "
                                       "over a shorter one. Each phase is one more decode step to compile.")
    engine: str = config_key("continuous", "Which generator the trainer's actor uses: 'continuous' "
                                           "(grpo_jax.rollout.engine: slots refilled between decode chunks, one "
                                           "prefill per prompt shared by its samples, groups streamed out as they "
                                           "finish, in-flight weight updates) or 'static' (rollout.sampler: one "
                                           "batch per handout, run until its longest row ends).")
    slots: int = config_key(0, "Continuous engine only: sequences decoded at once (0: prompts_per_step x "
                               "group_size in the trainer, 64 elsewhere), split evenly over decode_streams.")
    chunk_steps: int = config_key(16, "Continuous engine only: decode steps per device call; finished slots are "
                                      "refilled and new weights adopted between chunks.")
    inflight_updates: bool = config_key(True, "Continuous engine only: adopt new weights between chunks, with "
                                              "sequences in flight (each token records the version that produced "
                                              "it); false: stop starting sequences while new weights wait, and adopt "
                                              "them once the slots have drained.")
    kv_cache: str = config_key("ring", "Continuous engine only: how its banks hold keys and values. 'ring': every "
                                       "slot owns max_prompt_len + max_new_tokens positions; 'paged': one pool of "
                                       "kv_pages pages per bank, taken as sequences grow and freed as they end "
                                       "(a group's prompt pages shared by its samples), so that slots can follow a "
                                       "memory budget at live lengths; when pages run out no sequence starts, and "
                                       "the youngest in flight is put back in the queue and restarted later.")
    page_size: int = config_key(16, "kv_cache=paged: key positions per page.")
    kv_pages: int = config_key(0, "kv_cache=paged: pages per bank (decode_streams banks), besides one scratch "
                                  "page; at least one whole sequence's, ceil((max_prompt_len + max_new_tokens - "
                                  "1) / page_size). 0: as many as the slots' rings would hold.")

    def validate(self) -> list[str]:
        """Problems with this config, as 'key=value: what is allowed' strings (empty when valid)."""
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature={self.temperature}: must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p}: must be in (0, 1] (1 means off)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k}: must be >= 0 (0 means off)")
        for key in ("max_new_tokens", "max_prompt_len", "min_prompt_bucket", "min_batch_bucket", "decode_streams",
                    "decode_phases", "chunk_steps"):
            if getattr(self, key) <= 0:
                problems.append(f"{key}={getattr(self, key)}: must be a positive integer")
        if self.engine not in ENGINES:
            problems.append(f"engine={self.engine!r}: allowed {', '.join(ENGINES)}")
        if self.slots < 0:
            problems.append(f"slots={self.slots}: must be >= 0 (0 means automatic)")
        if self.kv_cache not in KV_CACHES:
            problems.append(f"kv_cache={self.kv_cache!r}: allowed {', '.join(KV_CACHES)}")
        if self.kv_cache == "paged" and self.engine != "continuous":
            problems.append(f"kv_cache='paged': pages are the continuous engine's (engine={self.engine!r}); set "
                            "engine=continuous or kv_cache=ring")
        if self.page_size <= 0:
            problems.append(f"page_size={self.page_size}: must be a positive integer")
        elif self.kv_pages < 0 or 0 < self.kv_pages < self.pages_per_sequence:
            problems.append(f"kv_pages={self.kv_pages}: must be 0 (as many as the rings would hold) or at least "
                            f"{self.pages_per_sequence} (one whole sequence: max_prompt_len + max_new_tokens - 1 "
                            f"positions in pages of {self.page_size})")
        return problems

    @property
    def pages_per_sequence(self) -> int:
        """kv_cache=paged: the most pages one sequence holds (max_prompt_len + max_new_tokens - 1 positions)."""
        return -(-(self.max_prompt_len + self.max_new_tokens - 1) // self.page_size)

    def banks(self, slots: int) -> tuple[int, int]:
        """The continuous engine's (banks, slots per bank) for `slots` slots: decode_streams banks (at most one per
        slot), every bank the same size."""
        banks = min(self.decode_streams, slots)
        return banks, -(-slots // banks)

    def pages_per_bank(self, bank_slots: int) -> int:
        """kv_cache=paged: the pages of one bank of `bank_slots` slots: kv_pages, or (0) as many as their rings of
        max_prompt_len + max_new_tokens positions would hold."""
        return self.kv_pages or bank_slots * -(-(self.max_prompt_len + self.max_new_tokens) // self.page_size)


def _phase_ends(new_bucket: int, phases: int) -> list[int]:
    """Exclusive ends of the decode phases over steps [1, new_bucket): near-equal spans, `phases` of them
    or fewer so that none is shorter than MIN_PHASE_STEPS. Step t writes cache slot plen + t - 1, so a
    phase ending at `end` needs plen + end - 1 slots; plen + end keeps the sizes round."""
    n = max(1, min(phases, new_bucket // MIN_PHASE_STEPS))
    return [new_bucket * (i + 1) // n for i in range(n)]


# ----------------------------------------------------------------------------- the sampler


class Sampler:
    """Generates completions for batches of token-id prompts from an NNX Transformer (a common.Generator). Over
    abstract weights (common module docstring) only programs() may be used."""

    def __init__(self, model: nnx.Module, eos_ids: Sequence[int], pad_id: int, config: SamplerConfig | None = None,
                 adapters: nnx.Module | None = None, version: int = 0):
        self.config = checked_config(config or SamplerConfig())
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.pad_id = int(pad_id)
        self.vocab_size = model.config.vocab_size
        self.model_config = model.config
        self.graphdef, self.state = nnx.split(model)
        self._head = vocab_major_head(self.graphdef, self.state)
        self.adapter_graphdef, self.adapters = nnx.split(adapters) if adapters is not None else (None, None)
        self.version = int(version)
        self.num_compilations = 0  # traces of the generate program (each is one XLA compile)
        self._compiled: set = set()
        # An actor across hosts (see the module docstring): rows over data x fsdp, every result row fetched.
        leaf = jax.tree.leaves(self.state)[0]
        self.across_hosts = not leaf.sharding.is_fully_addressable
        self._mesh = leaf.sharding.mesh if self.across_hosts else None
        self._weights_mesh = weights_mesh(self.state)
        self._generate = jax.jit(traced_on(self._weights_mesh, self._generate_impl),
                                 static_argnames=("new_bucket", "greedy", "top_k", "use_top_p"))
        # The KV cache's heads for the weights' mesh (cache_layout): its layout inside the program is the compiler's.
        self.cache_heads = cache_layout(model.config, self._weights_mesh)[0]
        self._pool = concurrent.futures.ThreadPoolExecutor(max(self.config.decode_streams - 1, 1),
                                                           thread_name_prefix="sampler")

    def close(self) -> None:
        """Stop the decode-stream threads once their current work ends (idempotent)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def update_params(self, model_or_state, version: int | None = None) -> None:
        """Swap in new trained weights: the model (or its nnx.State), or for a sampler built with LoRA adapters
        the adapters (or their state), the base weights staying as they are; and their version (default: one
        more). Same structure: no recompile."""
        model_or_state = weights_state(model_or_state)
        self.version = self.version + 1 if version is None else int(version)
        if self.adapter_graphdef is not None:
            self.adapters = model_or_state
            return
        self.state = model_or_state
        self._head = vocab_major_head(self.graphdef, model_or_state)

    def share_weights(self, state, head, adapters, version: int) -> None:
        """Sample with another generator's weights as they are (its nnx.State, vocab-major head and adapters, of
        `version`), no copy made: the continuous engine's static fallback."""
        self.state, self._head, self.adapters, self.version = state, head, adapters, int(version)

    @property
    def head(self) -> jax.Array:
        """The vocab-major LM head the programs take (vocab_major_head of the weights)."""
        return self._head

    def metrics(self) -> dict:
        """No running totals: the actor measures the static sampler's throughput itself."""
        return {}

    def generate(self, prompts: list[list[int]], keys, *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None) -> SampleResult:
        """Sample one completion per prompt. keys: an int seed, or [B] per-row PRNG keys (typed
        keys or raw uint32 key data [B, 2]); with per-row keys a row's result does not depend on the
        other rows of the batch."""
        cfg = self.config
        max_new = cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        temperature = cfg.temperature if temperature is None else float(temperature)
        top_p = cfg.top_p if top_p is None else float(top_p)
        top_k = cfg.top_k if top_k is None else int(top_k)
        problems = dataclasses.replace(cfg, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                                       top_k=top_k).validate()
        if problems:
            raise ValueError("invalid sampling arguments: " + "; ".join(problems))
        check_top_k(top_k, self.vocab_size, "generate")
        n = len(prompts)
        lens = checked_prompts(prompts, cfg.max_prompt_len)

        if isinstance(keys, (int, np.integer)):
            keys = jax.random.split(jax.random.key(int(keys)), n)
        elif not (hasattr(keys, "dtype") and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)):
            keys = jax.random.wrap_key_data(jnp.asarray(keys, jnp.uint32))
        if keys.shape[0] != n:
            raise ValueError(f"got {keys.shape[0]} keys for {n} prompts")

        # Rows are split into `decode_streams` chunks of one shape (one compiled program), each run from
        # its own thread (see SamplerConfig.decode_streams).
        calls, batch, plen = self._call_shapes(n, int(lens.max()))
        chunks = np.array_split(np.arange(n), calls)
        static = self._static_args(max_new, Sampling(temperature=temperature, top_p=top_p, top_k=top_k))
        scalars = (np.int32(max_new), np.float32(temperature or 1.0), np.float32(top_p))
        state, head, adapters = self.state, self._head, self.adapters

        def run(rows: np.ndarray):
            tokens = np.full((batch, plen), self.pad_id, np.int32)
            mask = np.zeros((batch, plen), bool)
            for r, i in enumerate(rows):
                tokens[r, plen - lens[i]:] = prompts[i]
                mask[r, plen - lens[i]:] = True
            mask[len(rows):, -1] = True  # dummy rows: one real (pad) token, so no row attends to nothing
            row_keys = keys[np.concatenate([rows, np.full(batch - len(rows), rows[0])])]
            live = np.arange(batch) < len(rows)
            if self.across_hosts:
                tokens, mask, live, row_keys = self._global_rows(tokens, mask, live, row_keys)
            out = self._generate(state, head, tokens, mask, live, row_keys, *scalars, adapters=adapters, **static)
            if self.across_hosts:
                out = multihost_utils.process_allgather(out, tiled=True)
            return [x[:len(rows)] for x in jax.device_get(out)]

        key = (batch, plen, tuple(static.items()))
        if self.across_hosts:  # one stream after the other, in the same order on every host
            outs = [run(c) for c in chunks]
        elif key not in self._compiled:  # compile once, before any concurrent call could trace it again
            outs = [run(chunks[0])]
            self._compiled.add(key)
            outs += list(self._pool.map(run, chunks[1:]))
        else:
            rest = [self._pool.submit(run, c) for c in chunks[1:]]
            outs = [run(chunks[0])] + [f.result() for f in rest]
        out_tokens, out_lp, lengths, stopped = (np.concatenate(x) for x in zip(*outs))
        return SampleResult(
            tokens=out_tokens[:, :max_new], logprobs=out_lp[:, :max_new], lengths=lengths,
            finish_reasons=["stop" if s else "length" for s in stopped], prompt_lengths=lens)

    def _call_shapes(self, rows: int, longest: int) -> tuple[int, int, int]:
        """A generate of `rows` prompts, the longest of `longest` tokens: its calls (the rows split over
        decode_streams calls of one shape), their batch bucket and their prompt bucket."""
        cfg = self.config
        calls = min(cfg.decode_streams, rows)
        return (calls, bucket(-(-rows // calls), cfg.min_batch_bucket),
                min(bucket(longest, cfg.min_prompt_bucket), cfg.max_prompt_len))

    @staticmethod
    def _static_args(max_new: int, sampling: Sampling) -> dict:
        """The generate program's static arguments: its new-token bucket and the sampling mode."""
        return dict(new_bucket=bucket(max_new, 1), **sampling.static)

    def _rows_sharding(self, batch: int) -> NamedSharding | None:
        """Where a call's rows are: across hosts, split over data x fsdp when they divide evenly (the same split as
        the weights' fsdp), else whole on every device; otherwise whole on the weights' devices."""
        if not self.across_hosts:
            return replicated(self._weights_mesh)
        splits = self._mesh.shape["data"] * self._mesh.shape["fsdp"]
        return NamedSharding(self._mesh, PartitionSpec(("data", "fsdp")) if batch % splits == 0 else PartitionSpec())

    def _global_rows(self, tokens, mask, live, keys) -> tuple:
        """The batch (the same on every process) as global arrays on the mesh that spans hosts (_rows_sharding).
        Each process places only the rows its own devices hold."""
        sharding = self._rows_sharding(len(live))

        def placed(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        return (placed(tokens), placed(mask), placed(live),
                jax.random.wrap_key_data(placed(jax.random.key_data(keys))))

    def _generate_impl(self, state, head, tokens, mask, live, keys, max_new, temperature, top_p, adapters=None,
                       *, new_bucket, greedy, top_k, use_top_p):
        self.num_compilations += 1  # runs only while tracing, i.e. once per compiled program
        model, lora = merged(self.graphdef, state, self.adapter_graphdef, adapters)
        eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
        batch, plen = tokens.shape

        # Step t of a row uses fold_in(row key, t): independent of the batch and of the bucket sizes.
        # Drawn up front in one batched threefry call rather than once per decode step.
        steps = jnp.arange(new_bucket)
        uniforms = jax.vmap(lambda k: jax.vmap(lambda t: jax.random.uniform(jax.random.fold_in(k, t)))(steps))(keys)

        def sample(logits, step):
            u = jax.lax.dynamic_index_in_dim(uniforms, step, axis=1, keepdims=False)
            return sample_logits(logits, u, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                                 vocab_major=True)

        def record(out, step, tok, lp):
            out_tok, out_lp, length, done, stopped = out
            tok = jnp.where(done, self.pad_id, tok)
            lp = jnp.where(done, 0.0, lp)
            hit = ~done & jnp.isin(tok, eos)
            out_tok = jax.lax.dynamic_update_slice(out_tok, tok[:, None], (0, step))
            out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, step))
            return out_tok, out_lp, length + (~done).astype(jnp.int32), done | hit, stopped | hit

        # Prefill into a prompt-sized cache (attention spans the prompt only); the decode phases grow it.
        hidden, cache = model.hidden_states(tokens, positions_from_mask(mask), mask,
                                            model.init_cache(batch, plen, self.cache_heads), 0, adapters=lora)
        prompt_len = mask.sum(-1).astype(jnp.int32)

        def logits(h):  # h: [B, E] -> vocab-major [V, B] (see the module docstring)
            return jnp.einsum("ve,be->vb", head, h, preferred_element_type=jnp.float32)

        tok, lp = sample(logits(hidden[:, -1]), 0)
        out = (jnp.full((batch, new_bucket), self.pad_id, jnp.int32), jnp.zeros((batch, new_bucket), jnp.float32),
               jnp.zeros((batch,), jnp.int32), ~live, jnp.zeros((batch,), bool))
        out = record(out, 0, tok, lp)

        def cond(carry, end):
            step, _, _, out = carry
            return (step < jnp.minimum(max_new, end)) & ~jnp.all(out[3])

        def body(carry):
            """Feed the token sampled at step - 1, sample the one at `step`."""
            step, cache, key_mask, out = carry
            slot = plen + step - 1  # the same cache slot for every row, thanks to left padding
            prev = jax.lax.dynamic_slice_in_dim(out[0], step - 1, 1, axis=1)
            key_mask = jax.lax.dynamic_update_slice(key_mask, jnp.ones((batch, 1), bool), (0, slot))
            positions = (prompt_len + step - 1)[:, None]
            hidden, cache = model.hidden_states(prev, positions, key_mask, cache, slot, adapters=lora)
            tok, lp = sample(logits(hidden[:, 0]), step)
            return step + 1, cache, key_mask, record(out, step, tok, lp)

        # Decode in phases, each a loop whose cache ends at the last slot the phase writes: attention (and its
        # reads of the cache, the decode step's largest memory traffic) spans the filled part plus at most
        # one phase, not the whole bucket. Slots past the current one are masked out either way, so the results
        # are those of one loop over the whole cache (up to float rounding); the phase ends are static, and
        # max_new_tokens only decides which loops run.
        step, key_mask = jnp.int32(1), mask
        for end in _phase_ends(new_bucket, self.config.decode_phases):
            grow = plen + end - key_mask.shape[1]
            cache = jax.tree.map(lambda c: jnp.pad(c, ((0, 0), (0, 0), (0, grow), (0, 0))), cache)
            key_mask = jnp.pad(key_mask, ((0, 0), (0, grow)))
            step, cache, key_mask, out = jax.lax.while_loop(functools.partial(cond, end=end), body,
                                                            (step, cache, key_mask, out))
        out_tok, out_lp, length, _, stopped = out
        return out_tok, out_lp, length, stopped

    # -- planning -------------------------------------------------------------------------------------

    def programs(self, workload: Workload) -> list[GeneratorProgram]:
        """The generate program for one handout of workload.samples prompts (the rows split into decode_streams
        calls of one shape, as generate splits them; shape: (batch, prompt bucket)), over abstract arguments,
        with its calls per step. Then, since its decode loops stop when every row is done (their trip counts are
        unknown to XLA, which counts each body once), its parts compiled alone for their cost, from the same model
        and sampling code: the prefill, then (unless max_new_tokens is 1) one decode step (donating its cache) at
        the steps-weighted mean cache length of the phases, whose cost_part is the decode steps of a call with
        every row running to max_new_tokens (a decode step costs a + b x cache length, so that one step times the
        number of steps is the sum over the phases)."""
        cfg = self.config
        calls, batch, plen = self._call_shapes(workload.samples, workload.prompt_len)
        new_bucket = bucket(cfg.max_new_tokens, 1)
        sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        static = self._static_args(cfg.max_new_tokens, sampling)
        mesh = self._weights_mesh
        whole, rows = replicated(mesh), self._rows_sharding(batch)
        state, head, adapters = abstract_arrays((self.state, self._head, self.adapters))

        def sds(shape, dtype, sharding=whole):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
        args = (state, head, sds((batch, plen), jnp.int32, rows), sds((batch, plen), jnp.bool_, rows),
                sds((batch,), jnp.bool_, rows), sds(keys.shape, keys.dtype, rows), sds((), jnp.int32),
                sds((), jnp.float32), sds((), jnp.float32))
        programs = [GeneratorProgram(name="sampler generate", label="sampler generate", jitted=self._generate,
                                     args=args, kwargs=dict(static, adapters=adapters), shape=(batch, plen),
                                     calls_per_step=calls)]

        graphdef, adapter_graphdef, model_config = self.graphdef, self.adapter_graphdef, self.model_config
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

        scalars = (sds((batch,), jnp.float32), sds((), jnp.float32), sds((), jnp.float32))
        programs.append(GeneratorProgram(
            name="sampler generate", label="sampler generate (the prefill alone, for its cost)",
            jitted=jax.jit(traced_on(mesh, prefill)),
            args=(state, head, sds((batch, plen), jnp.int32), sds((batch, plen), jnp.bool_), *scalars, adapters),
            shape=(batch, plen), cost_part=1))
        steps, weighted, start = 0, 0, 1
        for end in _phase_ends(new_bucket, cfg.decode_phases):
            phase_steps = max(min(end, cfg.max_new_tokens) - start, 0)
            steps, weighted, start = steps + phase_steps, weighted + phase_steps * (plen + end), max(start, end)
        if not steps:
            return programs
        length = round(weighted / steps)
        heads, cache_sharding = cache_layout(model_config, mesh)
        shape = (batch, heads, length, model_config.resolved_head_dim)
        cache = tuple((sds(shape, DTYPES[model_config.dtype], cache_sharding),) * 2
                      for _ in range(model_config.num_layers))
        # The cache is updated in place, as in the generate loop: donated, and returned with the same layout.
        out = {} if mesh is None else {"out_shardings": ((whole, whole), cache_sharding)}
        programs.append(GeneratorProgram(
            name="sampler generate", label="sampler generate (one decode step alone, for its cost)",
            jitted=jax.jit(traced_on(mesh, decode), donate_argnums=(5,), **out),
            args=(state, head, sds((batch, 1), jnp.int32), sds((batch, 1), jnp.int32), sds((batch, length), jnp.bool_),
                  cache, sds((), jnp.int32), *scalars, adapters),
            shape=(batch, length), donated=(5,), cost_part=steps))
        return programs
