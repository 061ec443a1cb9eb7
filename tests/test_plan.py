"""The trainer and `grpo-jax compile` are built from one run description (run.plan.RunPlan): for several
configs, the arguments the trainer passes to its programs (real arrays) carry the shapes, dtypes and
shardings that the compile command compiles the same programs for (abstract arrays from a plan built as
compile_run builds it). A program that one side lays out on its own fails here."""

import dataclasses

import jax
import numpy as np
import pytest

from grpo_jax.planning.actor_programs import engine_setup
from grpo_jax.run.plan import RunPlan
from grpo_jax.run.trainer import Trainer
from grpo_jax.state.replay_buffer import Group
from test_trainer import tiny_config

CONFIGS = {
    # actor and learner share all 8 devices
    "shared": [],
    # 4 actor devices (fsdp 4), 4 learner devices (fsdp 2 x tensor 2), static sampler
    "split": ["mesh.actor_devices=4", "mesh.learner.fsdp=2", "mesh.learner.tensor=2", "mesh.actor.fsdp=4",
              "sampler.engine=static"],
    # LoRA with dropout (a dropout key) and a KL penalty (the frozen base is the reference); bfloat16 compute:
    # the actor keeps its copy narrowed
    "lora": ["mesh.actor_devices=2", "mesh.actor.tensor=2", "mesh.learner.fsdp=2", "mesh.learner.tensor=3",
             "lora.rank=4", "lora.dropout=0.1", "loss.kl_coef=0.01", "model.dtype=bfloat16"],
    # a reference copy (KL without LoRA), mini-batches and micro-batches, top-k/top-p scoring
    "reference": ["mesh.actor_devices=4", "mesh.actor.tensor=2", "mesh.actor.fsdp=2", "mesh.learner.fsdp=4",
                  "loss.kl_coef=0.02", "optim.mini_batches=2", "optim.micro_batch_size=4", "sampler.top_k=8",
                  "sampler.top_p=0.9"],
    # the model's 2 KV heads on an actor tensor axis of 4: the engine's ring holds each KV head twice, split
    "kv_heads_repeated": ["mesh.actor_devices=4", "mesh.actor.tensor=4", "mesh.actor.fsdp=1", "mesh.learner.fsdp=4"],
    # one sequence per row (the padded layout), micro-batches counted in tokens (2 rows of 16 + 6)
    "padded": ["optim.packing=false", "optim.mini_batches=2", "optim.micro_batch_tokens=44"],
    # packed rows with mini-batches and micro-batches counted in tokens (2 rows), over data x fsdp
    "packed_tokens": ["mesh.actor_devices=4", "mesh.actor.fsdp=4", "mesh.learner.data=2", "mesh.learner.fsdp=2",
                      "optim.mini_batches=2", "optim.micro_batch_tokens=44"],
}


def described(tree) -> list:
    """Per leaf: (path, shape, dtype, sharding or None for host data)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = leaf.sharding if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else None
        out.append((jax.tree_util.keystr(path), tuple(leaf.shape), np.dtype(leaf.dtype), sharding))
    return out


def assert_laid_out_alike(real, abstract, what: str) -> None:
    real, abstract = described(real), described(abstract)
    assert [r[0] for r in real] == [a[0] for a in abstract], f"{what}: the trainer's tree differs from the plan's"
    for (path, shape, dtype, sharding), (_, a_shape, a_dtype, a_sharding) in zip(real, abstract):
        assert (shape, dtype) == (a_shape, a_dtype), f"{what}{path}: {dtype}{list(shape)} vs the plan's " \
                                                     f"{a_dtype}{list(a_shape)}"
        if sharding is None:  # host data (the dropout key, the step index): placed by the program itself
            continue
        assert sharding.is_equivalent_to(a_sharding, len(shape)), \
            f"{what}{path}: the trainer passes {sharding}, grpo-jax compile compiles for {a_sharding}"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trainer_and_plan(request, tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp(request.param), *CONFIGS[request.param])
    trainer = Trainer(config)
    try:
        # As compile_run builds its plan, here over this machine's devices.
        yield trainer, RunPlan.build(config, jax.devices(), process_word="host")
    finally:
        trainer.close()


def step_groups(trainer, prompt_len: int, completion_len: int) -> list[Group]:
    """A whole step's groups of this process, every prompt and completion of the given lengths."""
    g = trainer.config.grpo.group_size
    return [Group(ordinal=i, prompt={"prompt_ids": np.full(prompt_len, 3, np.int32)},
                  completions=[np.full(completion_len, 6, np.int32)] * g,
                  behaviour_logprobs=[np.zeros(completion_len, np.float32)] * g, rewards=np.zeros(g, np.float32),
                  weight_version=0, advantages=np.ones(g, np.float32))
            for i in range(trainer.local_prompts)]


def one_step_batch(trainer, prompt_len: int = 0, completion_len: int = 0):
    """A whole step's rows as the trainer lays them out (this process's rows, NumPy) and its padding metrics; by
    default every sequence at the buckets' lengths: the most rows a packed step can need (compile's memory)."""
    batch, padding, _ = trainer.learner_batch(step_groups(trainer, prompt_len or trainer.prompt_bucket,
                                                          completion_len or trainer.completion_bucket))
    return batch, padding


def test_the_learner_step_is_called_with_the_arguments_compile_compiles_it_for(trainer_and_plan):
    trainer, plan = trainer_and_plan
    batch, _ = one_step_batch(trainer)
    real = trainer.learner.step_arguments(trainer.device_batch(batch))
    assert_laid_out_alike(real, plan.learner_step.args, "learner step argument ")


def test_a_step_of_short_sequences_takes_one_of_the_plans_row_counts(trainer_and_plan):
    trainer, plan = trainer_and_plan
    batch, padding = one_step_batch(trainer, prompt_len=3, completion_len=2)
    length = plan.row_length
    assert padding["learner/padding_fraction"] == pytest.approx(1 - 5 / length)
    if not plan.packing:
        assert padding["learner/rows"] == plan.rows == plan.learner_rows
        assert padding["learner/padding_fraction_packed"] == padding["learner/padding_fraction"]
        return
    # Sequences of 3 + 2 tokens: a row of 22 tokens (16 + 6) holds three, as its completion bucket of 6 allows
    # three completions of 2; each mini-batch's sequences packed on their own, then a size of the plan.
    rows = padding["learner/rows"]
    mini = plan.config.optim.mini_batches
    assert (length, plan.completion_bucket) == (22, 6)
    assert rows in plan.packed_row_sizes and rows < plan.learner_rows // plan.processes
    assert rows == plan.packed_rows(mini * -(-(plan.rows // plan.processes // mini) // 3))
    assert padding["learner/padding_fraction_packed"] == pytest.approx(1 - plan.rows * 5 / (rows * length))
    # The same program (its arguments laid out alike) at the smaller row count, which compile's projection at the
    # expected fill compiles; it trains every sequence.
    real = trainer.learner.step_arguments(trainer.device_batch(batch))
    assert_laid_out_alike(real, plan.learner_step.args_with(plan.abstract_batch(rows)), "learner step argument ")
    metrics, applied = trainer.learner.step(trainer.device_batch(batch))
    assert applied.all() and metrics["num_seqs"] == plan.rows and metrics["num_tokens"] == 2 * plan.rows


def test_compile_projects_the_packed_step_at_the_expected_lengths(trainer_and_plan):
    trainer, plan = trainer_and_plan
    config = dataclasses.replace(trainer.config, optim=dataclasses.replace(
        trainer.config.optim, expected_prompt_len=3, expected_completion_len=2))
    expected = RunPlan.build(config, jax.devices(), process_word="host")
    # Nothing promised by default: every sequence at the buckets' lengths, one per row.
    assert plan.expected_learner_rows == plan.learner_rows
    if not plan.packing:
        assert expected.expected_learner_rows == plan.rows
        return
    _, padding = one_step_batch(trainer, prompt_len=3, completion_len=2)
    assert expected.expected_learner_rows == plan.processes * padding["learner/rows"] < plan.learner_rows


def test_the_actor_holds_its_weights_as_compile_sizes_them(trainer_and_plan):
    trainer, plan = trainer_and_plan
    lora = trainer.config.lora.enabled
    actor = trainer.sampler.adapters if lora else trainer.sampler.state
    _, abstract = plan.actor_adapters() if lora else plan.actor_params()
    assert_laid_out_alike(actor, abstract, "actor weights ")
    # What each sync delivers: the learner's trained parameters resharded onto the actor's layout.
    synced = trainer.weight_sync(trainer.learner.params, trainer.actor_shardings)
    assert_laid_out_alike(synced, abstract, "weight sync output ")


def test_the_engine_banks_keep_the_layout_compile_compiles_their_programs_for(trainer_and_plan):
    trainer, plan = trainer_and_plan
    if trainer.config.sampler.engine != "continuous":
        pytest.skip("the static sampler has no banks")
    engine = trainer.sampler
    g = trainer.config.grpo.group_size
    engine.submit([3, 4, 5], np.zeros((g, 2), np.uint32))
    engine.step()  # an admission: the bank now has the layout its programs give it, kept for the run
    setup = engine_setup(plan)
    assert engine.bank_slots in setup.banks
    assert_laid_out_alike(engine._banks[0].state, setup.banks[engine.bank_slots], "engine bank ")
    # Each actor device holds only the KV heads its query heads read: kv_heads / tensor of them, or one.
    kv, tensor = plan.model.num_kv_heads, plan.actor_mesh.shape["tensor"]
    ring = engine._banks[0].state.cache[0][0]
    assert {shard.data.shape[1] for shard in ring.addressable_shards} == {max(kv // tensor, 1)}


def test_the_plan_is_the_trainers(trainer_and_plan):
    trainer, plan = trainer_and_plan
    assert trainer.plan.learner_mesh.devices.tolist() == plan.learner_mesh.devices.tolist()
    assert trainer.plan.actor_mesh.devices.tolist() == plan.actor_mesh.devices.tolist()
    assert (trainer.prompt_bucket, trainer.completion_bucket) == (plan.prompt_bucket, plan.completion_bucket)
    assert trainer.learner.model().config == plan.model
