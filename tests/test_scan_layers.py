"""model.scan_layers: the learner's passes run the layers as a lax.scan over their repeating block (compiled once)
and give the numbers the Python loop over the layers gives: learner steps (packed rows, several updates, KL, remat
under each policy), Gemma 3's local/global pattern with a tail that is not a whole block, a MoE model's routing
replay, and LoRA with dropout."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import random_packed_batch
from grpo_jax.algorithm.learner import Learner, OptimConfig
from grpo_jax.algorithm.losses import LossConfig
from grpo_jax.model.lora import LoraConfig, init_adapters
from grpo_jax.model.transformer import ModelConfig, create_model, positions_from_mask

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2)
# 5 layers of 2 kinds alternating: two whole blocks scanned, the fifth layer after them.
GEMMA3 = dataclasses.replace(MODEL, num_layers=5, architecture="gemma3", sliding_window=3, rope_local_theta=100.0,
                             layer_types=("sliding_attention", "full_attention") * 2 + ("sliding_attention",),
                             tie_embeddings=True)
MOE = dataclasses.replace(MODEL, architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, num_layers=4, mlp_only_layers=(1, 3))


def test_the_repeating_block_is_the_shortest_period_of_the_layers_kinds():
    assert MODEL.layer_period() == 1
    assert GEMMA3.layer_period() == 2
    assert MOE.layer_period() == 2
    assert dataclasses.replace(MODEL, num_layers=4, layer_types=("sliding_attention",) + ("full_attention",) * 3,
                               sliding_window=4).layer_period() == 4


def packed_batch():
    return random_packed_batch(3, 10, MODEL.vocab_size, 6, 12, 2)


def stepped(config, scan: bool, **learner_options):
    """Parameters and metrics after one learner step of two mini-batches x two epochs, with a KL reference."""
    config = dataclasses.replace(config, scan_layers=scan)
    optim = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0, mini_batches=2, epochs=2)
    learner = Learner(create_model(config, seed=1), optim, LossConfig(kl_coef=0.1, off_policy="tis"),
                      reference_model=create_model(config, seed=2), **learner_options)
    start = jax.tree.leaves(jax.device_get(learner.params))
    metrics, applied = learner.step(packed_batch())
    assert applied.all()
    return start, jax.tree.leaves(jax.device_get(learner.params)), metrics


@pytest.mark.parametrize("config", [MODEL, GEMMA3, dataclasses.replace(MODEL, remat=True),
                                    dataclasses.replace(GEMMA3, remat=True, remat_policy="dots_saveable")],
                         ids=["qwen2", "gemma3", "qwen2-remat", "gemma3-remat-dots"])
def test_a_scanned_learner_step_trains_as_the_unrolled_one(config):
    start, unrolled, unrolled_metrics = stepped(config, scan=False)
    _, scanned, metrics = stepped(config, scan=True)
    moved = max(np.abs(a - b).max() for a, b in zip(unrolled, start))
    assert moved > 1e-2
    assert max(np.abs(a - b).max() for a, b in zip(scanned, unrolled)) < 1e-5 * moved
    for key in unrolled_metrics:
        assert metrics[key] == pytest.approx(unrolled_metrics[key], rel=1e-5, abs=1e-6), key


def test_lora_with_dropout_trains_alike_scanned_and_unrolled():
    """Each layer's adapters stacked with the other layers' and each layer's own dropout key."""
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.3, targets=("q", "v", "gate"))
    results = [stepped(MODEL, scan, adapters=init_adapters(MODEL, lora, seed=0), dropout_seed=5)
               for scan in (False, True)]
    (start, unrolled, _), (_, scanned, _) = results
    moved = max(np.abs(a - b).max() for a, b in zip(unrolled, start))
    assert moved > 1e-3
    assert max(np.abs(a - b).max() for a, b in zip(scanned, unrolled)) < 1e-5 * moved


def test_moe_layers_route_and_replay_alike_scanned_and_unrolled():
    """The experts each token used, in layer order, and values and gradients under replayed routing."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, MOE.vocab_size, (3, 14)))
    segments = jnp.asarray(np.sort(rng.integers(1, 4, (3, 14)), axis=1))
    replay = jnp.asarray(rng.integers(0, 4, (3, 14, 2, 2)), jnp.int32)
    outputs = []
    for scan in (False, True):
        graphdef, state = nnx.split(create_model(dataclasses.replace(MOE, scan_layers=scan), seed=3))

        def loss(state, routing, graphdef=graphdef):
            model = nnx.merge(graphdef, state)
            hidden, _, used = model.hidden_states_and_routing(tokens, positions_from_mask(segments), segments > 0,
                                                              segment_ids=segments, routing=routing)
            return jnp.sum(model.logits(hidden) ** 2), used

        (_, own), _ = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, None)
        (value, used), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, replay)
        outputs.append((np.asarray(own), float(value), np.asarray(used), jax.tree.leaves(grads)))
    (own, value, used, grads), (scan_own, scan_value, scan_used, scan_grads) = outputs
    assert own.shape == (3, 14, 2, 2)
    np.testing.assert_array_equal(scan_own, own)
    np.testing.assert_array_equal(scan_used, used)
    assert scan_value == pytest.approx(value, rel=1e-6)
    for a, b in zip(scan_grads, grads):
        np.testing.assert_allclose(a, b, atol=1e-6 * max(np.abs(b).max(), 1e-3))


def test_the_scanned_step_compiles_one_layer_body():
    """Six layers: the unrolled step's program holds six layers' matmuls, the scanned one's a loop over one."""
    config = dataclasses.replace(MODEL, num_layers=6)

    def dots(scan):
        learner = Learner(create_model(dataclasses.replace(config, scan_layers=scan), seed=1), OptimConfig(),
                          LossConfig())
        return len(re.findall(r"\bdot_general\b", learner.lowered_step(packed_batch()).as_text()))

    unrolled, scanned = dots(False), dots(True)
    assert scanned < unrolled / 3, (scanned, unrolled)


def test_auto_scans_the_programs_compiled_for_tpu_and_loops_on_cpu():
    """scan_layers=auto: the compile command traces for a TPU topology on this CPU and gets the scan; the trainer's
    CPU programs get the loop (XLA's CPU client deadlocks when a scanned step's collectives run beside the
    actor's). true and false are obeyed everywhere."""
    from grpo_jax.planning.compile import without_jax_cache
    from grpo_jax.planning.topology import tpu_topology

    assert MODEL.scan_layers == "auto"
    assert [MODEL.scans_layers(p) for p in ("cpu", "tpu", "gpu")] == [False, True, True]
    assert dataclasses.replace(MODEL, scan_layers=True).scans_layers("cpu")
    assert not dataclasses.replace(MODEL, scan_layers=False).scans_layers("tpu")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: create_model(MODEL, seed=0)))
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def forward_program() -> str:
        return str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))

    assert "scan[" not in forward_program()
    with without_jax_cache():
        devices = tpu_topology("v5e:2x2").devices
    with jax.sharding.use_abstract_mesh(jax.sharding.Mesh(np.array(devices), ("x",)).abstract_mesh):
        assert "scan[" in forward_program()
