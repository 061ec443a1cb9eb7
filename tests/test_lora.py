"""LoRA: adapters on a frozen base. The optimizer holds moments for the adapters only, the adapted model equals
the base at init, learner steps move only the adapters, a trainer run syncs only them, the merged export and
the PEFT adapter give the adapted model's logits (the latter in transformers + peft), and bad configs are
refused in one line."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from conftest import jitted_token_logprobs
from grpo_jax.algorithm.batch import pack_batch
from grpo_jax.algorithm.learner import Learner, OptimConfig
from grpo_jax.algorithm.losses import LossConfig
from grpo_jax.config_io import ConfigError, build_config, load_config
from grpo_jax.errors import CheckpointError
from grpo_jax.model.hf import load_hf_model, save_hf_model
from grpo_jax.model.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    TARGETS,
    LoraConfig,
    base_identity,
    init_adapters,
    merge_adapters,
    save_peft_adapter,
)
from grpo_jax.model.transformer import ModelConfig, abstract_model, create_model, param_dict, positions_from_mask
from grpo_jax.parallel.sharding import MeshConfig, make_mesh, state_shardings
from grpo_jax.rollout.sampler import Sampler, SamplerConfig
from grpo_jax.run.config import Config

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    qkv_bias=True)
LORA = LoraConfig(rank=4, alpha=8.0)
PROMPT_LEN, COMPLETION_LEN = 6, 5
REPO = pathlib.Path(__file__).resolve().parents[1]


def randomized(adapters, seed: int = 1, scale: float = 0.2):
    """The adapters with every B drawn at random (B starts at zero, which would hide any mapping mistake)."""
    key = jax.random.key(seed)
    for i, layer in enumerate(adapters.layers):
        for j, name in enumerate(adapters.config.targets):
            if getattr(layer, name) is None:  # an MLP target in a layer with experts
                continue
            b = getattr(layer, name).b
            b.set_value(scale * jax.random.normal(jax.random.fold_in(key, 100 * i + j), b.shape, b.get_value().dtype))
    return adapters


def logits(model, tokens, mask, adapters=None):
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    return np.asarray(model(tokens, positions_from_mask(mask), mask, adapters=adapters)[0])


def batch_of_tokens(vocab: int, seed: int = 0):
    """Three rows of different lengths, left-padded, and their mask."""
    rng = np.random.default_rng(seed)
    lengths, width = [9, 5, 2], 9
    tokens, mask = np.zeros((3, width), np.int32), np.zeros((3, width), bool)
    for i, n in enumerate(lengths):
        tokens[i, width - n:] = rng.integers(0, vocab, n)
        mask[i, width - n:] = True
    return tokens, mask


def random_batch(seed: int, size: int = 4):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, MODEL.vocab_size, rng.integers(2, PROMPT_LEN + 1))) for _ in range(size)]
    completions = [list(rng.integers(1, MODEL.vocab_size, rng.integers(1, COMPLETION_LEN + 1))) for _ in range(size)]
    behaviour = [rng.normal(-4.0, 0.3, len(c)) for c in completions]
    return pack_batch(prompts, completions, behaviour, rng.normal(size=size), pad_id=0, prompt_len=PROMPT_LEN,
                      completion_len=COMPLETION_LEN)


def host(tree):
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(tree))]


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ---- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("lora.rank=-1", "invalid config: lora.rank=-1: must be >= 0 (0 turns LoRA off)"),
    ("lora.alpha=0", "invalid config: lora.alpha=0.0: must be > 0 (the update is scaled by alpha / rank)"),
    ("lora.dropout=1", "invalid config: lora.dropout=1.0: must be in [0, 1)"),
    ("lora.targets=[q,x_proj]", "invalid config: lora.targets=['q', 'x_proj']: unknown ['x_proj']; allowed "
                                "['q', 'k', 'v', 'o', 'gate', 'up', 'down']"),
    ("lora.targets=[q,q]", "invalid config: lora.targets=['q', 'q']: each projection at most once"),
    ("lora.targets=[]", "invalid config: lora.targets=[]: rank=4 needs at least one of"),
    ("lora.ranks=4", "unknown config key 'lora.ranks'"),
])
def test_bad_lora_config_is_one_line_naming_key_and_value(override, message):
    with pytest.raises(ConfigError) as info:
        build_config(Config, {"tokenizer": "byte", "lora": {"rank": 4}}, [override])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_lora_is_off_by_default_and_configurable():
    assert not Config().lora.enabled
    config = build_config(Config, {"tokenizer": "byte"}, ["lora.rank=8", "lora.alpha=16", "lora.targets=[q,v]"])
    assert config.lora == LoraConfig(rank=8, alpha=16.0, targets=("q", "v")) and config.lora.scale == 2.0


# ---- model and learner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_config", [MODEL, dataclasses.replace(MODEL, dtype="bfloat16", remat=True)],
                         ids=["float32", "bfloat16_remat"])
def test_adapted_model_equals_the_base_at_init(model_config):
    model = create_model(model_config, seed=0)
    adapters = init_adapters(model_config, LORA, seed=3)
    assert all(np.all(np.asarray(getattr(layer, name).b[...]) == 0) for layer in adapters.layers for name in TARGETS)
    assert np.any(np.asarray(adapters.layers[0].q.a[...]) != 0)
    tokens, mask = batch_of_tokens(MODEL.vocab_size)
    np.testing.assert_array_equal(logits(model, tokens, mask, adapters), logits(model, tokens, mask))
    # ... and differs once B moves: the adapters are really in the forward pass.
    assert np.abs(logits(model, tokens, mask, randomized(adapters)) - logits(model, tokens, mask)).max() > 1e-2


def test_optimizer_state_holds_moments_for_the_adapters_only():
    model = create_model(MODEL, seed=0)
    adapters = init_adapters(MODEL, LORA, seed=0)
    learner = Learner(model, OptimConfig(lr=1e-2), LossConfig(), adapters=adapters)
    adapter_count = sum(x.size for x in jax.tree.leaves(learner.params))
    base_count = sum(x.size for x in jax.tree.leaves(learner.frozen))
    # Per adapted projection: A [in, r] + B [r, out]; e.g. q is 32 x 4 + 4 x (4 x 8).
    assert adapter_count == MODEL.num_layers * LORA.rank * (
        (32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 48) + (48 + 32))
    moments = [x for x in jax.tree.leaves(learner.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * adapter_count  # Adam's mu and nu, nothing for the base
    full = Learner(create_model(MODEL, seed=0), OptimConfig(lr=1e-2), LossConfig())
    assert sum(x.size for x in jax.tree.leaves(full.opt_state) if x.ndim > 0) == 2 * base_count


def test_a_from_scratch_base_keeps_its_identity_across_versions():
    """The fingerprint checkpoints record for a base built from a seed is the one releases before the Gemma 3 and
    Qwen3-MoE fields wrote (literals from that code), so a LoRA run resumes onto its base after an upgrade; fields a
    family sets, and the seed, change it."""
    assert base_identity("", ModelConfig(), 0) == "4403124087342b2d"
    llama = ModelConfig(vocab_size=32, hidden_size=128, architecture="llama")
    assert base_identity("", llama, 7) == "64d61674e042d29e"
    run_settings = dataclasses.replace(llama, dtype="bfloat16", routing_replay=False, moe_dispatch="dense")
    assert base_identity("", run_settings, 7) == "64d61674e042d29e"
    others = {base_identity("", ModelConfig(), 1), base_identity("", ModelConfig(architecture="gemma3"), 0),
              base_identity("", ModelConfig(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=8), 0)}
    assert len(others) == 3 and "4403124087342b2d" not in others


def test_learner_steps_move_the_adapters_and_leave_the_base_bit_identical():
    # KL to the reference (the base with the adapters off), dropout, mini-batches (a proximal pass), remat, and
    # a bfloat16 base with bfloat16 compute under float32 adapters.
    model_config = dataclasses.replace(MODEL, remat=True, dtype="bfloat16", param_dtype="bfloat16")
    lora = dataclasses.replace(LORA, dropout=0.1)
    learner = Learner(create_model(model_config, seed=0), OptimConfig(lr=1e-2, mini_batches=2, epochs=2),
                      LossConfig(kl_coef=0.1), adapters=init_adapters(model_config, lora, seed=0), dropout_seed=7)
    assert learner.ref_params is None  # no second copy of the weights for the reference
    assert {x.dtype for x in jax.tree.leaves(learner.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(learner.params)} == {jnp.dtype(jnp.float32)}
    base_before, adapters_before = host(learner.frozen), host(learner.params)
    for seed in range(3):
        metrics, applied = learner.step(random_batch(seed))
        assert applied.all() and np.isfinite(metrics["loss"])
    assert metrics["kl/mean"] > 0  # the adapted policy has moved away from the base
    for before, after in zip(base_before, host(learner.frozen)):
        np.testing.assert_array_equal(before, after)
    moved = [np.abs(a - b).max() for a, b in zip(adapters_before, host(learner.params))]
    assert min(moved) > 0  # every A and B moved


def test_dropout_acts_in_the_gradient_pass_only():
    model = create_model(MODEL, seed=0)
    adapters = randomized(init_adapters(MODEL, dataclasses.replace(LORA, dropout=0.5), seed=0))
    tokens, mask = batch_of_tokens(MODEL.vocab_size)
    positions = positions_from_mask(jnp.asarray(mask))

    def hidden(key):
        return np.asarray(model.hidden_states(jnp.asarray(tokens), positions, jnp.asarray(mask), adapters=adapters,
                                              dropout_key=key)[0])

    merged = merge_adapters(model, adapters)
    np.testing.assert_allclose(hidden(None), np.asarray(merged.hidden_states(
        jnp.asarray(tokens), positions, jnp.asarray(mask))[0]), atol=2e-5)
    assert np.abs(hidden(jax.random.key(0)) - hidden(None)).max() > 1e-3
    # The sampler never drops: greedy continuations with the adapters equal the merged model's.
    config = SamplerConfig(temperature=0.0, max_new_tokens=6, max_prompt_len=16, decode_streams=1)
    prompts = [[3, 4, 5], [7, 8]]
    with_adapters = Sampler(model, eos_ids=(), pad_id=0, config=config, adapters=adapters).generate(prompts, 0)
    with_merged = Sampler(merged, eos_ids=(), pad_id=0, config=config).generate(prompts, 0)
    np.testing.assert_array_equal(with_adapters.tokens, with_merged.tokens)
    # ... and in the learner, dropout changes the update (same seeds otherwise).
    updates = []
    for dropout in (0.0, 0.5):
        learner = Learner(create_model(MODEL, seed=0), OptimConfig(lr=1e-2), LossConfig(),
                          adapters=init_adapters(MODEL, dataclasses.replace(LORA, dropout=dropout), seed=0))
        learner.step(random_batch(0))
        updates.append(host(learner.params))
    assert max(np.abs(a - b).max() for a, b in zip(*updates)) > 1e-6


@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), (2, 2)])
def test_dropout_stays_out_of_the_importance_weight_and_the_ratio(mini_batches, epochs):
    # At staleness 0 (behaviour = the adapted policy's own log-probs, as the sampler computes them: no dropout)
    # and lr 0, dropout must not show in any value: the importance weight is 1 (one update a step, where the
    # proximal log-probs were the dropout pass's own) and the ratio is 1, so the clip never binds (several updates,
    # where the current log-probs carried the dropout noise), while the gradient still comes with dropout.
    lora = dataclasses.replace(LORA, dropout=0.5)
    adapters = randomized(init_adapters(MODEL, lora, seed=0))  # B != 0: dropout changes the adapters' output
    model = create_model(MODEL, seed=0)
    batch = random_batch(3, size=8)
    own = jitted_token_logprobs(model, batch.tokens, batch.input_mask, adapters=adapters)[0]
    batch = dataclasses.replace(batch, behaviour_logprobs=np.where(batch.loss_mask > 0, np.asarray(own), 0.0))
    optim = OptimConfig(lr=0.0, mini_batches=mini_batches, epochs=epochs)
    learner = Learner(model, optim, LossConfig(clip_low=0.2, clip_high=0.2), adapters=adapters, dropout_seed=1)
    metrics, applied = learner.step(batch)
    assert applied.all()
    print(f"{mini_batches} x {epochs}: tis/weight_mean {metrics['tis/weight_mean']:.7f}, ratio/min "
          f"{metrics['ratio/min']:.7f} max {metrics['ratio/max']:.7f}, clip {metrics['clip/frac_low']:.3f} / "
          f"{metrics['clip/frac_high']:.3f}, grad_norm {metrics['grad_norm']:.3g}")
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["tis/weight_max"] == pytest.approx(1.0, abs=1e-5) and abs(metrics["tis/mismatch_kl"]) < 1e-7
    assert metrics["ratio/min"] == pytest.approx(1.0, abs=1e-5) and metrics["ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip/frac_low"] == 0.0 and metrics["clip/frac_high"] == 0.0
    # The gradient is the dropout pass's: other dropout masks (another seed) give another gradient.
    other = Learner(create_model(MODEL, seed=0), optim, LossConfig(clip_low=0.2, clip_high=0.2),
                    adapters=randomized(init_adapters(MODEL, lora, seed=0)), dropout_seed=2)
    assert other.step(batch)[0]["grad_norm"] != pytest.approx(metrics["grad_norm"], rel=1e-4)


def test_adapter_shardings_follow_the_weights_axes():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    config = dataclasses.replace(MODEL, num_heads=4, num_kv_heads=2)
    shardings = state_shardings(nnx.state(init_adapters(config, LORA)), mesh)
    layer = shardings["layers"][0]
    spec = {name: (tuple(layer[name]["a"].spec), tuple(layer[name]["b"].spec)) for name in TARGETS}
    # A shares the weight's input axis, B its output axis; the rank is replicated.
    assert spec["q"] == (("fsdp", None), (None, "tensor", None))
    assert spec["k"] == (("fsdp", None), (None, "tensor", None))
    assert spec["o"] == (("tensor", None, None), (None, "fsdp"))
    assert spec["gate"] == (("fsdp", None), (None, "tensor"))
    assert spec["down"] == (("tensor", None), (None, "fsdp"))


# ---- export ------------------------------------------------------------------------------------------


def test_merged_export_gives_the_adapted_models_logits(tmp_path):
    model = create_model(MODEL, seed=0)
    adapters = randomized(init_adapters(MODEL, dataclasses.replace(LORA, targets=("q", "o", "up", "down"))))
    before = host(nnx.state(model))
    save_hf_model(merge_adapters(model, adapters), tmp_path)
    for want, got in zip(before, host(nnx.state(model))):  # merging made a new model; the base is as it was
        np.testing.assert_array_equal(got, want)
    exported, _ = load_hf_model(tmp_path)
    tokens, mask = batch_of_tokens(MODEL.vocab_size)
    adapted = logits(model, tokens, mask, adapters)
    assert np.abs(adapted - logits(model, tokens, mask)).max() > 1e-2
    np.testing.assert_allclose(logits(exported, tokens, mask)[mask], adapted[mask], atol=1e-5)
    # Untargeted weights are the base's, bit for bit.
    np.testing.assert_array_equal(np.asarray(param_dict(exported)["layers.0.attn.k"]),
                                  np.asarray(param_dict(model)["layers.0.attn.k"]))


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "gemma3", "qwen3_moe"])
def test_peft_adapter_loads_onto_the_transformers_base_with_equal_logits(tmp_path, family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config_class = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                    "qwen3": transformers.Qwen3Config, "gemma3": transformers.Gemma3TextConfig,
                    "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    # Gemma 3: a local layer over a window of 3 tokens, then a global one.
    gemma = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16)
    # Qwen3-MoE: experts in layer 0, a dense MLP in layer 1; adapters on attention only (run.plan refuses MLP
    # targets for a model with experts).
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    hf_config = config_class(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                             tie_word_embeddings=family != "llama", bos_token_id=None, eos_token_id=None,
                             pad_token_id=None, **{"gemma3": gemma, "qwen3_moe": moe}.get(family, {}))
    torch_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in torch_model.named_parameters():  # transformers' init leaves biases 0, norms 1
            p.copy_((1 + 0.2 * torch.randn(p.shape)) if name.endswith("norm.weight") else 0.2 * torch.randn(p.shape))
    torch_model.save_pretrained(tmp_path / "base")
    model, _ = load_hf_model(tmp_path / "base")
    targets = ("q", "k", "v", "o") if family == "qwen3_moe" else TARGETS
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.05, targets=targets)
    adapters = randomized(init_adapters(model.config, lora, seed=2), scale=0.3)
    save_peft_adapter(adapters, model.config, tmp_path / "adapter", base_model_path=str(tmp_path / "base"))

    written = safetensors.numpy.load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS_FILE)
    assert written["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
    assert written["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    if "down" in targets:
        assert written["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 96)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"

    peft_model = peft.PeftModel.from_pretrained(torch_model, tmp_path / "adapter").eval()
    # The names and shapes PEFT itself would save for this model: nothing missing, nothing extra.
    expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(peft_model).items()}
    assert {k: v.shape for k, v in written.items()} == expected
    tokens, mask = batch_of_tokens(hf_config.vocab_size)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        ref = peft_model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                         attention_mask=torch.from_numpy(mask.astype(np.int64)),
                         position_ids=torch.from_numpy(positions)).logits.numpy()
    ours = logits(model, tokens, mask, adapters)
    assert np.abs(ours - logits(model, tokens, mask))[mask].max() > 1e-2  # the adapters matter
    assert np.abs(ours - ref)[mask].max() <= 1e-4


# ---- trainer ------------------------------------------------------------------------------------------


FAST = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "grpo.group_size=4",
        "grpo.prompts_per_step=4", "trainer.progress=false", "trainer.group_timeout_s=120", "sampler.max_new_tokens=6",
        "trainer.tensorboard=false"]


def tiny_config(tmp_path, *overrides) -> Config:
    return load_config(Config, REPO / "configs" / "tiny_cpu.yaml", FAST + [f"run_dir={tmp_path}"] + list(overrides))


def distinct_characters_reward(records, completions, lengths):
    """A reward that differs between almost any two completions of a random model, so a group's advantages
    are never all zero. (The copy task's reward can give every sample of a step the same score, and then the
    update leaves B at its initial zeros.)"""
    return [float(len(set(text))) for text in completions]


def test_trainer_trains_and_syncs_only_the_adapters_and_exports_both_forms(tmp_path):
    from grpo_jax.algorithm.rewards import register_function
    from grpo_jax.run.trainer import Trainer

    # A reward that varies between completions: with the copy task's, every group of the 3 steps can score
    # evenly, no update moves B, and the check that the adapters trained would fail by chance.
    reward = f'rewards=[{{name: "{register_function(distinct_characters_reward)}"}}]'
    config = tiny_config(tmp_path, "lora.rank=4", "lora.alpha=8", "trainer.max_steps=3", "loss.kl_coef=0.05",
                         "mesh.learner.fsdp=4", "mesh.learner.tensor=2", "mesh.actor.fsdp=8", "sampler.engine=static",
                         reward)
    trainer = Trainer(config)
    base = host(nnx.state(create_model(config.model, seed=config.seed)))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2, 3]
    adapter_bytes = nbytes(trainer.learner.params)
    base_bytes = nbytes(trainer.learner.frozen)
    assert all(m["sync/bytes"] == adapter_bytes for m in history) and 4 * adapter_bytes < base_bytes
    # The base never changed, on the learner or on the actor; the adapters did, and the actor has the last ones.
    for want, learner_leaf, actor_leaf in zip(base, host(trainer.learner.frozen), host(trainer.sampler.state)):
        np.testing.assert_array_equal(learner_leaf, want)
        np.testing.assert_array_equal(actor_leaf, want)
    # B only: A starts random, so a check over every adapter parameter would pass with no training at all.
    assert min(np.abs(np.asarray(getattr(layer, name).b[...])).max()
               for layer in trainer.learner.adapters().layers for name in TARGETS) > 0
    for learner_leaf, actor_leaf in zip(host(trainer.learner.params), host(trainer.sampler.adapters)):
        np.testing.assert_array_equal(learner_leaf, actor_leaf)
    # Optimizer moments for the adapters only, in the checkpoint too.
    assert sum(x.size for x in jax.tree.leaves(trainer.learner.opt_state) if x.ndim > 0) == \
        2 * sum(x.size for x in jax.tree.leaves(trainer.learner.params))

    exported, _ = load_hf_model(tmp_path / "final_model")
    tokens, mask = batch_of_tokens(config.model.vocab_size)
    adapted = logits(nnx.merge(trainer.learner.base_graphdef, trainer.learner.frozen), tokens, mask,
                     trainer.learner.adapters())
    np.testing.assert_allclose(logits(exported, tokens, mask)[mask], adapted[mask], atol=1e-5)
    assert (tmp_path / "final_adapter" / ADAPTER_CONFIG_FILE).is_file()
    assert (tmp_path / "final_adapter" / ADAPTER_WEIGHTS_FILE).is_file()

    # A resume must use the same adapters on the same base.
    for overrides, said in [(["lora.rank=4", "lora.alpha=16"], "with LoRA rank=4 alpha=16.0"),
                            (["lora.rank=0"], "without LoRA"),
                            (["lora.rank=4", "lora.alpha=8", "seed=1"], "on base")]:
        with pytest.raises(CheckpointError, match="was trained with LoRA rank=4 alpha=8.0") as info:
            Trainer(tiny_config(tmp_path, *overrides, "trainer.max_steps=4", "loss.kl_coef=0.05"))
        assert said in str(info.value).split("this config has")[1]
    resumed = Trainer(tiny_config(tmp_path, "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "trainer.max_steps=4",
                                  "loss.kl_coef=0.05", "mesh.learner.fsdp=4", "mesh.learner.tensor=2",
                                  "mesh.actor.fsdp=8", "sampler.engine=static", reward))
    for saved, restored in zip(host(trainer.learner.params), host(resumed.learner.params)):
        np.testing.assert_array_equal(saved, restored)
    assert [m["step"] for m in resumed.train()] == [4]


def test_continuous_engine_samples_with_the_adapters_it_is_sent(tmp_path):
    from grpo_jax.algorithm.rewards import register_function
    from grpo_jax.run.trainer import Trainer

    # Synchronous (max_staleness 0): step 2's groups come from the adapters synced after step 1. No warm-up:
    # its first update has lr 0, and then the adapters synced after step 1 would still be the initial ones
    # (the actor may stop before it adopts step 2's).
    reward = register_function(distinct_characters_reward)
    config = tiny_config(tmp_path, "lora.rank=4", "trainer.max_steps=2", "grpo.max_staleness=0", "optim.warmup_steps=0",
                         f'rewards=[{{name: "{reward}"}}]',
                         "sampler.engine=continuous", "mesh.actor_devices=4", "mesh.actor.fsdp=4",
                         "mesh.learner.fsdp=4", "trainer.save_final_model=false", "checkpoint.save_at_end=false")
    trainer = Trainer(config)
    base = host(nnx.state(create_model(config.model, seed=config.seed)))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2] and history[-1]["staleness/max"] == 0
    assert all(m["sync/bytes"] == nbytes(trainer.learner.params) for m in history)
    for want, actor_leaf in zip(base, host(trainer.sampler.state)):  # the engine's base never changed
        np.testing.assert_array_equal(actor_leaf, want)
    actor_b = [np.asarray(layer.q.b[...]) for layer in nnx.merge(trainer.sampler.adapter_graphdef,
                                                                            trainer.sampler.adapters).layers]
    assert max(np.abs(b).max() for b in actor_b) > 0  # trained adapters, not the initial B = 0


# ---- grpo-jax compile -----------------------------------------------------------------------------------


def test_compile_lays_out_adapters_on_a_frozen_base():
    """The TPU compile (libtpu, the jax[tpu] test extra) of a LoRA run: the learner takes the frozen base as an
    argument but updates (donates) only the adapters and their moments, and the sync moves the adapters only."""
    from grpo_jax.planning.compile import compile_run
    from grpo_jax.run.plan import RunPlan, shard_bytes

    overrides = ["grpo.prompts_per_step=8", "grpo.group_size=4", "mesh.actor_devices=2", "mesh.actor.tensor=2",
                 "mesh.actor.fsdp=1", "mesh.learner.fsdp=2", "sampler.decode_streams=1", "sampler.engine=static",
                 "lora.rank=2",
                 "lora.dropout=0.1", "loss.kl_coef=0.01"]
    config = load_config(Config, REPO / "configs" / "tiny_cpu.yaml", overrides)
    report = compile_run(config, "v5e:2x2", isolate=False)  # in this process: no child's start-up and libtpu load
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        nnx.state(abstract_model(config.model))))
    learner = report.program("learner step")
    assert learner.memory is not None and not learner.refusal
    # The base, split over the 2 learner devices, is an argument; what is donated and written back is the
    # adapters and their moments, a small fraction (full fine-tuning donates parameters and both moments).
    assert learner.memory.arguments >= weights / 2
    assert 0 < learner.memory.aliased < weights / 4
    _, actor_adapters = RunPlan.build(config, report.topology.devices, process_word="host").actor_adapters()
    assert [t.bytes_per_device for t in report.transfers] == [shard_bytes(actor_adapters)]
    sampler = report.program("sampler generate")
    assert sampler.memory is not None and "adapters" in sampler.held_what


def test_a_lora_step_with_chunked_logprobs_equals_the_unchunked_one():
    rng = np.random.default_rng(5)
    batch = pack_batch(
        [list(rng.integers(1, 64, 4)) for _ in range(4)],
        [list(rng.integers(1, 64, 5)) for _ in range(4)],
        [rng.normal(-3, 0.3, 5) for _ in range(4)],
        rng.normal(size=4),
        pad_id=0,
        prompt_len=6,
        completion_len=5,
    )
    learners = [Learner(create_model(MODEL, seed=0), OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0, logprob_chunk=chunk),
                        LossConfig(kl_coef=0.01), adapters=init_adapters(MODEL, LORA, seed=0), temperature=0.7)
                for chunk in (0, 2)]
    start = jax.tree.map(np.asarray, learners[0].params)
    for learner in learners:
        learner.step(batch)
    moved = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(jax.tree.leaves(learners[0].params),
                                                                       jax.tree.leaves(start)))
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(learners[0].params), jax.tree.leaves(learners[1].params)))
    assert moved > 1e-3 and diff < 1e-5 * moved
