"""Weight sync by resharding (weight_sync.WeightSync, trainer.weights_copy): the learner's parameters reach the
actor's layout exactly (or exactly cast to the compute dtype), and no device, nor the host, holds a whole
copy on the way. Several hosts are simulated on one process by taking blocks of its devices as hosts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.model import ModelConfig, create_model
from grpo_jax.sampler import Sampler, SamplerConfig
from grpo_jax.sharding import MeshConfig, make_mesh, shard_module, state_shardings
from grpo_jax.weight_sync import WeightSync, host_copy_mesh, reshard_local

# Dimensions that divide over 4 and 8 devices (so "split over every device" is checkable), plus a qkv bias
# and a vocab that 8 does not divide (leaves replicated or split on one axis only).
MODEL = ModelConfig(vocab_size=36, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    qkv_bias=True, max_position_embeddings=64)


def learner_params(config: ModelConfig, mesh_config: MeshConfig, devices):
    model = shard_module(create_model(config, seed=1), make_mesh(mesh_config, devices))
    graphdef, params = nnx.split(model)
    # Not the initial values alone (norm weights of ones, zero biases): every element distinct.
    params = jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(x.size), x.shape, x.dtype) * 0.01, params)
    return graphdef, params


@pytest.fixture
def no_host_copies(monkeypatch):
    """Fails a test whose arrays are copied whole to the host (jax.Array._value): what jax.device_put does
    between device sets with different tilings."""
    from jax._src import array

    copied = []
    real = array.ArrayImpl._value

    def spy(self):
        copied.append(self.shape)
        return real.fget(self)

    monkeypatch.setattr(array.ArrayImpl, "_value", property(spy))
    yield copied
    monkeypatch.undo()


def assert_shards_are_blocks(out, sharding):
    """Every device holds exactly its own block of the target layout, nothing bigger."""
    for shard in out.addressable_shards:
        want = sharding.shard_shape(out.shape)
        assert shard.data.shape == want and shard.data.nbytes == out.dtype.itemsize * int(np.prod(want))
    assert out.sharding == sharding


def test_jax_device_put_between_device_sets_goes_through_a_whole_host_copy(no_host_copies):
    # Why WeightSync assembles shards itself: the plain device_put of the old one-process path copies the
    # whole array to the host when the actor's tiling differs from the learner's.
    devices = jax.devices()
    x = jax.device_put(jnp.arange(64 * 48.0).reshape(64, 48),
                       NamedSharding(make_mesh(MeshConfig(fsdp=4), devices[4:]), PartitionSpec("fsdp")))
    target = NamedSharding(make_mesh(MeshConfig(fsdp=1, tensor=4), devices[:4]), PartitionSpec(None, "tensor"))
    jax.device_put(x, target)
    assert no_host_copies == [(64, 48)]
    no_host_copies.clear()
    (y,) = reshard_local([x], [target])
    assert no_host_copies == []
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert_shards_are_blocks(y, target)


@pytest.mark.parametrize("actor, actor_devices", [(MeshConfig(fsdp=1, tensor=4), 4), (MeshConfig(fsdp=4), 4),
                                                  (MeshConfig(fsdp=2, tensor=2), 4), (MeshConfig(fsdp=1), 1),
                                                  (MeshConfig(fsdp=2, tensor=4), 0)])
def test_one_process_sync_is_exact_shard_by_shard_and_a_separate_copy(actor, actor_devices, no_host_copies):
    devices = jax.devices()
    learner_devices = devices[4:] if actor_devices else devices
    actor_mesh = make_mesh(actor, devices[:actor_devices] if actor_devices else devices)
    _, params = learner_params(MODEL, MeshConfig(fsdp=len(learner_devices) // 2, tensor=2), learner_devices)
    shardings = state_shardings(params, actor_mesh)
    sync = WeightSync()
    for _ in range(2):  # the second call reuses the plan and its programs
        out = sync(params, shardings)
    assert no_host_copies == []
    for want, got, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(shardings)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.dtype == want.dtype
        assert_shards_are_blocks(got, sharding)
        # Never the learner's buffers (it donates them to its next step), also where the devices are shared.
        learner_buffers = {s.data.unsafe_buffer_pointer() for s in want.addressable_shards}
        assert not learner_buffers & {s.data.unsafe_buffer_pointer() for s in got.addressable_shards}


def test_may_alias_shares_the_frozen_base_where_layouts_agree():
    devices = jax.devices()
    _, params = learner_params(MODEL, MeshConfig(fsdp=8), devices)
    out = WeightSync()(params, jax.tree.map(lambda x: x.sharding, params), may_alias=True)
    for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(out)):
        assert [s.data.unsafe_buffer_pointer() for s in want.addressable_shards] == \
            [s.data.unsafe_buffer_pointer() for s in got.addressable_shards]


def test_cast_to_the_compute_dtype_is_exact_and_halves_the_bytes():
    devices = jax.devices()
    _, params = learner_params(MODEL, MeshConfig(fsdp=4), devices[4:])
    shardings = state_shardings(params, make_mesh(MeshConfig(fsdp=1, tensor=4), devices[:4]))
    for hosts in (None, 2):
        out = WeightSync(jnp.bfloat16, hosts=hosts)(params, shardings)
        for want, got, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(shardings)):
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
            assert_shards_are_blocks(got, sharding)
        assert 2 * sum(x.nbytes for x in jax.tree.leaves(out)) == sum(x.nbytes for x in jax.tree.leaves(params))
    # Never widened: a float32 compute dtype over bfloat16 weights sends them as they are.
    narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out = WeightSync(jnp.float32)(narrow, shardings)
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("learner", [MeshConfig(fsdp=8), MeshConfig(fsdp=4, tensor=2), MeshConfig(data=2, fsdp=2, tensor=2),
                                     MeshConfig(fsdp=2, tensor=4), MeshConfig(data=2, fsdp=4)])
def test_several_hosts_each_get_a_whole_copy_spread_over_their_own_devices(learner):
    # 8 learner devices taken as 2 hosts of 4 (process-major, as make_mesh orders them across processes).
    hosts, local = 2, 4
    devices = jax.devices()
    mesh = make_mesh(learner, devices)
    assert host_copy_mesh(mesh, hosts) is not None
    _, params = learner_params(MODEL, learner, devices)
    sync = WeightSync(jnp.bfloat16, hosts=hosts)
    staged = sync.stage(params)
    blocks = [set(mesh.devices.flat[h * local:(h + 1) * local]) for h in range(hosts)]
    for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(staged)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
        full = got.nbytes
        learner_shard = max(s.data.nbytes for s in want.addressable_shards) // 2  # in bfloat16
        for block in blocks:  # the host's own devices hold the whole array between them
            cells = np.zeros(got.shape, bool)
            for s in got.addressable_shards:
                if s.device in block:
                    cells[s.index] = True
            assert cells.all()
        for s in got.addressable_shards:
            # At most the learner's own shard times the hosts it was split over; full / local for a leaf the
            # learner splits over every device; never a whole copy of a leaf the learner splits.
            assert s.data.nbytes <= learner_shard * hosts
            if learner_shard * len(devices) == full:
                assert s.data.nbytes == full // local
            if learner_shard < full:
                assert s.data.nbytes < full
    # The program's own buffers: no whole copy of the model on any device (temporaries included).
    compiled = list(sync._programs.values())[0].lower(jax.tree.leaves(params)).compile().memory_analysis()
    total = sum(x.nbytes for x in jax.tree.leaves(staged))
    assert compiled.output_size_in_bytes <= total // 2
    assert compiled.temp_size_in_bytes + compiled.output_size_in_bytes < total
    # Step 2 from the staged copy: exact.
    actor_mesh = make_mesh(MeshConfig(fsdp=1, tensor=4), devices[:4])
    shardings = state_shardings(params, actor_mesh)
    for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(sync(params, shardings))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))


def test_sampling_with_the_cast_weights_is_bit_identical():
    # bfloat16 compute over float32 master weights: the model casts every weight before use, so the actor's
    # bfloat16 copy samples exactly as the float32 weights do (tokens and log-probs).
    config = dataclasses.replace(MODEL, dtype="bfloat16", param_dtype="float32", tie_embeddings=False)
    devices = jax.devices()
    graphdef, params = learner_params(config, MeshConfig(fsdp=4), devices[4:])
    actor_mesh = make_mesh(MeshConfig(fsdp=1, tensor=4), devices[:4])
    shardings = state_shardings(params, actor_mesh)
    exact = nnx.merge(graphdef, WeightSync()(params, shardings))
    cast = nnx.merge(graphdef, WeightSync(jnp.bfloat16)(params, shardings))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(cast))} == {jnp.dtype(jnp.bfloat16)}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (3, 12)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(exact(tokens)[0]), np.asarray(cast(tokens)[0]))
    sampler_config = SamplerConfig(max_new_tokens=8, max_prompt_len=16, temperature=1.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    a = Sampler(exact, eos_ids=[0], pad_id=0, config=sampler_config).generate(prompts, 7)
    b = Sampler(cast, eos_ids=[0], pad_id=0, config=sampler_config).generate(prompts, 7)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_actor_keeps_the_compute_dtype_copy(tmp_path, lora):
    from test_trainer import tiny_config

    from grpo_jax.trainer import Trainer

    overrides = ["model.dtype=bfloat16", "model.param_dtype=float32", "trainer.max_steps=2", "mesh.actor_devices=4",
                 "mesh.actor.fsdp=1", "mesh.actor.tensor=4", "mesh.learner.fsdp=4", "sampler.engine=static",
                 "trainer.save_final_model=false", "checkpoint.save_at_end=false", "trainer.tensorboard=false"]
    if lora:
        overrides += ["lora.rank=4"]
    trainer = Trainer(tiny_config(tmp_path, *overrides))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    learner_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.learner.params))
    assert all(2 * m["sync/bytes"] == learner_bytes for m in history)  # what is sent: bfloat16
    assert {x.dtype for x in jax.tree.leaves(trainer.sampler.state)} == {jnp.dtype(jnp.bfloat16)}
    if lora:  # the base was sent once, cast; the adapters each sync, cast
        assert {x.dtype for x in jax.tree.leaves(trainer.sampler.adapters)} == {jnp.dtype(jnp.bfloat16)}
        for want, got in zip(jax.tree.leaves(trainer.learner.frozen), jax.tree.leaves(trainer.sampler.state)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
