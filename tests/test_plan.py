"""The trainer and `grpo-jax compile` are built from one run description (run.plan.RunPlan): for several
configs, the arguments the trainer passes to its programs (real arrays) carry the shapes, dtypes and
shardings that the compile command compiles the same programs for (abstract arrays from a plan built as
compile_run builds it). A program that one side lays out on its own fails here."""

import jax
import numpy as np
import pytest

from grpo_jax.algorithm.learner import pack_batch
from grpo_jax.planning.actor_programs import engine_setup
from grpo_jax.run.plan import RunPlan
from grpo_jax.run.trainer import Trainer
from test_trainer import tiny_config

CONFIGS = {
    # actor and learner share all 8 devices
    "shared": [],
    # 4 actor devices (fsdp 4), 4 learner devices (fsdp 2 x tensor 2), static sampler
    "split": [
        "mesh.actor_devices=4",
        "mesh.learner.fsdp=2",
        "mesh.learner.tensor=2",
        "mesh.actor.fsdp=4",
        "sampler.engine=static",
    ],
    # LoRA with dropout (a dropout key) and a KL penalty (the frozen base is the reference); bfloat16 compute:
    # the actor keeps its copy narrowed
    "lora": [
        "mesh.actor_devices=2",
        "mesh.actor.tensor=2",
        "mesh.learner.fsdp=2",
        "mesh.learner.tensor=3",
        "lora.rank=4",
        "lora.dropout=0.1",
        "loss.kl_coef=0.01",
        "model.dtype=bfloat16",
    ],
    # a reference copy (KL without LoRA), mini-batches and micro-batches, top-k/top-p scoring
    "reference": [
        "mesh.actor_devices=4",
        "mesh.actor.tensor=2",
        "mesh.actor.fsdp=2",
        "mesh.learner.fsdp=4",
        "loss.kl_coef=0.02",
        "optim.mini_batches=2",
        "optim.micro_batch_size=4",
        "sampler.top_k=8",
        "sampler.top_p=0.9",
    ],
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


def one_step_batch(trainer):
    """A whole step's rows as the trainer packs them (this process's rows, NumPy)."""
    rows = trainer.local_prompts * trainer.config.grpo.group_size
    prompts = [np.array([3, 4, 5], np.int32)] * rows
    completions = [np.array([6, 7], np.int32)] * rows
    logprobs = [np.zeros(2, np.float32)] * rows
    return pack_batch(prompts, completions, logprobs, np.ones(rows, np.float32), trainer.tokenizer.pad_id,
                      trainer.prompt_bucket, trainer.completion_bucket)


def test_the_learner_step_is_called_with_the_arguments_compile_compiles_it_for(trainer_and_plan):
    trainer, plan = trainer_and_plan
    real = trainer.learner.step_arguments(trainer.device_batch(one_step_batch(trainer)))
    assert_laid_out_alike(real, plan.learner_step.args, "learner step argument ")


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


def test_the_plan_is_the_trainers(trainer_and_plan):
    trainer, plan = trainer_and_plan
    assert trainer.plan.learner_mesh.devices.tolist() == plan.learner_mesh.devices.tolist()
    assert trainer.plan.actor_mesh.devices.tolist() == plan.actor_mesh.devices.tolist()
    assert (trainer.prompt_bucket, trainer.completion_bucket) == (plan.prompt_bucket, plan.completion_bucket)
    assert trainer.learner.model().config == plan.model
