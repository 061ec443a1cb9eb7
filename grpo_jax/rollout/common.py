"""What the static sampler, the continuous engine and the continuation engine share: the records they return, the
surface the actor drives them through (Generator, StreamingGenerator), the programs they publish for planning
(GeneratorProgram), and the helpers all three use.

- Generator: what the actor calls on the generator that samples its groups (sampler.Sampler, engine.Engine).
  StreamingGenerator adds the continuous interface: submit prompts, step one chunk, get finished groups back.
  A second backend implements one of them, and programs() for `grpo-jax compile`.
- programs(workload): a generator's jitted programs, each with abstract arguments (jax.ShapeDtypeStructs with
  their shardings) at the shapes a run uses, and the calls a learner step makes of it, as RunPlan.learner_step
  gives the learner's step. A generator built over abstract weights (ShapeDtypeStruct leaves, as
  RunPlan.actor_params gives them) computes and allocates nothing: its head and state are abstract too, and only
  programs() and its shape logic may be used.
- bucket(n, minimum): the power-of-two shape buckets every program is compiled for (one program per bucket).
- vocab_major_head: the LM head as [V, E], the layout the sampling code reads logits in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.algorithm.lengths import ExpectedLengths
from grpo_jax.model.transformer import ModelConfig


def bucket(n: int, minimum: int) -> int:
    """The shape bucket of n: the smallest power of two >= n, and at least `minimum`."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


# -- records ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SampleResult:
    tokens: np.ndarray  # [B, N] int32 completion ids, pad_id after the end (an eos is included)
    logprobs: np.ndarray  # [B, N] float32 log-prob under the distribution sampled from; 0 in padding
    lengths: np.ndarray  # [B] int32 completion lengths (including the eos)
    finish_reasons: list[str]  # "stop" (an eos was produced) or "length"
    prompt_lengths: np.ndarray  # [B] int32


@dataclasses.dataclass
class GroupResult:
    """The finished samples of one submitted prompt, in sample order."""

    tag: Any  # what submit() was given
    tokens: list  # G arrays [n_i] int32: the completion (an eos included)
    logprobs: list  # G arrays [n_i] float32: each token's log-prob under the weights that drew it
    versions: list  # G arrays [n_i] int32: the weight version that drew each token
    finish_reasons: list  # G of "stop" (eos) or "length"
    # G arrays [prompt + n_i - 1, moe layers, experts per token] int32: the experts each input token of the sample
    # (the prompt, then every sampled token but the last, which no step reads) was routed to; None unless recorded.
    routing: list | None = None

    @property
    def oldest_version(self) -> int:
        """The group's weight version for the staleness bound: the oldest among its tokens."""
        return min(int(v.min()) for v in self.versions if len(v))

    @property
    def version_spread(self) -> int:
        return max(int(v.max()) for v in self.versions if len(v)) - self.oldest_version


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How tokens are drawn: the static parts select the compiled programs."""

    temperature: float  # 0: greedy
    top_p: float
    top_k: int

    @property
    def static(self) -> dict:
        greedy = self.temperature == 0
        return dict(greedy=greedy, top_k=0 if greedy else self.top_k, use_top_p=(not greedy) and self.top_p < 1)

    @property
    def scalars(self) -> tuple:
        return np.float32(self.temperature or 1.0), np.float32(self.top_p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What one learner step asks of one actor's generator, for planning its programs (programs())."""

    samples: int  # the samples (or episodes) it generates per step: its hosts' prompts x group_size
    group_size: int
    prompt_len: int  # the longest prompt, in tokens
    turns: int = 1  # assistant turns per episode (the continuation engine's)
    # The lengths a step is expected to have (RunPlan.expected_lengths), for the projection at the expected lengths
    # beside the worst case; None: the longest prompt, every completion at max_new_tokens, only.
    expected: ExpectedLengths | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratorProgram:
    """One of a generator's jitted programs at one shape, over abstract arguments: what `grpo-jax compile` lowers
    and compiles (jitted.lower(*args, **kwargs)), as RunPlan.learner_step is the learner's."""

    name: str  # the program, as the compile report names it ("engine chunk", "sampler generate", ...)
    label: str  # this compile of it (its shape, or the part compiled alone): what progress lines and crashes say
    jitted: Callable  # the jax.jit-ted function the generator calls (or, with cost_part, its part alone)
    args: tuple  # positional arguments: jax.ShapeDtypeStructs with their shardings (None where a run has none)
    kwargs: dict = dataclasses.field(default_factory=dict)  # keyword arguments: static values, abstract arrays
    shape: tuple[int, ...] = ()  # the sizes it is compiled for, per program: see each generator's programs()
    donated: tuple[int, ...] = ()  # the positions of the args it donates (their buffers become its outputs)
    # Calls per learner step at this shape when every sample runs to max_new_tokens (0: none in that projection).
    calls_per_step: int = 0
    # The same when the samples have the workload's expected lengths (None: calls_per_step).
    expected_calls_per_step: int | None = None
    # > 0: never called itself but compiled alone for its cost, as a loop body is (XLA counts a loop body once
    # whatever its trip count): one call of `name` runs it cost_part times.
    cost_part: int = 0
    # A cost part compiled for the workload's expected lengths (paged KV: the keys a sequence holds on average),
    # beside the one at the maximum.
    at_expected: bool = False


# -- the actor's interface ------------------------------------------------------------------------------


@runtime_checkable
class Generator(Protocol):
    """What the actor (rollout.actor) calls on the generator that samples its groups, and what `grpo-jax compile`
    asks of it: sampler.Sampler and engine.Engine implement it. A generator is driven by one thread."""

    @property
    def state(self) -> Any:
        """The weights it samples with (nnx.State); their shardings say which devices it runs on."""

    @property
    def version(self) -> int:
        """The version of those weights (update_params)."""

    def update_params(self, model_or_state, version: int | None = None) -> None:
        """New weights (the model or its nnx.State; with LoRA adapters, the adapters), of `version` (default:
        one more), used from the next device program on."""

    def generate(self, prompts: list[list[int]], keys, *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None) -> SampleResult:
        """One completion per prompt; keys: an int seed, or one PRNG key per prompt (typed, or raw [B, 2]
        uint32), so that a row's draws depend on its key, not on its batch."""

    def metrics(self) -> dict:
        """Running totals for the step metrics (may be empty)."""

    def close(self) -> None:
        """Stop its threads (idempotent)."""

    def programs(self, workload: Workload) -> list[GeneratorProgram]:
        """Its jitted programs with abstract arguments, at the shapes a run with this workload uses."""


@runtime_checkable
class StreamingGenerator(Generator, Protocol):
    """A Generator that streams: prompts are submitted with one key per sample, and step() returns each group as
    soon as all its samples have finished (engine.Engine)."""

    @property
    def busy(self) -> bool:
        """Some submitted sample has not finished."""

    @property
    def free_slots(self) -> int:
        """Samples it could start at the next step."""

    @property
    def waiting_samples(self) -> int:
        """Samples submitted and not yet started."""

    def submit(self, prompt: Sequence[int], keys, tag: Any = None, max_new_tokens: int | None = None) -> None:
        """Queue one prompt with one key per sample; its GroupResult (with `tag`) comes back from step()."""

    def step(self) -> list[GroupResult]:
        """One device call's worth of generation; the groups that finished in it."""


# -- helpers ------------------------------------------------------------------------------------------


def checked_config(config):
    """A SamplerConfig as it is, or refused with every problem in one line."""
    problems = config.validate()
    if problems:
        raise ValueError("invalid sampler config: " + "; ".join(problems))
    return config


def check_top_k(top_k: int, vocab_size: int, where: str) -> None:
    """top_k above the model's vocabulary refused in one line (lax.top_k would fail on it inside a program).
    Config.validate refuses it for a run; this is for the engines' own callers."""
    if top_k > vocab_size:
        raise ValueError(f"{where}: top_k={top_k}: must be <= vocab_size={vocab_size} (0 means off)")


def checked_prompts(prompts: Sequence[Sequence[int]], max_prompt_len: int) -> np.ndarray:
    """The prompts' lengths [B] int32; a ValueError naming the prompt for an empty one or one over the limit."""
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, length in enumerate(lengths):
        if length == 0:
            raise ValueError(f"prompt {i} is empty")
        if length > max_prompt_len:
            raise ValueError(f"prompt {i} has {length} tokens, more than max_prompt_len={max_prompt_len}")
    return lengths


def raw_keys(keys) -> np.ndarray:
    """PRNG keys (typed, or raw uint32 key data) as raw key data [N, 2] uint32."""
    if hasattr(keys, "dtype") and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    return np.asarray(keys, np.uint32).reshape(-1, 2)


def weights_state(model_or_state):
    """update_params' argument as an nnx.State: a module's state, or the state itself."""
    if isinstance(model_or_state, nnx.Module):
        _, model_or_state = nnx.split(model_or_state)
    return model_or_state


def merged(graphdef, params, adapter_graphdef, adapters) -> tuple[nnx.Module, nnx.Module | None]:
    """The model and its LoRA adapters (None without) from their graphdefs and states, inside a program."""
    return nnx.merge(graphdef, params), None if adapters is None else nnx.merge(adapter_graphdef, adapters)


def draw_uniforms(keys, index):
    """[S] uniforms: draw `index[s]` of row s from fold_in(key[s], index[s]) (raw key data [S, 2]), as the static
    sampler's row draws its token `index[s]`: what a sequence samples depends on its key, not on its batch."""
    return jax.vmap(lambda k, t: jax.random.uniform(
        jax.random.fold_in(jax.random.wrap_key_data(k), t)))(keys, index)


def is_abstract(tree) -> bool:
    """Whether `tree`'s arrays are all jax.ShapeDtypeStructs (abstract weights: planning, not sampling)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def abstract_arrays(tree):
    """`tree` with every array as a jax.ShapeDtypeStruct of its shape, dtype and sharding (abstract ones as they
    are): a program's abstract arguments from the real arrays a generator holds."""
    def abstract(x):
        if x is None or isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(abstract, tree)


def placed(tree, shardings):
    """ShapeDtypeStructs of `tree`'s shapes with `shardings` (a matching tree; None: as they are)."""
    if shardings is None:
        return tree
    return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree,
                        shardings)


def _vocab_major(graphdef, state) -> jax.Array:
    model = nnx.merge(graphdef, state)
    head = model.embed[...] if model.lm_head is None else model.lm_head[...].T
    return head.astype(model.compute_dtype)


def vocab_major_head(graphdef, state) -> jax.Array:
    """The LM head as [V, E] in the compute dtype (sampler module docstring): the embedding itself when tied, else
    a transposed copy of lm_head, made once per weight update rather than once per call. For abstract weights its
    abstract form, laid out as the eager copy is: as the embedding, or as lm_head transposed."""
    if not is_abstract(state):
        return _vocab_major(graphdef, state)
    head = jax.eval_shape(lambda s: _vocab_major(graphdef, s), state)
    model = nnx.merge(graphdef, state)
    weight = (model.embed if model.lm_head is None else model.lm_head).get_value()
    sharding = getattr(weight, "sharding", None)
    if isinstance(sharding, NamedSharding) and model.lm_head is not None:
        spec = tuple(sharding.spec) + (None,) * (len(weight.shape) - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*reversed(spec)))
    return jax.ShapeDtypeStruct(head.shape, head.dtype, sharding=sharding)


def cache_layout(config: ModelConfig, mesh: jax.sharding.Mesh | None) -> tuple[int, NamedSharding | None]:
    """The heads of a KV cache ([rows, heads, positions, head_dim], Transformer.init_cache) for weights on `mesh`,
    and the cache's sharding there (None without a mesh). The query heads are split over the mesh's `tensor` axis
    (parallel.sharding), and so are the KV heads when their number divides it. When it does not, each KV head is
    held once per device of the group whose query heads use it (lcm(num_kv_heads, tensor) heads, split over
    `tensor`), so each device holds only the KV heads it reads: 1/gcd(num_kv_heads, tensor) of the cache instead
    of all of it (e.g. Qwen2.5-1.5B's 2 KV heads on tensor 4: half). Where the query heads do not split that way
    either, the cache is replicated."""
    if mesh is None:
        return config.num_kv_heads, None
    tensor = mesh.shape.get("tensor", 1)
    heads = cache_heads(config.num_kv_heads, config.num_heads, tensor)
    return heads, NamedSharding(mesh, PartitionSpec(None, "tensor") if heads % tensor == 0 else PartitionSpec())


def cache_heads(kv_heads: int, query_heads: int, tensor: int) -> int:
    """The KV cache's heads on a tensor axis of `tensor` (cache_layout): lcm(kv_heads, tensor), each KV head
    repeated, where the query heads split that way; else the KV heads as they are. The cache is split over
    `tensor` when its heads divide it, else replicated."""
    heads = math.lcm(kv_heads, tensor)
    return kv_heads if query_heads % heads else heads


def weights_mesh(state) -> jax.sharding.Mesh | None:
    """The mesh weights are laid out on (their first leaf's), or None for weights on one device."""
    sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def replicated(mesh: jax.sharding.Mesh | None) -> NamedSharding | None:
    """Whole on every device of `mesh` (None without one: wherever the compiler puts it)."""
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())
