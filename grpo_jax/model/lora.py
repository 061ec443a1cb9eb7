"""LoRA: low-rank adapters trained on top of a frozen base model (Hu et al., 2021), as PEFT defines them.

Each adapted projection W (one of q, k, v, o, gate, up, down) computes x @ W + (alpha / rank) *
(dropout(x) @ A) @ B, with A [in, rank] and B [rank, out] in the weight's own per-head layout: for q,
A is [embed, rank] and B [rank, heads, head_dim]; for o, A is [heads, head_dim, rank] and B [rank, embed].
A starts uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform(a=sqrt(5))), B at zero, so the adapted
model equals the base at step 0. Dropout acts on the adapter's input only, and only when a key is given
(the learner's gradient pass); the sampler and the no-gradient passes never drop.

The adapters are their own NNX module (Adapters), passed to the model's forward pass next to its
weights rather than built into it: the base model's graph and state are the same with and without LoRA,
so the learner differentiates only the adapters (optimizer moments exist for them alone), the frozen
base doubles as the KL reference (the same weights with the adapters off: no second copy), and a
weight sync sends only the adapters to an actor that holds its own copy of the base from the start.

Why not qwix (Google's library that Tunix uses): its LoRA provider intercepts einsum / dot_general calls
and picks them by a regex over the module path plus the op name, and here q, k, v, o are einsums of one
Attention module and gate, up, down matmuls of one MLP module, so targets such as [q, v] cannot be named
without a module per projection; it adds the adapters into the base's own modules on a first traced call,
so they would have to be filtered apart again for the optimizer, the reference pass and the sync; its
dropout runs whenever dropout > 0 (in the sampler too), drawn from an RNG stream kept in the module rather
than a key passed to the step; and PEFT's names would still need a mapping. The adapter here is two
tensordots per projection, in the layouts above, in a module of its own.

Export: merge_adapters() gives a plain Transformer with W + scale * A @ B (final_model/), and
save_peft_adapter() writes adapter_config.json + adapter_model.safetensors in PEFT's names and [out, in]
layouts (final_adapter/), which peft.PeftModel.from_pretrained loads onto the transformers base model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config_io import config_key
from grpo_jax.model.safetensors_io import save_file
from grpo_jax.model.transformer import FAMILY_FIELDS, ModelConfig, Transformer

# The projections an adapter can target, and their Hugging Face module names inside a decoder layer.
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = config_key(0, "0: off (every weight trains); > 0: train rank-r adapters on a frozen base.")
    alpha: float = config_key(16.0, "The update is scaled by alpha / rank.")
    dropout: float = config_key(0.0, "On each adapter's input, in the learner's gradient pass only.")
    targets: tuple[str, ...] = config_key(TARGETS, f"Projections that get an adapter, of {', '.join(TARGETS)}.")

    def __post_init__(self):
        # A tuple whatever was given: the adapters' graph holds this config, and jit hashes the graph.
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> list[str]:
        """Problems with this config, as 'key=value: what is allowed' strings (empty when valid)."""
        problems = []
        if self.rank < 0:
            problems.append(f"rank={self.rank}: must be >= 0 (0 turns LoRA off)")
        if not self.alpha > 0:
            problems.append(f"alpha={self.alpha}: must be > 0 (the update is scaled by alpha / rank)")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout}: must be in [0, 1)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            problems.append(f"targets={list(self.targets)}: unknown {unknown}; allowed {list(TARGETS)}")
        elif len(set(self.targets)) != len(self.targets):
            problems.append(f"targets={list(self.targets)}: each projection at most once")
        elif self.enabled and not self.targets:
            problems.append(f"targets=[]: rank={self.rank} needs at least one of {list(TARGETS)}")
        return problems


def projection_layout(cfg: ModelConfig, name: str) -> tuple[tuple, tuple, tuple, tuple]:
    """(in shape, in axes, out shape, out axes) of a projection's weight, as model.py lays it out."""
    e, m = cfg.hidden_size, cfg.intermediate_size
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    return {
        "q": ((e,), ("embed",), (h, d), ("heads", "head_dim")),
        "k": ((e,), ("embed",), (kv, d), ("kv_heads", "head_dim")),
        "v": ((e,), ("embed",), (kv, d), ("kv_heads", "head_dim")),
        "o": ((h, d), ("heads", "head_dim"), (e,), ("embed",)),
        "gate": ((e,), ("embed",), (m,), ("mlp",)),
        "up": ((e,), ("embed",), (m,), ("mlp",)),
        "down": ((m,), ("mlp",), (e,), ("embed",)),
    }[name]


class LoraAdapter(nnx.Module):
    """One projection's adapter: a [*in, rank] (sharded like the weight's input), b [rank, *out] (like its output)."""

    def __init__(self, in_shape: tuple, in_axes: tuple, out_shape: tuple, out_axes: tuple, config: LoraConfig,
                 param_dtype, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), (*in_shape, config.rank), param_dtype, -bound, bound)
        self.a = nnx.Param(a, axes=(*in_axes, "lora_rank"))
        self.b = nnx.Param(jnp.zeros((config.rank, *out_shape), param_dtype), axes=("lora_rank", *out_axes))
        self.scale = config.scale
        self.dropout = config.dropout

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """The update for input rows x [n, *in]: [n, *out], in x's dtype."""
        if dropout_key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(dropout_key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        low = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.a.ndim - 1)  # [n, rank]
        return jnp.tensordot(low, self.b[...].astype(x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)

    def delta(self) -> jax.Array:
        """scale * A @ B in the weight's layout and float32: what merging adds to the weight."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return jnp.tensordot(a, b, axes=1) * self.scale


class LayerAdapters(nnx.Module):
    """The adapters of one decoder layer: an attribute per target (None where the projection has none).
    Always float32, whatever model.param_dtype: they are the master weights that updates accumulate into,
    and they are small; the frozen base, which no update touches, may then be held in bfloat16."""

    def __init__(self, model_config: ModelConfig, config: LoraConfig, rngs: nnx.Rngs, layer: int = 0):
        # A layer with experts has no gate/up/down projection of its own to adapt: its experts train only with the
        # full model (run.plan refuses MLP targets for a model with experts: PEFT reads gate_proj, up_proj and
        # down_proj of a Qwen3-MoE as its experts').
        skipped = ("gate", "up", "down") if model_config.is_moe(layer) else ()
        for name in TARGETS:
            adapter = None
            if name in config.targets and name not in skipped:
                adapter = LoraAdapter(*projection_layout(model_config, name), config, jnp.float32, rngs)
            setattr(self, name, adapter)

    def apply(self, name: str, x: jax.Array, y: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
        """y (the projection of rows x by the base weight) plus the adapter's update, if `name` has one."""
        adapter = getattr(self, name)
        if adapter is None:
            return y
        if dropout_key is not None:
            dropout_key = jax.random.fold_in(dropout_key, TARGETS.index(name))
        return y + adapter(x, dropout_key).astype(y.dtype)


class Adapters(nnx.Module):
    """Every layer's adapters; passed to Transformer.hidden_states(adapters=...)."""

    def __init__(self, model_config: ModelConfig, config: LoraConfig, rngs: nnx.Rngs):
        problems = config.validate()
        if not config.enabled or problems:
            raise ValueError(f"invalid lora config {config}: " + ("; ".join(problems) or "rank must be > 0"))
        self.config = config
        self.layers = nnx.List([LayerAdapters(model_config, config, rngs, i) for i in range(model_config.num_layers)])


def init_adapters(model_config: ModelConfig, config: LoraConfig, seed: int = 0) -> Adapters:
    """Fresh adapters for a model of `model_config`: A random, B zero."""
    return Adapters(model_config, config, nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 0x10A)))


def _adapted(model: Transformer, adapters: Adapters):
    """(layer index, target name, the base weight's nnx.Param, the adapter) for every adapted projection."""
    for i, (layer, layer_adapters) in enumerate(zip(model.layers, adapters.layers)):
        for name in adapters.config.targets:
            module = layer.attn if name in ("q", "k", "v", "o") else layer.mlp
            if getattr(layer_adapters, name) is not None:
                yield i, name, getattr(module, name), getattr(layer_adapters, name)


def merge_adapters(model: Transformer, adapters: Adapters) -> Transformer:
    """A new Transformer whose adapted weights are W + scale * A @ B (computed in float32, stored in the
    weight's dtype); `model` is left as it was. Its forward pass without adapters equals `model`'s with
    them, up to float rounding."""
    graphdef, state = nnx.split(model)
    # New Variables over the same (immutable) arrays: nnx.merge alone would hand back model's own Variables,
    # and setting them would change model (the learner's frozen base) too.
    merged = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for _, _, weight, adapter in _adapted(merged, adapters):
        weight.set_value((weight[...].astype(jnp.float32) + adapter.delta()).astype(weight.get_value().dtype))
    return merged


def peft_tensors(model_config: ModelConfig, adapters: Adapters) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} in PEFT's torch layout: lora_A.weight [rank, in], lora_B.weight [out, rank],
    with multi-head dimensions flattened as the Hugging Face projections flatten them (hf.py)."""
    tensors = {}
    for i, layer_adapters in enumerate(adapters.layers):
        for name in adapters.config.targets:
            adapter = getattr(layer_adapters, name)
            if adapter is None:  # an MLP target in a layer with experts
                continue
            a = np.asarray(jax.device_get(adapter.a[...]))
            b = np.asarray(jax.device_get(adapter.b[...]))
            prefix = f"base_model.model.model.layers.{i}.{HF_MODULES[name]}"
            tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)
            tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(b.shape[0], -1).T)
    return tensors


def peft_config(config: LoraConfig, base_model_path: str = "") -> dict:
    """adapter_config.json: PEFT's LoraConfig for these adapters (bias none, no rsLoRA, no DoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path or None,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(HF_MODULES[name].split(".")[-1] for name in config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapter(adapters: Adapters, model_config: ModelConfig, path: str | os.PathLike,
                      base_model_path: str = "") -> None:
    """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors, float32):
    peft.PeftModel.from_pretrained(base, path) applies it to the base model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(model_config, adapters), path / ADAPTER_WEIGHTS_FILE)
    text = json.dumps(peft_config(adapters.config, base_model_path), indent=2) + "\n"
    (path / ADAPTER_CONFIG_FILE).write_text(text, encoding="utf-8")


# Bytes hashed from each weight file for the base's identity: SAMPLES reads of SAMPLE_BYTES, evenly spread.
SAMPLES, SAMPLE_BYTES = 16, 4096


def base_identity(model_path: str, model_config: ModelConfig, seed: int) -> str:
    """A short fingerprint of the frozen base, recorded in checkpoints so that adapters are never resumed onto
    another base. A checkpoint directory: its config.json and, for every *.safetensors file, its size and 16
    reads of 4 KiB spread over it (reading the whole of a multi-GB model at every start would cost more than
    the check is worth; two different checkpoints differ in every sampled weight). From scratch: the
    architecture and the seed that initialised it."""
    digest = hashlib.sha256()
    if model_path:
        path = Path(model_path)
        digest.update((path / "config.json").read_bytes())
        for weights in sorted(path.glob("*.safetensors")):
            size = weights.stat().st_size
            digest.update(f"{weights.name}:{size}".encode())
            with weights.open("rb") as f:
                for k in range(SAMPLES):
                    f.seek(size * k // SAMPLES)
                    digest.update(f.read(SAMPLE_BYTES))
    else:
        from grpo_jax.model.hf import RUN_SETTINGS
        default = ModelConfig()
        architecture = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in RUN_SETTINGS
                        and not (k in FAMILY_FIELDS and v == getattr(default, k))}
        digest.update(json.dumps({"seed": seed, "model": architecture}, sort_keys=True).encode())
    return digest.hexdigest()[:16]
