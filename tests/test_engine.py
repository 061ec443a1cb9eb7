"""Continuous engine tests: it draws what the static sampler draws, shares prefills exactly, tags in-flight
tokens with their weight version (and their log-probs are that version's), compiles a fixed set of programs,
and a trainer run with it accounts for every prompt. Tiny model; the engine is module-scoped and warmed up
once, so each program compiles once."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx
from jax.sharding import PartitionSpec

from conftest import jitted_token_logprobs
from grpo_jax.algorithm.batch import pack_batch
from grpo_jax.algorithm.losses import LossConfig, policy_loss
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.parallel.sharding import MeshConfig, make_mesh, shard_module
from grpo_jax.rollout.engine import Engine
from grpo_jax.rollout.sampler import Sampler, SamplerConfig
from grpo_jax.run.trainer import group_rows
from grpo_jax.state.replay_buffer import Group
from test_sampler import PAD, VOCAB, _model, _prompts

MAX_NEW = 12
EOS = tuple(range(1, 60))  # a fifth of the vocabulary: most samples stop early, some run to the limit
# 32 slots in two banks of 16 (which halve to 8 when draining), chunks of 4 steps: a sample spans up to 3 chunks.
CONFIG = SamplerConfig(engine="continuous", max_new_tokens=MAX_NEW, max_prompt_len=16, min_prompt_bucket=16,
                       chunk_steps=4, slots=32)
G = 3


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, EOS, PAD, CONFIG)
    engine.warm_up(group_size=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def static(model):
    sampler = Sampler(model, EOS, PAD, CONFIG)
    yield sampler
    sampler.close()


def _group_keys(n, seed):
    return jax.random.split(jax.random.key(seed), n * G).reshape(n, G)


def _run(engine, prompts, keys, between_steps=None):
    """Submit each prompt as a group, step until idle; results in submission order."""
    for i, (prompt, k) in enumerate(zip(prompts, keys)):
        engine.submit(prompt, k, tag=i)
    results, steps = {}, 0
    while engine.busy:
        for result in engine.step():
            results[result.tag] = result
        steps += 1
        if between_steps is not None:
            between_steps(steps)
    return [results[i] for i in range(len(prompts))]


@jax.jit
def _log_softmax_of(model, tokens):
    logits, _ = model(tokens[None])
    return jax.nn.log_softmax(logits[0].astype(jnp.float32))


def _full_forward_logprobs(model, prompt, completion):
    """Log-prob of each completion token under one full forward pass (temperature 1); right padding to one
    length (one compiled program) leaves the earlier positions exact under causal attention."""
    seq = np.zeros(16 + MAX_NEW, np.int32)
    seq[:len(prompt) + len(completion)] = list(prompt) + list(completion)
    logp = np.asarray(_log_softmax_of(model, seq))
    return logp[np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1), np.asarray(completion)]


def test_config_keys_are_checked():
    assert SamplerConfig(engine="continuous", slots=8, chunk_steps=3).validate() == []
    bad = SamplerConfig(engine="vllm", slots=-1, chunk_steps=0).validate()
    assert any(p.startswith("engine='vllm': allowed static, continuous") for p in bad)
    assert any(p.startswith("slots=-1") for p in bad) and any(p.startswith("chunk_steps=0") for p in bad)


def assert_draws_as_static(results, want):
    """Each group's samples (GroupResults, in submission order) are the static sampler's rows `want`: the same
    tokens, log-probs and finish reasons."""
    for i, result in enumerate(results):
        for j in range(G):
            row = i * G + j
            n = want.lengths[row]
            np.testing.assert_array_equal(result.tokens[j], want.tokens[row, :n])
            # Both sides are float32 log-softmaxes over different batch layouts (refilled slots vs one static
            # batch), so XLA's reductions may order sums differently: a few ulps of values near -5 (CI saw 1.3e-5).
            np.testing.assert_allclose(result.logprobs[j], want.logprobs[row, :n], rtol=1e-5, atol=1e-5)
            assert result.finish_reasons[j] == want.finish_reasons[row]


def test_engine_draws_what_the_static_sampler_draws(engine, static, model):
    """72 samples through 32 slots: refilled between chunks, groups split over boundaries and banks, banks halved
    while draining; each sample's tokens still come from its own key alone."""
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, rng.integers(1, 17, 24))
    keys = _group_keys(len(prompts), 0)
    results = _run(engine, prompts, keys)
    want = static.generate([p for p in prompts for _ in range(G)], keys.reshape(-1))
    assert_draws_as_static(results, want)
    assert {"stop", "length"} <= set(want.finish_reasons)
    for i in (0, 5):  # and the behaviour log-probs are the model's own
        for j in range(G):
            np.testing.assert_allclose(results[i].logprobs[j],
                                       _full_forward_logprobs(model, prompts[i], results[i].tokens[j]), atol=1e-4)
    assert engine.bank_sizes == [8, 8]  # drained banks were halved


def test_on_a_tensor_axis_larger_than_the_kv_heads_each_device_holds_the_kv_head_it_reads(engine):
    """The model's 2 KV heads on a tensor axis of 4 (its 4 query heads split one per device): the ring holds each
    KV head twice, split over the 4 devices, so each device keeps only the KV head its query head reads (half the
    keys and values, not all of them). The engine and the static sampler there draw what the engine draws on one
    device."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=4), jax.devices()[:4])
    sharded = shard_module(_model(), mesh)
    on_mesh = Engine(sharded, EOS, PAD, CONFIG)
    static = Sampler(sharded, EOS, PAD, CONFIG)
    try:
        assert (on_mesh.cache_heads, static.cache_heads, engine.cache_heads) == (4, 4, 2)
        rng = np.random.default_rng(7)
        prompts = _prompts(rng, rng.integers(1, 17, 12))
        keys = _group_keys(len(prompts), 7)
        want = _run(engine, prompts, keys)
        got = _run(on_mesh, prompts, keys)
        ring = on_mesh._banks[0].state.cache[0][0]
        assert ring.shape[1] == 4 and ring.sharding.spec == PartitionSpec(None, "tensor")
        assert {shard.data.shape[1] for shard in ring.addressable_shards} == {1}
        samples = static.generate([p for p in prompts for _ in range(G)], keys.reshape(-1))
        for i, (a, b) in enumerate(zip(want, got)):
            for j in range(G):
                n = samples.lengths[i * G + j]
                np.testing.assert_array_equal(b.tokens[j], a.tokens[j])
                np.testing.assert_array_equal(samples.tokens[i * G + j, :n], a.tokens[j])
                np.testing.assert_allclose(b.logprobs[j], a.logprobs[j], atol=1e-5)
    finally:
        on_mesh.close()
        static.close()


def test_shared_prefill_equals_separate_prefills(engine):
    """G samples from one prefill whose keys/values are copied into G slots == the same samples each prefilled
    on its own; the shared run computes one prefill per prompt."""
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, [5, 16, 9, 1])
    keys = _group_keys(len(prompts), 1)
    before = engine.metrics()
    shared = _run(engine, prompts, keys)
    middle = engine.metrics()
    separate = _run(engine, [p for p in prompts for _ in range(G)], keys.reshape(-1, 1))
    after = engine.metrics()
    for i, result in enumerate(shared):
        for j in range(G):
            np.testing.assert_array_equal(result.tokens[j], separate[i * G + j].tokens[0])
            np.testing.assert_allclose(result.logprobs[j], separate[i * G + j].logprobs[0], atol=1e-4)
    prompt_tokens = sum(map(len, prompts))
    assert middle["engine/prefill_tokens"] - before["engine/prefill_tokens"] == prompt_tokens
    assert middle["engine/prefill_tokens_saved"] - before["engine/prefill_tokens_saved"] == (G - 1) * prompt_tokens
    assert after["engine/prefill_tokens"] - middle["engine/prefill_tokens"] == G * prompt_tokens
    assert after["engine/prefill_tokens_saved"] == middle["engine/prefill_tokens_saved"]
    assert 0 < after["engine/slot_occupancy"] <= 1


def test_samples_follow_the_static_samplers_distribution(engine, static, model):
    """Chi-square: the first two tokens of 3000 engine samples (groups of 100 sharing a prefill, spread over
    slots) against 3000 static-sampler samples with independent keys, and the first token against the model's
    exact distribution."""
    prompt = [7, 3, 250, 41, 99]
    n = 3000
    engine_keys = jax.random.split(jax.random.key(11), n).reshape(30, 100)
    for i, k in enumerate(engine_keys):
        engine.submit(prompt, k, tag=i, max_new_tokens=2)
    got = []
    while engine.busy:
        got += [t[:2] for result in engine.step() for t in result.tokens]
    want = static.generate([prompt] * n, jax.random.split(jax.random.key(12), n), max_new_tokens=2)
    pairs = [tuple(t) + (-1,) * (2 - len(t)) for t in got], [tuple(want.tokens[i, :want.lengths[i]]) + (-1,) * (
        2 - want.lengths[i]) for i in range(n)]
    cells = sorted(set(pairs[0]) | set(pairs[1]))
    table = np.array([[side.count(c) for c in cells] for side in pairs])
    frequent = table.sum(0) >= 10
    table = np.concatenate([table[:, frequent], table[:, ~frequent].sum(1, keepdims=True)], axis=1)
    assert table.shape[1] > 5, table  # enough distinct outcomes for the test to mean something
    assert scipy.stats.chi2_contingency(table).pvalue > 1e-3, table
    first = np.bincount([t[0] for t in got], minlength=VOCAB)
    exact = np.exp(np.asarray(jax.nn.log_softmax(model(jnp.asarray([prompt]))[0][0, -1]), np.float64))
    common = exact * n >= 5
    observed = np.append(first[common], first[~common].sum())
    expected = np.append(exact[common], exact[~common].sum())
    assert scipy.stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue > 1e-3


def test_no_recompile_over_a_long_run(engine, model):
    """After warm_up, 120 groups arriving a few at a time, with prompt lengths 1-16, token limits 1-12, weight
    updates every third chunk and banks draining and refilling, compile nothing: no trace, no XLA compile."""
    other = nnx.state(_model())
    engine.update_params(other, version=1)  # the first update's head transpose is an eager op: compile it here
    engine.update_params(nnx.state(model), version=0)
    keys = np.asarray(jax.random.key_data(_group_keys(120, 2)))  # made before counting: eager ops compile
    events = []

    def listen(event, duration, **kwargs):
        if event.endswith(("jaxpr_trace_duration", "backend_compile_duration")):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        before = engine.num_compilations
        rng = np.random.default_rng(2)
        submitted, finished, chunks = 0, 0, 0
        while finished < 120:
            for _ in range(rng.integers(0, 4)):
                if submitted < 120:
                    engine.submit(rng.integers(1, VOCAB, rng.integers(1, 17)), keys[submitted],
                                  max_new_tokens=int(rng.integers(1, MAX_NEW + 1)))
                    submitted += 1
            finished += len(engine.step())
            chunks += 1
            if chunks % 3 == 0:
                engine.update_params(other if chunks % 2 else nnx.state(model), version=chunks)
        assert engine.num_compilations == before
        assert events == []
    finally:
        jax.monitoring.clear_event_listeners()  # (jax keeps no other listeners in tests)
        engine.update_params(nnx.state(model), version=0)
    assert chunks > 60


def _head_scaled(model, factor):
    """The model with its LM head scaled: another policy whose keys/values (layers) are the same."""
    state = jax.tree.map(lambda x: x, nnx.state(model))
    scaled = nnx.merge(nnx.graphdef(model), state)
    scaled.lm_head.set_value(scaled.lm_head.get_value() * factor)
    return scaled


def test_inflight_updates_tag_tokens_and_behaviour_logprobs(engine, model):
    """Weights alternate between A and B (A's LM head halved) after every chunk, with samples in flight. Every
    token carries the version that drew it, its log-prob is that version's, a group's version is its oldest
    token's, and the learner's off-policy weights are computed per token from those log-probs."""
    b_model = _head_scaled(model, 0.5)
    weights = {0: nnx.state(model), 1: nnx.state(b_model)}
    models = {0: model, 1: b_model}
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, rng.integers(1, 17, 16))
    try:
        results = _run(engine, prompts, _group_keys(len(prompts), 3),
                       between_steps=lambda step: engine.update_params(weights[step % 2], version=step))
    finally:
        engine.update_params(nnx.state(model), version=0)
    mixed = 0
    for prompt, result in zip(prompts, results):
        assert result.oldest_version == min(int(v.min()) for v in result.versions)
        for tokens, logprobs, versions in zip(result.tokens, result.logprobs, result.versions):
            assert (np.diff(versions) >= 0).all() and len(versions) == len(tokens)
            mixed += len(set(versions.tolist())) > 1
            for version in set(versions.tolist()):
                at = versions == version
                own = _full_forward_logprobs(models[version % 2], prompt, tokens)
                np.testing.assert_allclose(logprobs[at], own[at], atol=1e-4)
    assert mixed >= 3

    # The learner's rows: per-token behaviour log-probs in place, and per-token importance weights from them.
    groups = [Group(ordinal=i, prompt={"prompt_ids": p}, completions=r.tokens, behaviour_logprobs=r.logprobs,
                    rewards=np.zeros(G, np.float32), weight_version=r.oldest_version,
                    advantages=np.ones(G, np.float32), token_versions=r.versions)
              for i, (p, r) in enumerate(zip(prompts, results))]
    rows_prompts, completions, logprobs, advantages, _ = group_rows(groups, G)
    batch = pack_batch(rows_prompts, completions, logprobs, advantages, PAD, 16, MAX_NEW)
    versions = np.zeros(batch.behaviour_logprobs.shape, np.int32)
    for row, r in enumerate(v for result in results for v in result.versions):
        versions[row, 15:15 + len(r)] = r
    mask = np.asarray(batch.loss_mask) > 0
    np.testing.assert_array_equal(np.asarray(batch.behaviour_logprobs)[mask],
                                  np.concatenate([lp for result in results for lp in result.logprobs]))
    proximal = np.asarray(jitted_token_logprobs(model, batch.tokens, batch.input_mask)[0])  # the learner holds A
    _, metrics = policy_loss(jnp.asarray(proximal), jnp.asarray(proximal), batch.behaviour_logprobs, None,
                             batch.advantages, batch.loss_mask, LossConfig(off_policy="tis"))
    weight = np.exp(proximal - np.asarray(batch.behaviour_logprobs))
    a_tokens, b_tokens = mask & (versions % 2 == 0), mask & (versions % 2 == 1)
    np.testing.assert_allclose(weight[a_tokens], 1.0, atol=2e-4)  # drawn by the learner's own weights
    assert np.abs(weight[b_tokens] - 1.0).max() > 0.1  # drawn by B: corrected token by token
    np.testing.assert_allclose(float(metrics["tis/weight_mean"]), weight[mask].mean(), rtol=1e-5)


def test_without_inflight_updates_new_weights_wait_for_the_slots_to_drain(engine, model):
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, [6, 11, 3, 8])
    keys = _group_keys(len(prompts), 4)
    engine.config = dataclasses.replace(CONFIG, inflight_updates=False)
    try:
        for i, (prompt, k) in enumerate(zip(prompts[:2], keys[:2])):
            engine.submit(prompt, k, tag=i)
        first = engine.step()
        engine.update_params(nnx.state(_head_scaled(model, 0.5)), version=1)
        assert engine.version == 0 and engine.active_slots > 0  # held back: samples are in flight
        for i, (prompt, k) in enumerate(zip(prompts[2:], keys[2:]), start=2):
            engine.submit(prompt, k, tag=i)
        waiting = engine.waiting_samples
        results = first
        while engine.active_slots and engine.version == 0:
            results += engine.step()
            if engine.version == 0:
                assert engine.waiting_samples == waiting  # nothing new starts while new weights wait
        while engine.busy:
            results += engine.step()
        assert engine.version == 1
    finally:
        engine.config = CONFIG
        engine.update_params(nnx.state(model), version=0)
    for result in results:
        assert result.version_spread == 0  # every group drawn by one version
        assert result.oldest_version == (0 if result.tag < 2 else 1)


def test_generate_while_busy_leaves_the_slots_alone(engine, static):
    """generate() with samples in flight (an evaluation between two chunks) runs on the same weights without
    touching the slots; idle, the engine does the work itself. Both draw what the static sampler draws."""
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, [3, 14, 8, 8])
    keys = jax.random.split(jax.random.key(5), len(prompts))
    want = static.generate(prompts, keys)
    in_flight = _prompts(rng, [10])
    flight_keys = _group_keys(1, 6)
    engine.submit(in_flight[0], flight_keys[0], tag="in flight")
    engine.step()
    busy = engine.generate(prompts, keys)
    rest = []
    while engine.busy:
        rest += engine.step()
    idle = engine.generate(prompts, keys)
    alone = _run(engine, in_flight, flight_keys)
    for got in (busy, idle):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        assert got.finish_reasons == want.finish_reasons
    for j in range(G):
        np.testing.assert_array_equal(rest[0].tokens[j], alone[0].tokens[j])


@pytest.mark.parametrize("inflight", [True, False])
def test_trainer_with_the_engine_accounts_for_every_prompt(tmp_path, inflight):
    """An async run on the continuous engine with chunks of one step, so that new weights arrive while samples
    are in flight: every prompt trained or dropped once, the staleness bound holds for the oldest token of every
    group, and the engine's metrics are logged. In-flight updates on: groups hold tokens of two versions; off:
    never, and the held-back weights are adopted as the slots drain (the run does not wait for them)."""
    from grpo_jax.run.trainer import Trainer
    from test_trainer import assert_every_ordinal_accounted_once, tiny_config
    config = tiny_config(tmp_path, "sampler.engine=continuous", "sampler.chunk_steps=1", "trainer.max_steps=6",
                         "grpo.max_staleness=1", f"sampler.inflight_updates={str(inflight).lower()}",
                         "eval.every_steps=3", "eval.num_prompts=4", "eval.samples=2", "eval.synthetic_size=200",
                         "data.synthetic_min_digits=2", "data.synthetic_max_digits=2", "data.synthetic_size=40")
    history = Trainer(config).train()
    assert len(history) == 6
    assert_every_ordinal_accounted_once(tmp_path)
    # Evaluations ran as side jobs between chunks (the engine's generate, on the static sampler while busy).
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [row["eval/requested_step"] for row in evals] == [0, 3, 6] and evals[0]["eval/prompts"] == 4
    for m in history:
        assert m["staleness/max"] <= 1
        assert 0 < m["engine/slot_occupancy"] <= 1 and m["actor/tokens_per_s_per_device"] > 0
    spread = max(m["rollout/version_spread_max"] for m in history)
    assert spread >= 1 if inflight else spread == 0
    held_back = history[-1]["engine/updates_held_back"]
    assert held_back == 0 if inflight else held_back >= 1  # off: new weights did arrive with samples in flight


def test_gemma3_local_layers_keep_only_their_window_and_draw_what_the_static_sampler_draws():
    """Gemma 3's sliding-window layers get a ring of `sliding_window` columns, not the whole prompt + completion:
    writing a token overwrites the one that just left the window. Prompts longer than the window (their first
    tokens never placed) and completions that run past it draw what the static sampler draws (which reads a full
    cache through the window mask), with log-probs equal to one full forward pass."""
    window = 5
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, architecture="gemma3", tie_embeddings=True,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=window,
                         rope_local_theta=10000.0, rope_theta=1e6, query_pre_attn_scalar=24)
    model = create_model(config, seed=3)
    model.embed.set_value(model.embed.get_value() * 8.0)  # tied head: a peaked distribution
    sampler_config = dataclasses.replace(CONFIG, slots=8, decode_streams=1)
    engine = Engine(model, EOS, PAD, sampler_config)
    static = Sampler(model, EOS, PAD, sampler_config)
    try:
        empty = engine._banks[0].state
        assert engine.local_ring == window and empty.local_key_mask.shape == (8, window)
        assert [k.shape[2] for k, _ in empty.cache] == [window, engine.ring]
        rng = np.random.default_rng(4)
        prompts = _prompts(rng, [16, 3, 9, 14, 1, 7])
        keys = _group_keys(len(prompts), 5)
        results = _run(engine, prompts, keys)
        want = static.generate([p for p in prompts for _ in range(G)], keys.reshape(-1))
    finally:
        engine.close()
        static.close()
    assert max(want.lengths) > window
    assert_draws_as_static(results, want)
    for i, result in enumerate(results):
        for j in range(G):
            np.testing.assert_allclose(result.logprobs[j], _full_forward_logprobs(model, prompts[i], result.tokens[j]),
                                       atol=1e-4)


def test_every_path_refuses_a_top_k_above_the_vocabulary_in_one_line(model):
    """The trainer's paths too (submit/step, the continuation engine's extend), not only generate: lax.top_k would
    fail inside their first program with a raw JAX error (issue 36.13; Config.validate refuses it for a run)."""
    from grpo_jax.rollout.continuation import ContinuationEngine

    config = SamplerConfig(engine="continuous", top_k=VOCAB + 1, max_new_tokens=8, max_prompt_len=8, slots=8,
                           decode_streams=1)
    message = f"top_k={VOCAB + 1}: must be <= vocab_size={VOCAB}"
    engine = Engine(model, (), PAD, config)
    with pytest.raises(ValueError, match="generate: " + message):
        engine.generate([[1, 2, 3]], 0)
    with pytest.raises(ValueError, match="submit: " + message):
        engine.submit([1, 2, 3], jax.random.split(jax.random.key(0), 2))
    rows = ContinuationEngine(model, (5,), PAD, config, rows=2, context=16)
    with pytest.raises(ValueError, match="extend: " + message):
        rows.extend([[1, 2, 3], None], [True, False], np.zeros((2, 2), np.uint32), [4, 1])
