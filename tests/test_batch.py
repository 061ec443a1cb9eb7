"""algorithm.batch, the group -> batch hand-off: the producer of the mini-batch rule (pack_layout, through
sequences_of) and its consumer (groups_trained) agree, for ordinary and segment groups, on any process of a step."""

import numpy as np
import pytest

from grpo_jax.algorithm.batch import BatchLayout, assemble, groups_trained, rows_needed, sequences_of
from grpo_jax.state.replay_buffer import Group, Segments

G = 4


def layout(mini_batches: int, process_index: int, prompts: int, packing: bool = True) -> BatchLayout:
    return BatchLayout(group_size=G, mini_batches=mini_batches, step_sequences=prompts * G,
                       first_sequence=process_index * prompts * G, prompt_len=4, completion_len=8, packing=packing,
                       trains_segments=True, replays_routing=False, pad_id=0)


def random_group(ordinal: int, rng, segmented: bool) -> Group:
    if not segmented:
        completions = [rng.integers(1, 30, int(n)).astype(np.int32) for n in rng.integers(1, 8, G)]
        return Group(ordinal=ordinal, prompt={"prompt_ids": rng.integers(1, 30, 3).astype(np.int32)},
                     completions=completions, behaviour_logprobs=[np.zeros(len(c), np.float32) for c in completions],
                     rewards=np.zeros(G, np.float32), weight_version=0,
                     advantages=rng.normal(size=G).astype(np.float32), valid=np.ones(G, bool))
    trajectory = np.sort(rng.integers(0, G, int(rng.integers(G, 2 * G)))).astype(np.int32)
    trajectory[:G] = np.arange(G)  # every trajectory has a segment
    trajectory.sort()
    completions = [rng.integers(1, 30, int(n)).astype(np.int32) for n in rng.integers(1, 8, len(trajectory))]
    return Group(ordinal=ordinal, prompt={"prompt_ids": np.array([1], np.int32)}, completions=completions,
                 behaviour_logprobs=[np.zeros(len(c), np.float32) for c in completions],
                 rewards=np.zeros(G, np.float32), weight_version=0, advantages=rng.normal(size=G).astype(np.float32),
                 valid=np.ones(G, bool),
                 segments=Segments(prompts=[rng.integers(1, 30, 3).astype(np.int32) for _ in completions],
                                   masks=[np.ones(len(c), np.float32) for c in completions], trajectory=trajectory))


@pytest.mark.parametrize("seed", range(12))
def test_groups_trained_reads_back_the_mini_batches_pack_layout_placed_them_in(seed):
    rng = np.random.default_rng(seed)
    mini_batches, process, prompts = int(rng.integers(1, 4)), int(rng.integers(0, 3)), int(rng.integers(1, 4))
    here = layout(mini_batches, process, prompts)
    count = int(rng.integers(1, prompts + 1))
    groups = [random_group(i, rng, segmented=bool(rng.random() < 0.5)) for i in range(count)]
    sequences = sequences_of(groups, here)
    batch = assemble(sequences, here, rows_needed(sequences, here))
    assert batch.tokens.shape[0] == sequences.packed.rows
    owner = np.repeat(np.arange(len(groups)), sequences.per_group)  # the group of each (non-padding) sequence
    for m in range(mini_batches):
        applied = np.zeros(2 * mini_batches, bool)
        applied[m + mini_batches] = True  # the second epoch's update of mini-batch m
        placed = sequences.packed.row[:len(owner)]
        expected = [bool(np.any(placed[owner == k] % mini_batches == m)) for k in range(len(groups))]
        assert groups_trained(sequences, here, applied) == expected
    assert groups_trained(sequences, here, np.ones(mini_batches, bool)) == [True] * len(groups)
    assert groups_trained(sequences, here, np.zeros(mini_batches, bool)) == [False] * len(groups)


def test_the_padded_layout_puts_sequence_i_in_mini_batch_first_plus_i_mod_m():
    here = layout(mini_batches=3, process_index=1, prompts=2, packing=False)
    groups = [random_group(i, np.random.default_rng(i), segmented=False) for i in range(2)]
    sequences = sequences_of(groups, here)
    assert rows_needed(sequences, here) == 2 * G
    assert assemble(sequences, here, 2 * G).tokens.shape == (2 * G, here.row_length)
    # Process 1's first sequence is the step's 8th: rows 8 .. 15 in mini-batches 2, 0, 1, 2, 0, 1, 2, 0.
    assert groups_trained(sequences, here, np.array([False, False, True])) == [True, True]
    assert groups_trained(sequences, here, np.array([True, False, False])) == [True, True]
    with pytest.raises(ValueError, match="one per row"):
        assemble(sequences, here, 2 * G + 1)
