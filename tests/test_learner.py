"""The jitted learner step: accumulation is exact, several updates per step match an independent reference,
bad updates are skipped, mixed precision keeps f32 masters, log-probs use the sampler's temperature."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jitted_token_logprobs
from grpo_jax.algorithm.batch import pack_batch
from grpo_jax.algorithm.learner import Learner, NonFiniteError, OptimConfig, TrainBatch, learning_rate_schedule
from grpo_jax.algorithm.losses import LossConfig
from grpo_jax.model.transformer import ModelConfig, create_model
from test_sampler import _filtered_logprobs  # the sampler's numpy reference: one truth for both

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


def tempered_entropy(logits: np.ndarray, temperature: float) -> np.ndarray:
    """NumPy, float64: the entropy of softmax(logits / temperature) over the last axis (no truncation)."""
    x = logits.astype(np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


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
    # Every metric is the whole batch's, whatever the split (means weighted by what they are over).
    assert set(m_whole) == set(m_split)
    for key in m_whole:
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-6), key


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
    assert m_remat["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-6)
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
    logprobs, entropy = jitted_token_logprobs(model, batch.tokens, batch.input_mask, with_entropy=True)
    from grpo_jax.model.transformer import positions_from_mask
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
    assert float(schedule(0)) == pytest.approx(1 / 11)
    assert float(schedule(5)) == pytest.approx(6 / 11)
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.55)
    assert float(schedule(110)) == pytest.approx(0.1)


def full_forward_logprobs(graphdef, params, batch: TrainBatch, rows, temperature: float):
    """[rows, L-1] log-probs of the next tokens from the model's plain forward pass and a log-softmax."""
    from grpo_jax.model.transformer import positions_from_mask
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
    # jitted (one program each, not one per operation): the reference's math is the same either way
    old = jax.jit(full_forward_logprobs, static_argnums=(0, 4))(graphdef, params, batch, np.arange(size), temperature)

    @jax.jit
    def mini_batch_grads(params, batch, rows):
        def loss_fn(params):
            logp = full_forward_logprobs(graphdef, params, batch, rows, temperature)
            mask, adv = batch.loss_mask[rows], batch.advantages[rows][:, None]
            ratio = jnp.exp(logp - old[rows])
            objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - loss.clip_low, 1 + loss.clip_high) * adv)
            weight = jnp.minimum(jnp.exp(old[rows] - batch.behaviour_logprobs[rows]), loss.tis_cap)
            return jnp.sum(-objective * weight * mask) / jnp.sum(mask)
        return jax.grad(loss_fn)(params)

    flat, treedef = jax.tree.flatten(params)
    p = [np.asarray(x, np.float64) for x in flat]
    m1 = [np.zeros_like(x) for x in p]
    m2 = [np.zeros_like(x) for x in p]
    count = 0
    for _ in range(optim.epochs):
        for mini in range(optim.mini_batches):
            rows = np.arange(mini, size, optim.mini_batches)
            grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(mini_batch_grads(
                jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32) for x in p]), batch, rows))]
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
    logprobs, _ = jitted_token_logprobs(model, batch.tokens, batch.input_mask, temperature=temperature)
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


# ---- samples whose reward failed train nothing (issue 20, item 15) ----------------------------------------


def numpy_first_update_loss(logprobs, batch: TrainBatch, loss: LossConfig) -> float:
    """The loss of a step's first update written out in NumPy (float64): ratio 1, so each token's policy loss
    is -A * min(exp(proximal - behaviour), tis_cap), aggregated over the rows and tokens of loss_mask."""
    mask = np.asarray(batch.loss_mask, np.float64)
    lp = np.where(mask > 0, np.asarray(logprobs, np.float64), 0.0)
    behaviour = np.asarray(batch.behaviour_logprobs, np.float64)
    per_token = -np.asarray(batch.advantages, np.float64)[:, None] * np.minimum(np.exp(lp - behaviour), loss.tis_cap)
    rows = mask.sum(axis=1) > 0
    if loss.aggregation == "token_mean":
        return float((per_token * mask).sum() / mask.sum())
    norm = mask.sum(axis=1) if loss.aggregation == "seq_mean_token_mean" else loss.max_completion_len
    return float(((per_token * mask).sum(axis=1)[rows] / np.broadcast_to(norm, rows.shape)[rows]).mean())


def rows_of(seed: int, size: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, MODEL.vocab_size, rng.integers(2, PROMPT_LEN + 1)) for _ in range(size)]
    completions = [rng.integers(1, MODEL.vocab_size, rng.integers(1, COMPLETION_LEN + 1)) for _ in range(size)]
    behaviour = [rng.normal(-3.0, 0.3, len(c)) for c in completions]
    return prompts, completions, behaviour, rng.normal(size=size)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_failed_rows_train_nothing_like_padding(aggregation):
    # Half the rows failed (their advantage is garbage here, 0 in a run): the step must be the step of the valid
    # rows alone, in loss, gradient and every metric that counts tokens or sequences.
    loss = LossConfig(aggregation=aggregation, max_completion_len=COMPLETION_LEN, off_policy="tis", kl_coef=0.1)
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0)  # update ~ gradient (see the accumulation test)
    prompts, completions, behaviour, advantages = rows_of(21, 8)
    valid = np.array([True, False, True, True, False, False, True, False])
    mixed = pack_batch(prompts, completions, behaviour, advantages, 0, PROMPT_LEN, COMPLETION_LEN, valid=valid)
    keep = np.flatnonzero(valid)
    alone = pack_batch([prompts[i] for i in keep], [completions[i] for i in keep], [behaviour[i] for i in keep],
                       advantages[keep], 0, PROMPT_LEN, COMPLETION_LEN)
    assert np.asarray(mixed.loss_mask)[~valid].sum() == 0
    results = []
    for batch in (mixed, alone):
        # A reference model with other weights, so the KL term has a gradient the failed rows could add to.
        learner = Learner(create_model(MODEL, seed=1), optim, loss, reference_model=create_model(MODEL, seed=2))
        graphdef, params = nnx.split(learner.model())
        start = params_of(learner)
        logprobs = full_forward_logprobs(graphdef, params, batch, np.arange(batch.advantages.shape[0]), 1.0)
        metrics, applied = learner.step(batch)
        assert applied.all()
        results.append((metrics, jax.tree.map(lambda a, b: a - b, params_of(learner), start), logprobs))
    (m_mixed, d_mixed, lp_mixed), (m_alone, d_alone, _) = results
    pg_mixed = numpy_first_update_loss(lp_mixed, mixed, loss)
    assert m_mixed["pg_loss"] == pytest.approx(pg_mixed, rel=1e-4, abs=1e-6)
    assert m_mixed["pg_loss"] == pytest.approx(m_alone["pg_loss"], rel=1e-5, abs=1e-7)
    assert m_mixed["loss"] == pytest.approx(m_alone["loss"], rel=1e-5, abs=1e-7)
    assert m_mixed["kl/mean"] == pytest.approx(m_alone["kl/mean"], rel=1e-5) and m_mixed["kl/mean"] > 0
    assert m_mixed["grad_norm"] == pytest.approx(m_alone["grad_norm"], rel=1e-5)
    moved = max(float(np.abs(x).max()) for x in jax.tree.leaves(d_alone))
    assert moved > 1e-3 and max_param_diff(d_mixed, d_alone) < 1e-5 * moved
    for key in ("num_tokens", "num_seqs", "entropy", "advantage/mean", "tis/weight_mean"):
        assert m_mixed[key] == pytest.approx(m_alone[key], rel=1e-5), key
    assert m_alone["num_seqs"] == valid.sum()


def test_the_trainer_rows_carry_each_samples_validity():
    from grpo_jax.run.trainer import group_rows, row_validity
    from grpo_jax.state.replay_buffer import Group
    groups = [Group(ordinal=i, prompt={"prompt_ids": np.array([3, 4])}, completions=[np.array([5, 6])] * 3,
                    behaviour_logprobs=[np.array([-1.0, -1.0])] * 3, rewards=np.zeros(3, np.float32),
                    weight_version=0, advantages=np.zeros(3, np.float32), valid=valid)
              for i, valid in enumerate([np.array([True, False, True]), np.array([False, True, True])])]
    valid = row_validity(groups, 3, rows=8)  # two rows of padding after the six of the groups
    assert valid.tolist() == [True, False, True, False, True, True, False, False]
    prompts, completions, logprobs, advantages, masks = group_rows(groups, 3)
    assert masks is None  # ordinary groups: every completion token trains
    batch = pack_batch(prompts + [np.array([0])] * 2, completions + [np.zeros(0)] * 2, logprobs + [np.zeros(0)] * 2,
                       np.concatenate([advantages, np.zeros(2)]), 0, 4, 4, valid=valid)
    assert (np.asarray(batch.loss_mask).sum(axis=1) > 0).tolist() == valid.tolist()


# ---- the learner's policy is the sampler's truncated distribution (item 16) -------------------------------


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 0.9, 1.0), (5, 1.0, 0.7), (8, 0.6, 1.3), (0, 1.0, 0.8)])
def test_tempered_logprobs_truncate_like_the_sampler(top_k, top_p, temperature):
    from grpo_jax.algorithm.sampling import tempered_logprobs
    rng = np.random.default_rng(top_k + int(10 * top_p))
    logits = rng.normal(0, 3.0, (6, 40)).astype(np.float32)
    expected = np.stack([_filtered_logprobs(row, temperature, top_k, top_p) for row in logits])
    kept = np.isfinite(expected)
    # Targets: a kept token in each row but the last, whose target is one the truncation drops (when it drops
    # any): it counts as kept, so its log-prob stays finite (weights or logits that moved since sampling).
    targets = np.array([rng.choice(np.flatnonzero(k)) for k in kept])
    dropped = np.flatnonzero(~kept[-1])
    if len(dropped):
        targets[-1] = dropped[0]
    logprobs, entropy = tempered_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature, top_k, top_p,
                                          with_entropy=True)
    logprobs, entropy = np.asarray(logprobs), np.asarray(entropy)
    np.testing.assert_allclose(logprobs[:-1], expected[np.arange(5), targets[:-1]], atol=2e-5)
    last = expected[-1].copy()
    if len(dropped):  # the kept set plus the target, renormalised
        x = logits[-1].astype(np.float64) / temperature
        last = x - np.log(np.exp(x[kept[-1] | (np.arange(40) == targets[-1])]).sum())
    np.testing.assert_allclose(logprobs[-1], last[targets[-1]], atol=2e-5)
    # The entropy is the untruncated tempered distribution's (the entropy bonus's: see the entropy tests below),
    # for every row, the one whose target the truncation drops included.
    np.testing.assert_allclose(entropy, tempered_entropy(logits, temperature), atol=1e-4)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (6, 1.0), (10, 0.8)])
def test_importance_weight_is_one_at_staleness_zero_with_top_p_and_top_k(top_k, top_p):
    from grpo_jax.rollout.sampler import Sampler, SamplerConfig
    temperature, size = 0.9, 8
    model = create_model(MODEL, seed=3)
    # Sharpen the output distribution (random init gives near-uniform logits), so that the truncation cuts
    # off real mass: without it in the learner, the importance weights would average well below 1.
    model.lm_head.set_value(model.lm_head.get_value() * 8.0)
    config = SamplerConfig(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=COMPLETION_LEN,
                           max_prompt_len=PROMPT_LEN, decode_streams=1)
    sampler = Sampler(model, eos_ids=(), pad_id=0, config=config)
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(1, MODEL.vocab_size, rng.integers(2, PROMPT_LEN + 1))) for _ in range(size)]
    result = sampler.generate(prompts, jax.random.split(jax.random.key(5), size))
    sampler.close()
    completions = [result.tokens[i, :result.lengths[i]] for i in range(size)]
    behaviour = [result.logprobs[i, :result.lengths[i]] for i in range(size)]
    batch = pack_batch(prompts, completions, behaviour, rng.normal(size=size), 0, PROMPT_LEN, COMPLETION_LEN)
    mask = np.asarray(batch.loss_mask) > 0
    learner = Learner(model, OptimConfig(lr=1e-3), LossConfig(), temperature=temperature, top_k=top_k, top_p=top_p)
    own = jitted_token_logprobs(learner.model(), batch.tokens, batch.input_mask, temperature=temperature, top_k=top_k,
                         top_p=top_p)[0]
    untruncated = jitted_token_logprobs(learner.model(), batch.tokens, batch.input_mask, temperature=temperature)[0]
    gap = np.abs(np.asarray(own) - np.asarray(batch.behaviour_logprobs))[mask]
    kept_mass = np.exp(np.asarray(untruncated) - np.asarray(batch.behaviour_logprobs))[mask]
    metrics, _ = learner.step(batch)
    print(f"top_k {top_k} top_p {top_p}: max |learner - behaviour| {gap.max():.2e}, tis/weight_mean "
          f"{metrics['tis/weight_mean']:.7f}, tis/mismatch_kl {metrics['tis/mismatch_kl']:.2e}, kept mass "
          f"{kept_mass.mean():.4f}")
    assert kept_mass.mean() < 0.97  # the check can fail: the truncation really cuts off mass here
    assert gap.max() < 2e-5
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["tis/weight_max"] == pytest.approx(1.0, abs=2e-5)
    assert abs(metrics["tis/mismatch_kl"]) < 1e-7


# ---- the learning-rate schedule (items 19, 20) --------------------------------------------------------------


def test_warmup_starts_above_zero_and_reaches_lr_at_warmup_steps():
    schedule = learning_rate_schedule(OptimConfig(lr=1.0, warmup_steps=4, decay_steps=100, min_lr_ratio=0.1))
    assert [float(schedule(s)) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], rel=1e-6)
    assert float(schedule(104)) == pytest.approx(0.1)
    # The first learner step trains.
    learner = Learner(create_model(MODEL, seed=1), OptimConfig(lr=1e-2, warmup_steps=10), LossConfig())
    start = params_of(learner)
    metrics, _ = learner.step(random_batch(0))
    assert metrics["lr"] == pytest.approx(1e-2 / 11) and max_param_diff(start, params_of(learner)) > 1e-4


def sign_step_learner(optim: OptimConfig) -> Learner:
    # b1 = b2 = 0 and a tiny eps: Adam's update is lr * g / |g|, so a weight with a gradient moves by the rate
    # itself and the step's largest move reads out the rate it was applied at.
    return Learner(create_model(MODEL, seed=1), dataclasses.replace(optim, b1=0.0, b2=0.0, eps=1e-12, grad_clip=0.0),
                   LossConfig())


def test_a_skipped_update_does_not_shift_later_steps_learning_rates():
    optim = OptimConfig(lr=1.0, warmup_steps=4, mini_batches=2)
    schedule = learning_rate_schedule(optim)
    learner = sign_step_learner(optim)
    # Mini-batch 1 (rows 1, 3) has advantage 0: no gradient, so it moves nothing and each step's move is its
    # mini-batch 0's update. Step 1: mini-batch 0 is NaN and skipped.
    bad = dataclasses.replace(random_batch(1), advantages=jnp.array([np.nan, 0.0, 1.0, 0.0]))
    _, applied = learner.step(bad)
    assert applied.tolist() == [False, True]
    for step in (1, 2, 3):
        before = params_of(learner)
        good = dataclasses.replace(random_batch(step + 1), advantages=jnp.array([1.0, 0.0, -0.5, 0.0]))
        metrics, applied = learner.step(good)
        assert applied.all()
        move = max_param_diff(before, params_of(learner))
        assert move == pytest.approx(float(schedule(step)), rel=1e-4), step
        assert metrics["lr"] == pytest.approx(float(schedule(step)))
    assert learner._step._cache_size() == 1  # the step index is an argument: one program for every step


# ---- smaller (item 21) ---------------------------------------------------------------------------------------


def test_token_and_sequence_counts_are_the_batchs_whatever_the_split():
    batch = random_batch(8, size=8)
    tokens, seqs = float(np.asarray(batch.loss_mask).sum()), 8.0
    for optim in (OptimConfig(lr=1e-3, micro_batch_size=1), OptimConfig(lr=1e-3, mini_batches=2, epochs=3,
                                                                        micro_batch_size=2)):
        metrics, _ = Learner(create_model(MODEL, seed=1), optim, LossConfig()).step(batch)
        assert (metrics["num_tokens"], metrics["num_seqs"]) == (tokens, seqs), optim


def test_greedy_sampling_is_refused_for_training():
    from grpo_jax.config_io import ConfigError, build_config
    from grpo_jax.run.config import Config
    with pytest.raises(ConfigError) as info:
        build_config(Config, {"tokenizer": "byte"}, ["sampler.temperature=0"])
    message = str(info.value)
    assert "sampler.temperature=0" in message and "eval.temperature" in message and "\n" not in message
    # Evaluation's temperature is its own (its pass@1 is greedy whatever the sampler's).
    assert build_config(Config, {"tokenizer": "byte"}, ["sampler.temperature=0.5"]).eval.temperature == 1.0


# ------------------------------------------------------------------ log-probs in chunks of positions


@pytest.mark.parametrize("chunk", [1, 4, 11, 32])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 7, 0.9)])
def test_chunked_logprobs_equal_the_whole_at_once_in_value_and_gradient(chunk, temperature, top_k, top_p):
    from grpo_jax.algorithm.learner import chunked_logprobs

    rng = np.random.default_rng(chunk)
    hidden = jnp.asarray(rng.normal(size=(3, 11, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (3, 11)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 11)), jnp.float32)

    def objective(head, hidden, size):
        logprobs, entropy = chunked_logprobs(lambda h: h @ head, hidden, targets, size, temperature, top_k, top_p,
                                             with_entropy=True)
        return jnp.sum(logprobs * weights), (logprobs, entropy)

    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True), static_argnums=2)
    (value, (lp, ent)), (d_head, d_hidden) = grad(head, hidden, chunk)
    (value0, (lp0, ent0)), (d_head0, d_hidden0) = grad(head, hidden, 0)
    np.testing.assert_allclose(lp, lp0, atol=1e-5)
    np.testing.assert_allclose(ent, ent0, atol=1e-5)
    np.testing.assert_allclose(d_head, d_head0, atol=1e-5)
    np.testing.assert_allclose(d_hidden, d_hidden0, atol=1e-5)
    assert abs(float(value - value0)) < 1e-4


def test_chunked_logprobs_hold_no_rows_by_positions_by_vocab_array():
    # Compiled for 16 rows x 512 positions x a 4096 vocabulary: the whole float32 logits are 128 MiB; in chunks
    # of 32 positions, the step's temporaries stay near one chunk's (8 MiB) and its gradient's.
    from grpo_jax.algorithm.learner import chunked_logprobs

    rows, positions, embed, vocab = 16, 512, 64, 4096
    hidden = jax.ShapeDtypeStruct((rows, positions, embed), jnp.float32)
    head = jax.ShapeDtypeStruct((embed, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((rows, positions), jnp.int32)

    def temporaries(chunk):
        def loss(head, hidden, targets):
            return jnp.sum(chunked_logprobs(lambda h: h @ head, hidden, targets, chunk)[0])
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(head, hidden, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole = rows * positions * vocab * 4
    assert temporaries(0) >= whole
    assert temporaries(32) < whole / 4


@pytest.mark.parametrize("model_config", [MODEL, dataclasses.replace(MODEL, dtype="bfloat16")], ids=["f32", "bf16"])
def test_a_learner_step_with_chunked_logprobs_equals_the_unchunked_one(model_config):
    optim = dict(lr=1.0, eps=1.0, grad_clip=0.0, mini_batches=2)
    loss = LossConfig(aggregation="seq_mean_token_mean", kl_coef=0.01, off_policy="tis")
    batch = random_batch(7)
    learners = [Learner(create_model(model_config, seed=3), OptimConfig(**optim, logprob_chunk=chunk), loss,
                        reference_model=create_model(model_config, seed=4), temperature=0.8, top_p=0.9)
                for chunk in (0, 2)]
    start = params_of(learners[0])
    (whole, _), (chunked, _) = [learner.step(batch) for learner in learners]
    moved = max_param_diff(start, params_of(learners[0]))
    tolerance = 1e-5 if model_config.dtype == "float32" else 1e-2
    assert moved > 1e-3 and max_param_diff(params_of(learners[0]), params_of(learners[1])) < tolerance * moved
    assert whole["loss"] == pytest.approx(chunked["loss"], abs=1e-5 if model_config.dtype == "float32" else 1e-3)


# ------------------------------------------------------------------ the entropy bonus (loss.entropy_coef)


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (0, 0.9, 1.3), (6, 1.0, 0.7), (7, 0.8, 0.9)])
def test_entropy_gradient_matches_numpy_and_stays_finite_under_truncation(top_k, top_p, temperature):
    from grpo_jax.algorithm.sampling import tempered_logprobs
    rng = np.random.default_rng(top_k + int(10 * top_p))
    logits = rng.normal(0, 2.0, (5, 30)).astype(np.float32)
    weights = rng.normal(size=5).astype(np.float32)
    targets = np.argmax(logits, axis=-1)  # always kept

    def weighted_entropy(x):
        return jnp.sum(tempered_logprobs(x, jnp.asarray(targets), temperature, top_k, top_p, with_entropy=True)[1]
                       * weights)

    grad = np.asarray(jax.grad(weighted_entropy)(jnp.asarray(logits)))
    assert np.all(np.isfinite(grad))
    # dH/dz_i = -p_i (log p_i + H) over the whole vocabulary, with z = logits / temperature and p = softmax(z): the
    # untruncated tempered distribution's, whatever top_k and top_p (the sampler's truncation only decides which
    # tokens are drawn; the bonus acts on the distribution they are drawn from before it).
    x = logits.astype(np.float64) / temperature
    logp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    p = np.exp(logp)
    entropy = -(p * logp).sum(-1, keepdims=True)
    expected = weights[:, None] * -p * (logp + entropy) / temperature
    np.testing.assert_allclose(grad, expected, atol=2e-5)
    assert (np.abs(grad) > 1e-9).all()  # every token's logit gets gradient, not only the kept ones'


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (1, 1.0), (4, 0.5)])
def test_the_entropy_bonus_and_its_floor_act_where_the_truncation_left_one_token(top_k, top_p):
    """A position whose top token holds 0.95 of the mass: top_p 0.9 (or top_k 1) leaves the sampler one token, whose
    truncated distribution has entropy 0 whatever the logits (no gradient). The bonus and entropy_floor act on the
    untruncated tempered distribution instead (verl's entropy_coeff): 0.370 nats here, below a floor of 1, and a
    gradient that lowers the top token's logit. The log-prob the ratio uses stays the truncated one (0: the sampler
    draws that token surely), so the importance weight at staleness 0 is unchanged."""
    from grpo_jax.algorithm.losses import policy_loss
    from grpo_jax.algorithm.sampling import tempered_logprobs
    vocab, temperature = 32, 1.0
    logits = np.zeros((1, 1, vocab), np.float32)
    logits[..., 0] = np.log(0.95 * (vocab - 1) / 0.05)  # p(top) = 0.95
    targets = jnp.zeros((1, 1), jnp.int32)
    config = LossConfig(aggregation="token_mean", off_policy="none", entropy_coef=0.1, entropy_floor=1.0)

    def loss(z):
        logprobs, entropy = tempered_logprobs(z, targets, temperature, top_k, top_p, with_entropy=True)
        value, metrics = policy_loss(logprobs, jax.lax.stop_gradient(logprobs), None, None, jnp.zeros(1),
                                     jnp.ones((1, 1)), config, entropies=entropy)
        return value, (logprobs, entropy, metrics)

    (value, (logprobs, entropy, metrics)), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logits))
    want = tempered_entropy(logits, temperature)
    assert float(want[0, 0]) == pytest.approx(0.3702, abs=1e-4)
    np.testing.assert_allclose(np.asarray(entropy), want, rtol=1e-5)
    assert float(metrics["entropy"]) == pytest.approx(float(want[0, 0]), rel=1e-5)
    assert float(metrics["entropy/below_floor"]) == 1.0
    assert float(logprobs[0, 0]) == pytest.approx(0.0, abs=1e-6)  # the truncated distribution: one token, surely
    # d(-coef * H)/dz_i = coef * p_i (log p_i + H): NumPy, every logit.
    x = logits[0, 0].astype(np.float64)
    logp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    p = np.exp(logp)
    np.testing.assert_allclose(np.asarray(grad)[0, 0], config.entropy_coef * p * (logp + want[0, 0]), rtol=1e-4,
                               atol=1e-9)
    assert float(np.asarray(grad)[0, 0, 0]) == pytest.approx(3.03e-2, rel=1e-2)  # raises the entropy: top logit down


def test_entropy_bonus_alone_raises_the_policys_entropy():
    batch = dataclasses.replace(random_batch(3), advantages=jnp.zeros(4, jnp.float32))
    entropies = {}
    for coef in (0.0, 0.5):
        learner = Learner(create_model(MODEL, seed=2), OptimConfig(lr=3e-3, warmup_steps=0),
                          LossConfig(entropy_coef=coef, off_policy="none"))
        start = params_of(learner)
        entropies[coef] = [learner.step(batch)[0]["entropy"] for _ in range(4)]
        moved = max_param_diff(start, params_of(learner))
        assert (moved > 1e-3) if coef else (moved == 0.0)  # no advantage and no bonus: nothing to learn
    assert entropies[0.0][0] == pytest.approx(entropies[0.5][0])
    assert entropies[0.5][-1] > entropies[0.5][0] + 1e-3
    assert entropies[0.0][-1] == pytest.approx(entropies[0.0][0])
