"""Replay buffer: staleness bound, regeneration, admission arithmetic, max_staleness 0 = synchronous GRPO,
finish() at the end of the data (groups in flight still arrive), close(error) waking waiters,
plain-JSON checkpoints. No JAX."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.state.replay_buffer import (
    ArrayPool,
    EpisodeStats,
    Group,
    ReplayBuffer,
    ReplayBufferClosed,
    ReplayBufferTimeout,
    Segments,
)


def group(ordinal: int, weight_version: int = 0, **kw) -> Group:
    return Group(
        ordinal=ordinal,
        prompt={"dataset_index": ordinal, "epoch": 0, "prompt_ids": [1, 2]},
        completions=[[5, 6, 7], [8]],
        behaviour_logprobs=[[-0.1, -0.2, -0.3], [-1.0]],
        rewards=[1.0, 0.0],
        weight_version=weight_version,
        **kw,
    )


def test_take_is_oldest_ordinal_first_and_waits_for_a_full_step():
    b = ReplayBuffer(capacity=8, max_staleness=1, prompts_per_step=2)
    for o in [5, 2, 9]:
        b.put(group(o))
    taken = b.take(2, current_version=0, timeout=0)
    assert [g.ordinal for g in taken.groups] == [2, 5] and taken.too_stale == [] and not taken.drained
    with pytest.raises(ReplayBufferTimeout):
        b.take(2, current_version=1, timeout=0.01)  # only 9 left
    assert b.ordinals() == [9]


def test_too_stale_groups_are_handed_back_for_regeneration_never_evicted_silently():
    b = ReplayBuffer(capacity=8, max_staleness=1, prompts_per_step=2)
    b.put(group(0, weight_version=0))
    b.put(group(1, weight_version=2))
    b.put(group(2, weight_version=1))
    # at version 2: staleness 2, 0, 1 -> 0 is too stale; 1 and 2 are trainable
    taken = b.take(2, current_version=2, timeout=0)
    assert [g.ordinal for g in taken.groups] == [1, 2]
    assert [g.ordinal for g in taken.too_stale] == [0]
    assert len(b) == 0
    # staleness exactly max_staleness is allowed
    b.put(group(3, weight_version=1))
    b.put(group(4, weight_version=1))
    assert [g.ordinal for g in b.take(2, current_version=2).groups] == [3, 4]


def test_stale_groups_come_back_at_once_even_without_a_full_step():
    b = ReplayBuffer(capacity=8, max_staleness=0, prompts_per_step=2)
    b.put(group(0, weight_version=0))
    b.put(group(1, weight_version=1))
    start = time.monotonic()
    taken = b.take(2, current_version=1, timeout=5)  # must not wait for a second fresh group
    assert time.monotonic() - start < 1
    assert taken.groups == [] and [g.ordinal for g in taken.too_stale] == [0]
    # regenerated with the current weights, it is trainable
    b.put(group(0, weight_version=1, regenerations=1))
    taken = b.take(2, current_version=1, timeout=0)
    assert [(g.ordinal, g.regenerations) for g in taken.groups] == [(0, 1), (1, 0)]


def test_admission_arithmetic():
    b = ReplayBuffer(capacity=8, max_staleness=1, prompts_per_step=2)
    # learner at version 0, actor at 0: groups 1-2 land in step 0, groups 3-4 in step 1 (staleness 1)
    assert [b.next_target_step(n) for n in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2]
    assert b.may_generate(1, 0) and not b.may_generate(2, 0)
    assert b.reserve(4, actor_version=0)
    assert not b.reserve(1, actor_version=0)  # would be trained at step 2 with version-0 weights
    assert b.reserved == 4
    for o in range(4):
        b.put(group(o, weight_version=0))  # each put consumes a reservation
    assert b.reserved == 0 and len(b) == 4
    b.take(2, current_version=0)  # the learner moves on: its next step is version 1
    assert b.learner_version == 1
    assert not b.reserve(1, actor_version=0)  # needs newer weights: it would be trained at 2
    assert b.reserve(2, actor_version=1)
    b.release(2)  # both prompts dropped before generation finished
    assert b.reserved == 0 and b.reserve(2, actor_version=1)


def test_admissible_tops_up_a_handout_thinned_by_drops():
    b = ReplayBuffer(capacity=8, max_staleness=0, prompts_per_step=4)
    assert b.admissible(actor_version=0) == 4
    assert b.reserve(4, actor_version=0)
    for o in range(3):
        b.put(group(o, weight_version=0))
    b.release(1)  # the fourth prompt was dropped: step 0 still needs one group
    assert not b.reserve(4, actor_version=0)  # a whole handout no longer fits the bound...
    assert b.admissible(actor_version=0) == 1  # ...but exactly the missing group does
    assert b.reserve(1, actor_version=0) and b.admissible(actor_version=0) == 0
    # With max_steps, nothing beyond the groups the remaining steps need is admitted.
    c = ReplayBuffer(capacity=8, max_staleness=2, prompts_per_step=2)
    assert c.admissible(actor_version=0) == 6
    assert c.admissible(actor_version=0, max_steps=2) == 4
    assert c.admissible(actor_version=0, max_steps=0) == 0


def test_max_staleness_0_is_synchronous_grpo_through_the_same_code():
    """An actor thread and the learner, the actor only on weights it has seen published. With
    max_staleness 0 every group of step k is generated with version k and trained at version k; no group
    ever goes stale; the actor never runs ahead of the learner."""
    P, steps = 3, 6
    buffer = ReplayBuffer(capacity=P, max_staleness=0, prompts_per_step=P)
    published = {"version": 0}
    weights = threading.Condition()
    generated_at: list[tuple[int, int]] = []  # (ordinal, learner version seen when generation started)

    def actor():
        version, ordinal = 0, 0
        try:
            while ordinal < P * steps:
                while not buffer.reserve(1, version):
                    with weights:  # wait for weights newer than ours
                        weights.wait_for(lambda: published["version"] > version, timeout=5)
                        version = published["version"]
                generated_at.append((ordinal, buffer.learner_version))
                buffer.put(group(ordinal, weight_version=version), timeout=5)
                ordinal += 1
        except BaseException as e:  # an actor that dies must wake the learner
            buffer.close(e)
            raise

    thread = threading.Thread(target=actor, daemon=True)
    thread.start()
    for version in range(steps):
        taken = buffer.take(P, current_version=version, timeout=5)
        assert taken.too_stale == []
        assert [g.weight_version for g in taken.groups] == [version] * P
        assert [g.ordinal for g in taken.groups] == list(range(version * P, (version + 1) * P))
        time.sleep(0.01)  # a slow update: the actor must not run ahead meanwhile
        assert len(buffer) == 0 and buffer.reserved == 0
        with weights:
            published["version"] = version + 1
            weights.notify_all()
    thread.join(5)
    assert not thread.is_alive()
    assert all(o // P == v for o, v in generated_at)  # step k's groups generated while the learner was at k


def test_put_blocks_when_full_until_the_learner_takes():
    b = ReplayBuffer(capacity=2, max_staleness=3, prompts_per_step=2)
    b.put(group(0))
    b.put(group(1))
    with pytest.raises(ReplayBufferTimeout, match="full"):
        b.put(group(2), timeout=0.01)
    done = threading.Event()

    def producer():
        b.put(group(2), timeout=5)
        done.set()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()
    b.take(2, current_version=0)
    assert done.wait(5) and b.ordinals() == [2]
    with pytest.raises(ValueError, match="already in the buffer"):
        b.put(group(2))


@pytest.mark.parametrize("waiter", ["take", "put"])
def test_close_with_an_error_wakes_waiters_with_a_clear_error(waiter):
    b = ReplayBuffer(capacity=2, max_staleness=1, prompts_per_step=2)
    if waiter == "put":
        b.put(group(0))
        b.put(group(1))
    errors = []

    def wait():
        try:
            b.take(2, current_version=0) if waiter == "take" else b.put(group(2))
        except ReplayBufferClosed as e:
            errors.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.05)
    assert t.is_alive()  # blocked (no timeout given)
    b.close(RuntimeError("actor died: CUDA error"))
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and "actor died" in str(errors[0])
    assert isinstance(errors[0].__cause__, RuntimeError)
    with pytest.raises(ReplayBufferClosed):
        b.reserve(1, 0)


def test_finish_lets_the_groups_in_flight_arrive_and_then_drains_a_short_last_step():
    # The data ran out while three groups were being generated (a continuous engine decodes groups over
    # several chunks): they still arrive, one is dropped, and take() waits for them before the short step.
    b = ReplayBuffer(capacity=4, max_staleness=1, prompts_per_step=4)
    assert b.reserve(3, 0)
    b.put(group(3))
    b.finish()
    assert b.closed and b.reserved == 2
    with pytest.raises(ReplayBufferTimeout):
        b.take(4, current_version=0, timeout=0.05)  # two groups still in flight: not drained yet
    b.put(group(4))
    b.release(1)  # the third was dropped (e.g. overlong)
    taken = b.take(4, current_version=0, timeout=0)
    assert [g.ordinal for g in taken.groups] == [3, 4] and taken.drained
    assert b.take(4, current_version=1, timeout=0) == type(taken)([], [], drained=True)
    with pytest.raises(ValueError, match="without a reservation"):
        b.put(group(5))  # after finish() only reserved groups may come
    b.finish()  # idempotent
    assert b.take(4, current_version=1, timeout=0).drained


def test_finish_wakes_a_take_waiting_for_a_full_step():
    b = ReplayBuffer(capacity=4, max_staleness=1, prompts_per_step=4)
    b.put(group(0))
    results = []
    t = threading.Thread(target=lambda: results.append(b.take(4, current_version=0)), daemon=True)
    t.start()
    time.sleep(0.05)
    assert t.is_alive()
    b.finish()
    t.join(5)
    assert not t.is_alive() and [g.ordinal for g in results[0].groups] == [0] and results[0].drained


def test_close_needs_the_error_that_ended_the_producer():
    b = ReplayBuffer(capacity=4, max_staleness=1, prompts_per_step=4)
    with pytest.raises(TypeError):
        b.close()  # the normal end of the data is finish(), which keeps what is in flight
    assert b.reserve(2, 0)
    b.close(RuntimeError("actor died"))
    with pytest.raises(ReplayBufferClosed, match="actor died"):
        b.put(group(0))  # a reservation does not keep a failed buffer open


def test_after_finish_a_group_generated_again_is_waited_for_and_taken():
    # A group that grew too stale after the data ran out is generated again: take() waits for its
    # reservation instead of ending the run without it.
    b = ReplayBuffer(capacity=4, max_staleness=0, prompts_per_step=2)
    b.put(group(0, weight_version=0))
    b.finish()
    taken = b.take(2, current_version=1, timeout=0)
    assert taken.groups == [] and [g.ordinal for g in taken.too_stale] == [0]
    assert b.reserve(1, 1)  # the actor regenerates ordinal 0 with version 1
    waiting = b.take  # nothing there yet, but a reservation: take waits instead of reporting drained
    with pytest.raises(ReplayBufferTimeout):
        waiting(2, current_version=1, timeout=0.05)
    b.put(group(0, weight_version=1))
    taken = b.take(2, current_version=1, timeout=0)
    assert [g.ordinal for g in taken.groups] == [0] and taken.drained


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["admit", "put", "drop", "take"]), max_size=60), st.integers(0, 60),
       st.integers(1, 4), st.randoms(use_true_random=False))
def test_every_reserved_group_is_trained_once_or_dropped_whatever_the_order_around_finish(actions, finish_at, p, rng):
    # An actor and a learner interleaved at random; the data runs out at action `finish_at`. Whatever was
    # reserved before is put (and trained once) or released; take() reports drained only with nothing in
    # flight, and a full step is never cut short while groups are still coming.
    b = ReplayBuffer(capacity=1000, max_staleness=1000, prompts_per_step=p)
    in_flight, admitted, dropped, trained = [], [], [], []
    version = 0

    def take():
        nonlocal version
        try:
            taken = b.take(p, current_version=version, timeout=0)
        except ReplayBufferTimeout:
            assert len(b) < p
            return None
        assert not taken.too_stale
        assert len(taken.groups) == p or (taken.drained and b.closed and not in_flight)
        trained.extend(g.ordinal for g in taken.groups)
        version += not taken.drained
        return taken

    for i, action in enumerate(actions):
        if i == finish_at:
            b.finish()
        if action == "admit" and not b.closed:
            n = rng.randint(1, 3)
            assert b.reserve(n, version)
            new = list(range(len(admitted), len(admitted) + n))
            admitted += new
            in_flight += new
        elif action in ("put", "drop") and in_flight:
            ordinal = in_flight.pop(rng.randrange(len(in_flight)))
            if action == "put":
                b.put(group(ordinal, weight_version=version))
            else:
                b.release(1)
                dropped.append(ordinal)
        elif action == "take":
            take()
    b.finish()
    while in_flight:  # the groups in flight when the data ran out still arrive
        b.put(group(in_flight.pop(), weight_version=version))
    while not (taken := take()).drained or taken.groups:
        pass
    assert b.reserved == 0 and len(b) == 0
    assert len(trained) == len(set(trained)) and sorted(trained + dropped) == admitted


def test_from_state_leaves_out_groups_that_no_longer_fit():
    b = ReplayBuffer(capacity=4, max_staleness=1, prompts_per_step=1)
    for o in range(4):
        b.put(group(o))
    state = b.to_state()

    def fits(g):
        return "too long" if g.ordinal == 1 else None

    back = ReplayBuffer.from_state(state, capacity=2, fits=fits)
    assert back.ordinals() == [0, 2]
    assert back.left_out == [(1, "too long"), (3, "beyond the buffer's capacity of 2 groups")]
    with pytest.raises(ValueError, match="capacity is 2"):
        ReplayBuffer.from_state(state, capacity=2)


def test_state_is_plain_json_and_round_trips_arrays():
    b = ReplayBuffer(capacity=4, max_staleness=2, prompts_per_step=2, learner_version=7)
    g = Group(
        ordinal=11,
        prompt={"dataset_index": 3, "epoch": 1, "prompt_ids": np.array([4, 5, 6], dtype=np.int32)},
        completions=[np.array([1, 2, 3], dtype=np.int32), np.array([9], dtype=np.int32)],
        behaviour_logprobs=[np.array([-0.5, -0.25, -1.5], dtype=np.float32), np.array([-2.0], dtype=np.float32)],
        rewards=np.array([1.0, 0.5], dtype=np.float32),
        weight_version=6,
        regenerations=2,
        valid=np.array([True, False]),
        token_versions=[np.array([6, 6, 7], np.int32), np.array([6], np.int32)],
    )
    g.prompt.update(mask=np.ones((2, 3), dtype=bool), raw=b"\x00\x01")
    b.put(g)
    b.put(group(4, weight_version=7))
    state = json.loads(json.dumps(b.to_state(), allow_nan=False))
    assert state["ordinals"] == [4, 11]
    r = ReplayBuffer.from_state(state)
    assert (r.capacity, r.max_staleness, r.prompts_per_step, r.learner_version) == (4, 2, 2, 7)
    back = {x.ordinal: x for x in r.take(2, current_version=7).groups}[11]
    assert back.prompt["prompt_ids"].dtype == np.int32 and back.prompt["prompt_ids"].tolist() == [4, 5, 6]
    assert [c.tolist() for c in back.completions] == [[1, 2, 3], [9]]
    assert back.behaviour_logprobs[0].dtype == np.float32 and back.behaviour_logprobs[0].tolist() == [-0.5, -0.25, -1.5]
    assert back.prompt["mask"].shape == (2, 3) and back.prompt["raw"] == b"\x00\x01"
    assert (back.weight_version, back.regenerations) == (6, 2)
    assert back.valid.tolist() == [True, False] and [v.tolist() for v in back.token_versions] == [[6, 6, 7], [6]]
    assert back.advantages is None and back.segments is None and back.zero_variance is False
    unsaveable = ReplayBuffer(4, 1, 2)
    unsaveable.put(dataclasses.replace(group(0), prompt={"f": object()}))
    with pytest.raises(TypeError, match="group of ordinal 0.prompt.f: object cannot be saved"):
        unsaveable.to_state()


def test_bfloat16_arrays_survive_the_state():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = ReplayBuffer(capacity=2, max_staleness=0, prompts_per_step=1)
    b.put(group(0, advantages=np.array([0.5, -1.25], dtype=ml_dtypes.bfloat16)))
    r = ReplayBuffer.from_state(json.loads(json.dumps(b.to_state())))
    lp = r.take(1, 0).groups[0].advantages
    assert lp.dtype == ml_dtypes.bfloat16 and lp.astype(np.float32).tolist() == [0.5, -1.25]


def test_constructor_refuses_a_capacity_that_fits_no_step():
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=3, max_staleness=0, prompts_per_step=4)


def test_state_as_pooled_arrays_round_trips_and_an_empty_buffer_still_saves_an_array():
    def array_group(o):
        return Group(ordinal=o, prompt={"dataset_index": o, "epoch": 0, "prompt_ids": np.array([1, 2, o], np.int32)},
                     completions=[np.array([5, 6, o], np.int32), np.array([8], np.int32)],
                     behaviour_logprobs=[np.array([-0.1, -0.2, -0.3], np.float32), np.array([-1.0], np.float32)],
                     rewards=np.array([1.0, o], np.float32), weight_version=o,
                     valid=np.array([True, o % 2 == 0]))

    b = ReplayBuffer(capacity=4, max_staleness=9, prompts_per_step=2, learner_version=3)
    b.put(array_group(2))
    b.put(array_group(5))
    pool = ArrayPool()
    state = json.loads(json.dumps(b.to_state(pool)))  # the JSON part holds references only
    assert "__ndarray__" not in json.dumps(state) and "__pooled__" in json.dumps(state)
    arrays = pool.arrays()
    assert set(arrays) == {"int32", "float32", "bool"} and all(a.ndim == 1 and a.size >= 1 for a in arrays.values())
    r = ReplayBuffer.from_state(state, pool=ArrayPool(arrays), learner_version=4)
    assert r.learner_version == 4 and r.ordinals() == [2, 5]
    for g in r.take(2, current_version=4).groups:
        want = array_group(g.ordinal)
        for field in ("completions", "behaviour_logprobs"):
            assert [(x.dtype, x.tolist()) for x in getattr(g, field)] == [
                (x.dtype, x.tolist()) for x in getattr(want, field)
            ]
        assert g.rewards.dtype == np.float32 and g.rewards.tolist() == want.rewards.tolist()
        assert g.valid.dtype == bool and g.valid.tolist() == want.valid.tolist()
        assert g.prompt["prompt_ids"].tolist() == want.prompt["prompt_ids"].tolist()
    assert ArrayPool().arrays()["int32"].shape == (1,)  # Orbax refuses zero-size arrays
    with pytest.raises(ValueError, match="runs past the end"):
        ArrayPool({"int32": np.zeros(2, np.int32)}).get({"__pooled__": "int32", "start": 1, "shape": [4]})


def test_put_back_returns_an_abandoned_step_for_the_checkpoint():
    b = ReplayBuffer(capacity=2, max_staleness=1, prompts_per_step=2)
    b.put(group(0))
    b.put(group(1))
    taken = b.take(2, current_version=0)
    assert b.learner_version == 1
    b.put_back(taken.groups, current_version=0)
    assert b.ordinals() == [0, 1] and b.learner_version == 0
    assert [g.ordinal for g in b.to_state()["groups"] and b.take(2, current_version=0).groups] == [0, 1]
    with pytest.raises(ValueError, match="already in the buffer"):
        b.put_back([group(0), group(0)], current_version=0)


def test_a_segment_group_round_trips_exactly_with_and_without_a_pool():
    """A multi-turn group (replay_buffer.Segments): ragged per-segment lists, int8 masks, empty arrays, come back
    with the same dtypes, shapes and values, as JSON and as pooled arrays."""

    rng = np.random.default_rng(0)
    lengths = [5, 1, 0, 7]  # an empty completion too
    g = Group(ordinal=3, prompt={"dataset_index": 3, "epoch": 0, "prompt_ids": np.array([1, 2], np.int32)},
              completions=[rng.integers(0, 50, n).astype(np.int32) for n in lengths],
              behaviour_logprobs=[rng.normal(size=n).astype(np.float32) for n in lengths],
              rewards=np.array([0.5, -1.0], np.float32), weight_version=2,
              advantages=np.array([0.25, -0.25], np.float32), valid=np.array([True, False]),
              segments=Segments(prompts=[rng.integers(0, 50, n).astype(np.int32) for n in (3, 9, 4, 2)],
                                masks=[(rng.random(n) > 0.5).astype(np.int8) for n in lengths[:3]]
                                + [np.ones(7, np.float32)],
                                trajectory=np.array([0, 0, 1, 1], np.int32)),
              episodes=EpisodeStats(stats=rng.random((2, 6)).astype(np.float32),
                                    reward_parts=np.array([[0.5], [0.0]], np.float32), reward_part_names=["format"],
                                    step_rewards=np.array([[0.5, 1.0], [0.0, 2.0]], np.float32)))

    def same(a, b, where="group"):
        if isinstance(a, dict):
            assert isinstance(b, dict) and set(a) == set(b), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list):
            assert isinstance(b, list) and len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        elif isinstance(a, np.ndarray):
            assert isinstance(b, np.ndarray) and (a.dtype, a.shape) == (b.dtype, b.shape), where
            np.testing.assert_array_equal(a, b, err_msg=where)
        else:
            assert a == b, where

    for pool in (None, ArrayPool()):
        b = ReplayBuffer(capacity=2, max_staleness=1, prompts_per_step=1)
        b.put(g)
        state = json.loads(json.dumps(b.to_state(pool), allow_nan=False))
        restored = ReplayBuffer.from_state(state, pool=None if pool is None else ArrayPool(pool.arrays()))
        back = restored.take(1, current_version=2).groups[0]
        assert back.segmented
        same(dataclasses.asdict(g), dataclasses.asdict(back))


OLD_STATE = pathlib.Path(__file__).parent / "data" / "buffer_state_a458d4d"


@pytest.mark.parametrize("pooled", [False, True])
def test_a_buffer_saved_before_group_was_typed_restores_every_field(pooled):
    """tests/data/make_buffer_state_a458d4d.py wrote these with grpo_jax at a458d4d (Group.extras, a dict of string
    keys): a single-turn group with token versions, one with MoE routing, and a multi-turn group of segments."""
    if pooled:
        arrays = dict(np.load(f"{OLD_STATE}.pooled.npz"))
        state = json.loads(pathlib.Path(f"{OLD_STATE}.pooled.json").read_text())
        buffer = ReplayBuffer.from_state(state, pool=ArrayPool(arrays))
    else:
        buffer = ReplayBuffer.from_state(json.loads(pathlib.Path(f"{OLD_STATE}.json").read_text()))
    assert buffer.ordinals() == [4, 5, 6] and buffer.learner_version == 3
    single, moe, episodes = buffer.take(3, current_version=3).groups
    assert (single.weight_version, single.regenerations, single.zero_variance) == (2, 1, False)
    assert single.advantages.tolist() == [1.0, -1.0] and single.valid.tolist() == [True, True]
    assert [v.tolist() for v in single.token_versions] == [[2, 2, 3], [2, 3, 3, 3, 3]]
    assert single.prompt["row"] == {"question": "1+1?", "answer": "2"} and not single.segmented
    assert single.routing is None and single.episodes is None
    assert [r.shape for r in moe.routing] == [(4, 2, 2)] * 2 and moe.routing[0].dtype == np.int32
    assert moe.valid.tolist() == [True, False]
    assert episodes.segmented and episodes.segments.trajectory.tolist() == [0, 1, 1]
    assert [m.tolist() for m in episodes.segments.masks] == [[1, 1, 0], [1, 1, 0], [1, 1]]
    assert [p.tolist() for p in episodes.segments.prompts] == [[1, 2, 3], [1, 2, 3], [1, 2, 3, 11, 12, 13]]
    assert [c.tolist() for c in episodes.completions] == [[11, 12, 13], [11, 12, 13], [14, 15]]
    assert episodes.episodes.reward_part_names == ["format"]
    assert episodes.episodes.stats.shape == (2, 6) and episodes.episodes.step_rewards.shape == (2, 3)
    np.testing.assert_array_equal(episodes.episodes.reward_parts, [[0.0], [0.5]])
    # ... and saved again, the state has the same layout as the old one.
    resaved = ReplayBuffer(capacity=8, max_staleness=1, prompts_per_step=2, learner_version=3)
    for group in (single, moe, episodes):
        resaved.put(group)
    if not pooled:
        assert json.loads(json.dumps(resaved.to_state())) == json.loads(pathlib.Path(f"{OLD_STATE}.json").read_text())


def test_a_saved_group_with_keys_this_version_does_not_know_is_refused_naming_them():
    b = ReplayBuffer(capacity=2, max_staleness=1, prompts_per_step=1)
    b.put(group(3))
    state = b.to_state()
    state["groups"][0]["extras"]["surprise"] = 1
    with pytest.raises(ValueError, match=r"group of ordinal 3: unknown key\(s\) \['surprise'\]"):
        ReplayBuffer.from_state(state)
    state["groups"][0]["extras"] = {"segment_masks": []}
    with pytest.raises(ValueError, match="a segment group needs"):
        ReplayBuffer.from_state(state)
