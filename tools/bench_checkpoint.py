"""Checkpoint cost: how long a save blocks the learner, and how long a resume takes to its first step.

    python tools/bench_checkpoint.py [--steps 30] [--repeats 3] [key=value overrides ...]

1. Blocking. The default CPU config (plus overrides) trains `--steps` steps saving after every step
   (async Orbax), and again without saves. Prints the median time the learner is held per save (buffer
   + collector state, host copy of parameters and optimizer, Orbax bookkeeping), the median step time,
   their ratio (target < 5%), and the step time with and without saves (the background writing shares
   the CPU on a small machine).
2. Resume. Fresh processes, alternating: `grpo-jax train` on a new run directory, and on a directory
   holding a checkpoint (resume). Time from process launch to the first learner step's ledger line,
   median over `--repeats`; the ratio resume / fresh has a target < 1.5. Neither uses a persistent
   compilation cache, so both compile.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
QUIET = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.save_final_model=false"]


def blocking(steps: int, overrides: list[str], run_dir: pathlib.Path, every: int) -> tuple[list[float], list[float]]:
    from grpo_jax.config_io import load_config
    from grpo_jax.run.config import Config
    from grpo_jax.run.trainer import Trainer

    config = load_config(Config, CONFIG, [f"trainer.max_steps={steps}", f"checkpoint.every_steps={every}",
                                          "checkpoint.save_at_end=false", f"run_dir={run_dir}", *QUIET, *overrides])
    trainer = Trainer(config)
    history = trainer.train()
    step_times = [m["time/step_s"] - m["time/checkpoint_s"] for m in history[3:]]  # after compilation
    return trainer.checkpoints.blocked_seconds[2:], step_times


def first_step_seconds(run_dir: pathlib.Path, max_steps: int, overrides: list[str]) -> float:
    """Launch `grpo-jax train`; seconds until its first train line in the ledger (then stop it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    ledger = run_dir / "events.jsonl"
    runs_before = {json.loads(line)["run"] for line in ledger.read_text().splitlines()} if ledger.exists() else set()
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "grpo_jax.cli", "train", str(CONFIG), "--run-dir", str(run_dir),
                                f"trainer.max_steps={max_steps}", *QUIET, *overrides],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"trainer exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
            if ledger.exists():
                lines = [json.loads(line) for line in ledger.read_text().splitlines() if line.endswith("}")]
                if any(line["event"] == "train" and line["run"] not in runs_before for line in lines):
                    return time.perf_counter() - start
            time.sleep(0.01)
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        blocked, with_saves = blocking(args.steps, args.overrides, tmp / "saves", every=1)
        _, without_saves = blocking(args.steps, args.overrides, tmp / "nosaves", every=0)
        block, step = statistics.median(blocked), statistics.median(without_saves)
        print(f"save blocks the learner {block * 1e3:.1f} ms (median of {len(blocked)} saves; max "
              f"{max(blocked) * 1e3:.1f} ms); step time {step * 1e3:.1f} ms without saves, "
              f"{statistics.median(with_saves) * 1e3:.1f} ms while saving every step")
        print(f"blocked per save / step time: {block / step:.1%} (target < 5%)")

        # A run directory holding a checkpoint at step 2 to resume from.
        saved = tmp / "saved"
        subprocess.run([sys.executable, "-m", "grpo_jax.cli", "train", str(CONFIG), "--run-dir", str(saved),
                        "trainer.max_steps=2", *QUIET, *args.overrides], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        fresh, resumed = [], []
        for i in range(args.repeats):
            fresh.append(first_step_seconds(tmp / f"fresh{i}", 100, args.overrides))
            copy = tmp / f"resume{i}"
            subprocess.run(["cp", "-r", str(saved), str(copy)], check=True)
            resumed.append(first_step_seconds(copy, 100, args.overrides))
        f, r = statistics.median(fresh), statistics.median(resumed)
        print(f"launch to first learner step: fresh {f:.2f} s {[round(x, 2) for x in fresh]}, "
              f"resume {r:.2f} s {[round(x, 2) for x in resumed]}")
        print(f"resume / fresh: {r / f:.2f}x (target < 1.5x)")


if __name__ == "__main__":
    main()
