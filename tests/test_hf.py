"""Hugging Face checkpoint parity: tiny random Qwen2/Llama/Qwen3/Qwen3-MoE/Gemma 3 models built with transformers
(torch, CPU, float32) must give the same logits and greedy continuations after load_hf_model, and survive save_hf_model.
Bad checkpoints must fail with a CheckpointError naming the file and tensor."""

import dataclasses
import json
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from flax import nnx

from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.errors import CheckpointError
from grpo_jax.model.hf import (
    architecture_conflicts,
    checkpoint_config,
    hf_config_to_model_config,
    load_hf_model,
    model_config_to_hf_config,
    save_hf_model,
)
from grpo_jax.model.safetensors_io import SafetensorsFile, load_file, save_file
from grpo_jax.model.transformer import ModelConfig, abstract_model, create_model, param_dict, positions_from_mask

torch.set_num_threads(2)
transformers.logging.set_verbosity_error()

VOCAB = 300  # the byte-level tokenizer has 259 tokens; real models also pad their vocab beyond the tokenizer
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
GEMMA3 = dict(head_dim=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
              query_pre_attn_scalar=24, rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
SPECS = {
    "qwen2_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=10000.0), None),
    # Sharded on save, so the index path is exercised on load.
    "qwen2_untied": (transformers.Qwen2Config, dict(tie_word_embeddings=False), "60KB"),
    "llama3": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_theta=500000.0,
                                              rope_scaling=dict(LLAMA3_ROPE)), None),  # it mutates it
    # Per-head RMSNorm on queries and keys, no q/k/v bias, head_dim (32) other than hidden / heads (16).
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0), None),
    # A local layer (a window of 4: the prompts of 9 and the 16 greedy tokens run past it) and a global one, each
    # with its RoPE (linear scaling on the global only), query/key norms, attention scaled by 24^-1/2.
    "gemma3": (transformers.Gemma3TextConfig, GEMMA3, None),
    # 8 experts, 2 per token renormalised, in layer 0; layer 1 keeps a dense MLP (mlp_only_layers).
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=32, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1],
                                                    tie_word_embeddings=False), None),
}
NEW_TOKENS = 16


def _randomize(model: torch.nn.Module, seed: int):
    """transformers initializes biases to 0 and norms to 1; random values catch any mix-up in the mapping."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))  # spread logits: no near-ties in greedy
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (torch model, checkpoint dir)}, each built and saved once per module."""
    out = {}
    for seed, (name, (config_cls, extra, shard)) in enumerate(SPECS.items()):
        torch.manual_seed(seed)
        config = config_cls(**SMALL, **extra)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        _randomize(model, seed)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
        Tokenizer.byte_level().save(path)
        out[name] = (model, path)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {name: load_hf_model(path) for name, (_, path) in checkpoints.items()}


def _batch(side: str):
    """Three prompts of different lengths, padded on `side`, with the attention mask."""
    rng = np.random.default_rng(0)
    lengths = [9, 5, 2]
    width = max(lengths)
    tokens = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), bool)
    for i, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        tokens[i, cols] = rng.integers(0, VOCAB, n)
        mask[i, cols] = True
    return tokens, mask


@nnx.jit
def _forward(model, tokens, mask):
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    return logits


def _forward_fn(model):
    """Jitted logits; module-level so that each architecture and shape compiles once for the whole file."""
    return lambda tokens, mask: np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(mask)))


def _torch_logits(model, tokens, mask):
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                     position_ids=torch.from_numpy(positions)).logits.numpy()


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_match_transformers(checkpoints, loaded, name, side):
    torch_model, _ = checkpoints[name]
    model, _ = loaded[name]
    tokens, mask = _batch(side)
    ours = _forward_fn(model)(tokens, mask)
    ref = _torch_logits(torch_model, tokens, mask)
    assert np.abs(ours - ref)[mask].max() <= 1e-4


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_continuation_matches_generate(checkpoints, loaded, name):
    torch_model, _ = checkpoints[name]
    model, _ = loaded[name]
    prompt, prompt_mask = _batch("left")
    with torch.no_grad():
        ref = torch_model.generate(
            input_ids=torch.from_numpy(prompt), attention_mask=torch.from_numpy(prompt_mask.astype(np.int64)),
            generation_config=transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                                                            eos_token_id=None, pad_token_id=0)).numpy()
    # Greedy with full forward passes over a fixed-size buffer, so the jitted forward compiles once.
    b, p = prompt.shape
    tokens = np.concatenate([prompt, np.zeros((b, NEW_TOKENS), np.int64)], axis=1)
    mask = np.concatenate([prompt_mask, np.zeros((b, NEW_TOKENS), bool)], axis=1)
    forward = _forward_fn(model)
    for t in range(NEW_TOKENS):
        logits = forward(tokens, mask)
        tokens[:, p + t] = logits[:, p + t - 1].argmax(-1)
        mask[:, p + t] = True
    np.testing.assert_array_equal(tokens[:, p:], ref[:, p:])


def test_loaded_config_and_tokenizer(loaded):
    model, tok = loaded["llama3"]
    assert model.config.rope_scaling == LLAMA3_ROPE and model.config.rope_theta == 500000.0
    assert not model.config.qkv_bias and model.config.architecture == "llama"
    assert loaded["qwen2_tied"][0].config.tie_embeddings and loaded["qwen2_tied"][0].lm_head is None
    assert loaded["qwen2_untied"][0].config.qkv_bias
    qwen3 = loaded["qwen3"][0]
    assert qwen3.config.architecture == "qwen3" and qwen3.config.qk_norm and not qwen3.config.qkv_bias
    assert qwen3.config.resolved_head_dim == 32 and qwen3.layers[0].attn.q_norm.weight.get_value().shape == (32,)
    assert tok.eos_ids == Tokenizer.byte_level().eos_ids and tok.vocab_size == 259
    moe = loaded["qwen3_moe"][0]
    assert moe.config.moe_layers == (0,) and moe.config.norm_topk_prob and moe.config.qk_norm
    assert moe.layers[0].mlp.gate.get_value().shape == (8, 64, 48) and moe.layers[1].mlp.gate.get_value().shape == (
        64, 128)
    gemma = loaded["gemma3"][0].config
    assert gemma.architecture == "gemma3" and gemma.tie_embeddings and gemma.qk_norm
    assert gemma.layer_types == ("sliding_attention", "full_attention") and gemma.sliding_window == 4
    assert (gemma.rope_theta, gemma.rope_scaling, gemma.rope_local_theta) == \
        (1e6, {"rope_type": "linear", "factor": 2.0}, 1e4)
    assert gemma.query_pre_attn_scalar == 24 and gemma.resolved_head_dim == 32


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Gemma 3 from 4B up is published as Gemma3ForConditionalGeneration: its text_config (only what differs from
    Gemma3TextConfig's defaults) and its language model's tensors load, the vision tower's are left."""
    text = dict(SMALL, **GEMMA3)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        text.pop(key)
    config = transformers.Gemma3Config(text_config=text, mm_tokens_per_image=4, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    _randomize(hf, 7)
    hf.save_pretrained(tmp_path)
    names = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("vision_tower.") for n in names)
    text_config = json.loads((tmp_path / "config.json").read_text())["text_config"]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "query_pre_attn_scalar"):
        assert key in text_config
    model, _ = load_hf_model(tmp_path)
    assert model.config == dataclasses.replace(checkpoint_config(tmp_path))
    tokens, mask = _batch("right")
    assert np.abs(_torch_logits(hf, tokens, mask) - _forward_fn(model)(tokens, mask))[mask].max() <= 1e-4
    # Only what differs from the defaults (as Google's config.json files are written) fills in the rest.
    sparse = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": {
        "hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text", "num_attention_heads": 16,
        "num_hidden_layers": 48, "num_key_value_heads": 8, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}, "torch_dtype": "bfloat16"}
    gemma_12b = hf_config_to_model_config(sparse)
    assert (gemma_12b.vocab_size, gemma_12b.resolved_head_dim, gemma_12b.query_pre_attn_scalar) == (262208, 256, 256)
    assert gemma_12b.layer_types.count("full_attention") == 8 and gemma_12b.layer_types[5] == "full_attention"
    assert gemma_12b.rope_local_theta == 1e4 and gemma_12b.dtype == "bfloat16" and gemma_12b.tie_embeddings


@pytest.mark.parametrize("name", ["qwen2_tied", "llama3", "qwen3", "gemma3", "qwen3_moe"])
def test_export_loads_in_transformers(loaded, tmp_path, name):
    model, tok = loaded[name]
    save_hf_model(model, tmp_path, tokenizer=tok)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.dtype == torch.float32
    tokens, mask = _batch("right")
    ours = _forward_fn(model)(tokens, mask)
    assert np.abs(_torch_logits(reloaded, tokens, mask) - ours)[mask].max() <= 1e-4
    assert reloaded.generation_config.eos_token_id == list(tok.eos_ids)
    again, tok2 = load_hf_model(tmp_path)
    assert again.config == model.config
    assert tok2.eos_ids == tok.eos_ids and tok2.pad_id == tok.pad_id


def test_export_sharded_and_bfloat16(loaded, tmp_path):
    model, tok = loaded["qwen2_untied"]
    save_hf_model(model, tmp_path / "f32", tokenizer=tok, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "f32" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "f32" / "model.safetensors").exists()
    again, _ = load_hf_model(tmp_path / "f32")
    for key, value in param_dict(model).items():
        np.testing.assert_array_equal(np.asarray(param_dict(again)[key]), np.asarray(value))

    half, _ = load_hf_model(tmp_path / "f32", param_dtype="bfloat16", dtype="bfloat16")
    assert half.embed.get_value().dtype == jnp.bfloat16
    save_hf_model(half, tmp_path / "bf16")  # single file; replaces nothing, no tokenizer
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf.dtype == torch.bfloat16
    back, tok3 = load_hf_model(tmp_path / "bf16")
    assert tok3 is None and back.config.param_dtype == "bfloat16"


def test_export_fetches_each_weight_once_in_the_same_order_and_writes_only_when_asked(loaded, tmp_path):
    # As on several processes: every process fetches (a gather all must join), only one writes.
    model, tok = loaded["qwen2_untied"]
    orders = []
    for write in (True, False):
        fetched = []
        def fetch(x):
            fetched.append(x.shape)
            return jax.device_get(x)
        save_hf_model(model, tmp_path / str(write), tokenizer=tok, max_shard_bytes=40_000, fetch=fetch, write=write)
        orders.append(fetched)
    assert orders[0] == orders[1] and len(orders[0]) == len(param_dict(model))
    assert not (tmp_path / "False").exists()
    again, _ = load_hf_model(tmp_path / "True")
    for key, value in param_dict(model).items():
        np.testing.assert_array_equal(np.asarray(param_dict(again)[key]), np.asarray(value))


def _weight_dtypes(path) -> set[str]:
    """The dtypes in every safetensors header of a checkpoint directory (e.g. {"BF16"})."""
    return {info["dtype"] for file in path.glob("*.safetensors")
            for name, info in _header(file).items() if name != "__metadata__"}


def test_save_dtype_argument_writes_that_dtype(loaded, tmp_path):
    model, tok = loaded["qwen2_untied"]  # float32 weights
    save_hf_model(model, tmp_path / "bf16", tokenizer=tok, max_shard_bytes=40_000, dtype="bfloat16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and _weight_dtypes(tmp_path / "bf16") == {"BF16"}
    half, _ = load_hf_model(tmp_path / "bf16")
    assert half.config.param_dtype == "bfloat16"
    for key, value in param_dict(model).items():  # rounded to nearest, as a cast on device would
        np.testing.assert_array_equal(np.asarray(param_dict(half)[key]),
                                      np.asarray(value).astype(ml_dtypes.bfloat16), err_msg=key)

    save_hf_model(half, tmp_path / "f32", dtype="float32")  # widening is exact
    config = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32" and _weight_dtypes(tmp_path / "f32") == {"F32"}
    wide, _ = load_hf_model(tmp_path / "f32")
    for key, value in param_dict(half).items():
        np.testing.assert_array_equal(np.asarray(param_dict(wide)[key]), np.asarray(value).astype(np.float32))
    with pytest.raises(ValueError, match=r"dtype='float16': allowed \['bfloat16', 'float32'\]"):
        save_hf_model(model, tmp_path / "f16", dtype="float16")


def test_bfloat16_checkpoint_trains_in_float32_with_bfloat16_compute(loaded, tmp_path):
    """A bfloat16 checkpoint loaded with param_dtype float32 holds float32 weights (its exact values) and
    computes in bfloat16: the layout the trainer wants for a Qwen2.5 or Llama 3 checkpoint."""
    model, tok = loaded["qwen2_tied"]
    save_hf_model(model, tmp_path, tokenizer=tok, dtype="bfloat16")
    assert checkpoint_config(tmp_path).param_dtype == "bfloat16"
    train, _ = load_hf_model(tmp_path, dtype="bfloat16", param_dtype="float32")
    assert (train.config.dtype, train.config.param_dtype) == ("bfloat16", "float32")
    for key, value in param_dict(train).items():
        assert value.dtype == jnp.float32, key
        expected = np.asarray(param_dict(model)[key]).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(value), expected, err_msg=key)
    tokens, mask = _batch("right")
    hidden, _ = nnx.jit(lambda m, t, k: m.hidden_states(t, positions_from_mask(k), k))(train, tokens, mask)
    assert hidden.dtype == jnp.bfloat16
    assert _forward_fn(train)(tokens, mask).dtype == np.float32  # logits accumulate in float32


def test_remat_is_honoured(checkpoints):
    path = checkpoints["qwen2_tied"][1]
    tokens = jnp.zeros((1, 4), jnp.int32)

    def gradient_program(model) -> str:
        graphdef, params = nnx.split(model)
        return str(jax.make_jaxpr(jax.grad(lambda p: nnx.merge(graphdef, p)(tokens)[0].sum()))(params))

    plain, _ = load_hf_model(path)
    remat, _ = load_hf_model(path, remat=True)
    assert remat.config.remat and not plain.config.remat
    # The backward pass recomputes each layer (jax.checkpoint shows as a remat equation) only when asked: once in
    # the scanned body of the repeating block, once per layer unrolled (scan_layers=auto on this CPU).
    scanned = create_model(dataclasses.replace(remat.config, scan_layers=True))
    assert gradient_program(scanned).count("remat") == remat.config.layer_period()
    assert gradient_program(remat).count("remat") == remat.config.num_layers > 1
    assert "remat" not in gradient_program(plain)


def test_architecture_conflicts_name_only_keys_set_to_other_values():
    checkpoint = ModelConfig(vocab_size=VOCAB, hidden_size=96, num_heads=6, num_kv_heads=2, qkv_bias=True)
    assert architecture_conflicts(ModelConfig(), checkpoint) == []  # defaults count as not set
    run = ModelConfig(dtype="bfloat16", param_dtype="bfloat16", remat=True, head_dim=16, vocab_size=VOCAB)
    assert architecture_conflicts(run, checkpoint) == []  # run settings; head_dim 16 is the implied one
    assert architecture_conflicts(ModelConfig(hidden_size=128, num_heads=6), checkpoint) == \
        ["hidden_size=128 (config.json: 96)"]


def _random_model(cfg: ModelConfig, seed: int = 0):
    """Random values into an abstract model: create_model's eager init takes seconds on CPU."""
    model = abstract_model(cfg)
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            var.set_value(jnp.asarray(0.3 * rng.standard_normal(var.get_value().shape), jnp.float32))
    return model


def test_qwen2_without_bias_exports_zero_bias(tmp_path):
    model = _random_model(ModelConfig(vocab_size=VOCAB, qkv_bias=False, architecture="qwen2"))
    save_hf_model(model, tmp_path)
    again, _ = load_hf_model(tmp_path)
    assert again.config.qkv_bias  # Qwen2 always has biases; here they are zeros, so the function is equal
    np.testing.assert_array_equal(np.asarray(again.layers[0].attn.q_bias.get_value()), 0)
    tokens, mask = _batch("right")
    np.testing.assert_allclose(_forward_fn(again)(tokens, mask), _forward_fn(model)(tokens, mask), atol=1e-5)


def test_llama_with_qkv_bias_exports_zero_o_bias(tmp_path):
    model = _random_model(ModelConfig(vocab_size=VOCAB, qkv_bias=True, architecture="llama"))
    save_hf_model(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.attention_bias
    tokens, mask = _batch("right")
    assert np.abs(_torch_logits(hf, tokens, mask) - _forward_fn(model)(tokens, mask))[mask].max() <= 1e-4
    # o_proj.bias has no place in our model: only all zeros can be dropped.
    file = tmp_path / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    tensors["model.layers.1.self_attn.o_proj.bias"][0] = 1.0
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.o_proj\.bias' is nonzero"
    ):
        load_hf_model(tmp_path)


def test_qwen3_with_attention_bias_exports_zero_o_bias_and_loads_in_transformers(tmp_path):
    model = _random_model(ModelConfig(vocab_size=VOCAB, qkv_bias=True, architecture="qwen3"))
    save_hf_model(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.attention_bias
    tokens, mask = _batch("right")
    assert np.abs(_torch_logits(hf, tokens, mask) - _forward_fn(model)(tokens, mask))[mask].max() <= 1e-4
    assert np.all(safetensors.numpy.load_file(tmp_path / "model.safetensors")[
        "model.layers.0.self_attn.o_proj.bias"] == 0)


# ---- config conversion ------------------------------------------------------------------------------------


def test_config_roundtrip_and_rope_formats():
    for cfg in (ModelConfig(vocab_size=VOCAB, qkv_bias=True, tie_embeddings=True, architecture="qwen2"),
                ModelConfig(vocab_size=VOCAB, rope_scaling=LLAMA3_ROPE, architecture="llama", rope_theta=5e5),
                ModelConfig(vocab_size=VOCAB, rope_scaling={"rope_type": "linear", "factor": 2.0},
                            architecture="llama", param_dtype="bfloat16", dtype="bfloat16"),
                ModelConfig(vocab_size=VOCAB, head_dim=32, architecture="qwen3"),
                ModelConfig(vocab_size=VOCAB, qkv_bias=True, architecture="qwen3"),
                ModelConfig(vocab_size=VOCAB, head_dim=32, architecture="gemma3", tie_embeddings=True,
                            layer_types=("sliding_attention", "full_attention"), sliding_window=8,
                            rope_local_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                            query_pre_attn_scalar=24),
                ModelConfig(vocab_size=VOCAB, architecture="gemma3", rope_local_theta=1e4, query_pre_attn_scalar=16)):
        assert hf_config_to_model_config(model_config_to_hf_config(cfg), "x") == cfg
    gemma = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": VOCAB,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4}
    # transformers 4: rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern (every 3rd global).
    v4 = hf_config_to_model_config({**gemma, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 8,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                    "sliding_window_pattern": 3})
    v5 = hf_config_to_model_config({**gemma, "sliding_window": 8, "layer_types": ["sliding_attention"] * 2 + [
        "full_attention"] + ["sliding_attention"] * 2 + ["full_attention"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert v4 == v5 and v4.layer_types[2] == "full_attention" and v4.rope_local_theta == 1e4
    for bad, match in (({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
                       ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
                       ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {
                           "rope_type": "linear", "factor": 2.0}}}, "sliding-window layers")):
        with pytest.raises(CheckpointError, match=rf"cfg.json.*{match}"):
            hf_config_to_model_config({**gemma, **bad}, "cfg.json")
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
    v4 = hf_config_to_model_config({**base, "rope_theta": 5e5, "rope_scaling": dict(LLAMA3_ROPE)})
    v5 = hf_config_to_model_config({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}})
    assert v4 == v5 and v4.rope_scaling == LLAMA3_ROPE and v4.num_kv_heads == 4
    default = hf_config_to_model_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert default.rope_scaling is None and default.dtype == "float32"
    assert hf_config_to_model_config({**base, "attention_bias": True}).qkv_bias
    with pytest.raises(CheckpointError, match=r"cfg.json.*'yarn'"):
        hf_config_to_model_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "cfg.json")
    with pytest.raises(CheckpointError, match=r"cfg.json.*num_kv_heads=3"):
        hf_config_to_model_config({**base, "num_key_value_heads": 3}, "cfg.json")
    with pytest.raises(CheckpointError, match=r"cfg.json.*hidden_size must be an integer"):
        hf_config_to_model_config({**base, "hidden_size": None}, "cfg.json")
    with pytest.raises(CheckpointError, match=r"cfg.json.*bad value"):
        hf_config_to_model_config({**base, "rms_norm_eps": "tiny"}, "cfg.json")


# ---- bad checkpoints --------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    """A private copy of the tied Qwen2 checkpoint (single model.safetensors) to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2_tied"][1], dst)
    return dst


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_truncated_safetensors(ckpt):
    file = ckpt / "model.safetensors"
    header = _header(file)
    header.pop("__metadata__", None)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(CheckpointError) as e:
        load_hf_model(ckpt)
    assert str(file) in str(e.value) and repr(last) in str(e.value) and "truncated" in str(e.value)


def test_missing_tensor(ckpt):
    file = ckpt / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing") as e:
        load_hf_model(ckpt)
    assert str(file) in str(e.value)


def test_missing_shard_tensor(checkpoints, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(checkpoints["qwen2_untied"][1], dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["lm_head.weight"]
    tensors = safetensors.numpy.load_file(dst / shard)
    del tensors["lm_head.weight"]
    safetensors.numpy.save_file(tensors, dst / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight'") as e:
        load_hf_model(dst)
    assert shard in str(e.value)


def test_wrong_shape_in_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_hf_model(ckpt)
    msg = str(e.value)
    assert str(ckpt / "model.safetensors") in msg and "'model.layers.0.mlp.gate_proj.weight'" in msg
    assert "[128, 64]" in msg and "[96, 64]" in msg


def test_unexpected_and_untied_head(ckpt):
    file = ckpt / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
    tensors["model.rotary_emb.inv_freq"] = np.zeros(8, np.float32)  # harmless, ignored
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1  # tied config, different head
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_hf_model(ckpt)
    msg = str(e.value)
    assert str(file) in msg and "'model.layers.0.self_attn.extra.weight'" in msg and "'lm_head.weight'" in msg
    assert "inv_freq" not in msg


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_hf_model(ckpt)
    msg = str(e.value)
    assert str(ckpt / "config.json") in msg and "MistralForCausalLM" in msg
    assert "Qwen2ForCausalLM" in msg and "LlamaForCausalLM" in msg


def test_missing_files(ckpt, tmp_path):
    (ckpt / "tokenizer.json").unlink()
    model, tok = load_hf_model(ckpt)  # a checkpoint without a tokenizer is fine
    assert tok is None and model.config.vocab_size == VOCAB
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_model(ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json.*not found"):
        load_hf_model(empty)


def test_bad_headers(tmp_path):
    bad_json = tmp_path / "bad_json.safetensors"
    bad_json.write_bytes(struct.pack("<Q", 10) + b"{not json!")
    with pytest.raises(CheckpointError, match=r"bad_json\.safetensors.*not valid JSON"):
        SafetensorsFile(bad_json)

    too_long = tmp_path / "too_long.safetensors"
    too_long.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match=r"too_long\.safetensors.*beyond the file size"):
        SafetensorsFile(too_long)

    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=r"short\.safetensors"):
        SafetensorsFile(short)

    def write(name, header, data=b""):
        raw = json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return tmp_path / name

    wrong_count = write("count.safetensors", {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}},
                        bytes(24))
    with pytest.raises(CheckpointError, match=r"count\.safetensors: tensor 'w'.*20 bytes.*needs 24"):
        SafetensorsFile(wrong_count)
    bad_dtype = write("dtype.safetensors", {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    with pytest.raises(CheckpointError, match=r"dtype\.safetensors: tensor 'w'.*unsupported dtype 'Q7'"):
        SafetensorsFile(bad_dtype)
    bad_offsets = write("offsets.safetensors", {"w": {"dtype": "U8", "shape": [1], "data_offsets": [4, 2]}}, b"x")
    with pytest.raises(CheckpointError, match=r"offsets\.safetensors: tensor 'w'.*bad data_offsets"):
        SafetensorsFile(bad_offsets)


# ---- safetensors format -----------------------------------------------------------------------------------


def test_safetensors_roundtrip_with_reference_library(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal(5).astype(np.float16),
        "bf16": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "i64": np.arange(7, dtype=np.int64),
        "i32": np.array(-3, np.int32),  # 0-d
        "u8": np.arange(3, dtype=np.uint8),
        "empty": np.zeros((0, 5), np.float32),
        "transposed": rng.standard_normal((3, 2)).astype(np.float32).T,
    }
    save_file(tensors, tmp_path / "ours.safetensors")
    ref = safetensors.numpy.load_file(tmp_path / "ours.safetensors")  # the reference reader accepts our file
    ours = load_file(tmp_path / "ours.safetensors")
    for name, value in tensors.items():
        assert ref[name].dtype == value.dtype  # bfloat16 too (through ml_dtypes)
        np.testing.assert_array_equal(ref[name], value)
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape
        np.testing.assert_array_equal(ours[name], value)
    written_by_torch = {"w": torch.randn(2, 3, dtype=torch.bfloat16), "i": torch.arange(4)}
    safetensors.torch.save_file(written_by_torch, tmp_path / "ref.safetensors")
    ours = load_file(tmp_path / "ref.safetensors")
    np.testing.assert_array_equal(ours["w"].astype(np.float32), written_by_torch["w"].float().numpy())
    np.testing.assert_array_equal(ours["i"], np.arange(4))
    assert not ours["w"].flags.writeable  # the file's data: read-only (tests/test_safetensors_io.py: memory)


def test_load_onto_mesh(checkpoints, loaded):
    """Parameters go straight to their sharded layout (8 simulated CPU devices from conftest)."""
    from grpo_jax.parallel.sharding import MeshConfig, make_mesh
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    sharded, _ = load_hf_model(checkpoints["qwen2_untied"][1], mesh=mesh)
    q = sharded.layers[0].attn.q.get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (32, 1, 16)
    reference = param_dict(loaded["qwen2_untied"][0])
    for key, value in param_dict(sharded).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[key]))
