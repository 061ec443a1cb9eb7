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
  vocab-major logits [V, B], which sampling consumes as they are: XLA:CPU runs that dot ~12% faster
  than hidden @ head^T. The [V, E] head is kept beside the state (a transposed copy of an untied
  lm_head, made once per weight update).
- The decode loop runs in `decode_phases` loops over a growing KV cache, so attention reads only the
  filled part of the cache plus at most one phase (see _generate_impl).
- Rows are split over `decode_streams` concurrent executions of the same program (see SamplerConfig).
- Weights on a mesh that spans hosts (an actor across hosts, sharding.cut_devices): every process calls
  generate with the same prompts and keys (every host's rows), in the same order as its other calls; the
  rows are split over the mesh's data x fsdp devices, the streams run one after the other (concurrent
  collective programs could start in a different order on each host), and every process gets all rows back.

Batch independence is about the randomness: float results of XLA's kernels can differ in the last bits
between batch shapes or paddings, which can flip a draw that lands within rounding of a CDF boundary
(rare with a peaked distribution, more common with a near-uniform one over a large vocab).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.model.transformer import ModelConfig, positions_from_mask

MIN_PHASE_STEPS = 16  # shorter decode phases save less attention than their extra loop costs to compile
ENGINES = ("static", "continuous")  # SamplerConfig.engine


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    max_new_tokens: int = 64
    max_prompt_len: int = 512
    min_prompt_bucket: int = 16  # prompt lengths are padded to powers of two from here
    min_batch_bucket: int = 1  # batch sizes are padded to powers of two from here
    # Concurrent executions of the decode program, each on a share of the rows. The decode step is a
    # chain of small ops that XLA's CPU runtime mostly runs one at a time on one core; it overlaps
    # separate executions launched from separate threads. 2 gives +15-20% tokens/s on 2 cores;
    # use 1 on an accelerator.
    decode_streams: int = 2
    # The decode loop is split into up to this many loops (none shorter than MIN_PHASE_STEPS) over a
    # growing KV cache, so that early steps attend over a shorter one (see Sampler._generate_impl):
    # 4 gives ~+3% tokens/s over 1 at 128 new tokens. Each phase is one more decode step to compile.
    decode_phases: int = 4
    # Which generator the trainer's actor uses: "continuous" (grpo_jax.rollout.engine: slots refilled between decode
    # chunks, one prefill per prompt shared by its samples, groups streamed out as they finish, in-flight
    # weight updates) or "static" (this module: one batch per handout, run until its longest row ends).
    engine: str = "continuous"
    # Continuous engine only. slots: sequences decoded at once (0: prompts_per_step x group_size in the
    # trainer, 64 elsewhere), split evenly over decode_streams. chunk_steps: decode steps per device call;
    # finished slots are refilled and new weights adopted between chunks. inflight_updates: adopt new weights
    # between chunks, with sequences in flight (each token records the version that produced it); false:
    # stop starting sequences while new weights wait, and adopt them once the slots have drained.
    slots: int = 0
    chunk_steps: int = 16
    inflight_updates: bool = True

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
        return problems


@dataclasses.dataclass
class SampleResult:
    tokens: np.ndarray  # [B, N] int32 completion ids, pad_id after the end (an eos is included)
    logprobs: np.ndarray  # [B, N] float32 log-prob under the distribution sampled from; 0 in padding
    lengths: np.ndarray  # [B] int32 completion lengths (including the eos)
    finish_reasons: list[str]  # "stop" (an eos was produced) or "length"
    prompt_lengths: np.ndarray  # [B] int32


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def _phase_ends(new_bucket: int, phases: int) -> list[int]:
    """Exclusive ends of the decode phases over steps [1, new_bucket): near-equal spans, `phases` of them
    or fewer so that none is shorter than MIN_PHASE_STEPS. Step t writes cache slot plen + t - 1, so a
    phase ending at `end` needs plen + end - 1 slots; plen + end keeps the sizes round."""
    n = max(1, min(phases, new_bucket // MIN_PHASE_STEPS))
    return [new_bucket * (i + 1) // n for i in range(n)]


def cache_layout(config: ModelConfig, mesh: jax.sharding.Mesh | None) -> tuple[int, NamedSharding | None]:
    """The heads of a KV cache ([rows, heads, positions, head_dim], Transformer.init_cache) for weights on `mesh`,
    and the cache's sharding there (None without a mesh). The query heads are split over the mesh's `tensor` axis
    (parallel.sharding), and so are the KV heads when their number divides it. When it does not, each KV head is
    held once per device of the group whose query heads use it (lcm(num_kv_heads, tensor) heads, split over
    `tensor`), so each device holds only the KV heads it reads: 1/gcd(num_kv_heads, tensor) of the cache instead
    of all of it (e.g. Qwen2.5-1.5B's 2 KV heads on tensor 4: half). Where the query heads do not split that way
    either, the cache is replicated."""
    kv = config.num_kv_heads
    if mesh is None:
        return kv, None
    tensor = mesh.shape.get("tensor", 1)
    heads = math.lcm(kv, tensor)
    if config.num_heads % heads:
        heads = kv
    return heads, NamedSharding(mesh, PartitionSpec(None, "tensor") if heads % tensor == 0 else PartitionSpec())


def weights_mesh(state) -> jax.sharding.Mesh | None:
    """The mesh weights are laid out on (their first leaf's), or None for weights on one device."""
    sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


# ----------------------------------------------------------------------------- the sampler


def vocab_major_head(graphdef, state) -> jax.Array:
    """The LM head as [V, E] in the compute dtype (see the module docstring): the embedding itself when tied,
    else a transposed copy of lm_head, made once per weight update rather than once per call."""
    model = nnx.merge(graphdef, state)
    head = model.embed[...] if model.lm_head is None else model.lm_head[...].T
    return head.astype(model.compute_dtype)


class Sampler:
    """Generates completions for batches of token-id prompts from an NNX Transformer."""

    def __init__(self, model: nnx.Module, eos_ids: Sequence[int], pad_id: int, config: SamplerConfig | None = None,
                 adapters: nnx.Module | None = None):
        self.config = config or SamplerConfig()
        problems = self.config.validate()
        if problems:
            raise ValueError("invalid sampler config: " + "; ".join(problems))
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.pad_id = int(pad_id)
        self.vocab_size = model.config.vocab_size
        self.graphdef, self.state = nnx.split(model)
        self._head = self._vocab_major_head(self.state)
        self.adapter_graphdef, self.adapters = nnx.split(adapters) if adapters is not None else (None, None)
        self.num_compilations = 0  # traces of the generate program (each is one XLA compile)
        self._generate = jax.jit(self._generate_impl, static_argnames=("new_bucket", "greedy", "top_k", "use_top_p"))
        self._compiled: set = set()
        # An actor across hosts (see the module docstring): rows over data x fsdp, every result row fetched.
        leaf = jax.tree.leaves(self.state)[0]
        self.across_hosts = not leaf.sharding.is_fully_addressable
        self._mesh = leaf.sharding.mesh if self.across_hosts else None
        # The KV cache's heads for the weights' mesh (cache_layout): its layout inside the program is the compiler's.
        self.cache_heads = cache_layout(model.config, weights_mesh(self.state))[0]
        self._pool = concurrent.futures.ThreadPoolExecutor(max(self.config.decode_streams - 1, 1),
                                                           thread_name_prefix="sampler")

    def close(self) -> None:
        """Stop the decode-stream threads once their current work ends (idempotent)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def update_params(self, model_or_state) -> None:
        """Swap in new trained weights: the model (or its nnx.State), or for a sampler built with LoRA adapters
        the adapters (or their state), the base weights staying as they are. Same structure: no recompile."""
        if isinstance(model_or_state, nnx.Module):
            _, model_or_state = nnx.split(model_or_state)
        if self.adapter_graphdef is not None:
            self.adapters = model_or_state
            return
        self.state = model_or_state
        self._head = self._vocab_major_head(model_or_state)

    def _vocab_major_head(self, state) -> jax.Array:
        return vocab_major_head(self.graphdef, state)

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
        if top_k > self.vocab_size:
            raise ValueError(f"top_k={top_k}: must be <= vocab_size={self.vocab_size} (0 means off)")
        n = len(prompts)
        if n == 0:
            raise ValueError("generate needs at least one prompt")
        lens = np.array([len(p) for p in prompts], np.int32)
        for i, length in enumerate(lens):
            if length == 0:
                raise ValueError(f"prompt {i} is empty")
            if length > cfg.max_prompt_len:
                raise ValueError(f"prompt {i} has {length} tokens, more than max_prompt_len={cfg.max_prompt_len}")

        if isinstance(keys, (int, np.integer)):
            keys = jax.random.split(jax.random.key(int(keys)), n)
        elif not (hasattr(keys, "dtype") and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)):
            keys = jax.random.wrap_key_data(jnp.asarray(keys, jnp.uint32))
        if keys.shape[0] != n:
            raise ValueError(f"got {keys.shape[0]} keys for {n} prompts")

        # Rows are split into `decode_streams` chunks of one shape (one compiled program), each run from
        # its own thread (see SamplerConfig.decode_streams).
        chunks = np.array_split(np.arange(n), min(cfg.decode_streams, n))
        batch = _bucket(len(chunks[0]), cfg.min_batch_bucket)
        plen = min(_bucket(int(lens.max()), cfg.min_prompt_bucket), cfg.max_prompt_len)
        new_bucket = _bucket(max_new, 1)
        greedy = temperature == 0
        static = dict(new_bucket=new_bucket, greedy=greedy, top_k=0 if greedy else top_k,
                      use_top_p=(not greedy) and top_p < 1)
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

    def _global_rows(self, tokens, mask, live, keys) -> tuple:
        """The batch (the same on every process) as global arrays on the mesh that spans hosts: rows split over
        data x fsdp when they divide evenly (the same split as the weights' fsdp), else every device holds
        them all. Each process places only the rows its own devices hold."""
        splits = self._mesh.shape["data"] * self._mesh.shape["fsdp"]
        spec = PartitionSpec(("data", "fsdp")) if len(live) % splits == 0 else PartitionSpec()
        sharding = NamedSharding(self._mesh, spec)

        def placed(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        return (placed(tokens), placed(mask), placed(live),
                jax.random.wrap_key_data(placed(jax.random.key_data(keys))))

    def _generate_impl(self, state, head, tokens, mask, live, keys, max_new, temperature, top_p, adapters=None,
                       *, new_bucket, greedy, top_k, use_top_p):
        self.num_compilations += 1  # runs only while tracing, i.e. once per compiled program
        model = nnx.merge(self.graphdef, state)
        lora = None if adapters is None else nnx.merge(self.adapter_graphdef, adapters)
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
