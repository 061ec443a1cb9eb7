"""GGUF files (llama.cpp's format) -> a Hugging Face checkpoint directory that `load_hf_model` reads like any other
(`grpo-jax import-gguf FILE OUTDIR`, then `model_path: OUTDIR`).

What is written: the weights dequantized to bfloat16 (rounded to nearest) in model.safetensors (or shards plus
model.safetensors.index.json), under the tensor names of transformers' LlamaForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM (model.hf's layout); config.json (hf.model_config_to_hf_config of the ModelConfig the file's
`{arch}.*` metadata describes, plus the special token ids); tokenizer.json (a `tokenizers` byte-level BPE built from
`tokenizer.ggml.*`); tokenizer_config.json (the special tokens and `tokenizer.chat_template`); generation_config.json.

Everything is checked before anything is written (architecture, every tensor's presence, shape and type, the
tokenizer's kind), so a file that cannot be read is one `GgufImportError` naming the file, the architecture or the
tensor and its type, and what is supported. The directory is written under a temporary name beside OUTDIR and renamed
at the end: an import cut short leaves no half checkpoint under OUTDIR.

Weights. llama.cpp's converter stores the query and key projections of `llama` models with each head's rows
interleaved for its RoPE kernel (rows (half, i) -> (i, half)); `unpermute_rope_rows` undoes it, per head (key: per
key-value head). `qwen2` and `qwen3` files are stored unpermuted. The `gguf` package dequantizes every type it knows
(gguf.quants.dequantize); the others are refused. One shard's bfloat16 tensors are held at a time.

Tokenizer. Only `tokenizer.ggml.model` gpt2 (byte-level BPE) is read: the vocabulary as the file lists it (ids kept),
its merges, control and unknown tokens as special added tokens, user-defined ones as plain added tokens (matched
whole in any text, as llama.cpp matches them), and a pre-tokenizer chosen by `tokenizer.ggml.pre`, the split llama.cpp
applies for that name (PRE_TOKENIZERS). SmolLM2's `smollm` splits every digit (every number character) off first,
as its own tokenizer.json does (Digits, then ByteLevel); transformers' GGUF loader (5.x) ignores that name and splits
with GPT-2's pattern only, so wherever whitespace comes before a number (`"\\n\\n1"`, `" ¾"`) its ids differ: there
this importer follows the model.
An added token whose text is outside the byte alphabet is kept under its own id (transformers skips such control
tokens). Normal tokens outside the byte alphabet are respelled into it, as transformers does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
import shutil
import time
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from grpo_jax.data.tokenizer import GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from grpo_jax.errors import CheckpointError
from grpo_jax.model.hf import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    checkpoint_config,
    hf_config_to_model_config,
    model_config_to_hf_config,
)
from grpo_jax.model.safetensors_io import save_file
from grpo_jax.model.transformer import ModelConfig

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "GgufImport", "GgufImportError", "PRE_TOKENIZERS", "import_gguf",
           "unpermute_rope_rows"]

INSTALL_HINT = "pip install 'grpo_jax[gguf]' (or pip install gguf)"
DEFAULT_MAX_SHARD_BYTES = 2 << 30  # host memory holds one shard's bfloat16 tensors
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values read; each is also its config model_type
TOKENIZER_MODELS = ("gpt2",)

# {arch}.<key> -> config.json field, as llama.cpp's converter writes them from config.json.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_REQUIRED_KEYS = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one family of `tokenizer.ggml.pre` names."""

    split: str  # the regex (GPT2_SPLIT: the ByteLevel pre-tokenizer's own)
    digits: bool = False  # every digit split off first
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is that token
    clean_up_spaces: bool = True  # llama.cpp's clean_spaces when decoding

    def build(self) -> pre_tokenizers.PreTokenizer:
        if self.split == GPT2_SPLIT:
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
            if self.digits:
                return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            return byte_level
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(self.split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


_GPT2 = PreTokenizer(GPT2_SPLIT)
_DIGITS_GPT2 = PreTokenizer(GPT2_SPLIT, digits=True, clean_up_spaces=False)
_QWEN2 = PreTokenizer(QWEN2_SPLIT, clean_up_spaces=False)
_LLAMA3 = PreTokenizer(LLAMA3_SPLIT, ignore_merges=True)
# tokenizer.ggml.pre -> its split (llama.cpp's llama-vocab.cpp); any other name is refused, not guessed.
PRE_TOKENIZERS = {
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2, "codeshell": _DIGITS_GPT2,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3,
}


class GgufImportError(CheckpointError):
    """A GGUF file (or an output directory) import-gguf cannot use; the message names the file, the architecture or
    the tensor and its type, and what is supported."""


@dataclasses.dataclass(frozen=True)
class GgufImport:
    """What import_gguf wrote."""

    out_dir: Path
    architecture: str
    model_config: ModelConfig
    parameters: int
    source_types: dict[str, int]  # GGUF tensor type name -> tensors of that type in the file
    weight_files: tuple[str, ...]
    seconds: float


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's query/key row order for `heads` heads: its converter stores row (half, i) of each head (half
    0/1 of the rotary pairs, i < head_dim / 2) at (i, half). Rows are the first axis (a weight [heads * head_dim, in]
    or a bias [heads * head_dim])."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of an even head_dim")
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# ---- reading the file -----------------------------------------------------------------------------------


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise GgufImportError(f"import-gguf needs the gguf package, which is not installed ({e}): {INSTALL_HINT}") \
            from None
    return gguf


@functools.cache
def _dequantizable() -> tuple[str, ...]:
    """The tensor types the installed gguf package dequantizes (each tried on one block of zeros)."""
    gguf = _gguf()
    names = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(qtype.name)
    return tuple(names)


def _metadata(reader) -> dict:
    """Every metadata key with its value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _open(path: Path):
    gguf = _gguf()
    if not path.is_file():
        raise GgufImportError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
        metadata = _metadata(reader)
    except (OSError, ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise GgufImportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return reader, metadata


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (float32 1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


# ---- config ---------------------------------------------------------------------------------------------


def _model_config(path: Path, metadata: dict, tensor_names: set[str], embed_rows: int | None) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufImportError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    missing = [f"{arch}.{key}" for key in _REQUIRED_KEYS if f"{arch}.{key}" not in metadata]
    if missing:
        raise GgufImportError(f"{path}: metadata {', '.join(missing)} missing (a {arch} GGUF file states them)")
    cfg: dict = {"model_type": arch, "dtype": "bfloat16", "hidden_act": "silu"}
    for key, field in CONFIG_KEYS.items():
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            continue
        if isinstance(value, list):  # per-layer values (some architectures): not these
            raise GgufImportError(f"{path}: metadata {arch}.{key} is a list {value[:4]}...; only one value for "
                                  "every layer is supported")
        cfg[field] = _float(value) if isinstance(value, float) else value
    cfg.setdefault("vocab_size", embed_rows if embed_rows is not None else len(metadata.get("tokenizer.ggml.tokens",
                                                                                            ())))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else 0)
    value_length = metadata.get(f"{arch}.attention.value_length")
    if value_length is not None and value_length != head_dim:
        raise GgufImportError(f"{path}: {arch}.attention.value_length={value_length} differs from the key length "
                              f"{head_dim}; only equal query/key/value head sizes are supported")
    rotary = metadata.get(f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise GgufImportError(f"{path}: {arch}.rope.dimension_count={rotary} rotates part of each {head_dim}-wide "
                              "head; only RoPE over the whole head is supported")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _float(metadata[f"{arch}.rope.scaling.factor"])}
    elif scaling != "none":
        raise GgufImportError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported (supported: none, "
                              "linear)")
    if "rope_freqs.weight" in tensor_names:
        raise GgufImportError(f"{path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, as llama.cpp stores "
                              "Llama 3.1's scaling) is not supported; supported: rope.scaling.type none or linear")
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    return hf_config_to_model_config(cfg, f"{path} (its {arch}.* metadata)")


# ---- tensors --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Planned:
    gguf_name: str
    hf_name: str
    hf_shape: tuple[int, ...]
    rope_heads: int = 0  # llama.cpp's RoPE row order to undo over this many heads (0: stored as is)


def _plan(cfg: ModelConfig) -> list[_Planned]:
    """Every tensor of the file, where it goes in the checkpoint and the shape it must have there."""
    e, m, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    permuted = cfg.architecture == "llama"
    plan = [_Planned("token_embd.weight", "model.embed_tokens.weight", (v, e)),
            _Planned("output_norm.weight", "model.norm.weight", (e,))]
    if not cfg.tie_embeddings:
        plan.append(_Planned("output.weight", "lm_head.weight", (v, e)))
    for i in range(cfg.num_layers):
        g, p = f"blk.{i}.", f"model.layers.{i}."
        plan += [
            _Planned(g + "attn_norm.weight", p + "input_layernorm.weight", (e,)),
            _Planned(g + "ffn_norm.weight", p + "post_attention_layernorm.weight", (e,)),
            _Planned(g + "attn_q.weight", p + "self_attn.q_proj.weight", (h * d, e), h if permuted else 0),
            _Planned(g + "attn_k.weight", p + "self_attn.k_proj.weight", (kv * d, e), kv if permuted else 0),
            _Planned(g + "attn_v.weight", p + "self_attn.v_proj.weight", (kv * d, e)),
            _Planned(g + "attn_output.weight", p + "self_attn.o_proj.weight", (e, h * d)),
            _Planned(g + "ffn_gate.weight", p + "mlp.gate_proj.weight", (m, e)),
            _Planned(g + "ffn_up.weight", p + "mlp.up_proj.weight", (m, e)),
            _Planned(g + "ffn_down.weight", p + "mlp.down_proj.weight", (e, m)),
        ]
        if cfg.qkv_bias:
            plan += [_Planned(g + f"attn_{x}.bias", p + f"self_attn.{x}_proj.bias", (n * d,))
                     for x, n in (("q", h), ("k", kv), ("v", kv))]
        if cfg.qk_norm:
            plan += [_Planned(g + "attn_q_norm.weight", p + "self_attn.q_norm.weight", (d,)),
                     _Planned(g + "attn_k_norm.weight", p + "self_attn.k_norm.weight", (d,))]
    return plan


def _check_tensors(path: Path, cfg: ModelConfig, plan: list[_Planned], tensors: dict) -> None:
    """Refuse, before any is read, a file whose tensors are not exactly the plan's in shape and readable type."""
    where = f"{path} ({cfg.architecture})"
    expected = {p.gguf_name for p in plan}
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise GgufImportError(f"{where}: unexpected tensor {unexpected[0]!r}{more}: not part of a {cfg.architecture} "
                              "model as this importer reads it (no biases except qwen2's q/k/v, no extra tensors)")
    missing = [p.gguf_name for p in plan if p.gguf_name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GgufImportError(f"{where}: tensor {missing[0]!r}{more} is missing")
    for p in plan:
        tensor = tensors[p.gguf_name]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if shape != p.hf_shape:
            raise GgufImportError(f"{where}: tensor {p.gguf_name!r} has shape {list(shape)}, but the metadata implies "
                                  f"{list(p.hf_shape)}")
    readable = _dequantizable()
    unreadable = [(p.gguf_name, tensors[p.gguf_name].tensor_type.name) for p in plan
                  if tensors[p.gguf_name].tensor_type.name not in readable]
    if unreadable:
        name, kind = unreadable[0]
        more = f" (and {len(unreadable) - 1} more tensors)" if len(unreadable) > 1 else ""
        raise GgufImportError(f"{where}: tensor {name!r} is of type {kind}{more}, which the gguf package cannot "
                              f"dequantize; supported: {', '.join(readable)}")


def _bfloat16(tensor, planned: _Planned) -> np.ndarray:
    weights = _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
    weights = np.asarray(weights, np.float32).reshape(planned.hf_shape)
    if planned.rope_heads:
        weights = unpermute_rope_rows(weights, planned.rope_heads)
    return weights.astype(ml_dtypes.bfloat16)


def _shards(plan: list[_Planned], max_shard_bytes: int) -> list[list[_Planned]]:
    """Greedy packing in file order; a tensor bigger than the limit gets a shard of its own."""
    shards, current, size = [], [], 0
    for p in plan:
        nbytes = math.prod(p.hf_shape) * 2
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    shards.append(current)
    return shards


def _write_weights(out: Path, plan: list[_Planned], tensors: dict, max_shard_bytes: int) -> list[str]:
    shards = _shards(plan, max_shard_bytes)
    names = [WEIGHTS_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file_name, shard in zip(names, shards):
        arrays = {p.hf_name: _bfloat16(tensors[p.gguf_name], p) for p in shard}
        save_file(arrays, out / file_name)
        for p in shard:
            weight_map[p.hf_name] = file_name
            total += arrays[p.hf_name].nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return names


# ---- tokenizer ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TokenizerFiles:
    tokenizer: tokenizers.Tokenizer
    config: dict  # tokenizer_config.json
    special_ids: dict[str, int]  # bos_token_id / eos_token_id / pad_token_id present in the file
    stop_ids: tuple[int, ...]  # eos first, then end-of-turn / end-of-message


def _tokenizer_files(path: Path, metadata: dict, vocab_rows: int) -> _TokenizerFiles:
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise GgufImportError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, byte-level "
                              "BPE; 'llama' is sentencepiece)")
    pre_name = metadata.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise GgufImportError(f"{path}: tokenizer.ggml.pre {pre_name!r} is not supported (supported: "
                              f"{', '.join(PRE_TOKENIZERS)})")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GgufImportError(f"{path}: a gpt2 tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
    if len(tokens) > vocab_rows:
        raise GgufImportError(f"{path}: {len(tokens)} tokens, more than the {vocab_rows} rows of token_embd.weight")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GgufImportError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # text -> the byte alphabet
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (CONTROL, USER_DEFINED, UNKNOWN) and not set(token) <= alphabet:
            pieces = spell.pre_tokenize_str(token)  # a normal token spelled in plain text
            token = pieces[0][0] if pieces else token
        if token in vocab:
            raise GgufImportError(f"{path}: tokens {vocab[token]} and {token_id} are both {token!r}")
        vocab[token] = token_id
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise GgufImportError(f"{path}: tokenizer.ggml.merges[{rank}] = {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                              ignore_merges=pre.ignore_merges))
    except Exception as e:  # the Rust library raises plain Exception (a merge naming an unknown token)
        raise GgufImportError(f"{path}: the tokenizer's vocabulary and merges do not agree ({e})") from None
    tok.pre_tokenizer = pre.build()
    tok.decoder = decoders.ByteLevel()

    # Added tokens keep their ids: each is in the vocabulary under its own text.
    special = [t for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)]
    plain = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    for t in special + plain:
        if tok.token_to_id(t) != vocab[t]:
            raise GgufImportError(f"{path}: added token {t!r} did not keep its id {vocab[t]}")

    def token_of(key: str) -> tuple[int, str] | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise GgufImportError(f"{path}: tokenizer.ggml.{key}={token_id} is not a token id (0..{len(tokens) - 1})")
        return token_id, tokens[token_id]

    named = {role: token_of(key) for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                                    ("pad", "padding_token_id"), ("unk", "unknown_token_id"))}
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    for flag, role in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and named[role] is None:
            raise GgufImportError(f"{path}: tokenizer.ggml.add_{role}_token is set but there is no "
                                  f"tokenizer.ggml.{role}_token_id")
    if add_bos or add_eos:  # what tokenizer(text) puts around a text, as transformers' post-processor does
        bos, eos = named["bos"], named["eos"]

        def around(text: str, segment: int) -> str:
            return " ".join(([f"{bos[1]}:{segment}"] if add_bos else []) + [f"{text}:{segment}"]
                            + ([f"{eos[1]}:{segment}"] if add_eos else []))

        used = dict(([bos] if add_bos else []) + ([eos] if add_eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=around("$A", 0), pair=around("$A", 0) + " " + around("$B", 1),
            special_tokens=[(text, token_id) for token_id, text in used.items()])

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": pre.clean_up_spaces,
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        **{f"{role}_token": value[1] for role, value in named.items() if value is not None},
        "model_max_length": int(metadata.get(f"{metadata['general.architecture']}.context_length", 1 << 30)),
    }
    template = metadata.get("tokenizer.chat_template")
    named_templates = {key.removeprefix("tokenizer.chat_template."): value for key, value in metadata.items()
                       if key.startswith("tokenizer.chat_template.") and isinstance(value, str)}
    if named_templates:
        config["chat_template"] = ([{"name": "default", "template": template}] if template else []) + \
            [{"name": name, "template": value} for name, value in named_templates.items()]
    elif template is not None:
        config["chat_template"] = template
    stop = [named["eos"][0]] if named["eos"] else []
    for key in ("eot_token_id", "eom_token_id"):
        found = token_of(key)
        if found is not None and found[0] not in stop:
            stop.append(found[0])
    ids = {f"{role}_token_id": value[0] for role, value in named.items() if value is not None and role != "unk"}
    return _TokenizerFiles(tok, config, ids, tuple(stop))


# ---- the whole import -----------------------------------------------------------------------------------


def _prepare_out_dir(out_dir: Path) -> Path:
    """A fresh temporary directory beside out_dir (renamed onto it at the end); out_dir must not hold anything."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise GgufImportError(f"{out_dir}: exists and is not an empty directory; remove it or choose another output "
                              "directory")
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out_dir.name}.import-{secrets.token_hex(4)}"
        tmp.mkdir()  # the mode any directory made here gets (mkdtemp's is 0700)
        return tmp
    except OSError as e:
        raise GgufImportError(f"{out_dir}: cannot be created ({e.strerror})") from None


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> GgufImport:
    """Write the checkpoint directory `out_dir` (which must not exist, or be empty) from the GGUF file `path`
    (module docstring). Raises GgufImportError, before writing anything, for a file it cannot read."""
    start = time.perf_counter()
    path, out_dir = Path(path), Path(out_dir)
    reader, metadata = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    embed_rows = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None
    cfg = _model_config(path, metadata, set(tensors), embed_rows)
    plan = _plan(cfg)
    _check_tensors(path, cfg, plan, tensors)
    files = _tokenizer_files(path, metadata, cfg.vocab_size)

    tmp = _prepare_out_dir(out_dir)
    try:
        weight_files = _write_weights(tmp, plan, tensors, max_shard_bytes)
        files.tokenizer.save(str(tmp / TOKENIZER_FILE))
        (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(files.config, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
        stop = list(files.stop_ids)
        generation = {**files.special_ids, "eos_token_id": (stop[0] if len(stop) == 1 else stop) if stop else None}
        generation = {k: v for k, v in generation.items() if v is not None}
        (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
        hf_config = {**model_config_to_hf_config(cfg), **generation}
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")  # last, as in hf
        # What load_hf_model reads first; a mismatch here is this importer's bug, found before the rename.
        if checkpoint_config(tmp) != cfg:
            raise AssertionError(f"{tmp / CONFIG_FILE} does not read back as the config it was written from")
        Tokenizer.from_dir(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above): the rename takes its place
        os.replace(tmp, out_dir)
    except OSError as e:  # a full disk, a directory not writable: nothing is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise GgufImportError(f"{out_dir}: cannot be written ({e}); nothing was written there") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    source_types = Counter(tensors[p.gguf_name].tensor_type.name for p in plan)
    return GgufImport(out_dir=out_dir, architecture=cfg.architecture, model_config=cfg,
                      parameters=sum(math.prod(p.hf_shape) for p in plan), source_types=dict(source_types),
                      weight_files=tuple(weight_files), seconds=time.perf_counter() - start)
