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

from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.parallel.sharding import MeshConfig, make_mesh, shard_module, state_shardings
from grpo_jax.rollout.sampler import Sampler, SamplerConfig
from grpo_jax.rollout.weight_sync import WeightSync, host_copy_mesh, reshard_local

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


@pytest.mark.parametrize(
    "learner",
    [
        MeshConfig(fsdp=8),
        MeshConfig(fsdp=4, tensor=2),
        MeshConfig(data=2, fsdp=2, tensor=2),
        MeshConfig(fsdp=2, tensor=4),
        MeshConfig(data=2, fsdp=4),
    ],
)
def test_several_hosts_each_get_a_whole_copy_spread_over_their_own_devices(learner):
    # 8 learner devices taken as 2 hosts of 4 (process-major, as make_mesh orders them across processes).
    hosts, local = 2, 4
    devices = jax.devices()
    mesh = make_mesh(learner, devices)
    assert host_copy_mesh(mesh, hosts) is not None
    _, params = learner_params(MODEL, learner, devices)
    sync = WeightSync(jnp.bfloat16, hosts=hosts)
    staged = sync.stage(params)  # no targets: as for an actor per host, a whole copy on each
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


# Two simulated hosts of 4 devices (0-3 and 4-7), each with 2 actor devices and 2 learner devices: the actor mesh
# over devices 0, 1 (host 0) and 4, 5 (host 1), process-major as make_mesh lays one out across hosts.
SPAN_ACTOR, SPAN_LEARNER = [0, 1, 4, 5], [2, 3, 6, 7]


def host_block(sharding, shape, host: int, per_host: int):
    """The box of an array that one simulated host's devices of `sharding` hold between them: the union of their
    shards, worked out here from the shards themselves."""
    devices = list(sharding.mesh.devices.flat)[host * per_host:(host + 1) * per_host]
    cells = np.zeros(shape, bool)
    for device in devices:
        cells[sharding.devices_indices_map(shape)[device]] = True
    return cells


@pytest.mark.parametrize("actor", [MeshConfig(fsdp=1, tensor=4), MeshConfig(fsdp=2, tensor=2), MeshConfig(fsdp=4),
                                   MeshConfig(data=2, fsdp=1, tensor=2)])
@pytest.mark.parametrize("groups", [1, 4])
def test_an_actor_across_hosts_stages_only_each_hosts_block(actor, groups, no_host_copies):
    hosts = 2
    devices = jax.devices()
    actor_mesh = make_mesh(actor, [devices[i] for i in SPAN_ACTOR])
    learner = make_mesh(MeshConfig(fsdp=2, tensor=2), [devices[i] for i in SPAN_LEARNER])
    _, params = learner_params(MODEL, MeshConfig(fsdp=2, tensor=2), list(learner.devices.flat))
    shardings = state_shardings(params, actor_mesh)
    sync = WeightSync(jnp.bfloat16, hosts=hosts, groups=groups)
    staged = sync.stage(params, shardings)
    learner_blocks = [set(list(learner.devices.flat)[h * 2:(h + 1) * 2]) for h in range(hosts)]
    smaller = 0
    for want, got, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(staged), jax.tree.leaves(shardings)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
        for h, block in enumerate(learner_blocks):
            need = host_block(sharding, want.shape, h, 2)
            held = np.zeros(want.shape, bool)
            for s in got.addressable_shards:
                if s.device in block:
                    inside = np.zeros(want.shape, bool)
                    inside[s.index] = True
                    assert not (inside & ~need).any()  # nothing beyond the host's own block
                    assert s.data.nbytes <= need.sum() * got.dtype.itemsize
                    held |= inside
            assert (held == need).all()  # and all of it, on the host's own learner devices
            smaller += need.sum() < want.size
    # tensor / fsdp across the hosts: some leaves are split between them; data across them: whole copies.
    assert (smaller > 0) == (actor.data == 1)
    no_host_copies.clear()  # the checks above read the staged arrays on the host
    staged_whole = len(sync._programs)
    for _ in range(2):  # the second call reuses the programs and plans
        out = sync(params, shardings)
    assert no_host_copies == []
    for want, got, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(shardings)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
        assert_shards_are_blocks(got, sharding)
    # __call__ compiles one stage program per group (with one group, stage's own), each for about 1/groups of the
    # bytes.
    slices = sync.group_slices(jax.tree.leaves(params))
    assert len(slices) == 1 if groups == 1 else 3 <= len(slices) <= 6
    assert len(sync._programs) == staged_whole + (0 if groups == 1 else len(slices))


def test_a_tensor_split_across_hosts_stages_half_per_host_split_over_its_devices():
    # tensor 4 over both hosts: an MLP weight [embed, mlp] is cut in two along mlp, one half per host, and each
    # half split over the host's 2 learner devices: a quarter of the leaf per learner device, in bfloat16.
    devices = jax.devices()
    actor_mesh = make_mesh(MeshConfig(fsdp=1, tensor=4), [devices[i] for i in SPAN_ACTOR])
    learner = [devices[i] for i in SPAN_LEARNER]
    _, params = learner_params(MODEL, MeshConfig(fsdp=4), learner)
    shardings = state_shardings(params, actor_mesh)
    staged = WeightSync(jnp.bfloat16, hosts=2).stage(params, shardings)
    whole = sum(x.size * 2 for x in jax.tree.leaves(staged))
    per_device = {d: 0 for d in learner}
    for x in jax.tree.leaves(staged):
        for s in x.addressable_shards:
            per_device[s.device] += s.data.nbytes
    # A whole copy per host would be whole / 2 per learner device; the blocks are about a quarter (the norms,
    # replicated over tensor, are still whole per host).
    assert all(whole / 4 <= n < 0.3 * whole for n in per_device.values())
    mlp = next(x for path, x in jax.tree_util.tree_leaves_with_path(staged)
               if "up" in jax.tree_util.keystr(path) or "gate" in jax.tree_util.keystr(path))
    assert {s.data.size for s in mlp.addressable_shards} == {mlp.size // 4}


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
    from grpo_jax.run.trainer import Trainer
    from test_trainer import tiny_config

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
