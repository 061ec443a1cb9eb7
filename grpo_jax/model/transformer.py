"""Decoder-only transformer for the Llama 3, Qwen2/Qwen2.5, Qwen3 (dense and MoE) and Gemma 3 (text) families, in
Flax NNX.

One module covers them all: Llama and Qwen differ only in QKV bias, per-head query/key norms, tied embeddings and
RoPE scaling. Gemma 3 adds, per its architecture name: norms that scale by (1 + weight), a norm on the output of
attention and of the MLP besides the one on their input, a tanh-approximated GELU gate, embeddings scaled by
sqrt(hidden_size), attention scaled by query_pre_attn_scalar, and local layers (`layer_types`) that attend only to
the last `sliding_window` tokens, with a RoPE base of their own (`rope_local_theta`, unscaled). Qwen3-MoE replaces
the MLP of its sparse layers by a mixture of experts (MoE), whose routing can be given (routing replay: the learner
routes each token as the actor did).
Weights are laid out per head ([embed, heads, head_dim]) so that tensor parallelism splits heads and
the Hugging Face conversion is a reshape. Every parameter carries logical axis names; `sharding.py`
maps them onto a mesh.

The forward pass takes an optional KV cache so that the sampler (prefill + decode) and the learner
(full sequences) use the same code, and optional LoRA adapters (lora.py), kept outside the model so that
its graph and weights are the same with and without them. Without a cache a row may hold several
sequences (the learner's packed rows): with `segment_ids` a token attends only to earlier tokens of its
own segment, and positions_from_mask restarts the RoPE positions at each segment's first token, so each
sequence's hidden states are those it would have alone in a row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from grpo_jax.config_io import config_key
from grpo_jax.model.attention import (
    ATTENTION_IMPLS,
    AttentionMask,
    PagedKV,
    attend,
    causal_mask,
    choose,
    paged_attention,
    target_platform,
)
from grpo_jax.model.experts import (
    MOE_MATMULS,
    dense_experts,
    expert_parallel,
    expert_parallel_axis,
    local_experts,
    matmul_impl,
)
from grpo_jax.parallel.sharding import constrain, constrain_rows

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# ModelConfig fields that only some families use (Gemma 3's local layers, Qwen3-MoE's experts): at their defaults
# they say nothing about a model, so what identifies an architecture leaves them out then (lora.base_identity: a
# checkpoint written before they existed still names the same base).
FAMILY_FIELDS = ("layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                 "mlp_only_layers")
ROPE_SCALING_TYPES = ("llama3", "linear")
ARCHITECTURES = ("qwen2", "llama", "qwen3", "qwen3_moe", "gemma3")
MOE_DISPATCH = ("ragged", "dense")  # ModelConfig.moe_dispatch
LAYER_TYPES = ("full_attention", "sliding_attention")  # ModelConfig.layer_types, as Hugging Face names them
REMAT_POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")  # jax.checkpoint_policies


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = config_key(512, "Tokens in the vocabulary: rows of the embedding and of the LM head.")
    hidden_size: int = config_key(64, "Width of the residual stream (embedding size).")
    intermediate_size: int = config_key(192, "Width of the dense (SwiGLU) MLP.")
    num_layers: int = config_key(2, "Decoder layers.")
    num_heads: int = config_key(4, "Query heads per layer.")
    num_kv_heads: int = config_key(2, "Key/value heads per layer (grouped-query attention); must divide num_heads.")
    head_dim: int = config_key(0, "Width of one attention head; 0: hidden_size // num_heads.")
    rope_theta: float = config_key(10000.0, "The RoPE base.")
    rope_scaling: dict | None = config_key(None, "None, or {rope_type: llama3, factor, low_freq_factor, "
                                                 "high_freq_factor, original_max_position_embeddings} or "
                                                 "{rope_type: linear, factor}.")
    rms_norm_eps: float = config_key(1e-6, "Epsilon of the RMS norms.")
    qkv_bias: bool = config_key(False, "A bias on the query, key and value projections (Qwen2).")
    tie_embeddings: bool = config_key(False, "The LM head is the embedding matrix (no separate lm_head weight).")
    max_position_embeddings: int = config_key(4096, "The longest sequence (tokens) the model is meant for, as "
                                                    "config.json states it.")
    dtype: str = config_key("float32", "Compute dtype: float32 or bfloat16.")
    param_dtype: str = config_key("float32", "Dtype of the master weights: float32 or bfloat16.")
    remat: bool = config_key(False, "Recompute each layer in the backward pass (less memory, more compute).")
    remat_policy: str = config_key("nothing_saveable", "With remat, what a layer's forward pass keeps for the "
                                                       "backward: nothing_saveable (only the layer's input), "
                                                       "dots_with_no_batch_dims_saveable (also the matmuls against "
                                                       "weights), dots_saveable (every matmul's output).")
    scan_layers: bool | Literal["auto"] = config_key(
        "auto", "Without a KV cache (the learner's passes), run the layers as a lax.scan over their repeating block "
                "(every layer, or Gemma 3's 5 local + 1 global): one compiled body instead of one per layer, the "
                "same numbers. false: a Python loop over the layers. auto: scanned where the program is compiled "
                "for TPU or GPU (the compile command's too), a loop on CPU, whose compile times are short and whose "
                "client starves its threads when a scanned step's collectives run beside the actor's (the trainer "
                "refuses true there).")
    attention: str = config_key("auto", "How attention's softmax is computed (model.attention module): dense (the "
                                        "[T, S] scores whole), blockwise (online softmax over blocks of keys, "
                                        "memory linear in the sequence), splash (TPU's Pallas kernel; self-"
                                        "attention, else blockwise); auto: splash on TPU, elsewhere blockwise for "
                                        "rows longer than 4 blocks, dense below and for decode steps.")
    attention_block: int = config_key(512, "Keys per block of the blockwise and splash attention (splash: also "
                                           "queries per block); a power of two, at least 128 for splash.")
    architecture: str = config_key("qwen2", "The Hugging Face class written on export: qwen2, llama, qwen3 (which "
                                            "adds qk_norm), qwen3_moe (experts besides) or gemma3 (see the "
                                            "model.transformer module docstring).")
    layer_types: tuple[str, ...] = config_key((), "Per layer, full_attention (every earlier token) or "
                                                  "sliding_attention (a local layer: the last sliding_window tokens, "
                                                  "itself included); empty: every layer full.")
    sliding_window: int = config_key(0, "Tokens a sliding_attention layer attends over, itself included.")
    rope_local_theta: float = config_key(0.0, "The local layers' RoPE base (0: rope_theta); rope_scaling is not "
                                              "applied there.")
    query_pre_attn_scalar: int = config_key(0, "Attention scores are scaled by its -1/2 power (0: head_dim).")
    # Mixture of experts (Qwen3-MoE): in each sparse layer a router picks num_experts_per_tok of num_experts SwiGLU
    # experts (moe_intermediate_size wide) per token, weighted by their softmax probabilities (renormalised over the
    # chosen ones with norm_topk_prob). Sparse layers: every decoder_sparse_step-th (1-based) not in mlp_only_layers;
    # the others keep the dense MLP (intermediate_size).
    num_experts: int = config_key(0, "Mixture of experts (Qwen3-MoE): SwiGLU experts per sparse layer; 0: dense.")
    num_experts_per_tok: int = config_key(0, "Experts the router picks per token, weighted by their softmax "
                                             "probabilities.")
    moe_intermediate_size: int = config_key(0, "Width of one expert's MLP.")
    norm_topk_prob: bool = config_key(True, "Renormalise the chosen experts' probabilities over the chosen ones.")
    decoder_sparse_step: int = config_key(1, "Sparse layers: every decoder_sparse_step-th layer (1-based) not in "
                                             "mlp_only_layers; the others keep the dense MLP (intermediate_size).")
    mlp_only_layers: tuple[int, ...] = config_key((), "Layers (0-based) that keep the dense MLP.")
    moe_dispatch: str = config_key("ragged", "ragged: tokens sorted by expert, each expert's rows one group of "
                                             "jax.lax.ragged_dot (no capacity, no token dropped, FLOPs of the chosen "
                                             "experts only); dense: every expert on every token, weighted by a "
                                             "mostly-zero matrix (the reference the tests hold the ragged path to).")
    moe_matmul: str = config_key("auto", "The ragged dispatch's grouped matmuls (model.experts): ragged "
                                         "(jax.lax.ragged_dot and its own gradient, whose gradient for the expert "
                                         "weights XLA compiles on TPU to a dense product, num_experts times the "
                                         "work); megablox (ragged_dot forward, the weights' gradient from megablox's "
                                         "tgmm Pallas kernel; off TPU in Pallas's interpreter, slowly); auto: "
                                         "megablox on TPU, ragged elsewhere.")
    # Without routing replay a near tie decided otherwise by the two numerically different passes trains a token
    # through experts that did not sample it.
    routing_replay: bool = config_key(True, "Routing replay: the actor records the experts each token went to and "
                                            "the learner routes it there (its own router's probabilities at those "
                                            "experts still weight them, so the router trains); false: the learner's "
                                            "router picks again.")
    expert_parallel: bool = config_key(False, "Expert parallelism in the learner: the experts split over its fsdp "
                                              "axis, each device computing its own experts on the tokens routed to "
                                              "them (tokens gathered, outputs reduce-scattered: see "
                                              "_expert_parallel); false: every device gathers every expert's weights "
                                              "(FSDP) and computes its own tokens.")

    def __hash__(self):
        # rope_scaling is a dict (as in HF config.json); hash its items so the config, and the NNX
        # graphdef that holds it, can be a static jit argument.
        fields = dataclasses.astuple(dataclasses.replace(self, rope_scaling=None))
        return hash((fields, tuple(sorted((self.rope_scaling or {}).items()))))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def qk_norm(self) -> bool:
        """An RMSNorm over each query and key head before RoPE (Qwen3, Qwen3-MoE, Gemma 3), with weights of
        head_dim."""
        return self.architecture in ("qwen3", "qwen3_moe", "gemma3")

    @property
    def gemma(self) -> bool:
        """Gemma's layer: (1 + weight) norms, norms on attention's and the MLP's outputs, a GELU gate, scaled
        embeddings."""
        return self.architecture == "gemma3"

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window only."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (Hugging Face's Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % max(self.decoder_sparse_step, 1) == 0)

    @property
    def inactive_expert_params(self) -> int:
        """Expert weights a token does not use (num_experts - num_experts_per_tok of each MoE layer): what the
        parameter count overstates a token's FLOPs by (MFU counts active parameters)."""
        unused = self.num_experts - self.num_experts_per_tok
        return len(self.moe_layers) * unused * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with experts, in order: the rows of a token's routing ([moe layers, num_experts_per_tok])."""
        return tuple(i for i in range(self.num_layers) if self.is_moe(i))

    @property
    def replays_routing(self) -> bool:
        """Whether each token's experts are recorded by the actor and replayed by the learner (routing_replay)."""
        return bool(self.num_experts) and self.routing_replay

    @property
    def routing_shape(self) -> tuple[int, int]:
        """A token's recorded routing: (layers with experts, experts per token); (0, 0) when none is recorded."""
        return (len(self.moe_layers), self.num_experts_per_tok) if self.replays_routing else (0, 0)

    def layer_period(self) -> int:
        """The shortest p with every layer built as layer i mod p is (local or full attention, experts or a dense
        MLP): the repeating block scan_layers compiles once (num_layers: none repeats)."""
        kind = [(self.is_local(i), self.is_moe(i)) for i in range(self.num_layers)]
        return next(p for p in range(1, self.num_layers + 1)
                    if all(kind[i] == kind[i % p] for i in range(self.num_layers)))

    def scans_layers(self, platform: str) -> bool:
        """Whether the learner's passes scan the layers in a program compiled for `platform` (scan_layers)."""
        return platform != "cpu" if self.scan_layers == "auto" else self.scan_layers

    @property
    def has_local_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    def keys_over_layers(self, keys: float) -> float:
        """Summed over the layers, the keys each holds or reads where a full-attention layer has `keys`: a local
        layer at most sliding_window (KV cache columns, attention FLOPs)."""
        local = self.layer_types.count("sliding_attention")
        return (self.num_layers - local) * keys + local * min(keys, self.sliding_window or keys)

    def validate(self) -> list[str]:
        """Problems with this config, as 'key=value: reason' strings (empty when valid)."""
        problems = []
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "max_position_embeddings"):
            if getattr(self, key) <= 0:
                problems.append(f"{key}={getattr(self, key)}: must be a positive integer")
        if self.head_dim < 0:
            problems.append(f"head_dim={self.head_dim}: must be >= 0 (0 means hidden_size // num_heads)")
        if self.num_heads > 0 and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}")
        if self.head_dim == 0 and self.num_heads > 0 and self.hidden_size % self.num_heads:
            problems.append(f"num_heads={self.num_heads}: must divide hidden_size={self.hidden_size} "
                            "(or set head_dim)")
        if self.resolved_head_dim % 2:
            problems.append(f"head_dim={self.resolved_head_dim}: must be even for rotary embeddings")
        if self.rope_theta <= 0:
            problems.append(f"rope_theta={self.rope_theta}: must be > 0")
        if self.rms_norm_eps <= 0:
            problems.append(f"rms_norm_eps={self.rms_norm_eps}: must be > 0")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in DTYPES:
                problems.append(f"{key}={getattr(self, key)!r}: allowed {sorted(DTYPES)}")
        if self.architecture not in ARCHITECTURES:
            problems.append(f"architecture={self.architecture!r}: allowed {sorted(ARCHITECTURES)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                problems.append(f"layer_types: {len(self.layer_types)} entries for num_layers={self.num_layers} "
                                "(one per layer, or none for every layer full_attention)")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                problems.append(f"layer_types: {unknown} unknown; allowed {list(LAYER_TYPES)}")
        if self.has_local_layers and self.sliding_window <= 0:
            problems.append(f"sliding_window={self.sliding_window}: layer_types has sliding_attention layers, so it "
                            "must be a positive number of tokens")
        if self.sliding_window < 0:
            problems.append(f"sliding_window={self.sliding_window}: must be >= 0")
        if self.has_local_layers and self.architecture != "gemma3":
            problems.append(f"layer_types: sliding_attention layers are part of architecture gemma3 only (got "
                            f"{self.architecture!r}, whose Hugging Face class would ignore the window)")
        if self.num_experts:
            if self.architecture != "qwen3_moe":
                problems.append(f"num_experts={self.num_experts}: experts are part of architecture qwen3_moe only "
                                f"(got {self.architecture!r})")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                problems.append(f"num_experts_per_tok={self.num_experts_per_tok}: must be in 1..num_experts="
                                f"{self.num_experts}")
            if self.moe_intermediate_size <= 0:
                problems.append(f"moe_intermediate_size={self.moe_intermediate_size}: must be a positive integer")
            if self.decoder_sparse_step <= 0:
                problems.append(f"decoder_sparse_step={self.decoder_sparse_step}: must be a positive integer")
            if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
                problems.append(f"mlp_only_layers={list(self.mlp_only_layers)}: layer indices in "
                                f"0..{self.num_layers - 1}")
        elif self.architecture == "qwen3_moe":
            problems.append("num_experts=0: architecture qwen3_moe needs experts (num_experts, num_experts_per_tok, "
                            "moe_intermediate_size)")
        if self.remat_policy not in REMAT_POLICIES:
            problems.append(f"remat_policy={self.remat_policy!r}: allowed {list(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_IMPLS:
            problems.append(f"attention={self.attention!r}: allowed {list(ATTENTION_IMPLS)}")
        if self.attention_block < 8 or self.attention_block & (self.attention_block - 1):
            problems.append(f"attention_block={self.attention_block}: a power of two, at least 8 (512 is usual)")
        if self.moe_matmul not in MOE_MATMULS:
            problems.append(f"moe_matmul={self.moe_matmul!r}: allowed {list(MOE_MATMULS)}")
        if self.moe_dispatch not in MOE_DISPATCH:
            problems.append(f"moe_dispatch={self.moe_dispatch!r}: allowed {list(MOE_DISPATCH)}")
        for key in ("rope_local_theta", "query_pre_attn_scalar"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)}: must be >= 0 (0 means the default)")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_SCALING_TYPES:
                problems.append(f"rope_scaling.rope_type={kind!r}: allowed {list(ROPE_SCALING_TYPES)} or null")
            elif kind == "llama3":
                missing = {"factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"} - set(self.rope_scaling)
                if missing:
                    problems.append(f"rope_scaling={self.rope_scaling}: llama3 scaling needs {sorted(missing)}")
            elif "factor" not in self.rope_scaling:
                problems.append(f"rope_scaling={self.rope_scaling}: linear scaling needs 'factor'")
        return problems


def rope_inverse_frequencies(config: ModelConfig, local: bool = False) -> jnp.ndarray:
    """Per-pair rotation frequencies, with Llama-3 or linear scaling applied (as Hugging Face does). local: those of
    the sliding-window layers (rope_local_theta, unscaled)."""
    if local:
        config = dataclasses.replace(config, rope_theta=config.rope_local_theta or config.rope_theta,
                                     rope_scaling=None)
    dim = config.resolved_head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """x: [B, T, heads, D]; positions: [B, T]. Rotate-half convention, as the HF checkpoints expect."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def _param(rngs: nnx.Rngs, init, shape: tuple, dtype, axes: tuple) -> nnx.Param:
    """A parameter tagged with logical axis names (metadata `axes`); sharding.py maps them to a mesh."""
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


_normal = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs, zero_centered: bool = False):
        """zero_centered (Gemma): the weight starts at 0 and scales by (1 + weight), all in float32."""
        init = nnx.initializers.zeros if zero_centered else nnx.initializers.ones
        self.weight = _param(rngs, init, (dim,), param_dtype, ("norm",))
        self.eps = eps
        self.zero_centered = zero_centered

    @jax.named_scope("norm")
    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def _norm(config: ModelConfig, dim: int, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, DTYPES[config.param_dtype], rngs, zero_centered=config.gemma)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, h, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.resolved_head_dim
        pd = DTYPES[config.param_dtype]
        self.q = _param(rngs, _normal, (e, h, d), pd, ("embed", "heads", "head_dim"))
        self.k = _param(rngs, _normal, (e, kv, d), pd, ("embed", "kv_heads", "head_dim"))
        self.v = _param(rngs, _normal, (e, kv, d), pd, ("embed", "kv_heads", "head_dim"))
        self.o = _param(rngs, _normal, (h, d, e), pd, ("heads", "head_dim", "embed"))
        if config.qkv_bias:
            zeros = nnx.initializers.zeros
            self.q_bias = _param(rngs, zeros, (h, d), pd, ("heads", "head_dim"))
            self.k_bias = _param(rngs, zeros, (kv, d), pd, ("kv_heads", "head_dim"))
            self.v_bias = _param(rngs, zeros, (kv, d), pd, ("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        if config.qk_norm:
            self.q_norm, self.k_norm = _norm(config, d, rngs), _norm(config, d, rngs)
        else:
            self.q_norm = self.k_norm = None
        self.num_groups = h // kv
        self.scale = (config.query_pre_attn_scalar or d) ** -0.5
        self.impl, self.block = config.attention, config.attention_block

    @jax.named_scope("attention")
    def __call__(self, x, positions, mask: AttentionMask, inv_freq, cache, write_index, adapters=None,
                 dropout_key=None):
        """x: [B,T,E]; mask: which of S keys each query sees; cache: (k, v) each [B,C,S,D] or None (S == T), where C is
        num_kv_heads or a multiple of it that divides num_heads (see Transformer.init_cache); query head h reads
        cache head h // (num_heads / C). Or cache: a PagedKV (T == 1; the keys it names, not `mask`, are seen).
        adapters: this layer's lora.LayerAdapters or None; dropout_key: their dropout (None: none)."""
        dtype = x.dtype
        rows = x.reshape(-1, x.shape[-1])  # [B*T, E]: see MLP.__call__

        def project(w, b, name):
            y = jnp.einsum("ne,ehd->nhd", rows, w[...].astype(dtype))
            if adapters is not None:
                y = adapters.apply(name, rows, y, dropout_key)
            y = y.reshape(*x.shape[:2], *w.shape[1:])
            return y if b is None else y + b[...].astype(dtype)

        q, k = project(self.q, self.q_bias, "q"), project(self.k, self.k_bias, "k")
        if self.q_norm is not None:  # per head, over head_dim, before the rotation (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        v = project(self.v, self.v_bias, "v")
        # Keys/values as [B, KV, S, D]: batch dims leading, so the attention dots read the cache in place
        # (a [B, S, KV, D] cache made XLA transpose all of it every decode step).
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
        paged = isinstance(cache, PagedKV)  # a decode step over the continuous engine's paged cache
        if cache is not None:
            k_cache, v_cache = (cache.k_pages, cache.v_pages) if paged else cache
            heads = k_cache.shape[0 if paged else 1]
            if heads != k.shape[1]:  # a cache holding each KV head repeated (init_cache's `heads`)
                repeats = heads // k.shape[1]
                k, v = jnp.repeat(k, repeats, axis=1), jnp.repeat(v, repeats, axis=1)
        platform = target_platform()
        if paged:
            cache = cache.written(k, v, impl="kernel" if platform == "tpu" else "scatter")
        elif cache is not None:
            k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, write_index, 0))
            v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, write_index, 0))
            cache = (k, v)
        b, t, h, d = q.shape
        kv = cache.k_pages.shape[0] if paged else k.shape[1]
        # Queries as [B, KV, G, T, D], the attention's batch dims leading; its output in that order, then
        # transposed: asking XLA for btkgd directly picked a slow dot.
        q = q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
        if paged:
            out = paged_attention(q, cache, self.scale, impl="kernel" if platform == "tpu" else "gather")
        else:
            impl = choose(self.impl, mask, self.block, platform)
            out = attend(q, k.astype(dtype), v.astype(dtype), mask, self.scale, impl=impl, block=self.block)
        out = out.transpose(0, 3, 1, 2, 4).reshape(b * t, h, d)
        y = jnp.einsum("nhd,hde->ne", out, self.o[...].astype(dtype))
        if adapters is not None:
            y = adapters.apply("o", out, y, dropout_key)
        return y.reshape(b, t, -1), cache


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, m = config.hidden_size, config.intermediate_size
        pd = DTYPES[config.param_dtype]
        self.gate = _param(rngs, _normal, (e, m), pd, ("embed", "mlp"))
        self.up = _param(rngs, _normal, (e, m), pd, ("embed", "mlp"))
        self.down = _param(rngs, _normal, (m, e), pd, ("mlp", "embed"))
        # Gemma: GELU (tanh approximation, transformers' gelu_pytorch_tanh); the others: SiLU.
        self.activation = functools.partial(jax.nn.gelu, approximate=True) if config.gemma else jax.nn.silu

    @jax.named_scope("mlp")
    def __call__(self, x, adapters=None, dropout_key=None):
        dtype = x.dtype
        # Rows flattened to [B*T, E], so each weight gradient contracts one dimension: with [B, T, E]
        # operands (two contracting dims) XLA CPU transposed the [B, T, M] activation gradient into a
        # slow fused copy before every weight-gradient matmul (its share of a step: docs/benchmarks.md).
        rows = x.reshape(-1, x.shape[-1])
        gate = rows @ self.gate[...].astype(dtype)
        up = rows @ self.up[...].astype(dtype)
        if adapters is not None:
            gate = adapters.apply("gate", rows, gate, dropout_key)
            up = adapters.apply("up", rows, up, dropout_key)
        hidden = self.activation(gate) * up
        down = hidden @ self.down[...].astype(dtype)
        if adapters is not None:
            down = adapters.apply("down", hidden, down, dropout_key)
        return down.reshape(x.shape)


class MoE(nnx.Module):
    """A Qwen3-MoE sparse MLP: a router [embed, experts] and num_experts SwiGLU experts stacked on a leading
    `expert` axis (gate, up [experts, embed, moe_mlp], down [experts, moe_mlp, embed]). Routing is computed in
    float32 (softmax, top-k, renormalised with norm_topk_prob), as transformers computes it."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, m, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
        pd = DTYPES[config.param_dtype]
        self.router = _param(rngs, _normal, (e, x), pd, ("embed", "router"))
        self.gate = _param(rngs, _normal, (x, e, m), pd, ("expert", "embed", "moe_mlp"))
        self.up = _param(rngs, _normal, (x, e, m), pd, ("expert", "embed", "moe_mlp"))
        self.down = _param(rngs, _normal, (x, m, e), pd, ("expert", "moe_mlp", "embed"))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.dispatch = config.moe_dispatch
        self.matmul = config.moe_matmul
        self.expert_parallel = config.expert_parallel

    @jax.named_scope("experts")
    def __call__(self, x, routing=None):
        """x: [B, T, E]; routing: [B, T, k] int32 expert ids to use instead of the router's own top-k (routing
        replay: the weights are still the router's probabilities at those experts, so the router trains), or None.
        Returns the output [B, T, E] and the experts used [B, T, k] int32."""
        dtype = x.dtype
        rows = x.reshape(-1, x.shape[-1])  # [N, E]
        logits = rows @ self.router[...].astype(dtype)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, X]
        if routing is None:
            weights, experts = jax.lax.top_k(probs, self.top_k)
        else:
            experts = routing.reshape(-1, self.top_k).astype(jnp.int32)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        weights = weights.astype(dtype)
        gate, up, down = (w[...].astype(dtype) for w in (self.gate, self.up, self.down))
        axis = expert_parallel_axis(gate.shape[0]) if self.expert_parallel else None
        impl = matmul_impl(self.matmul, target_platform())
        if self.dispatch == "dense":
            out = dense_experts(rows, experts, weights, gate, up, down)
        elif axis is not None:
            out = expert_parallel(rows, experts, weights, gate, up, down, axis, impl)
        else:
            out = local_experts(rows, experts, weights, gate, up, down, impl)
        return out.reshape(x.shape), experts.reshape(*x.shape[:2], self.top_k)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        e = config.hidden_size
        self.input_norm = _norm(config, e, rngs)
        self.attn = Attention(config, rngs)
        self.post_attn_norm = _norm(config, e, rngs)  # the MLP's input norm (Hugging Face: post_attention_layernorm,
        #                                                 or Gemma's pre_feedforward_layernorm)
        self.mlp = MoE(config, rngs) if config.is_moe(layer) else MLP(config, rngs)
        if config.gemma:  # norms on attention's and the MLP's outputs, before each residual add
            self.attn_out_norm, self.mlp_out_norm = _norm(config, e, rngs), _norm(config, e, rngs)
        else:
            self.attn_out_norm = self.mlp_out_norm = None

    def __call__(self, x, positions, mask, inv_freq, cache, write_index, adapters=None, dropout_key=None,
                 routing=None):
        """Returns the layer's output, its cache and, in a layer with experts, the experts each token used
        ([B, T, k]; `routing` when given, see MoE), else None."""
        attn_out, cache = self.attn(self.input_norm(x), positions, mask, inv_freq, cache, write_index, adapters,
                                    dropout_key)
        if self.attn_out_norm is not None:
            attn_out = self.attn_out_norm(attn_out)
        x = x + attn_out
        experts = None
        if isinstance(self.mlp, MoE):  # no adapters on experts (lora.py)
            mlp_out, experts = self.mlp(self.post_attn_norm(x), routing)
        else:
            mlp_out = self.mlp(self.post_attn_norm(x), adapters, dropout_key)
        if self.mlp_out_norm is not None:
            mlp_out = self.mlp_out_norm(mlp_out)
        return x + mlp_out, cache, experts


KVCache = tuple  # per layer: (k, v), each [batch, kv_heads (or a multiple: init_cache), cache_len, head_dim]


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        problems = config.validate()
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        self.config = config
        pd = DTYPES[config.param_dtype]
        self.embed = _param(rngs, _normal, (config.vocab_size, config.hidden_size), pd, ("vocab", "embed"))
        self.layers = nnx.List([Block(config, rngs, i) for i in range(config.num_layers)])
        self.final_norm = _norm(config, config.hidden_size, rngs)
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(rngs, _normal, (config.hidden_size, config.vocab_size), pd, ("embed", "vocab"))

    @property
    def compute_dtype(self):
        return DTYPES[self.config.dtype]

    @jax.named_scope("embed")
    def embed_tokens(self, tokens) -> jnp.ndarray:
        """[B, T] ids -> [B, T, E] in the compute dtype (Gemma scales them by sqrt(hidden_size), in that dtype)."""
        x = self.embed[tokens].astype(self.compute_dtype)
        if self.config.gemma:
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), self.compute_dtype)
        return x

    def init_cache(self, batch: int, length: int, heads: int = 0, local_length: int = 0) -> KVCache:
        """Zeros for `length` positions of `batch` rows. heads: 0 for num_kv_heads; or a multiple of it that
        divides num_heads, each KV head then held heads / num_kv_heads times in a row (each copy read by its own
        share of the query heads): so that a tensor axis larger than num_kv_heads can split the cache, each
        device holding the KV head its query heads use (rollout.sampler.cache_layout). local_length: the
        positions of the sliding-window layers' caches (0: `length`; the engine's ring keeps only the window)."""
        c = self.config
        heads = heads or c.num_kv_heads
        if heads % c.num_kv_heads or c.num_heads % heads:
            raise ValueError(f"init_cache: heads={heads} must be a multiple of num_kv_heads={c.num_kv_heads} that "
                             f"divides num_heads={c.num_heads}")

        def zeros(i):
            columns = local_length if local_length and c.is_local(i) else length
            return jnp.zeros((batch, heads, columns, c.resolved_head_dim), self.compute_dtype)

        return tuple((zeros(i), zeros(i)) for i in range(c.num_layers))

    def hidden_states(self, tokens, positions, key_mask, cache: KVCache | None = None, write_index=0,
                      adapters=None, dropout_key=None, segment_ids=None, routing=None):
        """Final-normed hidden states [B, T, E] and the updated cache (hidden_states_and_routing, without the
        routing)."""
        hidden, cache, _ = self.hidden_states_and_routing(tokens, positions, key_mask, cache, write_index, adapters,
                                                          dropout_key, segment_ids, routing)
        return hidden, cache

    def hidden_states_and_routing(self, tokens, positions, key_mask, cache: KVCache | None = None, write_index=0,
                                  adapters=None, dropout_key=None, segment_ids=None, routing=None):
        """Final-normed hidden states [B, T, E], the updated cache, and the experts each token used in each layer
        with experts ([B, T, len(config.moe_layers), num_experts_per_tok] int32; None for a dense model).

        tokens, positions: [B, T] int. key_mask: [B, S] bool, which keys are real tokens (S == T without
        a cache, else the cache length, with this call's tokens already marked). A query at index t (cache
        slot write_index + t) sees key slot s when key_mask[b, s] and s <= write_index + t, so left and
        right padding are both handled by the mask alone.
        segment_ids: [B, T] int or None, without a cache only: a query sees only keys of its own segment
        (several sequences packed in one row; no token attends across sequences, forward or backward).
        adapters: lora.Adapters applied on top of these weights (None: the model alone); dropout_key: a
        PRNG key for their dropout (None: no dropout, as in sampling and in passes without gradient).
        routing: [B, T, len(config.moe_layers), num_experts_per_tok] int32, experts to route each token to instead
        of the router's choice (routing replay: the experts the actor used), or None.
        """
        x = constrain_rows(self.embed_tokens(tokens))
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids: only without a KV cache (a row of packed sequences)")
        mask = causal_mask(key_mask, tokens.shape[1], write_index, segment_ids)
        # A local layer's query sees the keys at most sliding_window - 1 slots before its own: a sequence's tokens
        # are in consecutive slots (padding only before or after them), so slots count positions.
        local_mask = mask.with_window(self.config.sliding_window) if self.config.has_local_layers else None
        platform = target_platform()
        mask, local_mask = (m if m is None or choose(self.config.attention, m, self.config.attention_block, platform)
                            != "dense" else m.with_whole() for m in (mask, local_mask))
        inv_freq = rope_inverse_frequencies(self.config)
        local_inv_freq = rope_inverse_frequencies(self.config, local=True)
        moe_index = {layer: j for j, layer in enumerate(self.config.moe_layers)}

        def layer_inputs(i):
            """Layer i's adapters, dropout key, routing, mask and RoPE frequencies."""
            local = self.config.is_local(i)
            return (None if adapters is None else adapters.layers[i],
                    None if dropout_key is None else jax.random.fold_in(dropout_key, i),
                    None if routing is None or i not in moe_index else routing[:, :, moe_index[i]],
                    local_mask if local else mask, local_inv_freq if local else inv_freq)

        def run_layer(layer, x, layer_adapters, layer_key, layer_routing, layer_mask, layer_inv_freq, layer_cache):
            args = (x, positions, layer_mask, layer_inv_freq, layer_cache, write_index)
            if not self.config.remat:
                return layer(*args, layer_adapters, layer_key, layer_routing)
            # jax.checkpoint over a pure function of the layer's (and its adapters') state: nnx.remat refuses
            # weights that enter the trace without being differentiated (the frozen base under LoRA).
            block_def, block_state = nnx.split((layer, layer_adapters))

            def block(state, key, layer_routing, *args):
                blk, adapters_i = nnx.merge(block_def, state)
                return blk(*args, adapters_i, key, layer_routing)

            policy = getattr(jax.checkpoint_policies, self.config.remat_policy)
            return jax.checkpoint(block, policy=policy)(block_state, layer_key, layer_routing, *args)

        period = self.config.layer_period()
        scans = cache is None and period < self.config.num_layers and self.config.scans_layers(target_platform())
        scanned = (self.config.num_layers // period) * period if scans else 0
        used: list = [None] * self.config.num_layers
        if scanned:
            x, experts = self._scan_layers(x, scanned, period, layer_inputs, run_layer)
            used[:scanned] = experts
        new_cache = []
        for i in range(scanned, self.config.num_layers):
            x, layer_cache, used[i] = run_layer(self.layers[i], x, *layer_inputs(i),
                                                None if cache is None else cache[i])
            x = constrain_rows(x)
            new_cache.append(layer_cache)
        used = [experts for experts in used if experts is not None]
        return (self.final_norm(x), (None if cache is None else tuple(new_cache)),
                jnp.stack(used, axis=2) if used else None)

    def _scan_layers(self, x, layers: int, period: int, layer_inputs, run_layer) -> tuple[jax.Array, list]:
        """The first `layers` layers (a multiple of `period`) as a lax.scan over their repeating block: layer
        j * period + r's weights (and adapters) stacked with the other r-th layers' and read as slice j. Returns
        the hidden states and each layer's experts (None for a dense MLP)."""
        def stacked(trees):
            return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

        def compute_weights(state):
            # Every matrix of a layer is cast to the compute dtype where it is used, so the stacked copy is made
            # in that dtype: half the bytes of float32 master weights. Vectors (norm weights) stay as they are.
            return jax.tree.map(lambda w: w.astype(self.compute_dtype) if w.ndim >= 2 else w, state)

        defs, states, per_layer = [], [], []
        for r in range(period):
            members = range(r, layers, period)
            split = [nnx.split((self.layers[i], layer_inputs(i)[0])) for i in members]
            defs.append(split[0][0])
            states.append(stacked([compute_weights(state) for _, state in split]))
            key, routing, mask, inv_freq = layer_inputs(r)[1:]
            keys = None if key is None else stacked([layer_inputs(i)[1] for i in members])
            routings = None if routing is None else stacked([layer_inputs(i)[2] for i in members])
            per_layer.append((keys, routings))
        fixed = [layer_inputs(r)[3:] for r in range(period)]  # mask and frequencies: the same for every slice

        def body(x, xs):
            block_states, block_inputs = xs
            experts = []
            for r in range(period):
                layer, layer_adapters = nnx.merge(defs[r], block_states[r])
                x, _, used = run_layer(layer, x, layer_adapters, *block_inputs[r], *fixed[r], None)
                x = constrain_rows(x)
                experts.append(used)
            return x, experts

        x, experts = jax.lax.scan(body, x, (states, per_layer))
        return x, [None if experts[r] is None else experts[r][j] for j in range(layers // period)
                   for r in range(period)]

    def head_weight(self) -> jnp.ndarray:
        """[E, V] output projection (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed[...].T
        return self.lm_head[...]

    def head_for(self, dtype) -> jnp.ndarray:
        """The output projection [E, V] in the compute dtype, gathered over fsdp (vocab stays split over tensor):
        made once and passed to `logits` by a caller that calls it in a loop (learner.chunked_logprobs), so that
        neither the cast nor the gather is repeated per chunk."""
        return constrain(self.head_weight().astype(dtype), PartitionSpec(None, "tensor"))

    @jax.named_scope("lm_head")
    def logits(self, hidden, head: jnp.ndarray | None = None):
        """float32 logits [..., V] of hidden states [..., E]; head: head_for(hidden.dtype) made beforehand."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # [B*T, E]: see MLP.__call__
        head = self.head_weight().astype(hidden.dtype) if head is None else head
        out = jnp.einsum("ne,ev->nv", rows, head, preferred_element_type=jnp.float32)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])

    def __call__(self, tokens, positions=None, key_mask=None, cache=None, write_index=0, adapters=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if key_mask is None:
            key_mask = jnp.ones(tokens.shape, bool)
        hidden, cache = self.hidden_states(tokens, positions, key_mask, cache, write_index, adapters)
        return self.logits(hidden), cache


def create_model(config: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(config, nnx.Rngs(params=seed))


class _ShapesOnly:
    """What Transformer's constructor asks of nnx.Rngs (`params()`), where only shapes are wanted: one key for
    every parameter. nnx.Rngs advances a counter variable per parameter, and under tracing flax asks that
    traced counter for its sharding, whose refusal JAX words by walking every operation traced so far:
    quadratic in the number of parameters (24 s for Llama-3.1-70B's 80 layers; now 0.9 s)."""

    @staticmethod
    def params() -> jax.Array:
        return jax.random.key(0)


def abstract_model(config: ModelConfig) -> Transformer:
    """The model with jax.ShapeDtypeStruct parameters (shapes, dtypes and axes metadata; no values, no memory)."""
    return nnx.eval_shape(lambda: Transformer(config, _ShapesOnly()))


def positions_from_mask(mask: jnp.ndarray) -> jnp.ndarray:
    """Position ids for a [B, T] token mask: 0 at each row's first real token, counting real tokens.

    A mask of integer segment labels (0: padding, k > 0: the tokens of one sequence, contiguous; rows of
    packed sequences): 0 at each segment's first token, counting within the segment, so RoPE sees each
    sequence as if it were alone in its row (padding gets 0)."""
    if mask.dtype == jnp.bool_:
        return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
    index = jnp.broadcast_to(jnp.arange(mask.shape[-1], dtype=jnp.int32), mask.shape)
    previous = jnp.concatenate([jnp.full_like(mask[..., :1], -1), mask[..., :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(mask != previous, index, 0), axis=mask.ndim - 1)
    return jnp.where(mask > 0, index - start, 0)


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def param_dict(model: nnx.Module) -> dict[str, Any]:
    """Flat {dotted.path: array} view of the parameters (used by conversion and tests)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(k) for k in path): v.get_value() for path, v in flat}
