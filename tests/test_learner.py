"""The jitted learner step: accumulation is exact, several updates per step match an independent reference,
bad updates are skipped, mixed precision keeps f32 masters, log-probs use the sampler's temperature."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.learner import (Learner, NonFiniteError, OptimConfig, TrainBatch, learning_rate_schedule,
                              pack_batch, token_logprobs)
from grpo_jax.losses import LossConfig
from grpo_jax.model import ModelConfig, create_model

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)
PROMPT_LEN, COMPLETION_LEN = 6, 5


def random_batch(seed: int, size: int = 4) -> TrainBatch:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, MODEL.vocab_size, rng.integers(2, PROMPT_LEN + 1))) for _ in range(size)]
    completions = [list(rng.integers(1, MODEL.vocab_size, rng.integers(1, COMPLETION_LEN + 1)))
                   for _ in range(size)]
    behaviour = [rng.normal(-3.0, 0.3, len(c)) for c in completions]
    return pack_batch(prompts, completions, behaviour, rng.normal(size=size), pad_id=0,
                      prompt_len=PROMPT_LEN, completion_len=COMPLETION_LEN)


def params_of(learner):
    return jax.tree.map(np.asarray, jax.device_get(learner.params))


def max_param_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("aggregation, micro", [("token_mean", 1), ("seq_mean_token_mean", 2),
                                                ("seq_mean_token_sum_norm", 2)])
def test_micro_batches_give_the_whole_batch_update(aggregation, micro):
    # eps=1 makes Adam's first update ~ lr * g, so the comparison sees gradient differences, not the
    # sign-like g/|g| that amplifies rounding noise in near-zero gradients.
    optim = dict(lr=1.0, eps=1.0, grad_clip=0.0)
    loss = LossConfig(aggregation=aggregation, max_completion_len=COMPLETION_LEN, off_policy="tis")
    batch = random_batch(0)
    start = params_of(Learner(create_model(MODEL, seed=1), OptimConfig(**optim), loss))
    whole = Learner(create_model(MODEL, seed=1), OptimConfig(**optim), loss)
    split = Learner(create_model(MODEL, seed=1), OptimConfig(**optim, micro_batch_size=micro), loss)
    (m_whole, _), (m_split, _) = whole.step(batch), split.step(batch)
    moved = max_param_diff(start, params_of(whole))
    assert moved > 1e-3
    assert max_param_diff(params_of(whole), params_of(split)) < 1e-5 * moved
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)


def test_non_finite_steps_are_skipped_then_stop_the_run():
    learner = Learner(create_model(MODEL), OptimConfig(lr=1e-2, max_nonfinite_in_row=2), LossConfig())
    before = params_of(learner)
    bad = dataclasses.replace(random_batch(1), advantages=jnp.array([np.nan, 1.0, 0.0, 1.0]))
    metrics, applied = learner.step(bad)
    assert metrics["nonfinite_total"] == 1 and applied.tolist() == [False]
    assert max_param_diff(before, params_of(learner)) == 0.0
    assert learner.diverged(1) is None
    _, applied = learner.step(random_batch(2))  # a good step resets the run of bad ones
    assert applied.tolist() == [True] and learner.nonfinite_in_row == 0 and learner.steps_done == 1
    last_loss = learner.last_finite_loss
    learner.step(bad)
    assert learner.diverged(3) is None
    learner.step(bad)
    error = learner.diverged(4)
    assert isinstance(error, NonFiniteError)
    assert "learner step 4: 2 steps in a row" in str(error) and f"last finite loss {last_loss:.6g}" in str(error)


def test_one_bad_mini_batch_skips_only_its_updates():
    # Row 0 is NaN: with 2 mini-batches (rows 0, 2 | rows 1, 3), updates on mini-batch 0 are skipped.
    optim = OptimConfig(lr=1e-2, mini_batches=2, epochs=2)
    learner = Learner(create_model(MODEL), optim, LossConfig())
    bad = dataclasses.replace(random_batch(1), advantages=jnp.array([np.nan, 1.0, 0.0, 1.0]))
    metrics, applied = learner.step(bad)
    assert applied.tolist() == [False, True, False, True]
    assert metrics["updates/applied"] == 2 and learner.updates_done == 2 and learner.nonfinite_in_row == 1


def test_bfloat16_compute_keeps_float32_master_weights_and_matches_float32():
    batch = random_batch(3)
    f32 = Learner(create_model(MODEL, seed=2), OptimConfig(lr=1e-3), LossConfig())
    bf16 = Learner(create_model(dataclasses.replace(MODEL, dtype="bfloat16"), seed=2), OptimConfig(lr=1e-3),
                   LossConfig())
    (m32, _), (m16, _) = f32.step(batch), bf16.step(batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16.params))
    assert np.isfinite(m16["loss"])
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.1)


def test_remat_changes_memory_not_results():
    batch = random_batch(4)
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0)  # update ~ gradient (see the accumulation test)
    plain = Learner(create_model(MODEL, seed=5), optim, LossConfig())
    remat = Learner(create_model(dataclasses.replace(MODEL, remat=True), seed=5), optim, LossConfig())
    (m_plain, _), (m_remat, _) = plain.step(batch), remat.step(batch)
    assert m_plain["grad_norm"] > 1e-3
    assert max_param_diff(params_of(plain), params_of(remat)) < 1e-5 * m_plain["grad_norm"]


def test_kl_to_reference_is_zero_at_start_and_skipped_when_off():
    batch = random_batch(5)
    with pytest.raises(ValueError, match="needs a reference model"):
        Learner(create_model(MODEL), OptimConfig(), LossConfig(kl_coef=0.04))
    learner = Learner(create_model(MODEL, seed=7), OptimConfig(lr=1e-2), LossConfig(kl_coef=0.04),
                      reference_model=create_model(MODEL, seed=7))
    first, _ = learner.step(batch)
    second, _ = learner.step(batch)
    assert first["kl/mean"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl/mean"] > 0.0
    assert Learner(create_model(MODEL), OptimConfig(), LossConfig()).ref_params is None


def test_token_logprobs_match_log_softmax_of_full_forward():
    model = create_model(MODEL, seed=3)
    batch = random_batch(6)
    logprobs, entropy = token_logprobs(model, batch.tokens, batch.input_mask, with_entropy=True)
    from grpo_jax.model import positions_from_mask
    logits, _ = model(batch.tokens, positions_from_mask(batch.input_mask), batch.input_mask)
    logp_all = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    expected = jnp.take_along_axis(logp_all, batch.tokens[:, 1:, None], axis=-1)[..., 0]
    mask = np.asarray(batch.loss_mask) > 0
    np.testing.assert_allclose(np.asarray(logprobs)[mask], np.asarray(expected)[mask], atol=1e-5)
    expected_entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    np.testing.assert_allclose(np.asarray(entropy)[mask], np.asarray(expected_entropy)[mask], atol=1e-4)


def test_pack_batch_layout():
    batch = pack_batch([[5, 6]], [[7, 8, 9]], [np.array([-1.0, -2.0, -3.0])], np.array([0.5]), pad_id=0,
                       prompt_len=4, completion_len=4)
    assert batch.tokens.tolist() == [[0, 0, 5, 6, 7, 8, 9, 0]]
    assert batch.input_mask.tolist() == [[False, False, True, True, True, True, True, False]]
    # index t scores token t+1: the completion tokens 7, 8, 9 are scored at 3, 4, 5
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0, 0, 0, -1, -2, -3, 0]]
    with pytest.raises(ValueError, match="row 0"):
        pack_batch([[1] * 5], [[1]], [np.zeros(1)], np.zeros(1), 0, prompt_len=4, completion_len=4)


def test_schedule_warmup_then_cosine():
    schedule = learning_rate_schedule(OptimConfig(lr=1.0, warmup_steps=10, decay_steps=100, min_lr_ratio=0.1))
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(0.5)
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(110)) == pytest.approx(0.1)


def test_schedule_counts_learner_steps_not_updates():
    per_update = learning_rate_schedule(OptimConfig(lr=1.0, warmup_steps=10, mini_batches=2, epochs=2))
    assert [float(per_update(u)) for u in (0, 3, 4, 20, 40)] == pytest.approx([0.0, 0.0, 0.1, 0.5, 1.0])


def full_forward_logprobs(graphdef, params, batch: TrainBatch, rows, temperature: float):
    """[rows, L-1] log-probs of the next tokens from the model's plain forward pass and a log-softmax."""
    from grpo_jax.model import positions_from_mask
    tokens, mask = batch.tokens[rows], batch.input_mask[rows]
    logits, _ = nnx.merge(graphdef, params)(tokens, positions_from_mask(mask), mask)
    logp_all = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
    return jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]


def reference_learner_step(model, batch: TrainBatch, optim: OptimConfig, loss: LossConfig, temperature: float):
    """The whole multi-update step written out: old log-probs once, then for each epoch and strided
    mini-batch a clipped, truncated-IS-weighted token-mean loss, its gradient, global-norm clipping and
    AdamW in NumPy (float64)."""
    graphdef, params = nnx.split(model)
    size = batch.advantages.shape[0]
    old = full_forward_logprobs(graphdef, params, batch, np.arange(size), temperature)
    flat, treedef = jax.tree.flatten(params)
    p = [np.asarray(x, np.float64) for x in flat]
    m1 = [np.zeros_like(x) for x in p]
    m2 = [np.zeros_like(x) for x in p]
    count = 0
    for _ in range(optim.epochs):
        for mini in range(optim.mini_batches):
            rows = np.arange(mini, size, optim.mini_batches)

            def loss_fn(params):
                logp = full_forward_logprobs(graphdef, params, batch, rows, temperature)
                mask, adv = batch.loss_mask[rows], batch.advantages[rows][:, None]
                ratio = jnp.exp(logp - old[rows])
                objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - loss.clip_low, 1 + loss.clip_high) * adv)
                weight = jnp.minimum(jnp.exp(old[rows] - batch.behaviour_logprobs[rows]), loss.tis_cap)
                return jnp.sum(-objective * weight * mask) / jnp.sum(mask)

            grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.grad(loss_fn)(
                jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32) for x in p])))]
            norm = np.sqrt(sum(np.sum(g * g) for g in grads))
            grads = [g * min(1.0, optim.grad_clip / norm) for g in grads]
            count += 1
            for i, g in enumerate(grads):
                m1[i] = optim.b1 * m1[i] + (1 - optim.b1) * g
                m2[i] = optim.b2 * m2[i] + (1 - optim.b2) * g * g
                m_hat, v_hat = m1[i] / (1 - optim.b1 ** count), m2[i] / (1 - optim.b2 ** count)
                p[i] = p[i] - optim.lr * (m_hat / (np.sqrt(v_hat) + optim.eps) + optim.weight_decay * p[i])
    return jax.tree.unflatten(treedef, p)


@pytest.mark.parametrize("mini_batches, epochs, micro", [(2, 2, 2), (4, 1, 0), (1, 3, 4)])
def test_multi_update_step_matches_reference(mini_batches, epochs, micro):
    temperature = 0.7
    optim = OptimConfig(lr=0.3, eps=1.0, grad_clip=1.0, weight_decay=0.01, mini_batches=mini_batches,
                        epochs=epochs, micro_batch_size=micro)
    loss = LossConfig(clip_low=0.2, clip_high=0.28, off_policy="tis", tis_cap=2.0)
    batch = random_batch(11, size=8)
    expected = reference_learner_step(create_model(MODEL, seed=4), batch, optim, loss, temperature)
    learner = Learner(create_model(MODEL, seed=4), optim, loss, temperature=temperature)
    start = params_of(learner)
    metrics, applied = learner.step(batch)
    assert applied.all() and len(applied) == mini_batches * epochs
    moved = max_param_diff(start, expected)
    assert moved > 1e-2
    assert max_param_diff(params_of(learner), expected) < 2e-4 * moved
    # After the first update the ratio moves away from 1 and the clip acts.
    assert metrics["ratio/max"] > 1.0 + 1e-4 and metrics["approx_kl_old"] > 0


def test_mini_batches_make_the_clip_act():
    batch = random_batch(12, size=8)
    loss = LossConfig(clip_low=0.2, clip_high=0.28)
    one = Learner(create_model(MODEL, seed=6), OptimConfig(lr=0.05), loss)
    four = Learner(create_model(MODEL, seed=6), OptimConfig(lr=0.05, mini_batches=4), loss)
    (m_one, _), (m_four, _) = one.step(batch), four.step(batch)
    assert m_one["clip/frac_low"] == 0.0 and m_one["clip/frac_high"] == 0.0 and m_one["ratio/max"] == 1.0
    assert m_four["clip/frac_low"] + m_four["clip/frac_high"] > 0.0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_token_logprobs_use_the_temperature(temperature):
    model = create_model(MODEL, seed=3)
    batch = random_batch(6)
    logprobs, _ = token_logprobs(model, batch.tokens, batch.input_mask, temperature=temperature)
    graphdef, params = nnx.split(model)
    expected = full_forward_logprobs(graphdef, params, batch, np.arange(4), temperature)
    mask = np.asarray(batch.loss_mask) > 0
    np.testing.assert_allclose(np.asarray(logprobs)[mask], np.asarray(expected)[mask], atol=1e-5)


def test_bfloat16_master_weights_keep_their_dtype_through_several_updates():
    model = create_model(dataclasses.replace(MODEL, dtype="bfloat16", param_dtype="bfloat16"), seed=2)
    learner = Learner(model, OptimConfig(lr=1e-2, mini_batches=2, epochs=2), LossConfig())
    metrics, applied = learner.step(random_batch(3))
    assert applied.all() and np.isfinite(metrics["loss"])
    assert {x.dtype for x in jax.tree.leaves(learner.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("seed", range(5))
def test_pack_batch_matches_a_row_by_row_reference(seed):
    rng = np.random.default_rng(seed)
    size, prompt_len, completion_len = 7, 9, 6
    prompts = [rng.integers(1, 50, rng.integers(1, prompt_len + 1)) for _ in range(size)]
    completions = [rng.integers(1, 50, rng.integers(0, completion_len + 1)) for _ in range(size)]
    logprobs = [rng.normal(size=len(c) + int(rng.integers(0, 3))) for c in completions]  # may run longer
    batch = pack_batch(prompts, completions, logprobs, rng.normal(size=size), pad_id=0, prompt_len=prompt_len,
                       completion_len=completion_len)
    length = prompt_len + completion_len
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        tokens = np.zeros(length, np.int32)
        tokens[prompt_len - len(p):prompt_len], tokens[prompt_len:prompt_len + len(c)] = p, c
        mask = np.zeros(length, bool)
        mask[prompt_len - len(p):prompt_len + len(c)] = True
        trained, scored = np.zeros(length - 1, np.float32), np.zeros(length - 1, np.float32)
        trained[prompt_len - 1:prompt_len - 1 + len(c)] = 1.0
        scored[prompt_len - 1:prompt_len - 1 + len(c)] = lp[:len(c)]
        np.testing.assert_array_equal(np.asarray(batch.tokens[i]), tokens)
        np.testing.assert_array_equal(np.asarray(batch.input_mask[i]), mask)
        np.testing.assert_array_equal(np.asarray(batch.loss_mask[i]), trained)
        np.testing.assert_allclose(np.asarray(batch.behaviour_logprobs[i]), scored, rtol=1e-6)
    with pytest.raises(ValueError, match="row 2: 7 tokens exceed the bucket of 6"):
        pack_batch(prompts, completions[:2] + [np.ones(7)] + completions[3:], logprobs, np.zeros(size), 0,
                   prompt_len, completion_len)
