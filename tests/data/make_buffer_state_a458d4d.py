"""Writes tests/data/buffer_state_a458d4d.*: replay buffer states (plain, and pooled as a checkpoint stores them)
as grpo_jax at a458d4d saved them, before Group was typed; tests/test_replay_buffer.py restores them. Run from the
project root with that version's package unpacked in /tmp/old-src:
    git archive a458d4d grpo_jax | tar -x -C /tmp/old-src && .venv/bin/python tests/data/make_buffer_state_a458d4d.py
"""

import importlib
import json
import sys
import types

import numpy as np

OLD_SOURCE = "/tmp/old-src"


def old(module: str):
    """A module of the old version (OLD_SOURCE first on the path, checked)."""
    loaded = importlib.import_module(module)
    assert loaded.__file__.startswith(OLD_SOURCE), loaded.__file__
    return loaded


def segment(tokens, mask):
    return old("grpo_jax.envs.trajectory").Segment(
        tokens=tuple(tokens), loss_mask=tuple(mask), behaviour_logprobs=tuple(-0.1 * m for m in mask),
        weight_versions=tuple(3 if m else -1 for m in mask))


def main() -> None:
    sys.path.insert(0, OLD_SOURCE)
    rb = old("grpo_jax.state.replay_buffer")
    episode_group = old("grpo_jax.rollout.actor").episode_group
    episode_result = old("grpo_jax.rollout.episodes").EpisodeResult
    rng = np.random.default_rng(0)
    buffer = rb.ReplayBuffer(capacity=8, max_staleness=1, prompts_per_step=2, learner_version=3)
    # Single-turn, with token versions (the continuous engine).
    completions = [rng.integers(1, 50, n).astype(np.int32) for n in (3, 5)]
    buffer.put(rb.Group(
        ordinal=4, prompt={"dataset_index": 4, "epoch": 0, "prompt_ids": np.array([1, 2, 3], np.int32),
                           "row": {"question": "1+1?", "answer": "2"}},
        completions=completions, behaviour_logprobs=[-rng.random(len(c)).astype(np.float32) for c in completions],
        rewards=np.array([1.0, 0.0], np.float32), weight_version=2, regenerations=1,
        extras={"advantages": np.array([1.0, -1.0], np.float32), "valid": np.array([True, True]),
                "zero_variance": False,
                "token_versions": [np.array([2, 2, 3], np.int32), np.array([2, 3, 3, 3, 3], np.int32)]}))
    # MoE routing replay.
    buffer.put(rb.Group(
        ordinal=5, prompt={"dataset_index": 5, "epoch": 0, "prompt_ids": np.array([7, 8], np.int32)},
        completions=[np.array([9, 10], np.int32)] * 2,
        behaviour_logprobs=[np.array([-0.5, -0.25], np.float32)] * 2,
        rewards=np.array([0.5, 0.0], np.float32), weight_version=3,
        extras={"advantages": np.array([0.7, -0.7], np.float32), "valid": np.array([True, False]),
                "zero_variance": False, "token_versions": [np.array([3, 3], np.int32)] * 2,
                "routing": [rng.integers(0, 4, (4, 2, 2)).astype(np.int32) for _ in range(2)]}))
    # Multi-turn episodes, laid out by that version's actor.
    segments = (segment([1, 2, 3, 11, 12, 13], [0, 0, 0, 1, 1, 0]),
                segment([1, 2, 3, 11, 12, 13, 14, 15], [0, 0, 0, 0, 0, 0, 1, 1]))
    episodes = [episode_result(
        trajectory=types.SimpleNamespace(segments=segments[:j + 1], turns=j + 1, tool_calls=j, tool_errors=0,
                                         truncated=False),
        reward=float(j), step_rewards=[0.5] * j, reward_parts={"format": 0.5 * j}, env_seconds=0.01) for j in range(2)]
    prompt = types.SimpleNamespace(ordinal=6, record={"dataset_index": 6, "epoch": 1, "row": {"id": 6},
                                                      "prompt_ids": np.array([1, 2, 3], np.int32)})
    steps = np.full((2, 3), np.nan, np.float32)
    steps[1, 0] = 0.5
    buffer.put(episode_group(prompt, episodes, np.array([0.0, 1.0], np.float32), np.array([-1.0, 1.0], np.float32),
                             np.array([True, True]), False, steps))
    with open("tests/data/buffer_state_a458d4d.json", "w") as f:
        json.dump(buffer.to_state(), f)
    pool = rb.ArrayPool()
    with open("tests/data/buffer_state_a458d4d.pooled.json", "w") as f:
        json.dump(buffer.to_state(pool), f)
    np.savez("tests/data/buffer_state_a458d4d.pooled.npz", **pool.arrays())


if __name__ == "__main__":
    main()
