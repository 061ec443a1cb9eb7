"""`grpo-jax compile`: every program of a run compiled for a TPU topology on this CPU machine (libtpu from
the jax[tpu] test extra; without it these tests fail, they do not skip). The static sampler and the
continuous engine (the default) are each compiled once on one host and once on two; the report fixtures
compile in this process, except the engine's two-host one, which goes through the compiling child process
as the command does. A multi-turn config (an env section) compiles the continuation engine's programs."""

import io
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.cli import main
from grpo_jax.config_io import load_config
from grpo_jax.errors import CheckpointError, ConfigError
from grpo_jax.model.hf import checkpoint_config, load_hf_model
from grpo_jax.model.transformer import DTYPES, abstract_model
from grpo_jax.planning.actor_programs import engine_setup
from grpo_jax.planning.compile import (
    PROGRESS_PREFIX,
    CompileFailure,
    CompilerCrash,
    compile_run,
    without_jax_cache,
)
from grpo_jax.planning.compile_cache import CACHE_DIR_ENV
from grpo_jax.planning.programs import ABORT_AT_ENV, RAISE_AT_ENV, compile_one
from grpo_jax.planning.report import DoesNotFit, format_report, model_flops_per_step
from grpo_jax.planning.topology import tpu_topology
from grpo_jax.rollout.weight_sync import WeightSync, narrowed
from grpo_jax.run.config import Config
from grpo_jax.run.plan import RunPlan, shard_bytes

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")
SHAPES = REPO / "configs" / "shapes"
# Two actor devices (tensor 2) and two learner devices (fsdp 2) per host; four updates per step (two
# mini-batches, two epochs) of two micro-batches each, so every loop of the learner step runs more than once.
SMALL = ["grpo.prompts_per_step=8", "grpo.group_size=4", "optim.mini_batches=2", "optim.epochs=2",
         "optim.micro_batch_size=8", "mesh.actor_devices=2", "mesh.actor.tensor=2", "mesh.actor.fsdp=1",
         "mesh.learner.fsdp=2", "sampler.decode_streams=1", "sampler.engine=static"]
# The continuous engine: one bank of 8 x 4 = 32 slots on one host (16 on each of two), chunks of 4 steps, so
# that a sample (8 tokens) spans two chunks and the bank halves while draining (32 -> 16 -> 8 slots).
ENGINE = [*SMALL[:-1], "sampler.engine=continuous", "sampler.chunk_steps=4"]


def tiny(*overrides: str) -> Config:
    return load_config(Config, TINY, [*SMALL, *overrides])


def tiny_engine(*overrides: str) -> Config:
    return load_config(Config, TINY, [*ENGINE, *overrides])


@pytest.fixture
def no_jax_cache():
    """For the tests that compile a program for a topology themselves, as compile_run does."""
    with without_jax_cache():
        yield


@pytest.fixture(scope="module")
def one_host_and_cache(tmp_path_factory):
    """The report, compiled in this process with a persistent compilation cache that a CPU program has already
    used (JAX decides once per process whether it uses the cache); and the cache's entries before and after."""
    from jax.experimental.compilation_cache import compilation_cache

    cache_dir, before_dir = tmp_path_factory.mktemp("xla_cache"), jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    compilation_cache.reset_cache()
    try:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
        before = sorted(p.name for p in cache_dir.iterdir())
        report = compile_run(tiny(), "v5e:2x2", isolate=False)
        return report, before, sorted(p.name for p in cache_dir.iterdir())
    finally:
        jax.config.update("jax_compilation_cache_dir", before_dir)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def one_host(one_host_and_cache):
    return one_host_and_cache[0]


def test_a_tpu_compile_leaves_the_persistent_cache_alone(one_host_and_cache):
    # Executables for a described topology cannot be loaded back (no TPU client): written, they would only cost
    # time and warn on every later read.
    _, before, after = one_host_and_cache
    assert before and after == before


TWO_HOSTS = ["mesh.learner.fsdp=4"]  # two learner devices on each host
BF16 = ["model.dtype=bfloat16"]  # compute in bfloat16 over float32 master weights: the actor keeps bfloat16


@pytest.fixture(scope="module")
def two_hosts():
    return compile_run(tiny(*TWO_HOSTS, *BF16), "v5p:2x2x2", isolate=False)


# One actor mesh across both hosts: 2 actor devices on each, tensor 4 over the 4 of them (the model's 4 heads split
# across hosts); the learner on the other 2 devices of each host.
SPANNING = ["mesh.actor_devices=2", "mesh.actor.tensor=4", "mesh.learner.fsdp=4", "eval.every_steps=0"]


@pytest.fixture(scope="module")
def spanning():
    return compile_run(tiny(*SPANNING, *BF16), "v5p:2x2x2", isolate=False)


@pytest.fixture(scope="module")
def engine_one_host():
    return compile_run(tiny_engine(*EVAL), "v5e:2x2", isolate=False)


EVAL = ["eval.every_steps=5", "eval.num_prompts=6", "eval.samples=3", "eval.max_new_tokens=12"]


@pytest.fixture(scope="module")
def engine_two_hosts_run(tmp_path_factory):
    """In the compiling child, as the command does: the report and the progress lines printed meanwhile. With a
    compile cache of its own, so that every program is compiled (none comes from another test's compile)."""
    progress = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("compile_cache")))
        report = compile_run(tiny_engine(*TWO_HOSTS), "v5p:2x2x2", progress=progress)
    return report, progress.getvalue()


@pytest.fixture(scope="module")
def engine_two_hosts(engine_two_hosts_run):
    return engine_two_hosts_run[0]


def param_bytes(config: Config) -> int:
    model = abstract_model(config.model)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


def test_one_host_compiles_every_program(one_host):
    assert one_host.topology.processes == 1 and len(one_host.topology.devices) == 4
    assert [p.name for p in one_host.programs] == ["learner step", "sampler generate"]
    assert [t.name for t in one_host.transfers] == ["weight sync copy"]
    for program in one_host.programs:
        assert program.memory is not None and not program.refusal
        assert 0 < program.total < one_host.topology.hbm_bytes
        assert program.cost.flops > 0 and program.cost.bytes > 0 and program.cost.seconds > 0
    step = one_host.step
    assert step.overlapped and step.seconds == max(step.learner_seconds, step.actor_seconds)
    assert 0 < step.mfu < 1
    text = format_report(one_host)
    for name in ("learner step", "sampler generate", "weight sync copy", "projected step", "MFU"):
        assert name in text


def test_memory_covers_the_sharded_state(one_host):
    config = tiny()
    weights = param_bytes(config)
    learner = one_host.program("learner step")
    # Parameters and both AdamW moments split over the two learner devices (the moments sharded like the
    # parameters, as the trainer places them, not replicated); the small batch on top.
    assert 3 * weights / 2 <= learner.memory.arguments < 2 * weights
    # Parameters and moments are donated: the new ones are written over them.
    assert learner.memory.aliased >= 3 * weights / 2
    sampler = one_host.program("sampler generate")
    assert sampler.memory.arguments >= weights / 2
    assert sampler.held >= weights / 2  # the next weights arrive while it samples


def test_costs_count_every_loop_iteration(one_host):
    """XLA counts a loop body once; the report multiplies each body by its trip count. Summed over the
    devices, the learner does at least the model FLOPs of its 4 updates x 2 micro-batches (6 per weight
    per token) and the sampler at least 2 per weight per generated token: counting each loop once would
    fall far short of both."""
    config = tiny()
    count = one_host.param_count
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    length = config.data.max_prompt_len + config.sampler.max_new_tokens
    trained = 6 * count * rows * length * config.optim.epochs
    learner = one_host.program("learner step")
    assert trained <= learner.cost.flops * learner.devices <= 4 * trained
    sampled = 2 * count * rows * config.sampler.max_new_tokens
    sampler = one_host.program("sampler generate")
    assert sampled <= sampler.cost.flops * sampler.devices <= 8 * sampled
    assert model_flops_per_step(config, config.model, count) == pytest.approx(one_host.step.model_flops)


def test_two_hosts_stage_a_narrow_copy_per_host_for_the_actor(two_hosts):
    """On several hosts the sync's first step (WeightSync.stage_program) is compiled: every host gets a whole copy
    of the weights in the compute dtype (bfloat16 here) spread over its own 2 learner devices, not a full copy
    per learner device; the actor keeps bfloat16 weights, half the float32 figure."""
    assert two_hosts.topology.processes == 2 and len(two_hosts.topology.devices) == 8
    assert [p.name for p in two_hosts.programs] == ["learner step", "sampler generate", "weight sync stage"]
    weights = param_bytes(tiny(*TWO_HOSTS, *BF16))  # float32 master weights
    narrow = weights / 2  # the whole model in bfloat16
    stage = two_hosts.program("weight sync stage")
    assert stage.devices == 4  # two learner devices on each of the two hosts
    # At most half of the bfloat16 copy on each of a host's 2 learner devices (staged in groups: see
    # test_two_hosts_stage_whole_copies_in_groups); a full copy per device would be at least `narrow`.
    assert stage.memory.outputs < 0.75 * narrow / 2
    assert stage.held >= 2 * weights / 4  # the moments stay where they are
    assert stage.cost is not None and stage.hints and "learner devices per host" in stage.hints[0]
    learner = two_hosts.program("learner step")
    assert learner.memory.arguments >= 3 * weights / 4  # the learner still holds float32 weights and moments
    sampler = two_hosts.program("sampler generate")
    # The actor's bfloat16 weights over its 2 devices: about a quarter of the float32 bytes, not half.
    assert narrow / 2 <= sampler.memory.arguments < 0.6 * weights / 2
    assert narrow / 2 <= sampler.held < 0.6 * weights / 2  # the next (bfloat16) weights arrive while it samples
    (copy,) = two_hosts.transfers
    # The largest shard: the norms are replicated over the actor's tensor axis.
    assert copy.name == "weight sync copy" and copy.bytes_per_device == pytest.approx(narrow / 2, rel=0.01)
    assert "bfloat16" in copy.how
    assert two_hosts.step is not None and two_hosts.step.seconds > 0
    assert "weight sync stage" in format_report(two_hosts)


def staged_group_bytes(config: Config, sync: WeightSync) -> list:
    """The bytes (in the dtype sent) of each group of leaves the sync stages one after the other."""
    leaves = jax.tree.leaves(nnx.state(abstract_model(config.model)))
    sizes = [math.prod(x.shape) * narrowed(x.dtype, sync.compute_dtype).itemsize for x in leaves]
    return [sum(sizes[g]) for g in sync.group_slices(leaves)]


def test_two_hosts_stage_whole_copies_in_groups(two_hosts):
    # The per-host copy is staged in groups of leaves: the stage's memory is its largest group's, split over a
    # host's 2 learner devices (TPU tiling pads the tiny leaves a little), not the whole copy's.
    config = tiny(*TWO_HOSTS, *BF16)
    groups = staged_group_bytes(config, WeightSync(DTYPES[config.model.dtype]))
    assert len(groups) > 1
    stage = two_hosts.program("weight sync stage")
    assert max(groups) / 2 <= stage.memory.outputs < 0.8 * max(groups)  # a whole copy per device: max(groups)
    assert stage.notes and f"{len(groups)} programs" in stage.notes[0]


def test_an_actor_across_hosts_samples_every_hosts_prompts_and_stages_a_block_per_host(spanning, no_jax_cache):
    config = tiny(*SPANNING, *BF16)
    topology = tpu_topology("v5p:2x2x2")
    layout = RunPlan.build(config, topology.devices, process_word="host")
    assert layout.actor_spans_hosts and layout.actor_mesh.size == 4 and layout.actor_devices_per_host == 2
    assert {d.process_index for d in layout.actor_mesh.devices.flat} == {0, 1}
    assert spanning.layout.startswith("actor (one across all 2 hosts, every host's prompts): 4 device(s), 2 per host")
    assert [p.name for p in spanning.programs] == ["learner step", "sampler generate", "weight sync stage"]
    for program in spanning.programs:
        assert program.memory is not None and 0 < program.total < topology.hbm_bytes
    # One actor samples all 8 prompts x 4: at least 2 FLOPs per weight per generated token of all 32 rows (a
    # per-host actor would generate 16).
    sampler = spanning.program("sampler generate")
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    assert sampler.devices == 4
    assert 2 * spanning.param_count * rows * config.sampler.max_new_tokens <= sampler.cost.flops * sampler.devices
    # The stage gives each host only its half of the (tensor-split) weights, over its 2 learner devices: about a
    # quarter of the bfloat16 model per learner device, where a whole copy per host would be half. Compiled here
    # for all leaves at once (the run stages them in groups, each smaller still).
    narrow = param_bytes(config) / 2
    _, params = layout.abstract_params()
    _, actor = layout.actor_params()
    sync = WeightSync(DTYPES[config.model.dtype], groups=1)
    leaves, targets = jax.tree.leaves(params), [x.sharding for x in jax.tree.leaves(actor)]
    # Per learner device, from the stage's shardings: the 2 KV heads do not split over tensor 4, so their leaves
    # (and the norms) are whole on each host; the rest is a quarter.
    ideal = sum(math.prod(s.shard_shape(x.shape)) * 2 for x, s in zip(leaves, sync.stage_shardings(leaves, targets)))
    assert narrow / 4 <= ideal < 0.3 * narrow
    whole = compile_one(sync.stage_program(leaves, targets), (leaves,), topology, label="weight sync stage")
    assert ideal <= whole.memory.outputs < 1.4 * ideal  # TPU tiling pads the tiny leaves
    stage = spanning.program("weight sync stage")
    assert stage.memory.outputs <= whole.memory.outputs
    assert "more learner devices (now 4, 2 per host)" in stage.hints[0]


def test_an_actor_across_hosts_is_refused_with_the_continuous_engine_or_evaluation():
    devices = tpu_topology("v5p:2x2x2").devices
    with pytest.raises(ConfigError, match="sampler.engine='continuous'.*set sampler.engine=static"):
        RunPlan.build(tiny(*SPANNING, "sampler.engine=continuous"), devices, process_word="host")
    with pytest.raises(ConfigError, match="eval.every_steps=5"):
        RunPlan.build(tiny(*SPANNING[:-1], "eval.every_steps=5"), devices, process_word="host")


def test_engine_keeps_the_actor_weights_in_the_compute_dtype():
    """The continuous engine's abstract weights (its programs' arguments) are in bfloat16 when the model computes in
    it over float32 master weights, as the trainer's sync delivers them (no compile: shapes only)."""
    config = tiny_engine(*TWO_HOSTS, *BF16)
    layout = RunPlan.build(config, tpu_topology("v5p:2x2x2").devices, process_word="host")
    setup = engine_setup(layout)
    assert {x.dtype.name for x in jax.tree.leaves(setup.state)} == {"bfloat16"}
    # bfloat16, split over the 2 actor devices (the largest shard: the norms are replicated over tensor)
    assert shard_bytes(setup.state) == pytest.approx(param_bytes(config) / 2 / 2, rel=0.01)


def test_oversized_config_is_refused_in_one_line(capsys):
    # A 10B-parameter layer: its float32 weights alone need 20 GiB on each of the two 16 GiB actor devices,
    # with the moments 60 GiB on each learner device.
    code = main(["compile", TINY, *SMALL, "model.num_layers=1", "model.hidden_size=16384", "model.num_heads=128",
                 "model.num_kv_heads=8", "model.intermediate_size=196608", "--topology", "v5e:2x2"])
    assert code == DoesNotFit.exit_code != 0
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("grpo-jax: error:")]
    assert len(errors) == 1, captured.err
    assert errors[0].startswith("grpo-jax: error: does not fit on v5e:2x2: learner step ")
    assert "mesh.learner.fsdp" in errors[0]
    assert "learner step" in captured.out  # the report is printed before the refusal


def test_unknown_topology_is_a_one_line_error(capsys):
    assert main(["compile", TINY, "sampler.engine=static", "--topology", "v5e-8"]) == 2
    assert "expected VERSION:AxB" in capsys.readouterr().err


PUBLISHED = {  # parameter counts of the public checkpoints
    "Qwen2.5-0.5B-Instruct": 0.494e9, "Qwen2.5-1.5B-Instruct": 1.544e9, "Qwen2.5-7B-Instruct": 7.616e9,
    "Qwen2.5-32B-Instruct": 32.76e9, "Llama-3.1-8B-Instruct": 8.030e9, "Llama-3.1-70B-Instruct": 70.55e9,
    "Qwen3-8B": 8.191e9,
    # Gemma 3's technical report: 1,012M embedding + 10,759M other parameters in the language model (the 417M of
    # its vision encoder are not loaded).
    "Gemma-3-12B": 11.771e9,
    "Qwen3-30B-A3B": 30.53e9,  # 3.3B of them active per token (test_moe)
    "Qwen3-235B-A22B": 235.09e9,  # 22.2B active
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shape_files_describe_the_public_models_without_weights(name):
    directory = SHAPES / name
    config = checkpoint_config(directory)
    model = abstract_model(config)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model)))
    assert count == pytest.approx(PUBLISHED[name], rel=2e-3)
    assert json.loads((directory / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(CheckpointError, match="no weights"):
        load_hf_model(directory)


def test_continuous_engine_compiles_on_one_host(engine_one_host):
    report = engine_one_host
    assert [p.name for p in report.programs] == ["learner step", "engine chunk", "engine admission", "engine resize",
                                                 "eval generate"]
    weights = param_bytes(tiny_engine())
    for program in report.programs:
        assert program.memory is not None and not program.refusal
        assert 0 < program.total < report.topology.hbm_bytes
    chunk, admission = report.program("engine chunk"), report.program("engine admission")
    for program in (chunk, admission):
        assert program.devices == 2 and program.actor
        # The actor's weights (split over its two devices) and the bank's slots are arguments; the bank is donated.
        assert program.memory.arguments >= weights / 2
        assert program.memory.aliased > 0
        assert program.held >= weights / 2  # the next weights arrive while it decodes
    # 32 samples fill the 32 slots once; 8 tokens: the admission's first token, then 7 steps in 2 chunks of 4.
    assert (chunk.calls_per_step, admission.calls_per_step, report.program("engine resize").calls_per_step) == (2, 1, 0)
    # A chunk is costed as chunk_steps decode steps of all 32 slots: 2 FLOPs per weight per slot per step at least.
    count = report.param_count
    assert 2 * count * 32 * 4 <= chunk.cost.flops * chunk.devices <= 4 * 2 * count * 32 * 4
    step = report.step
    assert step.actor_seconds == pytest.approx(2 * chunk.cost.seconds + admission.cost.seconds)
    text = format_report(report)
    for words in ("engine chunk", "engine admission", "banks of 32, 16, 8 slots", "projected step"):
        assert words in text


def test_evaluation_during_training_is_compiled_beside_the_engines_slots(engine_one_host):
    # With the continuous engine an evaluation runs on the static sampler while the engine's slots stay in flight.
    report = engine_one_host
    chunk, evaluation = report.program("engine chunk"), report.program("eval generate")
    assert not evaluation.actor and evaluation.memory is not None and evaluation.total < report.topology.hbm_bytes
    weights = param_bytes(tiny_engine()) // 2  # the actor's (float32) weights, split over tensor 2 (norms whole)
    slots = chunk.memory.arguments - weights  # the engine's arguments besides the weights the static sampler shares
    assert slots > 0 and evaluation.held == pytest.approx(chunk.held + slots, rel=0.01)
    assert evaluation.held_what.startswith("the engine's slots in flight")
    # 6 prompts x (1 greedy + 3 sampled) = 24 rows: one call of the actor's usual 32 rows.
    assert evaluation.calls_per_step == 1
    # Its program decodes eval.max_new_tokens=12 tokens, not the sampler's 8: more FLOPs than one chunk of 4 steps.
    assert evaluation.cost.flops > chunk.cost.flops
    step = report.step  # not part of the step
    assert step.actor_seconds == pytest.approx(2 * chunk.cost.seconds + report.program("engine admission").cost.seconds)
    text = format_report(report)
    assert "eval generate: held = the engine's slots in flight" in text and "1 call(s) per evaluation" in text


def test_continuous_engine_compiles_on_two_hosts(engine_two_hosts):
    report = engine_two_hosts
    # The report came back from the compiling child; its topology is described again here, with real devices.
    assert report.topology.processes == 2 and len(report.topology.devices) == 8
    assert RunPlan.build(tiny_engine(*TWO_HOSTS), report.topology.devices, process_word="host").actor_mesh.size == 2
    assert [p.name for p in report.programs] == ["learner step", "engine chunk", "engine admission", "engine resize",
                                                 "weight sync stage"]
    weights = param_bytes(tiny_engine(*TWO_HOSTS))
    for name in ("engine chunk", "engine admission"):
        program = report.program(name)
        assert program.memory.arguments >= weights / 2 and program.total < report.topology.hbm_bytes
    # Each host samples its 4 prompts x 4 in a bank of 16 slots: one wave, 2 chunks, one admission of 4 prompts.
    assert report.program("engine chunk").calls_per_step == 2
    assert report.program("engine admission").calls_per_step == 1
    assert report.step is not None and report.step.seconds > 0


PROGRESS_LINE = re.compile(re.escape(PROGRESS_PREFIX) + r" *([\d.]+) s  (.+): (compiling|compiled in ([\d.]+) s|"
                           r"from the compile cache \(compiled before in ([\d.]+) s\)); "
                           r"host memory peak ([\d.]+)([KMG])iB")


def test_the_compile_shows_each_program_as_it_starts_and_ends(engine_two_hosts_run):
    """While the child compiles, one line per program (and per loop body compiled alone for its cost) as it
    starts and as it ends: its label, the seconds since the start, its compile time, the child's peak host
    memory. They add up to the report's compile times. A program the run has compiled already (the weight sync's
    groups of equal shapes) comes from the compile cache, which this run starts empty."""
    report, text = engine_two_hosts_run
    lines = [PROGRESS_LINE.fullmatch(line) for line in text.splitlines()]
    assert len(lines) >= 2 and all(lines), text
    labels = [m.group(2) for m in lines]
    assert labels[::2] == labels[1::2], text  # each program's end follows its start
    assert [m.group(3) for m in lines[::2]] == ["compiling"] * (len(lines) // 2)
    ends = lines[1::2]
    assert all((m.group(4) is None) != (m.group(5) is None) for m in ends)
    cached = [m.group(2) for m in ends if m.group(5) is not None]
    compiled = {m.group(2) for m in ends if m.group(4) is not None}
    assert cached and all(label.startswith("weight sync stage (group ") for label in cached), cached
    assert "learner step" in compiled and not compiled & set(cached), text  # cached only after compiled once
    elapsed = [float(m.group(1)) for m in lines]
    assert elapsed == sorted(elapsed)
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    peaks = [float(m.group(6)) * units[m.group(7)] for m in lines]
    assert peaks[0] > 100 * 2 ** 20 and peaks == sorted(peaks)  # a process with JAX and libtpu: its high-water mark
    assert {"learner step", "engine chunk (16 slots)", "engine admission"} <= set(labels), labels
    assert any(label.startswith("weight sync stage (group 1 of ") for label in labels), labels
    for program in report.programs:  # a cached program's compile time is its lookup's, not in the lines
        own = [float(m.group(4)) for m in ends if m.group(2).startswith(program.name) and m.group(4)]
        lookups = sum(1 for m in ends if m.group(2).startswith(program.name) and m.group(5))
        assert own and sum(own) - 0.05 * len(own) - 0.01 <= program.compile_seconds <= \
            sum(own) + 0.05 * len(own) + 0.5 * lookups + 0.01, program.name


def test_a_program_compiled_before_comes_from_the_compile_cache(tmp_path, monkeypatch, no_jax_cache):
    """What compiling a program found is read back instead of compiled again, keyed by the program, the devices
    it is placed on and the topology; an entry that cannot be read is compiled again; an empty variable turns
    the cache off."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    topology = tpu_topology("v5e:2x2")
    program = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0))

    def argument(rows, devices):
        mesh = jax.sharding.Mesh(np.array(devices), ("x",))
        return jax.ShapeDtypeStruct((rows, 128), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x")))

    def entries():
        return sorted(p.name for p in tmp_path.iterdir())

    first = compile_one(program, (argument(256, topology.devices[:2]),), topology)
    assert first.memory.arguments > 0 and first.cost.flops > 0 and len(entries()) == 1
    again = compile_one(program, (argument(256, topology.devices[:2]),), topology)
    assert (again.memory, again.cost, again.refusal) == (first.memory, first.cost, first.refusal)
    assert len(entries()) == 1
    # Another shape, other devices, another topology: each is compiled and kept on its own.
    compile_one(program, (argument(512, topology.devices[:2]),), topology)
    compile_one(program, (argument(256, topology.devices[2:]),), topology)
    other = tpu_topology("v5p:2x2x1")
    compile_one(program, (argument(256, other.devices[:2]),), other)
    assert len(entries()) == 4 and all(name.endswith(".json") for name in entries())
    for path in tmp_path.iterdir():  # torn entries: compiled again and written whole
        path.write_text('{"memory": ')
    again = compile_one(program, (argument(256, topology.devices[:2]),), topology)
    assert (again.memory, again.cost) == (first.memory, first.cost)
    assert sum(1 for p in tmp_path.iterdir() if p.read_text().startswith('{"memory": {')) == 1
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    for path in tmp_path.iterdir():
        path.unlink()
    compile_one(program, (argument(256, topology.devices[:2]),), topology)
    assert entries() == []
    (tmp_path / "a_file").write_text("")  # a cache directory that cannot be made costs only the compile
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "a_file" / "cache"))
    again = compile_one(program, (argument(256, topology.devices[:2]),), topology)
    assert (again.memory, again.cost) == (first.memory, first.cost) and entries() == ["a_file"]


def test_a_run_compiled_again_reports_the_same_figures(one_host):
    # Every program of one_host's run now has an entry (written by its compile, or read by it).
    again = compile_run(tiny(), "v5e:2x2", isolate=False)
    assert [(p.name, p.memory, p.cost, p.refusal) for p in again.programs] == [
        (p.name, p.memory, p.cost, p.refusal) for p in one_host.programs]
    assert again.step == one_host.step


def test_oversized_engine_slots_are_refused_in_one_line(capsys):
    # 2^21 slots of 24 ring positions: their KV rings alone take 24 GiB on each of the two actor devices.
    code = main(["compile", TINY, *ENGINE, "sampler.slots=2097152", "sampler.chunk_steps=16", "--topology", "v5e:2x2"])
    assert code == DoesNotFit.exit_code
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("grpo-jax: error:")]
    assert len(errors) == 1, captured.err
    assert errors[0].startswith("grpo-jax: error: does not fit on v5e:2x2: engine chunk ")
    assert "learner step" not in errors[0]
    assert "fewer sampler.slots (now 2097152" in errors[0]


def test_an_exception_while_compiling_is_one_line_naming_the_program_and_the_log(capsys, monkeypatch):
    """A program the code cannot trace or lower for a layout (a bug, e.g. a Pallas kernel outside a shard_map)
    ends the compiling process on an exception: one error line naming the program and the exception, the whole
    output kept in a file, exit 5; no traceback."""
    monkeypatch.setenv(RAISE_AT_ENV, "learner step")
    code = main(["compile", TINY, *ENGINE, "--topology", "v5e:2x2"])
    assert code == CompileFailure.exit_code == 5
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if line.startswith("grpo-jax: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in captured.err, captured.err
    assert errors[0].startswith("grpo-jax: error: learner step: compiling it failed with NotImplementedError: "
                                f"{RAISE_AT_ENV}=learner step: raised for a test;")
    log = pathlib.Path(errors[0].rsplit(" is in ", 1)[1])
    assert "Traceback" in log.read_text()
    log.unlink()


def test_a_compiler_crash_is_one_line(capsys, monkeypatch):
    """libtpu aborts the process on some layouts (a failed check): the compile runs in a child process, and its
    death by a signal is one line that names the program, the signal and the layouts to try."""
    monkeypatch.setenv(ABORT_AT_ENV, "learner step")  # the child os.abort()s there, as libtpu does
    code = main(["compile", TINY, *ENGINE, "--topology", "v5e:2x2"])
    assert code == CompilerCrash.exit_code == 5
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("grpo-jax: error:")]
    # One error line; before it, only the progress lines, the last one the program being compiled.
    lines = captured.err.strip().splitlines()
    assert len(errors) == 1 and lines[-1] == errors[0], captured.err
    assert all(PROGRESS_LINE.fullmatch(line) for line in lines[:-1]), captured.err
    assert PROGRESS_LINE.fullmatch(lines[-2]).group(2, 3) == ("learner step", "compiling"), captured.err
    assert errors[0].startswith("grpo-jax: error: learner step: libtpu's compiler crashed while compiling it (SIGABRT)")
    assert "not a memory verdict" in errors[0] and "mesh.learner.fsdp" in errors[0]
    assert captured.out == ""


# A multi-turn config (an env section): its actor runs episodes on the continuation engine. 8 episodes of up to 3
# turns sharing 32 sampled tokens, in chunks of 8 steps; the actor on the learner's devices (mesh.actor_devices=0).
MULTITURN = str(REPO / "configs" / "tiny_multiturn_cpu.yaml")


@pytest.fixture(scope="module")
def multiturn():
    config = load_config(Config, MULTITURN, ["grpo.prompts_per_step=2", "grpo.group_size=4"])
    return config, compile_run(config, "v5e:2x2", isolate=False)


def test_an_env_config_compiles_the_continuation_engines_programs(multiturn):
    config, report = multiturn
    # context min(48, 16 + 32) = 48: extend buckets 16, 32, 64 (the widest), a cache of 128 columns per row.
    assert [p.name for p in report.programs] == ["learner step", "continuation decode", "continuation extend 64",
                                                 "continuation extend 16", "continuation compact"]
    weights = param_bytes(config)
    devices = report.program("learner step").devices
    for program in report.programs[1:]:
        assert program.actor and program.devices == devices
        assert program.memory is not None and not program.refusal and 0 < program.total < report.topology.hbm_bytes
        assert program.memory.aliased > 0  # the rows' state is donated
        assert "the learner's parameters and optimizer state" in program.held_what  # on the learner's devices
    decode, widest, smallest = (report.program(f"continuation {n}") for n in ("decode", "extend 64", "extend 16"))
    for program in (decode, widest, smallest):
        assert program.memory.arguments >= weights / devices
    assert widest.memory.total > smallest.memory.total and widest.cost.flops > smallest.cost.flops
    # The learner's devices also hold the actor's weights and the rows' state.
    assert "continuation engine's rows" in report.program("learner step").held_what
    # 8 episodes in one wave of 8 rows: 3 turns of ceil(29 / 3) = 10 decode steps, 2 chunks each; one extend per turn
    # (the opening prompt's bucket is the smallest, 16); the widest extend and the compaction not in the step.
    assert [p.calls_per_step for p in report.programs[1:]] == [6, 0, 3, 0]
    # A chunk is costed as chunk_steps=8 decode steps of all 8 rows: 2 FLOPs per weight per row per step at least.
    count = report.param_count
    assert 2 * count * 8 * 8 <= decode.cost.flops * decode.devices <= 4 * 2 * count * 8 * 8
    assert report.step.actor_seconds == pytest.approx(6 * decode.cost.seconds + 3 * smallest.cost.seconds)
    text = format_report(report)
    for words in ("continuation decode ", "continuation extend 64 ", "continuation compact ",
                  "the environment's steps (on the host, between turns) are not counted",
                  "the widest bucket (the whole context at once): the most memory; not in the step projection"):
        assert words in text, words
