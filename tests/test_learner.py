"""The jitted learner step: accumulation is exact, bad steps are skipped, mixed precision keeps f32 masters."""

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
    loss = LossConfig(aggregation=aggregation, max_completion_len=COMPLETION_LEN, tis="truncate")
    batch = random_batch(0)
    start = params_of(Learner(create_model(MODEL, seed=1), OptimConfig(**optim), loss))
    whole = Learner(create_model(MODEL, seed=1), OptimConfig(**optim), loss)
    split = Learner(create_model(MODEL, seed=1), OptimConfig(**optim, micro_batch_size=micro), loss)
    m_whole, m_split = whole.step(batch), split.step(batch)
    moved = max_param_diff(start, params_of(whole))
    assert moved > 1e-3
    assert max_param_diff(params_of(whole), params_of(split)) < 1e-5 * moved
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)


def test_non_finite_steps_are_skipped_then_stop_the_run():
    learner = Learner(create_model(MODEL), OptimConfig(lr=1e-2, max_nonfinite_in_row=2), LossConfig())
    before = params_of(learner)
    bad = dataclasses.replace(random_batch(1), advantages=jnp.array([np.nan, 1.0, 0.0, 1.0]))
    metrics = learner.step(bad)
    assert metrics["nonfinite_total"] == 1
    assert max_param_diff(before, params_of(learner)) == 0.0
    learner.step(random_batch(2))  # a good step resets the run of bad ones
    assert learner.nonfinite_in_row == 0 and learner.steps_done == 1
    learner.step(bad)
    with pytest.raises(NonFiniteError, match="2 learner steps in a row"):
        learner.step(bad)


def test_bfloat16_compute_keeps_float32_master_weights_and_matches_float32():
    batch = random_batch(3)
    f32 = Learner(create_model(MODEL, seed=2), OptimConfig(lr=1e-3), LossConfig())
    bf16 = Learner(create_model(dataclasses.replace(MODEL, dtype="bfloat16"), seed=2), OptimConfig(lr=1e-3),
                   LossConfig())
    m32, m16 = f32.step(batch), bf16.step(batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16.params))
    assert np.isfinite(m16["loss"])
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.1)


def test_remat_changes_memory_not_results():
    batch = random_batch(4)
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0)  # update ~ gradient (see the accumulation test)
    plain = Learner(create_model(MODEL, seed=5), optim, LossConfig())
    remat = Learner(create_model(dataclasses.replace(MODEL, remat=True), seed=5), optim, LossConfig())
    m_plain, m_remat = plain.step(batch), remat.step(batch)
    assert m_plain["grad_norm"] > 1e-3
    assert max_param_diff(params_of(plain), params_of(remat)) < 1e-5 * m_plain["grad_norm"]


def test_kl_to_reference_is_zero_at_start_and_skipped_when_off():
    batch = random_batch(5)
    with pytest.raises(ValueError, match="needs a reference model"):
        Learner(create_model(MODEL), OptimConfig(), LossConfig(kl_coef=0.04))
    learner = Learner(create_model(MODEL, seed=7), OptimConfig(lr=1e-2), LossConfig(kl_coef=0.04),
                      reference_model=create_model(MODEL, seed=7))
    first = learner.step(batch)
    second = learner.step(batch)
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
