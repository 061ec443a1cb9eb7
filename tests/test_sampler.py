"""Sampler tests: exactness against full forward passes, padding/batch independence, stopping, bucketing
and the sampled distributions. Tiny model; samplers are module-scoped so each program compiles once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.rollout.sampler import Sampler, SamplerConfig

VOCAB = 300
PAD = 0
MAX_NEW = 12  # bucket 16: every test below shares the compiled programs of that bucket


def _model():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, qkv_bias=True)
    model = create_model(cfg, seed=1)
    # Sharpen the output distribution (random init gives near-uniform logits) so greedy has clear
    # winners and top-k / top-p cut off real mass.
    model.lm_head.set_value(model.lm_head.get_value() * 60.0)
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, eos_ids=(), pad_id=PAD, config=SamplerConfig(max_new_tokens=MAX_NEW, max_prompt_len=40,
                                                                       min_prompt_bucket=16, min_batch_bucket=4))


@pytest.fixture(scope="module")
def forward(model):
    """Log-softmax (at temperature 1) over a single unpadded sequence, via one full forward pass."""
    length = 64

    @jax.jit
    def logp(tokens):
        logits, _ = model(tokens[None])
        return jax.nn.log_softmax(logits[0].astype(jnp.float32))

    def run(seq):
        padded = np.zeros(length, np.int32)  # right padding: causal attention keeps earlier positions exact
        padded[:len(seq)] = seq
        return np.asarray(logp(padded))[:len(seq)]

    return run


def _prompts(rng, lengths):
    return [list(rng.integers(1, VOCAB, n)) for n in lengths]


def _row_keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def _filtered_logprobs(logp, temperature, top_k, top_p):
    """numpy reference: log-probs after temperature, then top-k, then top-p (sorted, keep while the mass
    before a token is < top_p), renormalised."""
    x = logp.astype(np.float64) / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0)
        p /= p.sum()
    with np.errstate(divide="ignore"):
        return np.log(p)


def test_config_validate():
    assert SamplerConfig().validate() == []
    bad = SamplerConfig(temperature=-1, top_p=0, top_k=-2, max_new_tokens=0, max_prompt_len=-1,
                        decode_streams=0, decode_phases=0).validate()
    assert len(bad) == 7
    assert any(s.startswith("top_p=0:") for s in bad)
    assert any(s.startswith("temperature=-1:") for s in bad)
    with pytest.raises(ValueError, match="top_k"):
        Sampler(None, (), PAD, SamplerConfig(top_k=-1))  # rejected before the model is looked at


def test_logprobs_match_full_forward(sampler, forward):
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, [3, 9, 16, 1, 7])
    res = sampler.generate(prompts, _row_keys(5), temperature=1.0)
    assert res.tokens.shape == (5, MAX_NEW) and res.tokens.dtype == np.int32
    assert res.logprobs.dtype == np.float32
    assert list(res.prompt_lengths) == [3, 9, 16, 1, 7]
    for i, p in enumerate(prompts):
        n = res.lengths[i]
        assert n == MAX_NEW and res.finish_reasons[i] == "length"
        logp = forward(p + list(res.tokens[i, :n]))
        expected = logp[np.arange(len(p) - 1, len(p) + n - 1), res.tokens[i, :n]]
        np.testing.assert_allclose(res.logprobs[i, :n], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k,top_p,temperature", [(5, 1.0, 1.0), (0, 0.7, 1.0), (8, 0.6, 0.7), (0, 1.0, 0.5)])
def test_filtered_logprobs_match_reference(sampler, forward, top_k, top_p, temperature):
    """The logprob returned is that of the distribution actually sampled from, and the token is in its support."""
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, [4, 11, 6])
    res = sampler.generate(prompts, _row_keys(3, 1), temperature=temperature, top_k=top_k, top_p=top_p)
    for i, p in enumerate(prompts):
        seq = p + list(res.tokens[i])
        logp = forward(seq)
        for t in range(MAX_NEW):
            ref = _filtered_logprobs(logp[len(p) - 1 + t], temperature, top_k, top_p)
            tok = res.tokens[i, t]
            assert np.isfinite(ref[tok]), (i, t, tok)
            assert abs(res.logprobs[i, t] - ref[tok]) < 2e-4, (i, t, res.logprobs[i, t], ref[tok])


def test_greedy_matches_full_forward_loop(sampler, forward):
    rng = np.random.default_rng(2)
    prompts = _prompts(rng, [5, 13, 2])
    res = sampler.generate(prompts, 0, temperature=0.0)
    for i, p in enumerate(prompts):
        seq = list(p)
        for t in range(MAX_NEW):
            logp = forward(seq)[-1]
            tok = int(np.argmax(logp))
            assert res.tokens[i, t] == tok, (i, t)
            # greedy logprob: log-softmax of the raw (temperature 1) logits at the argmax
            assert abs(res.logprobs[i, t] - logp[tok]) < 1e-4
            seq.append(tok)


def sampler_model(sampler):
    return nnx.merge(sampler.graphdef, sampler.state)


def test_row_result_independent_of_batch_and_padding(sampler):
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, [4, 7, 15, 2, 10, 6])
    keys = _row_keys(6, 3)
    full = sampler.generate(prompts, keys)
    # Different companions: another prompt-length bucket (padding differs), batch size and order.
    order = [5, 2, 0]
    others = _prompts(rng, [33, 1])
    sub = sampler.generate([prompts[i] for i in order] + others,
                           jnp.concatenate([keys[np.array(order)], _row_keys(2, 99)]))
    solo = sampler.generate([prompts[2]], keys[2:3])
    for j, i in enumerate(order):
        np.testing.assert_array_equal(sub.tokens[j], full.tokens[i])
        np.testing.assert_allclose(sub.logprobs[j], full.logprobs[i], atol=1e-5)
    np.testing.assert_array_equal(solo.tokens[0], full.tokens[2])
    # One stream instead of two (other chunking, other batch shape): same rows.
    single = Sampler(sampler_model(sampler), (), PAD, dataclasses.replace(sampler.config, decode_streams=1))
    np.testing.assert_array_equal(single.generate(prompts, keys).tokens, full.tokens)
    # Key forms: raw uint32 key data gives the same as typed keys; an int seed is reproducible.
    raw = sampler.generate(prompts, jax.random.key_data(keys))
    np.testing.assert_array_equal(raw.tokens, full.tokens)
    a, b = sampler.generate(prompts, 7), sampler.generate(prompts, 7)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_eos_stopping_and_finish_reasons(model, forward):
    eos = tuple(range(1, 120))  # ~40% of the vocab: most rows stop early, some may run to the limit
    s = Sampler(model, eos_ids=eos, pad_id=PAD, config=SamplerConfig(max_new_tokens=MAX_NEW, min_prompt_bucket=16))
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, [3] * 5 + [8] * 5 + [12] * 6)
    res = s.generate(prompts, _row_keys(16, 4))
    assert "stop" in res.finish_reasons
    for i, p in enumerate(prompts):
        n = res.lengths[i]
        toks = res.tokens[i]
        assert not np.isin(toks[:n - 1], eos).any()
        assert (toks[n:] == PAD).all() and (res.logprobs[i, n:] == 0).all()
        if res.finish_reasons[i] == "stop":
            assert toks[n - 1] in eos
        else:
            assert n == MAX_NEW and toks[n - 1] not in eos
        logp = forward(p + list(toks[:n]))
        expected = logp[np.arange(len(p) - 1, len(p) + n - 1), toks[:n]]
        np.testing.assert_allclose(res.logprobs[i, :n], expected, atol=1e-4, rtol=0)


def test_decode_phases_change_no_result(model, forward):
    """Decoding in phases over a growing cache (bucket 32: two phases) gives what one loop over the whole
    cache gives, with the runtime limit and eos stops falling inside a phase."""
    rng = np.random.default_rng(8)
    prompts = _prompts(rng, [3, 17, 9, 30, 1])
    cfg = SamplerConfig(max_new_tokens=27, max_prompt_len=40, min_prompt_bucket=16)
    eos = tuple(range(1, 30))
    phased = Sampler(model, eos, PAD, cfg).generate(prompts, _row_keys(5, 8))
    single = Sampler(model, eos, PAD, dataclasses.replace(cfg, decode_phases=1)).generate(prompts, _row_keys(5, 8))
    assert "stop" in phased.finish_reasons and "length" in phased.finish_reasons
    np.testing.assert_array_equal(phased.tokens, single.tokens)
    np.testing.assert_allclose(phased.logprobs, single.logprobs, atol=1e-5)
    for i, p in enumerate(prompts):
        n = phased.lengths[i]
        logp = forward(p + list(phased.tokens[i, :n]))
        expected = logp[np.arange(len(p) - 1, len(p) + n - 1), phased.tokens[i, :n]]
        np.testing.assert_allclose(phased.logprobs[i, :n], expected, atol=1e-4, rtol=0)


def test_max_new_tokens_and_prompt_limit(sampler):
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, [5, 6])
    res = sampler.generate(prompts, 0, max_new_tokens=9)  # runtime limit, same program as MAX_NEW
    assert res.tokens.shape == (2, 9) and list(res.lengths) == [9, 9]
    assert res.finish_reasons == ["length", "length"]
    with pytest.raises(ValueError, match=r"prompt 1 has 41 tokens, more than max_prompt_len=40"):
        sampler.generate([[1, 2], [3] * 41], 0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sampler.generate([[]], 0)
    with pytest.raises(ValueError, match=f"top_k={VOCAB + 1}: must be <= vocab_size={VOCAB}"):
        sampler.generate(prompts, 0, top_k=VOCAB + 1)


def test_no_recompile_within_bucket_and_weight_update(model):
    s = Sampler(model, eos_ids=(5,), pad_id=PAD, config=SamplerConfig(max_new_tokens=MAX_NEW, min_prompt_bucket=16,
                                                                     min_batch_bucket=4))
    rng = np.random.default_rng(6)
    first = s.generate(_prompts(rng, [3, 4]), 0)
    assert s.num_compilations == 1
    for i, (lengths, max_new, temp) in enumerate([([16, 2, 9], 9, 0.7), ([1], 16, 1.3), ([12, 12, 5, 8], 13, 1.0)]):
        s.generate(_prompts(rng, lengths), i, max_new_tokens=max_new, temperature=temp)
    assert s.num_compilations == 1
    s.generate(_prompts(rng, [20]), 0)  # next prompt bucket: one more program
    assert s.num_compilations == 2
    # New weights: no recompile, and the outputs follow the new weights.
    other = _model()
    other.lm_head.set_value(-other.lm_head.get_value())
    s.update_params(other)
    prompts = _prompts(np.random.default_rng(6), [3, 4])
    again = s.generate(prompts, 0)
    assert s.num_compilations == 2
    s.update_params(model)
    back = s.generate(prompts, 0)
    assert not np.array_equal(again.tokens, back.tokens)
    del first


# ------------------------------------------------------------------ distribution of sample_logits itself


def _draw(logits, temperature, top_k, top_p, n=200_000, block=8, seed=0):
    b = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    u = jax.random.uniform(jax.random.key(seed), (n,))
    f = jax.jit(lambda b, u: sample_logits(b, u, temperature, top_p, greedy=False, top_k=top_k,
                                           use_top_p=top_p < 1, block=block))
    tok, lp = f(b, u)
    return np.asarray(tok), np.asarray(lp)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.6, 0, 1.0), (2.5, 0, 1.0), (1.0, 7, 1.0), (0.8, 0, 0.75), (1.3, 12, 0.5), (1.0, 0, 0.05)])
def test_sampled_distribution(temperature, top_k, top_p):
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 1.5, 37)  # 37: not a multiple of the block, so the padded tail is exercised
    want = np.exp(_filtered_logprobs(logits, temperature, top_k, top_p))
    tok, lp = _draw(logits, temperature, top_k, top_p)
    counts = np.bincount(tok, minlength=len(logits))
    assert counts[want == 0].sum() == 0  # nothing outside the support
    support = want > 0
    if support.sum() > 1:
        stat = scipy.stats.chisquare(counts[support], want[support] * len(tok))
        assert stat.pvalue > 1e-3, (stat, counts[support], want[support] * len(tok))
    np.testing.assert_allclose(lp, np.log(want[tok]), atol=1e-5)


def test_inverse_cdf_edges():
    """u at the ends of [0, 1) and -inf logits (zero mass) never yield a zero-probability token."""
    logits = np.full(50, -np.inf, np.float32)
    logits[[0, 17, 40]] = [0.0, 1.0, -2.0]
    u = jnp.array([0.0, 1e-9, 0.5, 1 - 2 ** -24, 0.9999999], jnp.float32)
    b = jnp.broadcast_to(jnp.asarray(logits), (len(u), 50))
    for top_k, top_p in [(0, 1.0), (3, 1.0), (0, 0.9)]:
        tok, lp = jax.jit(lambda b, u: sample_logits(b, u, 1.0, top_p, greedy=False, top_k=top_k,
                                                     use_top_p=top_p < 1, block=8))(b, u)
        assert set(np.asarray(tok).tolist()) <= {0, 17, 40}
        assert np.isfinite(np.asarray(lp)).all()
    # Greedy: the first maximum, found through block maxima; here in the padded last block.
    logits[49] = logits[45] = 3.0
    tok, lp = jax.jit(lambda x: sample_logits(x, u[:1], 0.0, 1.0, greedy=True, top_k=0, use_top_p=False,
                                              block=8))(jnp.asarray(logits)[None])
    assert int(tok[0]) == 45
    np.testing.assert_allclose(lp, jax.nn.log_softmax(jnp.asarray(logits))[45], atol=1e-6)
