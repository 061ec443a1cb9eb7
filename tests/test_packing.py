"""Packed learner rows (optim.packing): several sequences per row, each attending only to itself with positions
restarting, train exactly as one sequence per row does: the same loss, gradients, metrics, mini-batches and
epochs for every aggregation, GRPO and GSPO, the KL term and the off-policy weights (float32, tight tolerances,
random mixes of lengths with empty completions and failed rows)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jitted_token_logprobs
from grpo_jax.algorithm.batch import (
    pack_batch,
    pack_layout,
    pack_sequences,
    packed_row_sizes,
    packed_rows_for,
    padding_fraction,
    sequence_lengths,
)
from grpo_jax.algorithm.learner import Learner, OptimConfig, token_logprobs
from grpo_jax.algorithm.losses import LossConfig
from grpo_jax.model.transformer import ModelConfig, create_model, positions_from_mask

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)
PROMPT_LEN, COMPLETION_LEN = 6, 10
# Gemma 3's local layer over the last 3 tokens: in a packed row the window must not reach into the sequence before.
GEMMA3 = dataclasses.replace(MODEL, architecture="gemma3", layer_types=("sliding_attention", "full_attention"),
                             sliding_window=3, rope_local_theta=100.0, tie_embeddings=True)


def random_sequences(seed: int, size: int):
    """A step's sequences with long-tailed completion lengths (most short, a few at the bucket), some empty and
    some whose reward failed."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, MODEL.vocab_size, rng.integers(1, PROMPT_LEN + 1)) for _ in range(size)]
    lengths = np.minimum(rng.geometric(0.3, size), COMPLETION_LEN)
    lengths[rng.random(size) < 0.1] = 0
    completions = [rng.integers(1, MODEL.vocab_size, n) for n in lengths]
    behaviour = [rng.normal(-3.0, 0.3, n + int(rng.integers(0, 3))) for n in lengths]  # may run past the completion
    valid = rng.random(size) > 0.15
    return prompts, completions, behaviour, rng.normal(size=size).astype(np.float32), valid


def both_layouts(seed: int, size: int, mini_batches: int = 1, unit: int = 1):
    prompts, completions, behaviour, advantages, valid = random_sequences(seed, size)
    padded = pack_batch(prompts, completions, behaviour, advantages, 0, PROMPT_LEN, COMPLETION_LEN, valid=valid)
    layout = pack_layout(*sequence_lengths(prompts, completions, valid)[:2], PROMPT_LEN + COMPLETION_LEN,
                         COMPLETION_LEN, mini_batches)
    rows = -(-layout.rows // unit) * unit
    packed = pack_sequences(prompts, completions, behaviour, advantages, 0, PROMPT_LEN + COMPLETION_LEN,
                            COMPLETION_LEN, mini_batches, valid=valid, layout=layout, rows=rows)
    return padded, packed


def params_of(learner):
    return jax.tree.map(np.asarray, jax.device_get(learner.params))


def max_param_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_positions_restart_at_each_sequence():
    labels = jnp.array([[1, 1, 1, 2, 2, 0, 3, 3, 0], [0, 0, 1, 1, 1, 1, 1, 0, 0]], jnp.int32)
    np.testing.assert_array_equal(positions_from_mask(labels),
                                  [[0, 1, 2, 0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 2, 3, 4, 0, 0]])
    # A boolean mask still counts the real tokens of the row.
    np.testing.assert_array_equal(positions_from_mask(labels[1:] > 0), [[0, 0, 0, 1, 2, 3, 4, 4, 4]])


@pytest.mark.parametrize("config", [MODEL, GEMMA3], ids=["qwen2", "gemma3"])
def test_a_packed_sequence_scores_as_if_alone_and_no_gradient_crosses_sequences(config):
    """Each sequence's log-probs in a packed row equal those of the sequence alone in a padded row; the gradient of
    one sequence's log-probs does not depend on the other sequences' tokens (their values change, the gradient
    stays), so nothing leaks across sequences in the backward pass either."""
    model = create_model(config, seed=2)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(1, MODEL.vocab_size, n) for n in (7, 5, 3))
    row = np.concatenate([a, b, c, np.zeros(1, np.int64)])[None].astype(np.int32)
    labels = np.repeat([1, 2, 3, 0], [7, 5, 3, 1])[None].astype(np.int32)
    packed, _ = jitted_token_logprobs(model, row, labels)
    for start, seq in ((0, a), (7, b), (12, c)):
        alone, _ = jitted_token_logprobs(model, seq[None].astype(np.int32), np.ones((1, len(seq)), bool))
        np.testing.assert_allclose(packed[0, start:start + len(seq) - 1], alone[0], atol=1e-6)

    graphdef, params = nnx.split(model)

    def first_sequence_logprob(params, tokens):
        return token_logprobs(nnx.merge(graphdef, params), tokens, labels)[0][0, :6].sum()

    grad = jax.jit(jax.grad(first_sequence_logprob))
    other = row.copy()
    other[0, 7:15] = rng.integers(1, MODEL.vocab_size, 8)
    for x, y in zip(jax.tree.leaves(grad(params, row)), jax.tree.leaves(grad(params, other))):
        np.testing.assert_array_equal(x, y)
    # ... whereas in one unlabelled sequence the later tokens see the earlier ones: the check can fail.
    def whole_row(tokens):
        return jitted_token_logprobs(model, tokens, np.ones(row.shape, bool))[0][0, 7:14]
    assert np.abs(np.asarray(whole_row(row)) - np.asarray(packed[0, 7:14])).max() > 1e-3


def test_the_packed_layout_holds_each_trained_sequence_once_in_its_mini_batch():
    prompts, completions, behaviour, advantages, valid = random_sequences(3, 40)
    length = PROMPT_LEN + COMPLETION_LEN
    prompt_lengths, completion_lengths, trained_lengths = sequence_lengths(prompts, completions, valid)
    np.testing.assert_array_equal(trained_lengths, completion_lengths)  # without masks every token trains
    layout = pack_layout(prompt_lengths, completion_lengths, length, COMPLETION_LEN, mini_batches=2, first_sequence=3)
    trained = completion_lengths > 0
    assert (layout.row[~trained] == -1).all() and (layout.row[trained] >= 0).all()
    assert ((layout.row[trained] % 2) == (3 + np.flatnonzero(trained)) % 2).all()  # sequence i: mini-batch (3+i) % 2
    batch = pack_sequences(prompts, completions, behaviour, advantages, 0, length, COMPLETION_LEN, 2, valid=valid,
                           first_sequence=3)
    labels, loss_mask = np.asarray(batch.input_mask), np.asarray(batch.loss_mask)
    for i in np.flatnonzero(trained):
        r, start, n = layout.row[i], layout.offset[i], len(prompts[i]) + len(completions[i])
        assert (labels[r, start:start + n] == layout.slot[i] + 1).all()
        np.testing.assert_array_equal(batch.tokens[r, start:start + n], np.concatenate([prompts[i], completions[i]]))
        assert batch.advantages[r, layout.slot[i]] == advantages[i]
    assert loss_mask.sum() == completion_lengths.sum()
    assert (loss_mask.sum(axis=1) <= COMPLETION_LEN).all()  # the scored positions of a row fit its bucket
    # First-fit decreasing: a sequence is in a later row of its mini-batch only if it fits no earlier one (in
    # tokens, or in trained tokens), even as that row ends up.
    total = prompt_lengths + completion_lengths
    free = {r: length - total[layout.row == r].sum() for r in range(layout.rows)}
    free_scored = {r: COMPLETION_LEN - completion_lengths[layout.row == r].sum() for r in range(layout.rows)}
    for i in np.flatnonzero(trained):
        for earlier in range(layout.row[i] % 2, layout.row[i], 2):
            assert total[i] > free[earlier] or completion_lengths[i] > free_scored[earlier], (i, earlier)
    assert layout.rows < 0.7 * trained.sum()
    tokens_used = (labels > 0).sum()
    assert padding_fraction(tokens_used, layout.rows, length) < padding_fraction(tokens_used, len(prompts), length)
    with pytest.raises(ValueError, match="sequence 1: 7 \\+ 10 tokens exceed a packed row of 16"):
        pack_layout([2, 7], [3, 10], length, COMPLETION_LEN)


def test_packed_row_counts_come_from_a_few_sizes():
    sizes = packed_row_sizes(64, 4, 8)
    assert sizes == (8, 16, 24, 32, 40, 48, 56, 64)
    assert packed_row_sizes(10, 2, 8) == (2, 4, 6, 8, 10)  # no repeats; every size a multiple of the unit
    assert packed_rows_for(9, sizes) == 16 and packed_rows_for(64, sizes) == 64
    with pytest.raises(ValueError, match="65 packed rows"):
        packed_rows_for(65, sizes)


CASES = {
    "token_mean": (LossConfig(aggregation="token_mean", off_policy="tis"), dict()),
    "seq_mean_token_mean+kl": (LossConfig(aggregation="seq_mean_token_mean", kl_coef=0.05, kl_estimator="k3",
                                          off_policy="decoupled", tis_cap=1.5), dict(mini_batches=2, epochs=2)),
    "seq_mean_token_sum_norm": (LossConfig(aggregation="seq_mean_token_sum_norm", max_completion_len=COMPLETION_LEN,
                                           dual_clip=3.0), dict(mini_batches=2, micro_batch_size=2)),
    "gspo+kl": (LossConfig(loss_type="gspo", aggregation="seq_mean_token_mean", kl_coef=0.1, kl_estimator="k2",
                           off_policy="tis"), dict(epochs=2, micro_batch_size=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_step_trains_as_the_padded_step(case):
    """Same model, same sequences, one step of several updates on each layout: the parameters after it, the loss and
    every metric agree (float32; the packed batch has far fewer rows)."""
    loss, optim = CASES[case]
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0, **optim)
    unit = optim.mini_batches * (optim.micro_batch_size or 1)
    padded, packed = both_layouts(5, 24, optim.mini_batches, unit)
    assert packed.tokens.shape[0] <= padded.tokens.shape[0] // 2
    reference = create_model(MODEL, seed=9) if loss.needs_reference else None
    learners = [Learner(create_model(MODEL, seed=1), optim, loss, reference_model=reference, temperature=0.8)
                for _ in range(2)]
    start = params_of(learners[0])
    (m_padded, a_padded), (m_packed, a_packed) = learners[0].step(padded), learners[1].step(packed)
    assert a_padded.all() and a_packed.all()
    moved = max_param_diff(start, params_of(learners[0]))
    assert moved > 1e-2
    assert max_param_diff(params_of(learners[0]), params_of(learners[1])) < 1e-5 * moved
    assert set(m_padded) == set(m_packed)
    for key in m_padded:
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-5, abs=1e-6), key
    assert m_packed["num_seqs"] == float(np.asarray(padded.loss_mask).any(axis=1).sum())
    if loss.needs_reference:
        assert m_packed["kl/loss"] > 0


def test_micro_batches_counted_in_tokens():
    optim = OptimConfig(micro_batch_tokens=40)
    assert optim.micro_batch_rows(16) == 2 and optim.micro_batch_rows(50) == 1
    assert OptimConfig(micro_batch_size=3).micro_batch_rows(16) == 3
    problems = OptimConfig(micro_batch_size=2, micro_batch_tokens=40).validate()
    assert len(problems) == 1 and "micro_batch_tokens=40" in problems[0] and "not both" in problems[0]
    assert "packing_buckets=0" in " ".join(OptimConfig(packing_buckets=0).validate())
    # A token-counted micro-batch of a packed step is exact too (2 rows of 16 tokens per micro-batch).
    loss = LossConfig(aggregation="seq_mean_token_mean", off_policy="tis")
    padded, packed = both_layouts(6, 16, unit=2)
    whole = Learner(create_model(MODEL, seed=1), OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0), loss)
    split = Learner(create_model(MODEL, seed=1), OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0, micro_batch_tokens=32),
                    loss)
    start = params_of(whole)
    whole.step(padded)
    split.step(packed)
    moved = max_param_diff(start, params_of(whole))
    assert moved > 1e-2 and max_param_diff(params_of(whole), params_of(split)) < 1e-5 * moved


# ---- multi-turn trajectories cut into segments: one sequence for the sequence-level reductions (issue 36, 16) ----


def segmented_step(seed: int, trajectories: int, mini_batches: int, unit: int):
    """A step of `trajectories` trajectories of 1 to 3 segments each (random_sequences' segments, some failed
    trajectories), in both layouts: packed (pack_sequences with the segments' trajectories: a trajectory's segments
    in mini-batch t % M) and padded, one segment per row, rows placed so that row r (in mini-batch r % M) holds a
    segment of a trajectory t with t % M == r % M, empty rows filling the gaps. Each segment has its trajectory's
    advantage and validity."""
    rng = np.random.default_rng(seed)
    owner = np.repeat(np.arange(trajectories), rng.integers(1, 4, trajectories))
    n = len(owner)
    prompts, completions, behaviour, _, _ = random_sequences(seed, n)
    advantages = rng.normal(size=trajectories).astype(np.float32)[owner]
    valid = (rng.random(trajectories) > 0.15)[owner]
    layout = pack_layout(*sequence_lengths(prompts, completions, valid)[:2], PROMPT_LEN + COMPLETION_LEN,
                         COMPLETION_LEN, mini_batches, trajectories=owner)
    packed = pack_sequences(prompts, completions, behaviour, advantages, 0, PROMPT_LEN + COMPLETION_LEN,
                            COMPLETION_LEN, mini_batches, valid=valid, layout=layout,
                            rows=-(-layout.rows // unit) * unit, trajectories=owner)
    per_mini = [np.flatnonzero(owner % mini_batches == m) for m in range(mini_batches)]
    depth = -(-max(len(p) for p in per_mini) // (unit // mini_batches)) * (unit // mini_batches)
    order = np.full((depth, mini_batches), -1)
    for m, members in enumerate(per_mini):
        order[:len(members), m] = members
    order = order.reshape(-1)  # row j * M + m: the j-th segment of mini-batch m, or -1 (empty)
    empty = order < 0

    def placed(values, fill):
        return [fill if i < 0 else values[i] for i in order]

    padded = pack_batch(placed(prompts, np.array([1])), placed(completions, np.zeros(0, np.int64)),
                        placed(behaviour, np.zeros(0)), np.where(empty, 0.0, advantages[order]).astype(np.float32), 0,
                        PROMPT_LEN, COMPLETION_LEN, valid=np.where(empty, False, valid[order]),
                        trajectories=np.where(empty, 1000 + np.arange(len(order)), owner[order]))
    trained = np.unique(owner[valid & (np.array([len(c) for c in completions]) > 0)])
    return padded, packed, len(trained)


SEGMENT_CASES = {
    "seq_mean_token_mean": (LossConfig(aggregation="seq_mean_token_mean", off_policy="tis", kl_coef=0.05),
                            dict(mini_batches=2, epochs=2, micro_batch_size=2)),
    "gspo": (LossConfig(loss_type="gspo", aggregation="seq_mean_token_mean", off_policy="tis",
                        gspo_clip_low=0.02, gspo_clip_high=0.02), dict(mini_batches=2, epochs=2, micro_batch_size=1)),
}


@pytest.mark.parametrize("case", list(SEGMENT_CASES))
def test_a_segmented_step_trains_alike_in_both_layouts_and_whatever_the_micro_batches(case):
    """A trajectory's segments counted as one sequence (losses.Trajectories, checked against NumPy in
    test_losses.py) in a learner step of mini-batches, epochs and micro-batches that split trajectories: packed and
    padded rows end with the same parameters and metrics; GSPO's trajectory ratios over micro-batches (a forward pass
    over the mini-batch first) equal those of one micro-batch holding it all; num_seqs counts trajectories. Treated
    as separate sequences, the segments train otherwise (the check can fail)."""
    loss, optim = SEGMENT_CASES[case]
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0, **optim)
    padded, packed, trajectories = segmented_step(7, 12, optim.mini_batches, optim.mini_batches * 2)
    reference = create_model(MODEL, seed=9) if loss.needs_reference else None

    def trained(batch, optim=optim):
        learner = Learner(create_model(MODEL, seed=1), optim, loss, reference_model=reference, temperature=0.8)
        metrics, applied = learner.step(batch)
        assert applied.all()
        return params_of(learner), metrics

    start = params_of(Learner(create_model(MODEL, seed=1), optim, dataclasses.replace(loss, kl_coef=0.0)))
    (p_padded, m_padded), (p_packed, m_packed) = trained(padded), trained(packed)
    moved = max_param_diff(start, p_padded)
    assert moved > 1e-2 and max_param_diff(p_padded, p_packed) < 1e-5 * moved
    for key in m_padded:
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-5, abs=1e-6), key
    assert m_packed["num_seqs"] == pytest.approx(trajectories, rel=1e-6)
    if loss.loss_type == "gspo":  # one micro-batch per mini-batch: the loss sums each trajectory itself
        whole, _ = trained(packed, dataclasses.replace(optim, micro_batch_size=0))
        assert max_param_diff(whole, p_packed) < 1e-5 * moved
    apart, _ = trained(dataclasses.replace(packed, trajectories=None))
    assert max_param_diff(apart, p_packed) > 1e-3 * moved
