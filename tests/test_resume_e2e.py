"""End to end: `grpo-jax train` (async, on CPU) is stopped by SIGTERM, then killed with SIGKILL at random
moments (once while a checkpoint is being written, once during start-up), resumed each time, and run to
its end. `grpo-jax audit` must report nothing lost and nothing trained twice, and the ledger must agree
with the final checkpoint's own accounting. Twice: single-turn prompts (tiny_cpu.yaml), and multi-turn episodes
of an environment (tiny_multiturn_cpu.yaml), where every kill lands mid-episode: the episodes in flight are
generated again from their start on the resume, never trained in part."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from test_trainer import FAST, REPO

MAX_STEPS = 24
OVERRIDES = [f"trainer.max_steps={MAX_STEPS}", "grpo.max_staleness=2", "checkpoint.every_steps=2",
             "checkpoint.keep_last=2", "trainer.tensorboard=false", "optim.decay_steps=24"]
MULTITURN = [o for o in FAST if not o.startswith("sampler.")] + OVERRIDES
CONFIGS = {  # name -> (config file, overrides)
    "tiny_cpu": ("tiny_cpu.yaml", FAST + OVERRIDES),
    "tiny_multiturn_cpu": ("tiny_multiturn_cpu.yaml", MULTITURN),
    # The same episodes played by an agent through the agent endpoint (tests/example_agents.py).
    "agent": ("tiny_multiturn_cpu.yaml", MULTITURN + ["env.name=", "env.agent=example_agents:fetch_code_agent"]),
}
CONFIG = "tiny_cpu"  # the one start() runs; each test sets it


def start(run_dir: pathlib.Path) -> subprocess.Popen:
    config_file, overrides = CONFIGS[CONFIG]
    command = [sys.executable, "-m", "grpo_jax.cli", "train", str(REPO / "configs" / config_file),
               "--run-dir", str(run_dir)] + overrides
    log = open(run_dir.parent / "train.log", "ab")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"),
                                                                            os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=environment)


def ledger_lines(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def runs_started(run_dir: pathlib.Path) -> int:
    """How many starts wrote their run_start (runs are numbered 0, 1, 2, ...): the next start's run number."""
    return len({line["run"] for line in ledger_lines(run_dir)})


def trained_by_run(run_dir: pathlib.Path, run: int) -> int | None:
    """The train lines of start `run`; None until it has written its run_start (another start's lines must not
    be taken for it: a start still loading is killed for nothing otherwise)."""
    lines = [line for line in ledger_lines(run_dir) if line["run"] == run]
    return sum(line["event"] == "train" for line in lines) if lines else None


def started_and_trained(run_dir: pathlib.Path, run: int, steps: int):
    return lambda: (trained_by_run(run_dir, run) or 0) >= steps if steps else trained_by_run(run_dir, run) is not None


def wait_for(predicate, process: subprocess.Popen, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            pytest.fail(f"the trainer exited with {process.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll)


def save_in_progress(run_dir: pathlib.Path) -> bool:
    directory = run_dir / "checkpoints"
    return directory.exists() and any("orbax-checkpoint-tmp" in p.name for p in directory.iterdir())


def surviving_chain(lines: list[dict]) -> list[dict]:
    """An independent reader of the ledger contract (../shared/reference/ledger.md)."""
    by_run: dict[int, list[dict]] = {}
    for line in lines:
        by_run.setdefault(line["run"], []).append(line)
    chain, run, upto = [], max(by_run), None
    while True:
        chain = [line for line in by_run[run] if upto is None or line["seq"] <= upto] + chain
        resumed = by_run[run][0]["resumed_from"]
        if resumed is None:
            return chain
        run, upto = resumed["run"], resumed["seq"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sigterm_and_sigkills_at_random_moments_lose_nothing_and_train_nothing_twice(tmp_path, config, monkeypatch):
    monkeypatch.setitem(globals(), "CONFIG", config)
    rng = random.Random(int(os.environ.get("GRPO_JAX_E2E_SEED", "0")))
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    # 1. SIGTERM after a few steps: the trainer saves and exits with the documented code.
    process = start(run_dir)
    wait_for(started_and_trained(run_dir, 0, 3), process, 300, "3 steps")
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 75, (tmp_path / "train.log").read_text()[-3000:]

    # 2. SIGKILL while a checkpoint is being written (Orbax's temporary step directory exists).
    process = start(run_dir)
    wait_for(started_and_trained(run_dir, 1, 1), process, 300, "a step after resuming")
    wait_for(lambda: save_in_progress(run_dir), process, 300, "a checkpoint save", poll=0.0005)
    process.kill()
    process.wait()

    # 3 and 4. SIGKILL at random moments: within a step after this start's first 1-3 (counted in steps, not
    # seconds: a fast machine trains the whole rest of the run in a few seconds), and during start-up.
    for first_steps, extra in ((rng.randint(1, 3), rng.uniform(0.0, 0.25)), (None, rng.uniform(1.0, 6.0))):
        run = runs_started(run_dir)
        process = start(run_dir)
        if first_steps is not None:
            wait_for(started_and_trained(run_dir, run, first_steps), process, 300, "a step of this start")
        time.sleep(extra)
        if first_steps is not None:
            assert process.poll() is None, "the run ended before the kill: the kill must come mid-run"
        if process.poll() is None:
            process.kill()
        process.wait()

    # 5. Resume and run to the end.
    process = start(run_dir)
    assert process.wait(600) == 0, (tmp_path / "train.log").read_text()[-3000:]

    audit = subprocess.run(
        [sys.executable, "-m", "grpo_jax.cli", "audit", str(run_dir)], capture_output=True, text=True
    )
    print(audit.stdout)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "lost:                 0" in audit.stdout and "trained twice:        0" in audit.stdout
    lines = ledger_lines(run_dir)
    # Every start that got past start-up wrote its run_start: starts 1, 2, 3 and 5 waited for a step; start 4,
    # killed during start-up, may have died before opening the ledger (start-up takes longer on a busy machine).
    assert len({line["run"] for line in lines}) >= 4

    # Training reached its end.
    chain = surviving_chain(lines)
    steps = [line["step"] for line in chain if line["event"] == "train"]
    assert steps == list(range(1, MAX_STEPS + 1))
    assert (run_dir / "final_model" / "config.json").is_file()

    # The ledger agrees with the final checkpoint: the ordinals it accounts for are exactly the ones trained
    # or dropped in the surviving chain up to the ledger line the checkpoint covers.
    final = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert final == MAX_STEPS
    saved = json.loads((run_dir / "checkpoints" / str(final) / "collector" / "metadata").read_text())["collector"]
    accounted = set(range(saved["accounted_from"]))
    for a, b in saved["accounted_ranges"]:
        accounted |= set(range(a, b))
    covers = saved["ledger_covers"]
    upto_covers, seen_cover = [], False
    for line in chain:
        if not seen_cover:
            upto_covers.append(line)
        seen_cover = seen_cover or (line["run"], line["seq"]) == (covers["run"], covers["seq"])
    in_ledger = {o for line in upto_covers if line["event"] == "train" for o in line["ordinals"]}
    in_ledger |= {line["ordinal"] for line in upto_covers if line["event"] == "drop"}
    assert in_ledger == accounted
    assert saved["trained_count"] == len(
        {o for line in upto_covers if line["event"] == "train" for o in line["ordinals"]}
    )
    assert not list((run_dir / "checkpoints").glob("*orbax-checkpoint-tmp*"))  # the killed save never became a step
