"""`grpo-jax compile --fit`: the layout search (planning.fit). The enumeration, its pruning and the search order
are checked on several configs and slices without compiling; one end-to-end --fit run on the tiny model for a
v5e:2x2 slice (2 layouts compiled, each in its compiling child, as the command does) checks the ranking and that
a layout's overrides, passed back to the config loader, compile to the projection the table shows; a config
that fits nowhere exits 2 with one line."""

import contextlib
import dataclasses
import io
import math
import pathlib
import re

import pytest
import yaml

from grpo_jax.cli import main
from grpo_jax.config_io import load_config, merge_overrides, read_config_file
from grpo_jax.planning.compile import compile_run
from grpo_jax.planning.fit import (
    SEARCHED,
    Layout,
    SliceShape,
    enumerate_layouts,
    estimate,
    fit,
    own_layout,
    parameter_count,
    pinned_keys,
    search_order,
)
from grpo_jax.planning.topology import CHIPS, GIB, tpu_topology
from grpo_jax.planning.units import time_text
from grpo_jax.run.config import Config
from grpo_jax.run.plan import RunPlan, run_model_config

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")
GSM8K = str(REPO / "configs" / "gsm8k_qwen2_5.yaml")
GSM8K_8K = str(REPO / "configs" / "gsm8k_qwen2_5_8k.yaml")
SHAPES = REPO / "configs" / "shapes"
# As tests/test_compile.py's SMALL: 8 prompts x 4 samples, two mini-batches, two epochs, the static sampler.
SMALL = ["grpo.prompts_per_step=8", "grpo.group_size=4", "optim.mini_batches=2", "optim.epochs=2",
         "optim.micro_batch_size=8", "mesh.actor_devices=2", "mesh.actor.tensor=2", "mesh.actor.fsdp=1",
         "mesh.learner.fsdp=2", "sampler.decode_streams=1", "sampler.engine=static"]
V5E = CHIPS["TPU v5 lite"]

# (config file, overrides, hosts, devices per host): a tiny model on one and two hosts, with the engine too;
# Qwen2.5-1.5B as shipped on a v5e-8 host; Llama-3.1-70B on 16 v5p hosts of 4 chips.
CASES = {
    "tiny, 1 host x 4": (TINY, SMALL, 1, 4),
    "tiny engine, 2 hosts x 4": (TINY, [*SMALL[:-1], "sampler.engine=continuous"], 2, 4),
    "gsm8k 1.5B, 1 host x 8": (GSM8K, [f"model_path={SHAPES / 'Qwen2.5-1.5B-Instruct'}"], 1, 8),
    "gsm8k 8k 1.5B paged, 1 host x 8": (GSM8K_8K, [f"model_path={SHAPES / 'Qwen2.5-1.5B-Instruct'}"], 1, 8),
    "gsm8k 70B, 16 hosts x 4": (GSM8K, [f"model_path={SHAPES / 'Llama-3.1-70B-Instruct'}", "sampler.engine=static"],
                                16, 4),
}


def space(case: str, *more: str, pinned: frozenset = frozenset()):
    path, overrides, hosts, per_host = CASES[case]
    config = load_config(Config, path, [*overrides, *more])
    model = run_model_config(config)
    return config, model, enumerate_layouts(config, model, hosts, per_host, pinned)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layout_uses_exactly_the_slices_devices_and_splits_evenly(case):
    config, model, layouts = space(case)
    _, _, hosts, per_host = CASES[case]
    assert layouts and len(set(layouts)) == len(layouts)
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    mini_rows = rows // config.optim.mini_batches
    for layout in layouts:
        assert 0 <= layout.actor_devices < per_host  # every host keeps a learner device
        assert math.prod(layout.actor) == (layout.actor_devices or per_host)
        assert math.prod(layout.learner) == (per_host - layout.actor_devices) * hosts
        data, fsdp, tensor = layout.learner
        for t in (layout.actor[2], tensor):  # splits the heads and the MLP
            assert model.num_heads % t == 0 and model.intermediate_size % t == 0
        assert layout.actor[0] == 1 and (per_host - layout.actor_devices) % tensor == 0
        assert (data * fsdp) % hosts == 0 and (rows // hosts) % (data * fsdp // hosts) == 0
        assert mini_rows % layout.micro_batch_size == 0 and layout.micro_batch_size % (data * fsdp) == 0
        if config.sampler.engine == "continuous":
            assert layout.slots > 0
            assert (rows // hosts) % layout.slots == 0 or layout.slots == config.sampler.slots
        else:
            assert layout.slots == 0 and not any(w.startswith("sampler.slots") for w in layout.overrides())
    # Both sides of each choice are searched.
    assert {x.remat for x in layouts} == {False, True}
    assert 0 in {x.actor_devices for x in layouts} and len({x.actor_devices for x in layouts}) > 1


@pytest.mark.parametrize("case", ["tiny, 1 host x 4", "gsm8k 1.5B, 1 host x 8"])
def test_every_layout_is_accepted_by_the_config_loader(case):
    path, overrides, _, _ = CASES[case]
    _, _, layouts = space(case)
    for layout in layouts[::7]:  # a spread of them: the loader reads the YAML file each time
        config = load_config(Config, path, [*overrides, *layout.overrides()])
        assert config.mesh.actor_devices == layout.actor_devices and config.model.remat == layout.remat
        assert (config.mesh.learner.data, config.mesh.learner.fsdp, config.mesh.learner.tensor) == layout.learner
        assert config.optim.micro_batch_size == layout.micro_batch_size


@pytest.mark.parametrize("topology, case", [("v5e:2x2", "tiny, 1 host x 4"), ("v5p:2x2x2", "tiny engine, 2 hosts x 4")])
def test_every_layout_is_accepted_by_the_run_description(topology, case):
    # The pruning needs no devices; the run description (RunPlan.build, which refuses what a trainer cannot lay
    # out) on the described slice accepts all it keeps. No compiling.
    path, overrides, hosts, per_host = CASES[case]
    devices = tpu_topology(topology).devices
    assert len(devices) == hosts * per_host
    for layout in space(case)[2]:
        RunPlan.build(load_config(Config, path, [*overrides, *layout.overrides()]), devices, process_word="host")


def test_the_shipped_layout_is_in_the_search_space():
    config, _, layouts = space("gsm8k 1.5B, 1 host x 8")
    shipped = Layout(4, (1, 1, 4), (1, 4, 1), 64, 512, True)
    assert shipped in layouts
    # The micro-batches searched: the mini-batch of 128 halved down to one row per learner batch split.
    assert {x.micro_batch_size for x in layouts if x.learner == (1, 4, 1)} == {128, 64, 32, 16, 8, 4}
    assert {x.slots for x in layouts} == {512, 256, 128}


def test_the_configs_own_layout_is_compiled_first(monkeypatch):
    """--fit compiles the config's own layout before the estimate's picks, so that its ranking says whether any
    layout searched beats the one shipped. (Compiling is stubbed: only the order is checked here.)"""
    def refuse(*args, **kwargs):
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr("grpo_jax.planning.fit.compile_run", refuse)
    lines = []
    search = fit(GSM8K, [f"model_path={SHAPES / 'Qwen2.5-1.5B-Instruct'}"], "v5e:2x4", limit=2, isolate=False,
                 progress=lines.append)
    shipped = Layout(4, (1, 1, 4), (1, 4, 1), 64, 512, True)
    config = load_config(Config, GSM8K, [f"model_path={SHAPES / 'Qwen2.5-1.5B-Instruct'}"])
    assert own_layout(RunPlan.build(config, tpu_topology("v5e:2x4").devices, process_word="host")) == shipped
    assert [a.layout for a in search.attempts][0] == shipped and search.attempts[1].layout != shipped
    assert "the config's own first" in lines[0]


def test_the_paged_engines_page_budget_is_searched_and_held_when_given():
    config, model, layouts = space("gsm8k 8k 1.5B paged, 1 host x 8")
    sampler = config.sampler
    # 512 slots in one bank: their rings would hold 512 x 544 pages of 16 positions; halved twice, and the
    # config's own budget.
    assert {x.kv_pages for x in layouts if x.slots == 512} == {278528, 139264, 69632, sampler.kv_pages}
    assert all(x.kv_pages >= sampler.pages_per_sequence for x in layouts)
    plan = RunPlan.build(config, tpu_topology("v5e:2x4").devices, process_word="host")
    own = own_layout(plan)
    assert own.kv_pages == sampler.kv_pages and own in layouts
    assert f"sampler.kv_pages={sampler.kv_pages}" in own.overrides()
    _, _, held = space("gsm8k 8k 1.5B paged, 1 host x 8", "sampler.kv_pages=0",
                       pinned=pinned_keys(["sampler.kv_pages=0"]))
    assert {(x.slots, x.kv_pages) for x in held} == {(512, 278528), (256, 139264), (128, 69632)}
    # Rings have no page budget to search.
    _, _, rings = space("gsm8k 1.5B, 1 host x 8")
    assert {x.kv_pages for x in rings} == {0}

    shape = SliceShape(1, 8, V5E.hbm_bytes, V5E.peak_flops, V5E.hbm_bandwidth)
    count = parameter_count(model)
    by_pages = {pages: estimate(config, model, count, dataclasses.replace(own, kv_pages=pages), shape)
                for pages in (278528, 69632, sampler.kv_pages)}
    # Fewer pages: less memory, fewer sequences at once at the longest, a slower (worst-case) step.
    assert by_pages[278528].actor_bytes > by_pages[69632].actor_bytes > by_pages[sampler.kv_pages].actor_bytes
    assert by_pages[278528].seconds < by_pages[69632].seconds < by_pages[sampler.kv_pages].seconds
    assert not by_pages[278528].fits  # 8704-position rings of 512 slots: 120 GiB a chip
    # The rings of the same 512 slots hold what the largest pool does.
    ring = estimate(config, model, count, dataclasses.replace(own, kv_pages=0), shape)
    assert ring.actor_bytes == pytest.approx(by_pages[278528].actor_bytes, rel=0.01)


def test_settings_given_on_the_command_line_are_held():
    overrides = ["mesh.actor_devices=2", "mesh.learner={data: 1, fsdp: 2, tensor: 1}", "model.remat=true"]
    pinned = pinned_keys([*overrides, "optim.lr=1e-3"])
    assert pinned == {"mesh.actor_devices", "mesh.learner.data", "mesh.learner.fsdp", "mesh.learner.tensor",
                      "model.remat"}
    assert pinned <= set(SEARCHED)
    _, _, layouts = space("tiny, 1 host x 4", *overrides, pinned=pinned)
    assert layouts
    assert all(x.actor_devices == 2 and x.learner == (1, 2, 1) and x.remat for x in layouts)
    assert {x.micro_batch_size for x in layouts} == {16, 8, 4, 2}  # not held: searched
    # A held value no layout of the space can take leaves nothing to search.
    _, _, none = space("tiny, 1 host x 4", "mesh.actor.tensor=3", pinned=pinned_keys(["mesh.actor.tensor=3"]))
    assert none == []


def test_search_order_puts_the_layouts_estimated_to_fit_first_fastest_first():
    config, model, layouts = space("gsm8k 1.5B, 1 host x 8")
    shape = SliceShape(1, 8, V5E.hbm_bytes, V5E.peak_flops, V5E.hbm_bandwidth)
    count = parameter_count(model)
    order = search_order(layouts, [estimate(config, model, count, x, shape) for x in layouts])
    assert sorted(map(id, (x for x, _ in order))) == sorted(map(id, layouts))
    fitting = [(x, e) for x, e in order if e.fits]
    rest = [(x, e) for x, e in order if not e.fits]
    assert fitting and rest
    assert [e.fits for _, e in order] == [True] * len(fitting) + [False] * len(rest)
    assert all(e.peak_bytes <= shape.hbm_bytes for _, e in fitting)
    for group, figure in ((fitting, lambda e: e.seconds), (rest, lambda e: e.peak_bytes)):
        meshes = {(x.actor_devices, x.actor, x.learner): [] for x, _ in group}
        for x, e in group:
            meshes[(x.actor_devices, x.actor, x.learner)].append(figure(e))
        # Each device layout's own layouts in the estimate's order; the meshes take turns, the best first.
        assert all(values == sorted(values) for values in meshes.values())
        firsts = [values[0] for values in meshes.values()]
        assert firsts == sorted(firsts)
        assert len({(x.actor_devices, x.actor, x.learner) for x, _ in group[:len(meshes)]}) == len(meshes) > 1


def test_the_estimate_moves_the_way_the_settings_do():
    config, model, _ = space("gsm8k 1.5B, 1 host x 8")
    shape = SliceShape(1, 8, V5E.hbm_bytes, V5E.peak_flops, V5E.hbm_bandwidth)
    count = parameter_count(model)

    def guess(**changes):
        return estimate(config, model, count, Layout(**{**vars(Layout(4, (1, 1, 4), (1, 4, 1), 64, 512, True)),
                                                        **changes}), shape)

    shipped = guess()
    # The compile report fits the shipped layout's engine (docs/compile.md: a 9.05 GiB engine chunk, the 2 KV
    # heads each held twice so that tensor 4 splits them: one a chip); the estimate says so too.
    assert 8 * GIB < shipped.actor_bytes < V5E.hbm_bytes and shipped.fits
    assert guess(micro_batch_size=8).learner_bytes < shipped.learner_bytes
    assert guess(remat=False).learner_bytes > shipped.learner_bytes
    assert guess(remat=False).seconds < shipped.seconds  # no recomputation
    assert guess(learner=(4, 1, 1)).learner_bytes > shipped.learner_bytes  # data replicates the weights
    assert guess(slots=128).actor_bytes < shipped.actor_bytes
    # The 2 KV heads: one a chip on tensor 2, and on tensor 4 too (each held twice); without that layout the
    # KV ring would be whole on every chip of tensor 4.
    assert guess(actor=(1, 2, 2)).actor_bytes == pytest.approx(shipped.actor_bytes)
    # The layout the compile report found to fit (micro-batches of 8, KV heads split) is estimated to fit.
    assert guess(micro_batch_size=8, actor=(1, 2, 2)).fits
    # Shared devices hold both sides.
    shared = guess(actor_devices=0, actor=(1, 8, 1), learner=(1, 8, 1))
    assert shared.learner_bytes == shared.actor_bytes
    assert 40 * GIB > shared.peak_bytes


# -- end to end: grpo-jax compile --fit ----------------------------------------------------------------------

FIT_LIMIT = 2
# SMALL's shapes without its layout: a config file of its own, so that the layout is searched, not held.
SMALL_SHAPES = [o for o in SMALL if not o.startswith(("mesh.", "optim.micro_batch_size"))]


@pytest.fixture(scope="module")
def small_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fit") / "small.yaml"
    path.write_text(yaml.safe_dump(merge_overrides(read_config_file(TINY), SMALL_SHAPES)))
    return str(path)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def fit_run(small_config):
    # mesh.actor_devices given on the command line: held at 2, the rest searched.
    return run_cli(["compile", small_config, "mesh.actor_devices=2", "--topology", "v5e:2x2", "--fit",
                    "--fit-limit", str(FIT_LIMIT)])


def table_rows(out: str) -> list[tuple[str, str]]:
    """(projected step text, overrides line) of each ranked row of the --fit table."""
    lines = out.splitlines()
    rows = []
    for line, below in zip(lines, lines[1:]):
        found = re.match(r"\d+\s+([\d.]+ m?s)\s", line)
        if found and below.startswith("     mesh.actor_devices="):
            rows.append((found.group(1), below.strip()))
    return rows


def test_fit_compiles_at_most_the_limit_and_ranks_the_layouts_that_fit(fit_run):
    code, out, err = fit_run
    assert code == 0, err
    assert "Traceback" not in out + err
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line[:5] for line in progress] == [f"[{i}/{FIT_LIMIT}]" for i in range(1, FIT_LIMIT + 1)]
    assert all(re.search(r"\(\d+ s\)$", line) and " actor 2/host " in f" {line} " for line in progress)
    fitting = sum("fits, projected step" in line for line in progress)
    header = next(line for line in out.splitlines() if " layouts compiled fit on v5e:2x2" in line)
    assert fitting >= 1 and header.startswith(f"{fitting} of {FIT_LIMIT} ")
    rows = table_rows(out)
    assert len(rows) == fitting
    seconds = [float(text.split()[0]) * (1e-3 if text.endswith(" ms") else 1) for text, _ in rows]
    assert seconds == sorted(seconds)
    assert all("mesh.actor_devices=2 " in overrides for _, overrides in rows)


def test_the_best_layouts_overrides_compile_to_the_projection_shown(fit_run, small_config):
    _, out, _ = fit_run
    step_text, overrides = table_rows(out)[0]
    # Re-parsed by the config loader after the user's own overrides, as `grpo-jax train` / `compile` take them.
    config = load_config(Config, small_config, ["mesh.actor_devices=2", *overrides.split()])
    report = compile_run(config, "v5e:2x2", isolate=False)
    assert report.step is not None and time_text(report.step.seconds) == step_text


def test_a_config_that_fits_nowhere_exits_2_with_one_line():
    # A 10B-parameter layer (tests/test_compile.py's oversized config): 60 GiB of weights and moments per
    # learner device of a 16 GiB v5e chip, whatever the layout of 4 devices.
    code, out, err = run_cli(["compile", TINY, *SMALL, "model.num_layers=1", "model.hidden_size=16384",
                              "model.num_heads=128", "model.num_kv_heads=8", "model.intermediate_size=196608",
                              "--topology", "v5e:2x2", "--fit", "--fit-limit", "1"])
    assert code == 2
    # The compile's progress lines (one per program as it starts and ends), then the error in one line.
    lines = err.strip().splitlines()
    assert all(line.startswith("grpo-jax compile: ") for line in lines[:-1]), err
    assert "Traceback" not in err
    assert lines[-1].startswith("grpo-jax: error: none of the 1 layouts compiled (of "), err
    assert "does not fit" in out and out.count("[1/1]") == 1


@pytest.mark.parametrize("argv, words", [
    (["--fit-limit", "3"], "--fit-limit 3: only with --fit"),
    (["--fit", "--fit-limit", "0"], "--fit-limit 0: must be at least 1"),
])
def test_fit_flags_are_checked_in_one_line(argv, words):
    code, out, err = run_cli(["compile", TINY, *SMALL, "--topology", "v5e:2x2", *argv])
    assert code == 2 and out == ""
    assert err.strip() == f"grpo-jax: error: {words}" or err.strip().startswith(f"grpo-jax: error: {words}")
