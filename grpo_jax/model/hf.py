"""Hugging Face checkpoints (Qwen2ForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM) <-> our
Transformer, without torch.

Gemma 3's larger models are published as Gemma3ForConditionalGeneration (text and vision): their language model
loads from the same directory (config.json's text_config, the tensors under its language model's prefix; the
vision tower's are left unread) and exports as the text-only Gemma3ForCausalLM.

A checkpoint directory holds config.json, model.safetensors or model.safetensors.index.json + shards, and
optionally tokenizer files. Loading validates everything (config, every tensor's presence, shape and dtype,
no unknown tensors) before any array is built, so a bad checkpoint fails with one message naming the file
and tensor instead of a half-loaded model.

Layout: a torch Linear weight is [out, in]; ours are [in, heads, head_dim] (q/k/v), [heads, head_dim, out] (o)
and [in, out] (mlp, lm_head), so each conversion is a transpose plus a reshape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.data.tokenizer import Tokenizer, read_json
from grpo_jax.errors import CheckpointError
from grpo_jax.model.safetensors_io import SafetensorsFile, save_file
from grpo_jax.model.transformer import DTYPES, ModelConfig, Transformer, abstract_model, param_dict

__all__ = ["CheckpointError", "RUN_SETTINGS", "architecture_conflicts", "checkpoint_config",
           "hf_config_to_model_config", "model_config_to_hf_config", "load_hf_model", "save_hf_model"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma3ForCausalLM": "gemma3"}
_HF_CLASS = {family: arch for arch, family in ARCHITECTURES.items()}
MODEL_TYPES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "gemma3_text": "gemma3"}  # config.json's
_HF_MODEL_TYPE = {family: model_type for model_type, family in MODEL_TYPES.items()}
MULTIMODAL_GEMMA3 = "Gemma3ForConditionalGeneration"  # its text_config and language model are loaded
# Where a checkpoint's language model lies: a causal LM's own, transformers 5's and transformers 4's multimodal one.
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
# transformers' Gemma3TextConfig defaults: the multimodal checkpoints' text_config lists only what differs.
GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6}
# Old checkpoints store the rotary table; it is recomputed from the config, so ignoring it is safe.
_HARMLESS = re.compile(r"^(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
# Default max_position_embeddings of each family in transformers, used when config.json omits it.
_DEFAULT_MAX_POS = {"qwen2": 32768, "llama": 2048, "qwen3": 32768, "qwen3_moe": 32768, "gemma3": 131072}
_FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)}
# The ModelConfig fields a run chooses for a loaded checkpoint (the trainer's `model` section with model_path);
# every other field is architecture and comes from the checkpoint's config.json.
RUN_SETTINGS = ("dtype", "param_dtype", "remat", "remat_policy", "scan_layers", "attention", "attention_block",
                "moe_dispatch", "moe_matmul", "routing_replay", "expert_parallel")


# ---- config -------------------------------------------------------------------------------------------


def _rope_from_hf(cfg: dict, where: str, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    # transformers 5 gives rope_scaling priority over rope_parameters when both are present.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_parameters/rope_scaling must be an object, got {rope!r}")
    if rope and all(isinstance(v, dict) for v in rope.values()):
        # Nested per layer type ({"full_attention": {...}}): fine only when every layer type agrees.
        distinct = {json.dumps(v, sort_keys=True) for v in rope.values()}
        if len(distinct) > 1:
            raise CheckpointError(f"{where}: per-layer-type RoPE parameters differ ({rope}); not supported")
        rope = next(iter(rope.values()))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor != 1 is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(rope["factor"])}
    if kind == "llama3":
        try:
            return theta, {"rope_type": "llama3", "factor": float(rope["factor"]),
                           "low_freq_factor": float(rope["low_freq_factor"]),
                           "high_freq_factor": float(rope["high_freq_factor"]),
                           # transformers falls back to max_position_embeddings too
                           "original_max_position_embeddings":
                               int(rope.get("original_max_position_embeddings", max_pos))}
        except KeyError as e:
            raise CheckpointError(f"{where}: llama3 rope scaling lacks {e.args[0]!r}") from e
    raise CheckpointError(f"{where}: rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def hf_config_to_model_config(cfg: dict, path_for_errors: str | os.PathLike = CONFIG_FILE) -> ModelConfig:
    """ModelConfig from a transformers config.json dict. dtype/param_dtype come from its dtype/torch_dtype."""
    where = str(path_for_errors)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return _hf_config_to_model_config(cfg, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a value of the wrong type somewhere
        raise CheckpointError(f"{where}: bad value ({type(e).__name__}: {e})") from e


def _gemma3_rope(cfg: dict, where: str, max_pos: int) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling) of Gemma 3's global layers and the local layers' rope_theta, from transformers 4
    (rope_theta, rope_scaling, rope_local_base_freq) or 5 (rope_parameters per layer type)."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict) and "full_attention" in nested:
        theta, scaling = _rope_from_hf({"rope_parameters": nested["full_attention"]}, where, max_pos)
        local = nested.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
        local_theta, local_scaling = _rope_from_hf({"rope_parameters": local}, where, max_pos)
    else:
        theta, scaling = _rope_from_hf(cfg, where, max_pos)
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", 10000.0)), None
    if local_scaling is not None:
        raise CheckpointError(f"{where}: RoPE scaling on the sliding-window layers ({local_scaling}) is not supported")
    return theta, scaling, local_theta


def _gemma3_layer_types(cfg: dict, where: str) -> tuple[str, ...]:
    layers = cfg["num_hidden_layers"]
    if cfg.get("layer_types") is not None:
        return tuple(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 6)
    if not isinstance(pattern, int) or pattern <= 0:
        raise CheckpointError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def _hf_config_to_model_config(cfg: dict, where: str) -> ModelConfig:
    if MULTIMODAL_GEMMA3 in (cfg.get("architectures") or []) or cfg.get("model_type") == "gemma3":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: a {MULTIMODAL_GEMMA3} config needs a text_config object")
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        cfg = {"dtype": dtype, **text, "architectures": None, "model_type": "gemma3_text"}
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None and not archs and model_type in MODEL_TYPES:
        family = MODEL_TYPES[model_type]
    if family is None:
        supported = ", ".join(f"{a} (model_type {f})" for a, f in ARCHITECTURES.items())
        raise CheckpointError(f"{where}: unsupported architecture {archs or model_type!r} "
                              f"(model_type {model_type!r}); supported: {supported}, {MULTIMODAL_GEMMA3} (its "
                              "language model)")
    if family == "gemma3":
        cfg = {**GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}}

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(cfg.get(key), int):
            raise CheckpointError(f"{where}: {key} must be an integer, got {cfg.get(key)!r}")
    if family == "gemma3":
        if cfg["hidden_activation"] != "gelu_pytorch_tanh":
            raise CheckpointError(f"{where}: hidden_activation {cfg['hidden_activation']!r} is not supported (Gemma 3: "
                                  "only gelu_pytorch_tanh)")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key) is not None:
                raise CheckpointError(f"{where}: {key}={cfg[key]!r} is not supported (Gemma 3 has none: null)")
        if cfg.get("use_bidirectional_attention"):
            raise CheckpointError(f"{where}: use_bidirectional_attention=true is not supported (causal LMs only)")
    elif cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if family in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
    if family in ("llama", "qwen3", "qwen3_moe", "gemma3") and cfg.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")

    max_pos = cfg.get("max_position_embeddings") or _DEFAULT_MAX_POS[family]
    gemma = {}
    if family == "gemma3":
        theta, scaling, local_theta = _gemma3_rope(cfg, where, max_pos)
        layer_types = _gemma3_layer_types(cfg, where)
        if "sliding_attention" not in layer_types:
            layer_types = ()  # every layer global: ModelConfig's canonical form, so configs round-trip equal
        window = int(cfg["sliding_window"]) if layer_types else 0
        gemma = dict(layer_types=layer_types, sliding_window=window, rope_local_theta=local_theta,
                     query_pre_attn_scalar=int(cfg["query_pre_attn_scalar"]))
    else:
        theta, scaling = _rope_from_hf(cfg, where, max_pos)
    moe = {}
    if family == "qwen3_moe":
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        moe = dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok"),
                   moe_intermediate_size=cfg.get("moe_intermediate_size"),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if not isinstance(moe[key], int):
                raise CheckpointError(f"{where}: {key} must be an integer, got {moe[key]!r}")
    # float16 is not a compute dtype here; widening it to float32 is exact.
    dtype = {"bfloat16": "bfloat16"}.get(cfg.get("dtype") or cfg.get("torch_dtype"), "float32")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or 0
    if heads > 0 and head_dim * heads == cfg["hidden_size"]:
        head_dim = 0  # the implied value: keep ModelConfig canonical so configs round-trip equal
    model_cfg = ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # Qwen2 always has q/k/v biases; Llama, Qwen3 and Gemma 3 have them (plus an o_proj bias) with
        # attention_bias.
        qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos, dtype=dtype, param_dtype=dtype, architecture=family, **gemma, **moe)
    problems = model_cfg.validate()
    if problems:
        raise CheckpointError(f"{where}: invalid model config: " + "; ".join(problems))
    return model_cfg


def model_config_to_hf_config(cfg: ModelConfig) -> dict:
    """config.json contents for transformers (4.45+ and 5). Rope is written both the old way (rope_theta +
    rope_scaling, read by transformers 4) and the new way (rope_parameters, read by transformers 5)."""
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope_parameters = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        rope_parameters["rope_type"] = rope_parameters.pop("type", None) or rope_parameters["rope_type"]
    out = {
        "architectures": [_HF_CLASS[cfg.architecture]],
        "model_type": _HF_MODEL_TYPE[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None
        else {k: v for k, v in rope_parameters.items() if k != "rope_theta"},
        "rope_parameters": rope_parameters,
        "torch_dtype": cfg.param_dtype,  # transformers 4
        "dtype": cfg.param_dtype,  # transformers 5
        "use_cache": True,
    }
    if cfg.architecture in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = False
        out["sliding_window"] = None
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                   output_router_logits=False)
    if cfg.architecture in ("llama", "qwen3", "qwen3_moe", "gemma3"):
        out["attention_bias"] = cfg.qkv_bias
        out["mlp_bias"] = False
    if cfg.gemma:
        del out["hidden_act"]
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg.query_pre_attn_scalar
                   or cfg.resolved_head_dim, sliding_window=cfg.sliding_window or None,
                   layer_types=list(cfg.layer_types) or ["full_attention"] * cfg.num_layers,
                   rope_local_base_freq=local["rope_theta"], final_logit_softcapping=None,
                   attn_logit_softcapping=None, use_bidirectional_attention=False,
                   rope_parameters={"full_attention": rope_parameters, "sliding_attention": local})
    return out


def architecture_conflicts(requested: ModelConfig, checkpoint: ModelConfig) -> list[str]:
    """'key=value (config.json: value)' for each architecture field that `requested` sets to something other
    than the checkpoint's. A field left at its ModelConfig default counts as not set (a config cannot say
    otherwise), so only values someone chose are compared; RUN_SETTINGS are never architecture."""
    default = ModelConfig()
    conflicts = []
    for field in dataclasses.fields(ModelConfig):
        name = field.name
        value = getattr(requested, name)
        if name in RUN_SETTINGS or value == getattr(default, name):
            continue
        # config.json always names head_dim; ours keeps 0 when it is the implied hidden_size // num_heads.
        theirs = checkpoint.resolved_head_dim if name == "head_dim" else getattr(checkpoint, name)
        if value != theirs:
            conflicts.append(f"{name}={value!r} (config.json: {theirs!r})")
    return conflicts


# ---- tensor layout ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    hf_name: str
    ours: str | None  # dotted param path; None: a tensor we do not have, which must be all zeros
    hf_shape: tuple[int, ...]
    kind: str  # "copy", "linear" (transpose), "in_heads" (q/k/v), "out_heads" (o), "bias_heads", "zero"
    expert: int | None = None  # the index in our stacked experts ([experts, ...]) of this one expert's tensor


def _head_name(prefix: str) -> str:
    """The LM head's tensor beside a language model at `prefix` (TEXT_PREFIXES)."""
    return "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"


def _layout(cfg: ModelConfig, prefix: str = "model.") -> list[_Entry]:
    """Every tensor of the HF checkpoint of this config, and where it goes in our model; prefix: where the
    checkpoint keeps its language model (TEXT_PREFIXES)."""
    e, m, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    # Qwen2 always stores q/k/v biases: zeros when our model has none. The attention_bias of Llama, Qwen3 and
    # Gemma 3 also adds an o_proj bias we do not model, so it must be zero.
    bias_kind = "bias_heads" if cfg.qkv_bias else "zero"
    out = [_Entry(prefix + "embed_tokens.weight", "embed", (v, e), "copy"),
           _Entry(prefix + "norm.weight", "final_norm.weight", (e,), "copy")]
    if not cfg.tie_embeddings:
        out.append(_Entry(_head_name(prefix), "lm_head", (v, e), "linear"))
    # Our MLP input norm is Llama's and Qwen's post_attention_layernorm; Gemma's is pre_feedforward_layernorm, its
    # post_attention_layernorm normalizing attention's output.
    norms = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm"}
    if cfg.gemma:
        norms = {"input_layernorm": "input_norm", "post_attention_layernorm": "attn_out_norm",
                 "pre_feedforward_layernorm": "post_attn_norm", "post_feedforward_layernorm": "mlp_out_norm"}
    for i in range(cfg.num_layers):
        p, a = f"{prefix}layers.{i}.", f"layers.{i}."
        out += [_Entry(f"{p}{theirs}.weight", f"{a}{ours}.weight", (e,), "copy") for theirs, ours in norms.items()]
        out += [
            _Entry(p + "self_attn.q_proj.weight", a + "attn.q", (h * d, e), "in_heads"),
            _Entry(p + "self_attn.k_proj.weight", a + "attn.k", (kv * d, e), "in_heads"),
            _Entry(p + "self_attn.v_proj.weight", a + "attn.v", (kv * d, e), "in_heads"),
            _Entry(p + "self_attn.o_proj.weight", a + "attn.o", (e, h * d), "out_heads"),
        ]
        if cfg.is_moe(i):  # the router, and each expert's SwiGLU as Qwen3-MoE checkpoints store them
            mm = cfg.moe_intermediate_size
            out.append(_Entry(p + "mlp.gate.weight", a + "mlp.router", (cfg.num_experts, e), "linear"))
            # One of our stacked tensors after the other (save_hf_model fetches each once).
            for name, ours, shape in (("gate", "gate", (mm, e)), ("up", "up", (mm, e)), ("down", "down", (e, mm))):
                out += [_Entry(f"{p}mlp.experts.{j}.{name}_proj.weight", f"{a}mlp.{ours}", shape, "linear", j)
                        for j in range(cfg.num_experts)]
        else:
            out += [_Entry(p + "mlp.gate_proj.weight", a + "mlp.gate", (m, e), "linear"),
                    _Entry(p + "mlp.up_proj.weight", a + "mlp.up", (m, e), "linear"),
                    _Entry(p + "mlp.down_proj.weight", a + "mlp.down", (e, m), "linear")]
        if cfg.architecture == "qwen2" or cfg.qkv_bias:
            for name, heads in (("q", h), ("k", kv), ("v", kv)):
                ours = a + f"attn.{name}_bias" if cfg.qkv_bias else None
                out.append(_Entry(p + f"self_attn.{name}_proj.bias", ours, (heads * d,), bias_kind))
        if cfg.architecture != "qwen2" and cfg.qkv_bias:
            out.append(_Entry(p + "self_attn.o_proj.bias", None, (e,), "zero"))
        if cfg.qk_norm:
            out += [_Entry(p + "self_attn.q_norm.weight", a + "attn.q_norm.weight", (d,), "copy"),
                    _Entry(p + "self_attn.k_norm.weight", a + "attn.k_norm.weight", (d,), "copy")]
    return out


def _to_ours(entry: _Entry, array: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
    if entry.kind in ("linear", "in_heads", "out_heads"):
        return array.T.reshape(our_shape)  # [out, in] -> [in, out] -> split heads
    return array.reshape(our_shape)


def _to_hf(entry: _Entry, array: np.ndarray) -> np.ndarray:
    if entry.kind == "in_heads":  # [E, H, D] -> [H*D, E]
        return array.reshape(array.shape[0], -1).T
    if entry.kind == "out_heads":  # [H, D, E] -> [H*D, E] -> [E, H*D]
        return array.reshape(-1, array.shape[-1]).T
    if entry.kind == "linear":
        return array.T
    return array.reshape(entry.hf_shape)


# ---- loading ------------------------------------------------------------------------------------------


def _read_config(path: Path) -> dict:
    cfg = read_json(path / CONFIG_FILE)
    if cfg is None:
        raise CheckpointError(f"{path / CONFIG_FILE}: not found (is {path} a Hugging Face model directory?)")
    return cfg


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory's config.json, without reading any weights. Its dtype and
    param_dtype are the checkpoint's own: bfloat16, or float32 for anything else (float16 widens exactly)."""
    path = Path(path)
    return hf_config_to_model_config(_read_config(path), path / CONFIG_FILE)


def _open_weights(path: Path) -> tuple[dict[str, SafetensorsFile], str]:
    """{tensor name: opened file holding it}, and a description of the files searched (for errors)."""
    index_file, single = path / INDEX_FILE, path / WEIGHTS_FILE
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
                raise TypeError("weight_map must map tensor names to file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file}: bad index ({type(e).__name__}: {e})") from e
        shards = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).exists():
                raise CheckpointError(f"{path / shard}: shard listed in {index_file} not found")
            shards[shard] = SafetensorsFile(path / shard)
        where = {}
        for shard, f in shards.items():
            for name in f.keys():
                where.setdefault(name, f)
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise CheckpointError(f"{path / shard}: tensor {name!r} listed in {index_file} is not in this shard")
            where[name] = shards[shard]
        return where, f"{index_file} and its {len(shards)} shard(s)"
    if single.exists():
        f = SafetensorsFile(single)
        return {name: f for name in f.keys()}, str(single)
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
    hint = f" (found {others}: only safetensors checkpoints are supported)" if others else ""
    raise CheckpointError(f"{path}: no weights: neither {WEIGHTS_FILE} nor {INDEX_FILE} found{hint}")


def _text_prefix(cfg: ModelConfig, files: dict[str, SafetensorsFile]) -> str:
    """Where the checkpoint keeps its language model (TEXT_PREFIXES): a Gemma 3 checkpoint may be multimodal."""
    if cfg.gemma:
        for prefix in TEXT_PREFIXES:
            if prefix + "embed_tokens.weight" in files:
                return prefix
    return "model."


def _check_tensors(cfg: ModelConfig, files: dict[str, SafetensorsFile], searched: str, prefix: str) -> list[str]:
    """Every problem with the checkpoint's tensors, as messages naming file and tensor."""
    layout = _layout(cfg, prefix)
    problems = []
    for entry in layout:
        f = files.get(entry.hf_name)
        if f is None:
            problems.append(f"tensor {entry.hf_name!r} is missing (searched {searched})")
            continue
        info = f.tensors[entry.hf_name]
        if info.shape != entry.hf_shape:
            problems.append(f"{f.path}: tensor {entry.hf_name!r} has shape {list(info.shape)}, but "
                            f"config.json implies {list(entry.hf_shape)}")
        elif info.dtype not in _FLOAT_DTYPES and info.dtype.name != "bfloat16":
            problems.append(f"{f.path}: tensor {entry.hf_name!r} has dtype {info.dtype}, expected a float type")
        elif entry.kind == "zero" and np.any(f.get(entry.hf_name)):
            problems.append(f"{f.path}: tensor {entry.hf_name!r} is nonzero, but this model has no such "
                            "parameter (only all-zero values can be dropped exactly)")
    known = {entry.hf_name for entry in layout}
    for name in sorted(set(files) - known):
        if _HARMLESS.match(name) or (prefix != "model." and _VISION.match(name)):
            continue  # the multimodal Gemma 3's vision tower is not part of the language model
        embed_name = prefix + "embed_tokens.weight"
        if name == _head_name(prefix) and cfg.tie_embeddings and embed_name in files:
            # Some tied checkpoints store the head anyway; harmless only if it really is the embedding.
            head, embed = files[name].get(name), files[embed_name].get(embed_name)
            if head.shape == embed.shape and np.array_equal(head, embed):
                continue
            problems.append(f"{files[name].path}: tensor {name!r} differs from the embedding, but "
                            "config.json says tie_word_embeddings=true")
            continue
        problems.append(f"{files[name].path}: unexpected tensor {name!r} (not part of a {cfg.architecture} "
                        "model with this config.json)")
    return problems


def load_hf_model(path: str | os.PathLike, dtype: str | None = None, param_dtype: str | None = None,
                  remat: bool = False, mesh=None, rules: dict | None = None) -> tuple[Transformer, Tokenizer | None]:
    """Load a Qwen2/Llama/Qwen3/Gemma 3 safetensors checkpoint directory; the tokenizer too when tokenizer.json exists.

    dtype (compute) / param_dtype (the weights held) default to the checkpoint's dtype (bfloat16 stays
    bfloat16, anything else float32); training wants param_dtype float32 whatever the checkpoint holds, since
    bfloat16 master weights round most small updates away. remat: recompute each layer in the backward pass.
    With a jax Mesh, each parameter goes straight to its sharded layout (sharding.spec_for with `rules`,
    default sharding.DEFAULT_RULES), so no single device ever holds the whole model.
    Raises CheckpointError, naming file and tensor, for anything unusable; nothing is built before all
    checks pass.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    cfg = checkpoint_config(path)
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value is not None and value not in DTYPES:
            raise ValueError(f"{name}={value!r}: allowed {sorted(DTYPES)}")
    cfg = dataclasses.replace(cfg, dtype=dtype or cfg.dtype, param_dtype=param_dtype or cfg.param_dtype,
                              remat=remat)

    files, searched = _open_weights(path)
    prefix = _text_prefix(cfg, files)
    problems = _check_tensors(cfg, files, searched, prefix)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"{path}: checkpoint does not match {path / CONFIG_FILE}:\n  " + "\n  ".join(shown))

    tokenizer = None
    if (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_dir(path)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(f"{path / 'tokenizer.json'}: tokenizer has {tokenizer.vocab_size} tokens, more "
                                  f"than the model's vocab_size {cfg.vocab_size} in {path / CONFIG_FILE}")

    # Build an abstract model (shapes only, no random init) and fill each parameter from the checkpoint.
    model = abstract_model(cfg)
    by_name: dict[str, list[_Entry]] = {}
    for entry in _layout(cfg, prefix):
        if entry.ours is not None:
            by_name.setdefault(entry.ours, []).append(entry)
    target = np.dtype(DTYPES[cfg.param_dtype])
    if mesh is not None:
        from grpo_jax.parallel.sharding import DEFAULT_RULES, spec_for
        rules = DEFAULT_RULES if rules is None else rules
    for path_tuple, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        name = ".".join(str(k) for k in path_tuple)
        entries = by_name[name]
        shape = var.get_value().shape
        # One host copy per tensor (transpose + dtype cast), then straight to its device(s); experts stacked.
        if entries[0].expert is None:
            array = _to_ours(entries[0], files[entries[0].hf_name].get(entries[0].hf_name), shape).astype(target)
        else:
            array = np.empty(shape, target)
            for entry in entries:
                array[entry.expert] = _to_ours(entry, files[entry.hf_name].get(entry.hf_name), shape[1:])
        if mesh is None:
            var.set_value(jnp.asarray(array))
        else:
            spec = spec_for(var.get_metadata()["axes"], shape, mesh, rules)
            var.set_value(jax.device_put(array, jax.sharding.NamedSharding(mesh, spec)))
    return model, tokenizer


# ---- saving -------------------------------------------------------------------------------------------


def save_hf_model(model: Transformer, path: str | os.PathLike, tokenizer: Tokenizer | None = None,
                  max_shard_bytes: int | None = None, dtype: str | None = None,
                  fetch: Callable[[jax.Array], np.ndarray] = jax.device_get, write: bool = True) -> None:
    """Write a checkpoint that transformers' AutoModelForCausalLM.from_pretrained (and load_hf_model) reads.

    Weights are written in `dtype` ("float32" or "bfloat16"; None: the model's param_dtype, rounded to
    nearest when narrowing), and config.json names that dtype. With max_shard_bytes they are split into
    model-0000i-of-0000n.safetensors + model.safetensors.index.json (a single shard is written as
    model.safetensors). Old weight files in the directory are removed first so they cannot be mixed in.
    config.json is written last: a directory without it is an export cut short.

    `fetch` brings one weight to the host; the weights are fetched one at a time, in a fixed order, so host
    memory holds one shard. Weights sharded over several processes: every process calls this with a fetch
    that all of them must join (a gather), and all but the writing one pass write=False (fetch only).
    """
    dtype = dtype or model.config.param_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed {sorted(DTYPES)}")
    cfg = dataclasses.replace(model.config, param_dtype=dtype)  # config.json names the dtype written
    path = Path(path)
    if write:
        path.mkdir(parents=True, exist_ok=True)
        for old in [path / WEIGHTS_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
            old.unlink(missing_ok=True)

    params = param_dict(model)
    itemsize = np.dtype(DTYPES[cfg.param_dtype]).itemsize
    layout = _layout(cfg)
    shards, current, current_bytes = [], [], 0
    for entry in layout:  # greedy packing in layout order; a tensor bigger than the limit gets its own shard
        nbytes = int(np.prod(entry.hf_shape)) * itemsize
        if max_shard_bytes and current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(entry)
        current_bytes += nbytes
    shards.append(current)

    stacked: dict[str, np.ndarray] = {}  # the experts tensor being written, fetched once for all its experts

    def hf_array(entry: _Entry) -> np.ndarray:
        if entry.ours is None:
            return np.zeros(entry.hf_shape, DTYPES[cfg.param_dtype])
        # One tensor at a time so host memory holds one shard, not the whole model twice.
        if entry.expert is None:
            array = fetch(params[entry.ours])
        else:
            if entry.ours not in stacked:
                stacked.clear()
                stacked[entry.ours] = fetch(params[entry.ours])
            array = stacked[entry.ours][entry.expert]
        return _to_hf(entry, np.asarray(array).astype(DTYPES[cfg.param_dtype], copy=False))

    names = [WEIGHTS_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file_name, entries in zip(names, shards):
        tensors = {e.hf_name: hf_array(e) for e in entries}
        if not write:
            continue
        save_file(tensors, path / file_name)
        for e in entries:
            weight_map[e.hf_name] = file_name
            total += tensors[e.hf_name].nbytes
    if not write:
        return
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")

    hf_cfg = model_config_to_hf_config(cfg)
    generation = {}
    if tokenizer is not None:
        tokenizer.save(path)
        eos = list(tokenizer.eos_ids)
        try:
            pad = tokenizer.pad_id
        except ValueError:  # neither pad nor eos: leave pad_token_id unset
            pad = None
        generation = {"eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
                      "pad_token_id": pad, "bos_token_id": tokenizer.bos_id}
        generation = {k: v for k, v in generation.items() if v is not None}
        hf_cfg.update(generation)
    (path / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
