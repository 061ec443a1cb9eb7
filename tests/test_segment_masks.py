"""Completion masks (multi-turn environments): a completion interleaves sampled tokens (trained) with environment
tokens (context only). Padded and packed layouts with masks give the loss and gradients of a hand-built NumPy loss
mask, for every aggregation; a masked token's behaviour log-prob or advantage cannot change them; packing budgets
only the trained tokens. The trainer lays out segment groups (replay_buffer.Segments) one sequence per segment,
with its trajectory's advantage and validity."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.algorithm.batch import (
    groups_trained,
    pack_batch,
    pack_layout,
    pack_sequences,
    sequence_lengths,
    sequences_of,
)
from grpo_jax.algorithm.learner import Learner, OptimConfig, batch_logprobs
from grpo_jax.algorithm.losses import AGGREGATIONS, LossConfig, policy_loss
from grpo_jax.model.transformer import create_model
from grpo_jax.run.plan import RunPlan
from grpo_jax.run.resume import group_fits
from grpo_jax.run.trainer import (
    Trainer,
    TrainerError,
    group_rows,
    row_validity,
    sample_lengths,
    sequence_tokens,
)
from grpo_jax.state.replay_buffer import Group, Segments
from test_packing import COMPLETION_LEN, MODEL, PROMPT_LEN, max_param_diff, params_of, random_sequences
from test_trainer import tiny_config

SCORED = 6  # the packed rows' trained budget: below COMPLETION_LEN, so only masks make the longer completions fit
LOSSES = [LossConfig(aggregation=a, off_policy="tis", tis_cap=2.0, max_completion_len=COMPLETION_LEN)
          for a in AGGREGATIONS]


def random_masks(seed: int, completions: list) -> list[np.ndarray]:
    """Per completion a 0/1 int8 mask: runs of environment tokens, at most SCORED sampled tokens, some masks all 0
    (a segment of environment tokens only)."""
    rng = np.random.default_rng(seed)
    masks = []
    for completion in completions:
        mask = (rng.random(len(completion)) > 0.4).astype(np.int8)
        mask[np.cumsum(mask) > SCORED] = 0
        if rng.random() < 0.1:
            mask[:] = 0
        masks.append(mask)
    return masks


def masked_step(seed: int, size: int):
    prompts, completions, behaviour, advantages, valid = random_sequences(seed, size)
    return prompts, completions, behaviour, advantages, valid, random_masks(seed + 100, completions)


def hand_built_loss_mask(completions, masks, valid) -> np.ndarray:
    """The padded layout's loss mask written out token by token: completion token j of row i is scored at
    position PROMPT_LEN - 1 + j, trained iff its mask is 1 and the row's reward was scored."""
    out = np.zeros((len(completions), PROMPT_LEN + COMPLETION_LEN - 1), np.float32)
    for i, mask in enumerate(masks):
        for j, m in enumerate(mask):
            out[i, PROMPT_LEN - 1 + j] = float(m == 1 and valid[i])
    return out


_LOSS_AND_GRAD = {}


def loss_and_grad(graphdef, params, batch, aggregation: str):
    """(loss, gradient) of one update's policy loss (ratio 1, TIS weights from the behaviour log-probs) at
    `aggregation`: the three aggregations in one program per layout, picked by a one-hot weight, so a layout
    compiles once."""
    if graphdef not in _LOSS_AND_GRAD:
        def loss(params, batch, pick):
            logprobs, _ = batch_logprobs(nnx.merge(graphdef, params), batch, temperature=0.8)
            losses = [policy_loss(logprobs, jax.lax.stop_gradient(logprobs), batch.scored(batch.behaviour_logprobs),
                                  None, batch.advantages, batch.scored(batch.loss_mask), config,
                                  sequence_ids=batch.sequence_ids())[0] for config in LOSSES]
            return jnp.dot(pick, jnp.stack(losses))

        _LOSS_AND_GRAD[graphdef] = jax.jit(jax.value_and_grad(loss))
    pick = np.asarray([a == aggregation for a in AGGREGATIONS], np.float32)
    value, grad = _LOSS_AND_GRAD[graphdef](params, batch, pick)
    return float(value), jax.tree.map(np.asarray, grad)


def assert_same(a, b, rel=1e-5):
    (loss_a, grad_a), (loss_b, grad_b) = a, b
    assert loss_b == pytest.approx(loss_a, rel=rel, abs=1e-7)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(grad_a))
    assert scale > 0 and max_param_diff(grad_a, grad_b) <= rel * scale


def test_packing_budgets_only_the_trained_tokens():
    prompts, completions, behaviour, advantages, valid, masks = masked_step(1, 40)
    prompt_lengths, completion_lengths, trained_lengths = sequence_lengths(prompts, completions, valid, masks)
    expected = [int(m.sum()) if v else 0 for m, v in zip(masks, valid)]
    assert trained_lengths.tolist() == expected and (completion_lengths[~valid] == 0).all()
    length = PROMPT_LEN + COMPLETION_LEN
    assert (completion_lengths > SCORED).any()  # the masks are what makes these fit the trained budget
    with pytest.raises(ValueError, match="exceed a packed row"):
        pack_layout(prompt_lengths, completion_lengths, length, SCORED)
    layout = pack_layout(prompt_lengths, completion_lengths, length, SCORED, trained_lengths=trained_lengths)
    assert ((layout.row >= 0) == (trained_lengths > 0)).all()  # all-masked and failed sequences are left out
    batch = pack_sequences(prompts, completions, behaviour, advantages, 0, length, SCORED, valid=valid,
                           completion_masks=masks)
    loss_mask, scored = np.asarray(batch.loss_mask), np.asarray(batch.scored_positions)
    assert loss_mask.sum() == trained_lengths.sum() and (loss_mask.sum(axis=1) <= SCORED).all()
    # Every trained position is among the row's scored positions, in order: none cut off by the budget.
    for r in range(loss_mask.shape[0]):
        np.testing.assert_array_equal(scored[r][scored[r] >= 0], np.flatnonzero(loss_mask[r]))
    # Each sequence's mask lands under its completion, behaviour log-probs only where it trains.
    for i in np.flatnonzero(layout.row >= 0):
        r, start = layout.row[i], layout.offset[i] + len(prompts[i]) - 1
        span = slice(start, start + len(completions[i]))
        np.testing.assert_array_equal(loss_mask[r, span], masks[i])
        np.testing.assert_array_equal(batch.behaviour_logprobs[r, span],
                                      np.where(masks[i] > 0, behaviour[i][:len(completions[i])], 0).astype(np.float32))
    with pytest.raises(ValueError, match=r"completion_masks\[0\]: 1 values for a completion of"):
        pack_batch([[1]], [[2, 3]], [[0.0, 0.0]], np.zeros(1), 0, 4, 4, completion_masks=[[1]])
    with pytest.raises(ValueError, match=r"completion_masks\[0\]: values \[2.0\]"):
        pack_batch([[1]], [[2, 3]], [[0.0, 0.0]], np.zeros(1), 0, 4, 4, completion_masks=[[1, 2]])


def test_no_masks_and_all_ones_masks_give_the_same_batch():
    prompts, completions, behaviour, advantages, valid = random_sequences(2, 16)
    ones = [np.ones(len(c), np.int8) for c in completions]
    for pack, args in ((pack_batch, (PROMPT_LEN, COMPLETION_LEN)),
                       (pack_sequences, (PROMPT_LEN + COMPLETION_LEN, COMPLETION_LEN))):
        plain = pack(prompts, completions, behaviour, advantages, 0, *args, valid=valid)
        masked = pack(prompts, completions, behaviour, advantages, 0, *args, valid=valid, completion_masks=ones)
        for field in ("tokens", "input_mask", "loss_mask", "advantages", "scored_positions"):
            np.testing.assert_array_equal(getattr(plain, field), getattr(masked, field), err_msg=field)
        # Behaviour log-probs only differ where nothing trains (failed rows: never read there).
        trained = np.asarray(plain.loss_mask) > 0
        np.testing.assert_array_equal(np.asarray(plain.behaviour_logprobs)[trained],
                                      np.asarray(masked.behaviour_logprobs)[trained])


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_layouts_train_as_a_hand_built_loss_mask(aggregation):
    """Padded and packed layouts with masks: the loss and gradient of a padded batch whose loss mask was written
    by hand (NumPy), for each aggregation; NaN behaviour log-probs at masked tokens and huge advantages of
    all-masked sequences change nothing, while a trained token's behaviour log-prob does."""
    prompts, completions, behaviour, advantages, valid, masks = masked_step(3, 24)
    graphdef, params = nnx.split(create_model(MODEL, seed=1))
    padded = pack_batch(prompts, completions, behaviour, advantages, 0, PROMPT_LEN, COMPLETION_LEN, valid=valid,
                        completion_masks=masks)
    packed = pack_sequences(prompts, completions, behaviour, advantages, 0, PROMPT_LEN + COMPLETION_LEN, SCORED,
                            valid=valid, completion_masks=masks)
    assert packed.tokens.shape[0] < padded.tokens.shape[0] // 2
    plain = pack_batch(prompts, completions, behaviour, advantages, 0, PROMPT_LEN, COMPLETION_LEN)
    reference = dataclasses.replace(plain, loss_mask=hand_built_loss_mask(completions, masks, valid))
    np.testing.assert_array_equal(padded.loss_mask, reference.loss_mask)
    want = loss_and_grad(graphdef, params, reference, aggregation)
    assert want[0] != 0.0
    assert_same(want, loss_and_grad(graphdef, params, padded, aggregation), rel=1e-6)
    assert_same(want, loss_and_grad(graphdef, params, packed, aggregation))

    masked_out = np.asarray(reference.loss_mask) == 0
    untrained = masked_out.all(axis=1)
    assert untrained.any() and (~untrained).any()
    noisy = dataclasses.replace(
        reference, behaviour_logprobs=np.where(masked_out, np.nan, reference.behaviour_logprobs).astype(np.float32),
        advantages=np.where(untrained, 1e6, reference.advantages).astype(np.float32))
    assert_same(want, loss_and_grad(graphdef, params, noisy, aggregation), rel=1e-6)
    packed_noisy = dataclasses.replace(packed, behaviour_logprobs=np.where(
        np.asarray(packed.loss_mask) == 0, np.nan, packed.behaviour_logprobs).astype(np.float32))
    assert_same(want, loss_and_grad(graphdef, params, packed_noisy, aggregation))
    # ... whereas moving a trained token's behaviour log-prob moves the loss: the check can fail.
    moved = np.array(reference.behaviour_logprobs)
    moved[~masked_out] += 0.5
    assert abs(loss_and_grad(graphdef, params, dataclasses.replace(reference, behaviour_logprobs=moved),
                             aggregation)[0] - want[0]) > 1e-4 * abs(want[0])


def test_a_masked_learner_step_trains_alike_in_both_layouts():
    """Learner.step over mini- and micro-batches: the same parameters and metrics from padded and packed rows with
    masks; num_tokens counts only the sampled tokens."""
    prompts, completions, behaviour, advantages, valid, masks = masked_step(4, 16)
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0, mini_batches=2, micro_batch_size=2)
    loss = LossConfig(aggregation="seq_mean_token_mean", off_policy="tis", tis_cap=2.0)
    padded = pack_batch(prompts, completions, behaviour, advantages, 0, PROMPT_LEN, COMPLETION_LEN, valid=valid,
                        completion_masks=masks)
    prompt_lengths, completion_lengths, trained_lengths = sequence_lengths(prompts, completions, valid, masks)
    layout = pack_layout(prompt_lengths, completion_lengths, PROMPT_LEN + COMPLETION_LEN, SCORED, 2,
                         trained_lengths=trained_lengths)
    packed = pack_sequences(prompts, completions, behaviour, advantages, 0, PROMPT_LEN + COMPLETION_LEN, SCORED, 2,
                            valid=valid, layout=layout, rows=-(-layout.rows // 4) * 4, completion_masks=masks)
    learners = [Learner(create_model(MODEL, seed=1), optim, loss, temperature=0.8) for _ in range(2)]
    start = params_of(learners[0])
    (m_padded, _), (m_packed, _) = learners[0].step(padded), learners[1].step(packed)
    moved = max_param_diff(start, params_of(learners[0]))
    assert moved > 1e-2 and max_param_diff(params_of(learners[0]), params_of(learners[1])) < 1e-5 * moved
    for key in m_padded:
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-5, abs=1e-6), key
    assert m_padded["num_tokens"] == trained_lengths.sum()
    assert m_padded["num_seqs"] == (trained_lengths > 0).sum()


# ---- the trainer: segment groups ---------------------------------------------------------------------------------


class WithEnv:
    """A Config with an env section (Config.env): RunPlan reads only env.max_turns."""

    def __init__(self, config, max_turns: int):
        self._config, self.env = config, types.SimpleNamespace(max_turns=max_turns)

    def __getattr__(self, name):
        return getattr(self._config, name)


def segment_group(ordinal: int, rng, group_size: int, row_length: int, sampled_budget: int, valid=None) -> Group:
    """G trajectories of 1 to 3 segments each, as the actor lays them out: each segment's completion interleaves
    sampled and environment tokens; its prompt's first token is unique to the segment (to find it in a batch)."""
    prompts, completions, logprobs, masks, trajectory = [], [], [], [], []
    for t in range(group_size):
        for s in range(int(rng.integers(1, 4))):
            prompt = rng.integers(1, 30, int(rng.integers(2, 8)))
            prompt[0] = 1000 + 100 * ordinal + 10 * t + s  # the segment's signature
            n = int(rng.integers(1, row_length - len(prompt) + 1))
            mask = (rng.random(n) > 0.5).astype(np.int8)
            mask[0] = 1  # a segment's completion starts at its first sampled token
            mask[np.cumsum(mask) > sampled_budget] = 0
            prompts.append(prompt.astype(np.int32))
            completions.append(rng.integers(1, 30, n).astype(np.int32))
            logprobs.append(np.where(mask > 0, rng.normal(-2.0, 0.5, n), 0.0).astype(np.float32))
            masks.append(mask)
            trajectory.append(t)
    valid = np.ones(group_size, bool) if valid is None else np.asarray(valid, bool)
    return Group(ordinal=ordinal, prompt={"prompt_ids": np.array([1, 2], np.int32)}, completions=completions,
                 behaviour_logprobs=logprobs, rewards=rng.normal(size=group_size).astype(np.float32),
                 weight_version=0, advantages=rng.normal(size=group_size).astype(np.float32), valid=valid,
                 segments=Segments(prompts=prompts, masks=masks, trajectory=np.asarray(trajectory, np.int32)))


def fake_trainer(tmp_path, *overrides, max_turns: int = 3):
    """What Trainer.learner_batch reads (and algorithm.batch's layout), around the real RunPlan of a tiny config
    with an env section: no model, no actor."""
    config = tiny_config(tmp_path, *overrides)
    plan = RunPlan.build(config, jax.devices(), process_word="host")
    plan = dataclasses.replace(plan, config=WithEnv(config, max_turns))
    return FakeTrainer(config=config, plan=plan, local_prompts=plan.local_prompts, process_index=0,
                       prompt_bucket=plan.prompt_bucket, completion_bucket=plan.completion_bucket,
                       agreement=types.SimpleNamespace(gather=np.asarray))


class FakeTrainer(types.SimpleNamespace):
    @property
    def batch_layout(self):  # from the plan as it is now (a test may replace it)
        return self.plan.batch_layout(self.process_index, pad_id=0)


def test_the_plan_makes_room_for_every_segment_alone_in_a_row(tmp_path):
    config = tiny_config(tmp_path)
    plan = RunPlan.build(config, jax.devices(), process_word="host")
    assert plan.sequences_per_sample == 1
    with_env = dataclasses.replace(plan, config=WithEnv(config, 3))
    assert with_env.sequences_per_sample == 3
    sequences = plan.local_prompts * config.grpo.group_size
    unit = plan.packed_row_unit
    assert plan.packed_row_sizes[-1] == -(-sequences // unit) * unit
    assert with_env.packed_row_sizes[-1] == -(-3 * sequences // unit) * unit


def test_a_segment_group_trains_its_sampled_tokens_with_its_trajectorys_advantage(tmp_path):
    trainer = fake_trainer(tmp_path)
    g, rng = trainer.config.grpo.group_size, np.random.default_rng(0)
    length, budget = trainer.plan.row_length, trainer.completion_bucket
    # Three groups of a step of four (the last step of a finite dataset: padded), one with failed trajectories.
    groups = [segment_group(i, rng, g, length, budget, valid=[True, i != 1, True, i != 1]) for i in range(3)]
    prompts, completions, logprobs, advantages, masks = group_rows(groups, g)
    segments = [(grp, i) for grp in groups for i in range(len(grp.completions))]
    assert len(prompts) == len(segments) > trainer.local_prompts * g // 2
    for (grp, i), prompt, completion, mask, advantage in zip(segments, prompts, completions, masks, advantages):
        t = grp.segments.trajectory[i]
        np.testing.assert_array_equal(prompt, grp.segments.prompts[i])
        np.testing.assert_array_equal(completion, grp.completions[i])
        np.testing.assert_array_equal(mask, grp.segments.masks[i])
        assert advantage == grp.advantages[t]
    valid = row_validity(groups, g, len(prompts) + 2)
    assert valid.tolist() == [bool(grp.valid[grp.segments.trajectory[i]]) for grp, i in segments
                              ] + [False, False]

    batch, padding, _ = Trainer.learner_batch(trainer, groups)
    assert padding["learner/rows"] in trainer.plan.packed_row_sizes
    tokens, labels = np.asarray(batch.tokens), np.asarray(batch.input_mask)
    loss_mask, behaviour = np.asarray(batch.loss_mask), np.asarray(batch.behaviour_logprobs)
    found = 0
    for r in range(tokens.shape[0]):
        for slot in range(labels[r].max()):
            where = np.flatnonzero(labels[r] == slot + 1)
            start, end = where[0], where[-1] + 1
            grp, i = next((grp, i) for grp, i in segments if grp.segments.prompts[i][0] == tokens[r, start])
            prompt, completion = grp.segments.prompts[i], grp.completions[i]
            t = grp.segments.trajectory[i]
            assert grp.valid[t] and end - start == len(prompt) + len(completion)
            np.testing.assert_array_equal(tokens[r, start:end], np.concatenate([prompt, completion]))
            span = slice(start + len(prompt) - 1, end - 1)  # the positions that score the completion
            np.testing.assert_array_equal(loss_mask[r, span], grp.segments.masks[i])
            np.testing.assert_array_equal(behaviour[r, span], grp.behaviour_logprobs[i])
            assert batch.advantages[r, slot] == grp.advantages[t]
            # Its trajectory, numbered group after group (each of these groups has all g trajectories).
            assert batch.trajectories[r, slot] == groups.index(grp) * g + t
            found += 1
    trained = [(grp, i) for grp, i in segments if grp.valid[grp.segments.trajectory[i]]]
    assert found == len(trained) < len(segments)
    assert (np.asarray(batch.trajectories) >= 0).sum() == found  # an empty slot is -1
    # The loss mask covers exactly the sampled tokens of the valid trajectories' segments, nothing else.
    assert loss_mask.sum() == sum(grp.segments.masks[i].sum() for grp, i in trained)

    # The metrics count the model's tokens per trajectory; tokens_per_s every token of the sequences.
    first = groups[0]
    per_trajectory = [sum(int(m.sum()) for m, tr in zip(first.segments.masks, first.segments.trajectory)
                          if tr == t) for t in range(g)]
    assert sample_lengths(first).tolist() == per_trajectory
    assert sequence_tokens(first, g) == sum(len(p) + len(c) for p, c in zip(first.segments.prompts,
                                                                            first.completions))

    # Two mini-batches: a trajectory's segments are in one (trajectory n in mini-batch n % 2), whatever their rows.
    two = fake_trainer(tmp_path / "two", "optim.mini_batches=2")
    two_batch, _, _ = Trainer.learner_batch(two, groups)
    numbers, rows = np.asarray(two_batch.trajectories), np.arange(len(two_batch.tokens))[:, None]
    placed = numbers >= 0
    assert ((np.broadcast_to(rows, numbers.shape)[placed] % 2) == numbers[placed] % 2).all()
    assert max(np.sum(numbers == n) for n in np.unique(numbers[placed])) > 1  # some trajectory has several segments
    # Which groups an update trained: mini-batch u % 2 holds trajectories u, u + 2, ... (group after group, each
    # group's by rank). A group left with one trajectory of several segments trains in one mini-batch only.
    alone = next(t for t in range(g) if np.sum(groups[1].segments.trajectory == t) > 1)
    keep = np.flatnonzero(groups[1].segments.trajectory == alone)
    single = dataclasses.replace(groups[1], completions=[groups[1].completions[i] for i in keep],
                                 behaviour_logprobs=[groups[1].behaviour_logprobs[i] for i in keep],
                                 segments=Segments(prompts=[groups[1].segments.prompts[i] for i in keep],
                                                   masks=[groups[1].segments.masks[i] for i in keep],
                                                   trajectory=groups[1].segments.trajectory[keep]))
    three = [groups[0], single, groups[2]]  # trajectories 0 .. g-1, g (the single one: mini-batch 0), g+1 .. 2g
    sequences = sequences_of(three, two.batch_layout)
    assert groups_trained(sequences, two.batch_layout, np.array([False, True])) == [True, False, True]
    assert groups_trained(sequences, two.batch_layout, np.array([True, False])) == [True, True, True]
    broken = segment_group(9, rng, g, length, budget)
    del broken.segments.masks[1:]  # masks missing: refused, naming the field
    with pytest.raises(ValueError, match=r"segments.masks has 1 entries"):
        group_rows([broken], g)

    # A restored segment group fits while each segment fits a packed row and the trained budget.
    prompt_bucket, budget = trainer.prompt_bucket, trainer.completion_bucket
    assert group_fits(groups[0], prompt_bucket, budget, length) is None
    assert "sampled tokens, over sampler.max_new_tokens=0" in group_fits(groups[0], prompt_bucket, 0, length)
    assert "over a learner row of 2" in group_fits(groups[0], prompt_bucket, budget, 2)


def test_a_segment_step_is_the_batch_compile_compiles_the_learner_for(tmp_path):
    """With an env section the learner batch carries the segments' trajectories, and grpo-jax compile's abstract
    batch (RunPlan.abstract_batch) has the same fields, shapes and dtypes; without one neither has them."""
    for name, turns in (("env", 3), ("plain", None)):
        trainer = fake_trainer(tmp_path / name)
        g, rng = trainer.config.grpo.group_size, np.random.default_rng(2)
        if turns is None:
            trainer.plan = dataclasses.replace(trainer.plan, config=trainer.config)
            groups = [Group(ordinal=i, prompt={"prompt_ids": np.array([1, 2, 3], np.int32)},
                            completions=[np.array([4, 5], np.int32)] * g, behaviour_logprobs=[np.zeros(2)] * g,
                            rewards=np.zeros(g, np.float32), weight_version=0,
                            advantages=rng.normal(size=g).astype(np.float32), valid=np.ones(g, bool))
                      for i in range(trainer.local_prompts)]
        else:
            groups = [segment_group(i, rng, g, trainer.plan.row_length, trainer.completion_bucket) for i in range(2)]
        batch, padding, _ = Trainer.learner_batch(trainer, groups)
        assert (batch.trajectories is not None) == (turns is not None) == trainer.plan.trains_segments
        abstract = trainer.plan.abstract_batch(rows=padding["learner/rows"])
        assert jax.tree.structure(batch) == jax.tree.structure(abstract)
        for got, want in zip(jax.tree.leaves(batch), jax.tree.leaves(abstract)):
            assert np.shape(got) == want.shape and np.asarray(got).dtype == want.dtype


def test_ordinary_groups_are_laid_out_as_before_and_segments_need_packing(tmp_path):
    trainer = fake_trainer(tmp_path)
    g, rng = trainer.config.grpo.group_size, np.random.default_rng(1)
    groups = [Group(ordinal=i, prompt={"prompt_ids": rng.integers(1, 30, 5).astype(np.int32)},
                    completions=[rng.integers(1, 30, int(n)).astype(np.int32) for n in rng.integers(1, 7, g)],
                    behaviour_logprobs=[rng.normal(size=6).astype(np.float32) for _ in range(g)],
                    rewards=np.zeros(g, np.float32), weight_version=0,
                    advantages=rng.normal(size=g).astype(np.float32), valid=np.ones(g, bool))
              for i in range(trainer.local_prompts)]
    prompts, completions, logprobs, advantages, masks = group_rows(groups, g)
    assert masks is None and len(prompts) == trainer.local_prompts * g
    batch, _, _ = Trainer.learner_batch(trainer, groups)
    length = trainer.plan.row_length
    layout = pack_layout(*sequence_lengths(prompts, completions)[:2], length, trainer.completion_bucket)
    want = pack_sequences(prompts, completions, logprobs, advantages, 0, length, trainer.completion_bucket,
                          layout=layout, rows=trainer.plan.packed_rows(layout.rows))
    for field in ("tokens", "input_mask", "loss_mask", "advantages", "behaviour_logprobs", "scored_positions"):
        np.testing.assert_array_equal(getattr(batch, field), getattr(want, field), err_msg=field)
    np.testing.assert_array_equal(sample_lengths(groups[0]), [len(c) for c in groups[0].completions])

    unpacked = fake_trainer(tmp_path / "unpacked", "optim.packing=false")
    segments = [segment_group(0, rng, g, length, trainer.completion_bucket)]
    with pytest.raises(TrainerError, match="optim.packing=true"):
        Trainer.learner_batch(unpacked, segments)
