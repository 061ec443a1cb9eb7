"""Paged KV in the continuous engine (sampler.kv_cache = paged): it draws what the static sampler draws, with a
pool big enough or one that runs short (samples put back and restarted, none lost), Gemma 3's window included;
the page pool's invariants on random workloads; decode attention over pages equals attention over the rows;
and the TPU kernel path compiles."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.algorithm.lengths import ExpectedLengths
from grpo_jax.model.attention import AttentionMask, PagedKV, dense_attention, paged_attention
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.rollout.engine import Engine
from grpo_jax.rollout.pages import PagePool, pages_for, positions_needed
from grpo_jax.rollout.sampler import Sampler
from test_engine import CONFIG, EOS, G, _group_keys, _run, assert_draws_as_static
from test_sampler import PAD, VOCAB, _model, _prompts

PAGED = dataclasses.replace(CONFIG, kv_cache="paged", page_size=4)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def want(model):
    """72 samples (24 groups of 3) and what the static sampler draws for them."""
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, rng.integers(1, 17, 24))
    keys = _group_keys(len(prompts), 0)
    sampler = Sampler(model, EOS, PAD, CONFIG)
    yield prompts, keys, sampler.generate([p for p in prompts for _ in range(G)], keys.reshape(-1))
    sampler.close()


def test_paged_engine_draws_what_the_static_sampler_draws(model, want):
    prompts, keys, expected = want
    engine = Engine(model, EOS, PAD, PAGED)
    try:
        assert engine.bank_pages == 16 * pages_for(16 + 12, 4)  # kv_pages 0: what the rings would hold
        assert_draws_as_static(_run(engine, prompts, keys), expected)
        metrics = engine.metrics()
        assert metrics["engine/samples_put_back"] == 0 and metrics["engine/kv_pages_peak"] > 0
        assert all(bank.pool.used == 0 for bank in engine._banks)  # every page back in its pool
        assert metrics["engine/prefill_tokens_saved"] > 0  # a group's prompt prefilled once, its pages shared
    finally:
        engine.close()


def test_a_pool_that_runs_short_puts_the_youngest_back_and_loses_no_sample(model, want):
    """Two banks of 16 slots, 12 pages each (a sequence needs up to 7): admission stops when pages run out, and
    sequences that cannot grow are put back and restarted; every sample still draws what it drew before."""
    prompts, keys, expected = want
    engine = Engine(model, EOS, PAD, dataclasses.replace(PAGED, kv_pages=12))
    try:
        results = _run(engine, prompts, keys)
        assert_draws_as_static(results, expected)
        metrics = engine.metrics()
        assert metrics["engine/samples_put_back"] > 0
        assert metrics["engine/kv_pages_peak"] <= 12
        assert all(bank.pool.used == 0 for bank in engine._banks)
    finally:
        engine.close()


def test_kv_pages_below_one_sequence_is_one_line():
    problems = dataclasses.replace(PAGED, kv_pages=6).validate()
    assert problems == ["kv_pages=6: must be 0 (as many as the rings would hold) or at least 7 (one whole "
                        "sequence: max_prompt_len + max_new_tokens - 1 positions in pages of 4)"]
    assert dataclasses.replace(PAGED, kv_cache="blocks").validate() == ["kv_cache='blocks': allowed ring, paged"]


def test_gemma3_window_with_paged_full_attention_layers():
    """Gemma 3's local layers keep their window ring; its global layers read pages: what the static sampler
    draws."""
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, architecture="gemma3", tie_embeddings=True,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=5,
                         rope_local_theta=10000.0, rope_theta=1e6, query_pre_attn_scalar=24)
    model = create_model(config, seed=3)
    model.embed.set_value(model.embed.get_value() * 8.0)  # tied head: a peaked distribution
    sampler_config = dataclasses.replace(PAGED, slots=8, decode_streams=1, kv_pages=10)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, [16, 3, 9, 14, 1, 7])
    keys = _group_keys(len(prompts), 1)
    sampler = Sampler(model, EOS, PAD, sampler_config)
    engine = Engine(model, EOS, PAD, sampler_config)
    try:
        cache = engine._banks[0].state.cache
        assert cache[0][0].shape == (8, 2, 5, 32) and cache[1][0].shape == (2, 11, 4, 32)  # window ring; pool
        expected = sampler.generate([p for p in prompts for _ in range(G)], keys.reshape(-1))
        assert max(expected.lengths) > 5
        assert_draws_as_static(_run(engine, prompts, keys), expected)
    finally:
        engine.close()
        sampler.close()


def test_positions_needed_covers_the_next_chunk():
    assert positions_needed(5, 1, 12, 4) == 9  # admission: positions 5 .. 8 written by the first chunk
    assert positions_needed(5, 10, 12, 4) == 16  # the last token (12th) is drawn by the step writing 15
    assert positions_needed(5, 12, 12, 4) == 16
    assert pages_for(16, 4) == 4 and pages_for(17, 4) == 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.booleans()), max_size=60))
def test_page_pool_never_hands_out_a_held_page(operations):
    """Random takes, shares and releases of sequences: a page held by a sequence is never handed out, the free
    count plus the distinct pages held is the pool, and releasing everything frees every page."""
    pool = PagePool(10)
    sequences: list[list[int]] = []
    for kind, count, share in operations:
        if kind < 2 and count <= pool.free:
            taken = pool.take(count)
            assert not {p for s in sequences for p in s} & set(taken)
            sequences.append(taken)
        elif kind == 2 and sequences and share:
            pool.share(sequences[-1])
            sequences.append(list(sequences[-1]))
        elif sequences:
            pool.release(sequences.pop(0))
        held = {p for s in sequences for p in s}
        assert pool.free + len(held) == 10
        counts = np.bincount([p for s in sequences for p in s], minlength=10)
        np.testing.assert_array_equal(pool.holders(), counts)
    for s in sequences:
        pool.release(s)
    assert pool.free == 10 and sorted(pool.take(10)) == list(range(10))


def test_paged_attention_gathers_what_dense_attention_reads():
    """A decode query per row over pages scattered in a pool equals dense attention over the same keys laid
    out in a row, with GQA and rows of different lengths."""
    rng = np.random.default_rng(0)
    b, c, g, d, page, per_row, pages = 3, 2, 2, 8, 4, 5, 20
    k_pages = jnp.asarray(rng.normal(size=(c, pages, page, d)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(c, pages, page, d)), jnp.float32)
    table = np.stack([rng.permutation(pages)[:per_row] for _ in range(b)]).astype(np.int32)
    lengths = np.array([1, 9, 20], np.int32)
    q = jnp.asarray(rng.normal(size=(b, c, g, 1, d)), jnp.float32)
    cache = PagedKV(k_pages=k_pages, v_pages=v_pages, page_table=jnp.asarray(table), lengths=jnp.asarray(lengths),
                    write_page=jnp.zeros(b, jnp.int32))
    got = paged_attention(q, cache, 0.3)
    rows_k = np.asarray(k_pages)[:, table].transpose(1, 0, 2, 3, 4).reshape(b, c, -1, d)
    rows_v = np.asarray(v_pages)[:, table].transpose(1, 0, 2, 3, 4).reshape(b, c, -1, d)
    mask = AttentionMask(key_mask=jnp.arange(per_row * page)[None] < lengths[:, None])
    np.testing.assert_allclose(got, dense_attention(q, rows_k, rows_v, mask, 0.3), rtol=1e-6, atol=1e-6)
    scores = np.einsum("bcgd,bcsd->bcgs", np.asarray(q)[:, :, :, 0], rows_k) * 0.3
    scores = np.where(np.asarray(mask.key_mask)[:, None, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(got)[:, :, :, 0], np.einsum("bcgs,bcsd->bcgd", weights, rows_v),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,rows,staged", [(jnp.bfloat16, 5, None), (jnp.float32, 12, 3)])
def test_the_page_write_kernel_writes_what_the_scatter_writes(monkeypatch, dtype, rows, staged):
    """model.page_writes.write_rows (interpreted on CPU) against the scatter, on random pages, rows and offsets;
    with a small VMEM budget the rows go in several calls (3 rows x 2 heads x (16 + 8) x 128 x 4 bytes each)."""
    from grpo_jax.model import page_writes

    if staged:
        monkeypatch.setattr(page_writes, "STAGED_VMEM_BYTES", staged * 2 * (16 + 8) * 128 * 4)
        assert page_writes.rows_per_call(rows, 2, 16, 128, 4) == staged
    rng = np.random.default_rng(rows)
    pages = jnp.asarray(rng.normal(size=(2, 20, 16, 128)), dtype)
    page = jnp.asarray(rng.choice(20, rows, replace=False), jnp.int32)
    offset = jnp.asarray(rng.integers(0, 16, rows), jnp.int32)
    new = jnp.asarray(rng.normal(size=(rows, 2, 128)), jnp.float32)
    got = page_writes.write_rows(pages, page, offset, new, interpret=True)
    want = pages.at[:, page, offset].set(new.swapaxes(0, 1).astype(dtype))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_on_a_tpu_chip_with_several_cache_heads_the_page_writes_copy_no_pool():
    """Two cache heads a chip: XLA's scatter wanted the pool in another layout than the paged-attention kernel
    reads, so each layer copied its pool there and back every step; the page-write kernel writes in place."""
    from grpo_jax.planning.compile import without_jax_cache
    from grpo_jax.planning.topology import tpu_topology

    c, n, page, d, b, per_row = 2, 4097, 16, 128, 64, 32
    pool_shape = f"bf16[{c},{n},{page},{d}]"

    def two_layers(impl, q, k_pages, v_pages, table, lengths, new):
        def layer(carry, _):
            k_pages, v_pages, q = carry
            cache = PagedKV(k_pages=k_pages, v_pages=v_pages, page_table=table, lengths=lengths,
                            write_page=table[:, 0]).written(new, new, impl=impl)
            out = paged_attention(q, cache, 0.1, impl="kernel")
            return (cache.k_pages, cache.v_pages, q + out), None

        return jax.lax.scan(layer, (k_pages, v_pages, q), None, length=2)[0]

    with without_jax_cache():
        device = tpu_topology("v5e:1x1").devices[0]
        whole = jax.sharding.SingleDeviceSharding(device)
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)  # noqa: E731
        args = (sds((b, c, 1, 1, d), jnp.bfloat16), sds((c, n, page, d), jnp.bfloat16),
                sds((c, n, page, d), jnp.bfloat16), sds((b, per_row), jnp.int32), sds((b,), jnp.int32),
                sds((b, c, 1, d), jnp.bfloat16))
        copies = {}
        for impl in ("scatter", "kernel"):
            step = jax.jit(functools.partial(two_layers, impl), donate_argnums=(1, 2))
            text = step.lower(*args).compile().as_text()
            copies[impl] = sum(f"= {pool_shape}" in line and " copy(" in line for line in text.splitlines())
    assert copies["scatter"] > 0 and copies["kernel"] == 0


def test_on_tpu_chips_the_paged_decode_chunk_runs_the_paged_attention_kernel():
    """Compiled for 4 v5e chips (fsdp 2 x tensor 2), the paged engine's decode chunk reads its pages through the
    paged-attention kernel (in a shard_map over the cache heads), its pool split over tensor; the compile command
    costs the kernel at the keys a row holds, and counts the chunk calls at the expected length beside the worst
    case."""
    from flax import nnx

    from grpo_jax.model.transformer import abstract_model
    from grpo_jax.parallel.sharding import MeshConfig, make_mesh, state_shardings
    from grpo_jax.planning.compile import without_jax_cache
    from grpo_jax.planning.hlo_cost import program_cost
    from grpo_jax.planning.topology import tpu_topology
    from grpo_jax.rollout.common import Workload

    with without_jax_cache():
        devices = tpu_topology("v5e:2x2").devices
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices)
    config = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=128, dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = nnx.split(abstract_model(config))
    state = jax.tree.map(lambda s, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.get_value().dtype, sharding=s)),
                         state_shardings(state, mesh), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    sampler_config = dataclasses.replace(PAGED, max_prompt_len=64, max_new_tokens=192, page_size=16, kv_pages=64,
                                         decode_streams=1, slots=16)
    engine = Engine(nnx.merge(graphdef, state), (1,), PAD, sampler_config)
    try:
        pool = engine.slot_state_shape(16).cache[0][0]
        assert pool.shape == (2, 65, 16, 128) and pool.sharding.spec == jax.sharding.PartitionSpec("tensor")
        work = Workload(samples=64, group_size=4, prompt_len=64, turns=1,
                        expected=ExpectedLengths(prompt=64, completions=(64,), source="test"))
        programs = engine.programs(work)
        chunk = next(p for p in programs if p.name == "engine chunk")
        with without_jax_cache():
            text = chunk.jitted.lower(*chunk.args, **chunk.kwargs).compile().as_text()
        assert "tpu_custom_call" in text and "paged_attention" in text
        # One cache head a device: the scatter writes the new keys in the pool's own layout, no copy of a pool.
        pool_shape = "bf16[" + ",".join(map(str, pool.shape)) + "]"
        assert not [line for line in text.splitlines() if f"= {pool_shape}" in line and " copy(" in line]
        # The compile command's cost of one decode step: the kernel at every page of a row (the worst case) and
        # at the keys a sequence holds on average (64 + 64 / 2 = 96 of 256), from the scope the kernel names.
        steps = [p for p in programs if p.name == "engine chunk" and p.cost_part]
        assert [p.at_expected for p in steps] == [False, True] and steps[1].kwargs["cost_keys"] == 96
        kernel = []
        for step in steps:
            with without_jax_cache():
                compiled = step.jitted.lower(*step.args, **step.kwargs).compile().as_text()
            kernel.append(sum(part.flops for (_, kind), part in program_cost(compiled).parts.items()
                              if kind == "kernel"))
        per_key = 2 * 2 * 16 * 2 * 128 * 2  # q k^T and p v: rows x this device's 2 query heads x head_dim, 2 layers
        assert kernel == [per_key * 256, per_key * 96]
        # Chunk calls (chunks of 4 steps): the worst case in lockstep waves of what 64 pages hold at full length (4
        # sequences of 255 positions: 16 waves of 48 chunks), against slots refilled at the expected length (64
        # pages hold 9 sequences of 96 keys and a chunk: 64 x 63 tokens in 448 steps, 112 chunks).
        assert chunk.calls_per_step == 16 * 48 and chunk.expected_calls_per_step == 112
        # The same mean with a long tail (a quarter of the samples at 190 tokens, the rest at 22): a decoding
        # sequence holds 137 keys on average, so 64 pages hold 7 at once, and 64 x 63 tokens take 576 steps.
        tail = Workload(samples=64, group_size=4, prompt_len=64, turns=1,
                        expected=ExpectedLengths(prompt=64, completions=(22, 22, 22, 190), source="test"))
        tail_chunk = next(p for p in engine.programs(tail) if p.name == "engine chunk")
        assert engine.expected_keys(tail) == 137 and tail_chunk.expected_calls_per_step == 144
    finally:
        engine.close()


def test_a_page_table_beyond_smem_goes_through_the_kernel_in_row_blocks():
    """The kernel prefetches its page table into SMEM (1 MiB): 512 rows of 544 pages (Qwen2.5-1.5B at 512 + 8192
    tokens in pages of 16) is 1.1 MiB, which the compiler refused; the rows go through in blocks whose tables fit,
    and the step compiles for a v5e chip."""
    from grpo_jax.model.attention import PAGE_TABLE_SMEM_BYTES
    from grpo_jax.planning.compile import without_jax_cache
    from grpo_jax.planning.topology import tpu_topology

    b, c, g, d, page, per_row, pages = 512, 1, 6, 128, 16, 544, 4096
    assert b * per_row * 4 > 2 * PAGE_TABLE_SMEM_BYTES

    def step(q, k_pages, v_pages, table, lengths):
        cache = PagedKV(k_pages=k_pages, v_pages=v_pages, page_table=table, lengths=lengths,
                        write_page=jnp.zeros(b, jnp.int32))
        return paged_attention(q, cache, 0.1, impl="kernel")

    with without_jax_cache():
        device = tpu_topology("v5e:2x2").devices[0]
    one = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=one) for shape, dtype in (
        ((b, c, g, 1, d), jnp.bfloat16), ((c, pages, page, d), jnp.bfloat16), ((c, pages, page, d), jnp.bfloat16),
        ((b, per_row), jnp.int32), ((b,), jnp.int32))]
    with without_jax_cache():
        text = jax.jit(step).lower(*args).compile().as_text()
    assert text.count("custom_call_target=\"tpu_custom_call\"") == 4  # 128 rows a call


def test_trainer_on_a_pool_that_runs_short_accounts_for_every_prompt(tmp_path):
    """An async run on the paged engine whose pool holds far fewer sequences than its slots (8 pages of 4
    positions per bank, where one group's prompt alone takes 4 and each sample one more), chunks of one step and
    in-flight updates: samples are put back and restarted, every prompt is
    trained or dropped once (the audit), and the engine's page metrics are logged."""
    from grpo_jax.run.trainer import Trainer
    from test_trainer import assert_every_ordinal_accounted_once, tiny_config
    config = tiny_config(tmp_path, "sampler.engine=continuous", "sampler.kv_cache=paged", "sampler.page_size=4",
                         "sampler.kv_pages=8", "sampler.chunk_steps=1", "trainer.max_steps=4",
                         "grpo.max_staleness=1", "data.synthetic_size=40")
    history = Trainer(config).train()
    assert len(history) == 4
    assert_every_ordinal_accounted_once(tmp_path)
    assert all(m["engine/kv_pages_peak"] <= 8 for m in history)
    assert history[-1]["engine/samples_put_back"] > 0
