"""Attention without [T, S] in memory (model.attention): the blockwise (online softmax, custom VJP) and splash
(Pallas kernel, run here in interpret mode) implementations give the values and gradients of the dense path, and a
NumPy reference, on random packed rows with padding, GQA and sliding windows; a model, a learner step and the
engine's admission give what they gave with dense attention; the compiled learner step holds no [.., T, S] array."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_packed_batch
from grpo_jax.algorithm.learner import Learner, OptimConfig
from grpo_jax.algorithm.losses import LossConfig
from grpo_jax.model import attention
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.rollout.engine import Engine
from grpo_jax.rollout.sampler import SamplerConfig

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    attention="dense", attention_block=8)
GEMMA3 = dataclasses.replace(MODEL, architecture="gemma3", layer_types=("sliding_attention", "full_attention"),
                             sliding_window=5, rope_local_theta=100.0, tie_embeddings=True)


def random_case(seed: int, rows: int, kv: int, groups: int, length: int, dim: int, window: int):
    """q, k, v and the mask of packed rows: sorted segment ids (several sequences a row), a padded tail, and a few
    masked keys inside."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(rows, kv, groups, length, dim)).astype(np.float32)
    k = rng.normal(size=(rows, kv, length, dim)).astype(np.float32)
    v = rng.normal(size=(rows, kv, length, dim)).astype(np.float32)
    segments = np.sort(rng.integers(0, 4, size=(rows, length)), axis=1)
    key_mask = (np.arange(length)[None] < rng.integers(length // 2, length + 1, size=(rows, 1))) & \
        (rng.random((rows, length)) > 0.05)
    mask = attention.causal_mask(jnp.asarray(key_mask), length, 0, jnp.asarray(segments)).with_window(window)
    return q, k, v, mask


def numpy_attention(q, k, v, mask, scale):
    allowed = np.asarray(mask.dense())[:, None, None]
    scores = np.einsum("bkgtd,bksd->bkgts", q.astype(np.float64), k.astype(np.float64)) * scale
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    probs = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    probs = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bkgts,bksd->bkgtd", probs, v.astype(np.float64)), allowed.any(-1)


def values_and_grads(q, k, v, mask, impl, seen, **options):
    """The output and the gradients of a loss that reads every query that sees a key."""
    weight = jnp.asarray(seen, jnp.float32)[..., None] * jnp.cos(jnp.arange(q.shape[-1]))

    def loss(q, k, v):
        out = attention.attend(q, k, v, mask, 0.3, impl=impl, **options)
        return jnp.sum(out * weight), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("seed,window,groups,block", [(0, 0, 2, 8), (1, 5, 3, 16), (2, 0, 1, 64), (3, 9, 2, 4)])
def test_blockwise_attention_equals_numpy_and_the_dense_gradients(seed, window, groups, block):
    """Rows of 37 keys (not a multiple of any block: the last block is padded)."""
    q, k, v, mask = random_case(seed, rows=3, kv=2, groups=groups, length=37, dim=8, window=window)
    expected, seen = numpy_attention(q, k, v, mask, 0.3)
    dense_out, dense_grads = values_and_grads(q, k, v, mask, "dense", seen)
    out, grads = values_and_grads(q, k, v, mask, "blockwise", seen, block=block)
    np.testing.assert_allclose(np.where(seen[..., None], out, 0), np.where(seen[..., None], expected, 0), atol=2e-6)
    assert np.all(out[~np.broadcast_to(seen, out.shape[:-1])] == 0)  # a query that sees nothing reads zeros
    for got, want in zip(grads, dense_grads):
        np.testing.assert_allclose(got, want, atol=3e-6 * np.abs(want).max())


def test_blockwise_attention_reads_a_cache_from_a_write_index():
    """Queries in slots 11..18 of a 40-slot cache (prefill after earlier keys): each sees the marked keys up to
    its own slot, as the dense path does."""
    rng = np.random.default_rng(4)
    q = rng.normal(size=(2, 2, 2, 8, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 2, 40, 8)).astype(np.float32) for _ in range(2))
    key_mask = jnp.asarray(np.arange(40)[None] < np.array([[19], [30]]))
    mask = attention.causal_mask(key_mask, 8, jnp.int32(11))
    assert not mask.self_attention
    expected, seen = numpy_attention(q, k, v, mask, 0.3)
    out, _ = values_and_grads(q, k, v, mask, "blockwise", seen, block=8)
    np.testing.assert_allclose(out, expected, atol=2e-6)


@pytest.mark.parametrize("window", [0, 33])
def test_splash_attention_equals_the_dense_path_in_values_and_gradients(window):
    """Splash's Pallas kernels in interpret mode (the TPU program's own code, run on CPU), one row of 200 tokens
    in three sequences and a padded tail, 4 query heads over 2 key/value heads, head_dim 128."""
    rng = np.random.default_rng(window)
    length = 200
    q = rng.normal(size=(1, 2, 2, length, 128)).astype(np.float32)
    k, v = (rng.normal(size=(1, 2, length, 128)).astype(np.float32) for _ in range(2))
    segments = np.sort(rng.integers(0, 3, size=(1, length)), axis=1)
    key_mask = jnp.asarray(np.arange(length)[None] < 190)
    mask = attention.causal_mask(key_mask, length, 0, jnp.asarray(segments)).with_window(window)
    seen = np.broadcast_to(np.asarray(key_mask)[:, None, None], q.shape[:-1])  # real tokens: every one sees itself
    dense_out, dense_grads = values_and_grads(q, k, v, mask, "dense", seen)
    out, grads = values_and_grads(q, k, v, mask, "splash", seen, block=128, interpret=True)
    np.testing.assert_allclose(out[seen], dense_out[seen], atol=1e-5)
    for got, want in zip(grads, dense_grads):
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_splash_on_a_mesh_splits_rows_and_heads_even_where_the_rows_do_not_divide():
    """Under a mesh (fsdp 4 x tensor 2) the kernel runs in a shard_map (XLA cannot partition a Pallas kernel): 2
    rows padded to split over 4 devices, the 2 key/value heads over tensor; the real rows' values and gradients
    are the dense path's."""
    from grpo_jax.parallel.sharding import MeshConfig, make_mesh
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    rng = np.random.default_rng(7)
    length = 130
    q = rng.normal(size=(2, 2, 2, length, 128)).astype(np.float32)
    k, v = (rng.normal(size=(2, 2, length, 128)).astype(np.float32) for _ in range(2))
    segments = np.sort(rng.integers(0, 3, size=(2, length)), axis=1)
    key_mask = jnp.asarray(np.arange(length)[None] < np.array([[120], [130]]))
    mask = attention.causal_mask(key_mask, length, 0, jnp.asarray(segments))
    seen = np.broadcast_to(np.asarray(key_mask)[:, None, None], q.shape[:-1])
    dense_out, dense_grads = values_and_grads(q, k, v, mask, "dense", seen)
    on_mesh = [jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())) for a in (q, k, v)]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        out, grads = values_and_grads(*on_mesh, mask, "splash", seen, block=128, interpret=True)
    np.testing.assert_allclose(out[seen], dense_out[seen], atol=1e-5)
    for got, want in zip(grads, dense_grads):
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("length,block,window", [(1024, 256, 0), (1024, 256, 300), (2048, 128, 129), (512, 512, 0)])
def test_the_blocks_counted_for_splash_are_those_its_mask_computes(length, block, window):
    """causal_blocks (what the compile command costs splash by) against splash's own block mask."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    rule = masks.CausalMask((length, length))
    if window:
        rule = masks.LogicalAnd(rule, masks.LocalMask((length, length), (window - 1, 0), offset=0))
    sizes = kernels.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    kernel = kernels.make_splash_mha(masks.MultiHeadMask([rule]), block_sizes=sizes, head_shards=1, q_seq_shards=1)
    assert attention.causal_blocks(length, block, window) == np.count_nonzero(kernel.fwd_mask_info.block_mask)


def test_auto_chooses_splash_on_tpu_blockwise_for_long_rows_and_dense_for_decode():
    long, short = (attention.causal_mask(jnp.ones((1, n), bool), n) for n in (4096, 1024))
    ring = attention.AttentionMask(key_mask=jnp.ones((1, 4096), bool))
    assert attention.choose("auto", long, 512, "tpu") == "splash"
    assert attention.choose("auto", long, 512, "cpu") == "blockwise"
    assert attention.choose("auto", short, 512, "gpu") == "dense"
    assert attention.choose("auto", ring, 512, "tpu") == "dense"
    cached = attention.causal_mask(jnp.ones((1, 4096), bool), 64, jnp.int32(100))
    assert attention.choose("splash", cached, 512, "tpu") == "blockwise"
    assert "attention='flash'" in " ".join(dataclasses.replace(MODEL, attention="flash").validate())


def packed_batch():
    return random_packed_batch(5, 12, MODEL.vocab_size, 40, 24, 1)


@pytest.mark.parametrize("config", [MODEL, GEMMA3], ids=["qwen2", "gemma3"])
def test_a_packed_learner_step_trains_alike_with_blockwise_attention(config):
    """Rows of 64 tokens holding several sequences (Gemma 3: a window of 5 in its local layer); keys span 8 blocks
    of 8, so blockwise runs in every layer."""
    batch = packed_batch()
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0)
    learners = [Learner(create_model(dataclasses.replace(config, attention=impl), seed=1), optim,
                        LossConfig(off_policy="tis")) for impl in ("dense", "blockwise")]
    start = jax.tree.map(np.asarray, jax.device_get(learners[0].params))
    (dense_metrics, _), (metrics, applied) = (learner.step(batch) for learner in learners)
    assert applied.all()
    after = [jax.tree.leaves(jax.device_get(learner.params)) for learner in learners]
    moved = max(np.abs(a - b).max() for a, b in zip(after[0], jax.tree.leaves(start)))
    assert moved > 1e-2
    assert max(np.abs(a - b).max() for a, b in zip(*after)) < 1e-5 * moved
    assert metrics["loss"] == pytest.approx(dense_metrics["loss"], rel=1e-5, abs=1e-6)


def learner_step_hlo(impl: str, batch) -> str:
    learner = Learner(create_model(dataclasses.replace(MODEL, attention=impl), seed=1),
                      OptimConfig(lr=1e-3), LossConfig())
    return learner.lowered_step(batch).compile().as_text()


def test_the_compiled_learner_step_holds_no_array_of_queries_by_keys():
    """Packed rows of 64 tokens score 63 positions: with dense attention the compiled step holds [.., 63, 63]
    scores and masks, with blockwise none (its largest score array is [.., 63, 8])."""
    batch = packed_batch()
    queries = batch.tokens.shape[1] - 1
    square = re.compile(rf"\[[0-9,]*\b{queries},{queries}\b[0-9,]*\]")
    assert square.search(learner_step_hlo("dense", batch))
    text = learner_step_hlo("blockwise", batch)
    assert not square.search(text), square.search(text).group(0)
    assert re.search(rf"\[[0-9,]*\b{queries},8\]", text)


def test_admission_prefills_with_blockwise_attention_as_with_dense():
    """Prompts of 40-47 tokens (keys span more than 4 blocks of 8): the engine's greedy tokens and log-probs are
    the same with either attention."""
    rng = np.random.default_rng(6)
    prompts = [list(rng.integers(1, MODEL.vocab_size, n)) for n in (40, 47, 43)]
    config = SamplerConfig(max_new_tokens=6, max_prompt_len=48, temperature=0.0, slots=4)
    results = []
    for impl in ("dense", "blockwise"):
        model = create_model(dataclasses.replace(MODEL, attention=impl), seed=2)
        model.lm_head.set_value(model.lm_head.get_value() * 30.0)
        results.append(Engine(model, (), 0, config).generate(prompts, 0))
    np.testing.assert_array_equal(results[0].tokens, results[1].tokens)
    np.testing.assert_allclose(results[0].logprobs, results[1].logprobs, atol=1e-5)


def test_splash_compiles_for_tpu_chips_that_outnumber_the_rows():
    """2 rows on 4 v5e chips (fsdp): the kernel is still wrapped in a shard_map (XLA refuses to partition a Pallas
    kernel: "Mosaic kernels cannot be automatically partitioned"), the rows padded to split."""
    from grpo_jax.planning.compile import without_jax_cache
    from grpo_jax.planning.topology import tpu_topology

    with without_jax_cache():
        devices = tpu_topology("v5e:2x2").devices
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 4, 1), ("data", "fsdp", "tensor"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
            for shape in ((2, 2, 2, 256, 128), (2, 2, 256, 128), (2, 2, 256, 128))]

    def loss(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            mask = attention.causal_mask(jnp.ones((2, 256), bool), 256)
            return attention.attend(q, k, v, mask, 0.1, impl="splash", block=128).astype(jnp.float32).sum()

    with without_jax_cache():
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
