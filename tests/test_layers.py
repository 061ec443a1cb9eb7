"""The package's parts import only parts below them (or their own), and no modules import each other in a
cycle: the data flow stays readable from the folder names (ARCHITECTURE.md)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "grpo_jax"
# Lowest first. A module may import modules of its own part and of the parts before it, never after.
LAYERS = [
    # the base: error types, config machinery, shutdown helper, sandbox, untrusted JSON text, platform choice,
    # import paths of user code
    {"errors", "config_io", "cleanup", "sandbox", "json_text", "platform", "plugins"},
    {"parallel"},  # meshes, device cuts, agreements between processes
    {"state"},  # what survives a restart: ledger, replay buffer, checkpoints, run lock
    {"data"},  # sources, tokenizers, the collector that stamps ordinals
    {"model"},  # the transformer, its Hugging Face and LoRA forms
    {"algorithm"},  # sampling distribution, advantages, losses, rewards, the learner
    {"envs"},  # multi-turn environments, tools, renderers per model family, trajectories (no JAX)
    {"rollout"},  # sampler, engine, actor, weight sync
    {"run"},  # the whole Config, the run description, trainer, evaluation, metrics
    {"planning"},  # grpo-jax compile
    {"api", "cli", "__init__"},  # the public surface
]


def part_of(module: str) -> str:
    """grpo_jax.state.ledger -> state; grpo_jax.errors -> errors; grpo_jax -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    part = part_of(module)
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{module}: part {part!r} is in no layer of tests/test_layers.py: add it where it belongs")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(relative.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: pathlib.Path, name: str, top_level_only: bool) -> set[str]:
    """grpo_jax modules `path` imports (every import, or only those run when the module loads)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    known = modules()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("grpo_jax"):
            for alias in node.names:  # `from grpo_jax.state import ledger` imports a module
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("grpo_jax")}
    return {m for m in found if m != name and m in known}


def test_every_part_imports_only_parts_below_it():
    wrong = []
    for name, path in sorted(modules().items()):
        for target in sorted(imports(path, name, top_level_only=False)):
            if part_of(target) != part_of(name) and layer_of(target) > layer_of(name) and target != "grpo_jax":
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports from a lower part to a higher one: " + "; ".join(wrong)


def test_no_import_cycle():
    graph = {name: imports(path, name, top_level_only=True) for name, path in modules().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_only_the_orchestration_layer_and_the_commands_see_the_whole_config():
    users = sorted(name for name, path in modules().items()
                   if "grpo_jax.run.config" in imports(path, name, top_level_only=False)
                   and part_of(name) not in {"run", "planning", "api", "cli", "__init__"})
    assert not users, f"modules below the orchestration layer that take the whole Config: {users}"


def test_the_environments_read_answers_without_loading_the_reward_suite():
    """envs/ is host-side: it takes the answer parsing (algorithm.rewards.answers) and the registry, never the
    suite's thread pools and worker processes (loaded on first use of RewardSuite)."""
    import subprocess
    import sys

    probe = ("import sys, grpo_jax.envs.gsm8k, grpo_jax.envs.environment; "
             "print('grpo_jax.algorithm.rewards.suite' in sys.modules, 'multiprocessing.connection' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.split()
    assert out == ["False", "False"], out
