"""Qwen3-MoE: the capacity-free (ragged) dispatch equals a NumPy reference and the dense one in values and
gradients; the engine records the experts every token went through; routing replay makes the learner route each
token as the actor did, even where its own router would pick otherwise; a tiny MoE trains end to end with replay,
its behaviour log-probs matching the learner's at staleness 0. Logits against transformers: test_hf.py."""

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.algorithm.batch import pack_batch, pack_sequences
from grpo_jax.algorithm.learner import batch_logprobs
from grpo_jax.config_io import ConfigError
from grpo_jax.model.experts import dense_experts, grouped_matmul, local_experts, ragged_experts
from grpo_jax.model.hf import checkpoint_config
from grpo_jax.model.transformer import (
    ModelConfig,
    abstract_model,
    count_params,
    create_model,
)
from grpo_jax.parallel.sharding import MeshConfig, make_mesh, shard_module
from grpo_jax.rollout.engine import Engine
from grpo_jax.rollout.sampler import SamplerConfig
from grpo_jax.run.trainer import Trainer
from grpo_jax.state.replay_buffer import Group, ReplayBuffer
from test_trainer import assert_every_ordinal_accounted_once, tiny_config

VOCAB = 300
# Layer 0 has 8 experts (2 per token), layer 1 keeps its dense MLP (mlp_only_layers).
MOE = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  mlp_only_layers=(1,))
SAMPLER = SamplerConfig(engine="continuous", max_new_tokens=12, max_prompt_len=16, min_prompt_bucket=16,
                        chunk_steps=4, slots=16, decode_streams=1)
G = 4


def numpy_experts(rows, experts, weights, gate, up, down):
    """Token by token: the weighted sum of its chosen experts' SwiGLU."""
    out = np.zeros_like(rows)
    for n in range(len(rows)):
        for e, w in zip(experts[n], weights[n]):
            g, u = rows[n] @ gate[e], rows[n] @ up[e]
            out[n] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("impl", ["ragged", "megablox"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_dispatch_equals_numpy_and_dense_in_values_and_gradients(dtype, impl):
    """impl megablox: the expert weights' gradient from megablox's tgmm kernel (in Pallas's interpreter here)."""
    rng = np.random.default_rng(0)
    n, e, m, x, k = 37, 16, 8, 6, 3
    rows, gate, up, down = (rng.normal(size=s).astype(np.float32) for s in ((n, e), (x, e, m), (x, e, m), (x, m, e)))
    experts = np.stack([rng.choice(x - 1, k, replace=False) for _ in range(n)]).astype(np.int32)
    experts[:5] = [0, 1, 2]  # the last expert (5) is chosen by no token
    weights = rng.random((n, k)).astype(np.float32)
    args = [jnp.asarray(a, dtype) for a in (rows, gate, up, down)]
    dispatch = functools.partial(ragged_experts, impl=impl)
    ragged = dispatch(args[0], experts, jnp.asarray(weights, dtype), *args[1:])
    dense = dense_experts(args[0], experts, jnp.asarray(weights, dtype), *args[1:])
    want = numpy_experts(rows, experts, weights, gate, up, down)
    # float32 rounding, or bfloat16's (8 bits: a few hundredths of the values' scale)
    tolerance = (1e-5 if dtype == jnp.float32 else 3e-2) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(ragged, np.float32), want, rtol=0, atol=tolerance)
    np.testing.assert_allclose(np.asarray(ragged, np.float32), np.asarray(dense, np.float32), rtol=0, atol=tolerance)

    cotangent = jnp.asarray(rng.normal(size=(n, e)), jnp.float32)

    def loss(dispatch, rows, weights, gate, up, down):
        return jnp.sum(dispatch(rows, experts, weights, gate, up, down).astype(jnp.float32) * cotangent)

    grads = [jax.grad(loss, argnums=(1, 2, 3, 4, 5))(d, args[0], jnp.asarray(weights, dtype), *args[1:])
             for d in (dispatch, dense_experts)]
    for a, b in zip(*grads):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = 1e-5 if dtype == jnp.float32 else 3e-2
        np.testing.assert_allclose(a, b, rtol=0, atol=scale * np.abs(b).max())
    assert np.all(np.asarray(grads[0][2][5]) == 0)  # the unused expert gets no gradient


@pytest.mark.parametrize("m, sizes", [(37, (10, 0, 20, 7)), (300, (0, 130, 90, 80))])
def test_the_megablox_weight_gradient_equals_ragged_dots_own(m, sizes):
    """Groups of rows times their group's matrix: values and both gradients of the megablox path (tgmm in Pallas's
    interpreter, its rows padded to a tile) equal ragged_dot's, with an empty group and rows past the groups."""
    rng = np.random.default_rng(m)
    lhs = jnp.asarray(rng.normal(size=(m + 5, 24)), jnp.float32)  # 5 rows in no group
    rhs = jnp.asarray(rng.normal(size=(4, 24, 40)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    assert int(group_sizes.sum()) == m
    cotangent = jnp.asarray(rng.normal(size=(m + 5, 40)), jnp.float32)

    def loss(impl, lhs, rhs):
        return jnp.sum(grouped_matmul(lhs, rhs, group_sizes, impl) * cotangent)

    (want, want_grads), (got, got_grads) = (jax.value_and_grad(loss, argnums=(1, 2))(impl, lhs, rhs)
                                            for impl in ("ragged", "megablox"))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    assert np.all(np.asarray(got_grads[1][np.asarray(group_sizes) == 0]) == 0)
    assert np.all(np.asarray(got_grads[0][m:]) == 0)


def test_on_tpu_the_experts_cost_the_flops_of_the_chosen_pairs_forward_and_backward():
    """Compiled for a v5e chip: with megablox the expert layer's forward and backward do the useful FLOPs (9
    matmuls of the routed pairs: 3 forward, 3 for the rows, 3 for the weights); with ragged_dot's own gradient the
    weights' 3 run dense over all 16 experts (x16), 6x in all."""
    from grpo_jax.planning.compile import without_jax_cache
    from grpo_jax.planning.hlo_cost import program_cost
    from grpo_jax.planning.topology import tpu_topology

    with without_jax_cache():
        devices = tpu_topology("v5e:2x2").devices
    chip = NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    n, e, m, x, k = 1024, 512, 256, 16, 2
    shapes = [((n, e), jnp.bfloat16), ((n, k), jnp.int32), ((n, k), jnp.bfloat16), ((x, e, m), jnp.bfloat16),
              ((x, e, m), jnp.bfloat16), ((x, m, e), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=chip) for shape, dtype in shapes]
    useful = 9 * 2 * n * k * e * m

    def flops(impl):
        def loss(*args):
            with jax.sharding.use_abstract_mesh(chip.mesh.abstract_mesh):
                return ragged_experts(*args, impl).astype(jnp.float32).sum()
        with without_jax_cache():
            compiled = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5))).lower(*args).compile()
        return program_cost(compiled.as_text()).flops

    assert flops("megablox") == pytest.approx(useful, rel=0.02)
    assert flops("ragged") == pytest.approx(6 * useful, rel=0.02)


def test_each_device_routes_and_computes_only_its_own_rows():
    """Rows split over fsdp 4, each expert's hidden units over tensor 2: the layer's values and gradients equal the
    single-device dispatch's, and the only all-gathers in its compiled program are of expert weights (FSDP's
    gather); no device receives another's rows or routing."""
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    rng = np.random.default_rng(1)
    n, e, m, x, k = 64, 16, 8, 8, 2
    rows = rng.normal(size=(n, e)).astype(np.float32)
    gate, up = (rng.normal(size=(x, e, m)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(x, m, e)).astype(np.float32)
    experts = np.stack([rng.choice(x, k, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.random((n, k)).astype(np.float32)
    cotangent = rng.normal(size=(n, e)).astype(np.float32)

    def loss(dispatch, rows, weights, gate, up, down):
        return jnp.sum(dispatch(rows, experts, weights, gate, up, down) * cotangent)

    def on_mesh(rows, weights, gate, up, down):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))(local_experts, rows, weights, gate, up, down)

    put = [NamedSharding(mesh, spec) for spec in (PartitionSpec(("data", "fsdp")), PartitionSpec(("data", "fsdp")),
                                                  PartitionSpec("fsdp", None, "tensor"),
                                                  PartitionSpec("fsdp", None, "tensor"),
                                                  PartitionSpec("fsdp", "tensor", None))]
    args = (rows, weights, gate, up, down)
    program = jax.jit(on_mesh)
    value, grads = program(*(jax.device_put(a, s) for a, s in zip(args, put)))
    want, want_grads = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))(ragged_experts, *args)
    assert float(value) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    text = program.lower(*(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(args, put))
                         ).compile().as_text()
    gathered = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather\(", text)
    assert gathered and all(dtype == "f32" and dims in ("8,16,4", "8,4,16") for dtype, dims in gathered), gathered


def test_expert_parallelism_computes_what_every_device_holding_every_expert_computes():
    """Experts split over fsdp 4 (tensor 2 beside it): each device runs its own 2 of 8 experts on the gathered
    tokens and the outputs are reduce-scattered back; log-probs and gradients equal the FSDP path's, and the
    learner step's HLO has the shard_map's collectives. 6 rows of 15 input tokens: 90 tokens, padded to split over
    the 4 devices (as a micro-batch of fewer rows than devices is)."""
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, rng.integers(2, 9)) for _ in range(6)]
    completions = [rng.integers(1, VOCAB, rng.integers(1, 9)) for _ in range(6)]
    behaviour = [np.full(len(c), -2.0, np.float32) for c in completions]
    batch = pack_batch(prompts, completions, behaviour, rng.normal(size=6).astype(np.float32), 0, 8, 8)
    batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())), batch)
    config = dataclasses.replace(MOE, mlp_only_layers=())
    results = []
    for expert_parallel in (False, True):
        model = shard_module(create_model(dataclasses.replace(config, expert_parallel=expert_parallel), seed=1), mesh)
        assert model.layers[0].mlp.gate.get_value().sharding.spec == PartitionSpec("fsdp", None, "tensor")
        graphdef, state = nnx.split(model)

        @jax.jit
        def logprobs_and_grads(state, batch, graphdef=graphdef):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                def total(state):
                    logprobs = batch_logprobs(nnx.merge(graphdef, state), batch)[0]
                    return jnp.sum(logprobs * batch.scored(batch.loss_mask)), logprobs
                return jax.grad(total, has_aux=True)(state)

        grads, logprobs = logprobs_and_grads(state, batch)
        text = logprobs_and_grads.lower(state, batch).as_text()
        results.append((np.asarray(logprobs), jax.tree.map(np.asarray, jax.device_get(grads)), text))
    (logprobs, grads, fsdp_text), (ep_logprobs, ep_grads, ep_text) = results
    np.testing.assert_allclose(ep_logprobs, logprobs, atol=1e-5)
    for a, b in zip(jax.tree.leaves(ep_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(np.abs(b).max(), 1e-3))
    assert "reduce_scatter" in ep_text and "reduce_scatter" not in fsdp_text


def sample(model, prompts, seed, eos=()):
    """Groups of G samples from the continuous engine: {prompt index: GroupResult}."""
    engine = Engine(model, eos, 0, SAMPLER)
    keys = jax.random.split(jax.random.key(seed), len(prompts) * G).reshape(len(prompts), G)
    try:
        for i, (prompt, k) in enumerate(zip(prompts, keys)):
            engine.submit(prompt, k, tag=i)
        results = {}
        while engine.busy:
            results.update({r.tag: r for r in engine.step()})
    finally:
        engine.close()
    return results


def rows_of(prompts, results):
    """(prompts, completions, behaviour log-probs, routing) per sample, in order."""
    out = [], [], [], []
    for i, prompt in enumerate(prompts):
        r = results[i]
        for j in range(G):
            for column, value in zip(out, (np.asarray(prompt, np.int32), r.tokens[j], r.logprobs[j], r.routing[j])):
                column.append(value)
    return out


@jax.jit
def _own_routing(model, tokens):
    positions = jnp.arange(tokens.shape[0])[None]
    return model.hidden_states_and_routing(tokens[None], positions, jnp.ones((1, tokens.shape[0]), bool))[2][0]


def test_the_engine_records_the_experts_each_token_went_through():
    """Per sample: the prompt's routing from its prefill, each sampled token's (but the last, which no step reads)
    from the decode step that read it; equal to the routing of one forward pass over the whole sequence."""
    model = create_model(MOE, seed=3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, VOCAB, n)) for n in (16, 3, 9, 5)]
    prompts_, completions, _, routing = rows_of(prompts, sample(model, prompts, 1))
    assert max(len(c) for c in completions) == SAMPLER.max_new_tokens
    for prompt, completion, used in zip(prompts_, completions, routing):
        inputs = np.concatenate([prompt, completion])[:-1]
        assert used.shape == (len(inputs), 1, 2)  # one layer with experts, 2 per token
        np.testing.assert_array_equal(np.sort(used, -1), np.sort(np.asarray(_own_routing(model, inputs)), -1))


def tied_model():
    """One expert per token, the router unable to tell expert 2j from 2j + 1 (equal columns: top-k breaks the tie
    for the lower index), the experts themselves different; and the same function with each pair's experts
    swapped, whose tie-break therefore takes the other expert of each pair."""
    config = dataclasses.replace(MOE, num_experts_per_tok=1, norm_topk_prob=False)
    model = create_model(config, seed=5)
    model.lm_head.set_value(model.lm_head.get_value() * 10)
    swap = np.arange(config.num_experts).reshape(-1, 2)[:, ::-1].reshape(-1)
    swapped = create_model(config, seed=5)
    for i, (ours, theirs) in enumerate(zip(model.layers, swapped.layers)):
        if config.is_moe(i):
            router = np.array(ours.mlp.router.get_value())
            router[:, 1::2] = router[:, 0::2]
            ours.mlp.router.set_value(jnp.asarray(router) * 10)
            theirs.mlp.router.set_value(ours.mlp.router.get_value())
            for name in ("gate", "up", "down"):
                weight = getattr(ours.mlp, name)
                weight.set_value(weight.get_value() * 4)
                getattr(theirs.mlp, name).set_value(weight.get_value()[swap])
    swapped.lm_head.set_value(model.lm_head.get_value())
    return model, swapped, swap


@pytest.fixture(scope="module")
def tied_samples():
    """The learner's model, and samples of the tie-swapped actor with their routing in the learner's expert ids."""
    model, actor, swap = tied_model()
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(1, VOCAB, n)) for n in (16, 3, 9, 5, 12)]
    # A fifth of the vocabulary ends a sample: long and short ones, several to a packed row.
    prompts_, completions, behaviour, routing = rows_of(prompts, sample(actor, prompts, 2, eos=tuple(range(1, 60))))
    return model, prompts_, completions, behaviour, [swap[r] for r in routing]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_routing_replay_routes_the_learner_as_the_actor_even_where_its_router_would_not(tied_samples, layout):
    """The actor samples with every tie broken towards the odd expert of its pair; the learner, with the same
    function but its router breaking ties towards the even one, scores the samples exactly as the actor did only
    when it replays the actor's routing (at staleness 0 the log-probs are then the behaviour log-probs, to float32
    rounding); left to its own router, it scores them through other experts."""
    model, prompts_, completions, behaviour, routing = tied_samples
    for prompt, completion, used in zip(prompts_, completions, routing):
        own = np.asarray(_own_routing(model, np.concatenate([prompt, completion])[:-1]))
        assert np.all(own % 2 == 0) and np.all(used % 2 == 1)  # every token routed elsewhere by its own router
    advantages = np.zeros(len(prompts_), np.float32)
    if layout == "padded":
        batch = pack_batch(prompts_, completions, behaviour, advantages, 0, 16, 12, routing=routing)
    else:
        batch = pack_sequences(prompts_, completions, behaviour, advantages, 0, 28, 12, routing=routing)
        assert batch.tokens.shape[0] < len(prompts_)  # several sequences per row
    batch = jax.tree.map(jnp.asarray, batch)
    trained = np.asarray(batch.scored(batch.loss_mask)) > 0
    want = np.asarray(batch.scored(batch.behaviour_logprobs))[trained]
    replayed = np.asarray(batch_logprobs(model, batch)[0])[trained]
    own = np.asarray(batch_logprobs(model, dataclasses.replace(batch, routing=None))[0])[trained]
    assert np.abs(replayed - want).max() < 1e-5
    assert np.abs(own - want).max() > 0.1


def test_the_replay_buffer_checkpoints_a_groups_routing():
    routing = [np.arange(6 * 2, dtype=np.int32).reshape(6, 1, 2), np.zeros((4, 1, 2), np.int32)]
    group = Group(ordinal=3, prompt={"dataset_index": 0, "epoch": 0, "prompt_ids": [1, 2]},
                  completions=[np.arange(5), np.arange(3)], behaviour_logprobs=[np.zeros(5), np.zeros(3)],
                  rewards=np.zeros(2, np.float32), weight_version=0, routing=routing)
    buffer = ReplayBuffer(capacity=2, max_staleness=1, prompts_per_step=1)
    buffer.put(group)
    state = json.loads(json.dumps(buffer.to_state()))
    (restored,) = ReplayBuffer.from_state(state).take(1, 0).groups
    for a, b in zip(restored.routing, routing):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int32


MOE_RUN = ("model.architecture=qwen3_moe", "model.head_dim=16", "model.qkv_bias=false", "model.num_layers=2",
           "model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
           "model.mlp_only_layers=[1]")


def test_a_tiny_qwen3_moe_trains_with_routing_replay_and_exports_as_qwen3_moe(tmp_path):
    """Routing travels with each group from the engine to the learner: at staleness 0 the learner's log-probs of
    the first update equal the sampler's (importance weights 1), which misplaced routing would break. The learner
    runs its experts in parallel over its fsdp axis, the engine as one device's (no mesh context)."""
    from grpo_jax.model.hf import load_hf_model

    config = tiny_config(tmp_path, *MOE_RUN, "grpo.max_staleness=0", "trainer.max_steps=2", "optim.lr=1e-2",
                         "optim.warmup_steps=0", "loss.off_policy=tis", "optim.packing=true",
                         "model.expert_parallel=true")
    history = Trainer(config).train()
    assert [m["step"] for m in history] == [1, 2]
    for metrics in history:
        assert metrics["staleness/max"] == 0
        assert abs(metrics["tis/weight_max"] - 1) < 1e-4 and metrics["tis/mismatch_kl"] < 1e-8, metrics
    assert_every_ordinal_accounted_once(tmp_path)
    config_json = json.loads((tmp_path / "final_model" / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen3MoeForCausalLM"] and config_json["num_experts"] == 8
    final, _ = load_hf_model(tmp_path / "final_model")
    assert final.config.moe_layers == (0,)
    assert final.layers[0].mlp.gate.get_value().shape == (8, config.model.hidden_size, 32)


def test_the_published_qwen3_30b_a3b_has_3_3b_active_parameters():
    """MFU counts a token's FLOPs through its 8 experts of 128, not all of them."""
    config = checkpoint_config(pathlib.Path(__file__).resolve().parents[1] / "configs" / "shapes" / "Qwen3-30B-A3B")
    assert config.moe_layers == tuple(range(48)) and config.norm_topk_prob and config.num_experts_per_tok == 8
    total = count_params(abstract_model(config))
    assert total == pytest.approx(30.53e9, rel=1e-3)
    assert total - config.inactive_expert_params == pytest.approx(3.35e9, rel=1e-2)


def test_moe_settings_that_cannot_work_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"sampler.engine='static': routing replay"):
        Trainer(tiny_config(tmp_path, *MOE_RUN, "sampler.engine=static"))
    with pytest.raises(ConfigError, match=r"lora.targets=.*\['down', 'gate', 'up'\] are not adapted"):
        Trainer(tiny_config(tmp_path, *MOE_RUN, "lora.rank=4"))
    problems = dataclasses.replace(MOE, architecture="qwen3", num_experts_per_tok=9).validate()
    assert any("experts are part of architecture qwen3_moe" in p for p in problems)
    assert any(p.startswith("num_experts_per_tok=9: must be in 1..num_experts=8") for p in problems)
