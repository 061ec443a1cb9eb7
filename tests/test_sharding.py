"""The same model gives the same logits on one device and on an 8-device FSDP x tensor mesh."""

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.parallel.sharding import (
    MeshConfig,
    batch_sharding,
    constrain_rows,
    cut_devices,
    make_mesh,
    shard_module,
    spec_for,
)

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=8, num_kv_heads=2, qkv_bias=True)


def forward(model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, tokens)


@pytest.mark.parametrize("mesh_config", [MeshConfig(fsdp=8), MeshConfig(fsdp=2, tensor=4),
                                         MeshConfig(data=2, fsdp=2, tensor=2)])
def test_sharded_logits_match_single_device(mesh_config):
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices (see conftest.py)"
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, CONFIG.vocab_size)
    reference = np.asarray(forward(create_model(CONFIG, seed=3), tokens))
    mesh = make_mesh(mesh_config)
    model = shard_module(create_model(CONFIG, seed=3), mesh)
    q = model.layers[0].attn.q[...]
    assert len(q.sharding.device_set) == 8
    out = forward(model, jax.device_put(tokens, batch_sharding(mesh)))
    np.testing.assert_allclose(np.asarray(out), reference, atol=1e-5)


def test_tensor_axis_splits_heads_and_replicates_indivisible_dims():
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    model = shard_module(create_model(CONFIG), mesh)
    assert model.layers[0].attn.q[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    # 2 KV heads cannot be split 4 ways: replicated on that dim, not an error.
    assert model.layers[0].attn.k[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", None, None)
    assert spec_for(("embed", "embed"), (64, 64), mesh, {"embed": "fsdp"}) == jax.sharding.PartitionSpec("fsdp", None)


def test_mesh_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs 6 devices"):
        MeshConfig(data=1, fsdp=2, tensor=3).resolve(8)
    with pytest.raises(ValueError, match="do not divide"):
        MeshConfig(fsdp=-1, tensor=3).resolve(8)
    assert MeshConfig(fsdp=-1, tensor=2).resolve(8) == (1, 4, 2)
    assert MeshConfig(fsdp=-1, tensor=-1).validate()


def test_the_device_cut_chooses_one_actor_per_host_or_one_across_hosts_and_names_impossible_ones():
    hosts = np.array(jax.devices()[:8]).reshape(2, 4)  # two hosts of four devices, process-major
    per_host = cut_devices(hosts, 1, MeshConfig(), this_host=1)
    assert per_host.actor == [hosts[1, 0]] and not per_host.actor_spans_hosts and not per_host.shared
    assert per_host.learner == [*hosts[0, 1:], *hosts[1, 1:]]
    shared = cut_devices(hosts, 0, MeshConfig(fsdp=2, tensor=2))
    assert shared.shared and shared.actor == list(hosts[0]) and shared.learner == list(hosts.flat)
    across = cut_devices(hosts, 2, MeshConfig(fsdp=2, tensor=2))  # 4 devices: more than one host's 2
    assert across.actor_spans_hosts and across.actor == [*hosts[0, :2], *hosts[1, :2]]
    assert across.learner == [*hosts[0, 2:], *hosts[1, 2:]]
    with pytest.raises(
        ValueError, match=r"mesh.actor_devices=4: leaves no device for the learner \(4 devices per host"
    ):
        cut_devices(hosts, 4, MeshConfig())
    with pytest.raises(ValueError, match="needs devices of its own, so set mesh.actor_devices > 0"):
        cut_devices(hosts, 0, MeshConfig(fsdp=8))
    with pytest.raises(ValueError, match="fits neither one host's 2 actor device.s. nor the 4 of all 2 hosts"):
        cut_devices(hosts, 2, MeshConfig(fsdp=3))


def test_constrain_rows_splits_rows_only_under_a_mesh_whose_axes_divide_them():
    """Under the learner step's mesh (jit_train_step traces under it) a row-constrained array comes out split
    over data x fsdp whatever its input's layout; outside a mesh, or when the rows do not divide, unchanged."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    whole = jax.device_put(np.ones((8, 6), np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    f = jax.jit(lambda x: constrain_rows(x * 2))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        split = f(whole)
        odd = jax.jit(lambda x: constrain_rows(x * 2))(whole[:6])
    assert split.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(split), 2 * np.ones((8, 6)))
    assert odd.sharding.is_fully_replicated  # 6 rows over 4: left to the compiler, as before
    assert jax.jit(lambda x: constrain_rows(x * 2))(whole).sharding.is_fully_replicated  # no mesh in context
