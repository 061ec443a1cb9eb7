"""Learning curves of one config over several seeds: does the run learn from every seed, and how fast?

Trains CONFIG once per seed (`grpo-jax train CONFIG seed=S run_dir=OUT/seed_S`, one run at a time so that each
has the machine to itself and its wall-clock time is the one a user sees), then reads each run's metrics.jsonl
and prints, per seed: the mean reward over each `--every` steps, the first step (and elapsed seconds, from the
run's own `time/elapsed_s`) at which the mean of the last `--window` steps reached `--target`, and the mean of
the run's last `--window` steps. The last line says how many seeds reached the target within `--minutes`.

    python tools/seed_curves.py configs/tiny_multiturn_cpu.yaml [--seeds 0 1 2 3 4] [--out runs/seed_curves]
        [--target 0.8] [--window 10] [--minutes 10] [--every 50] [--stop-when-reached] [--read-only] [OVERRIDE ...]

OVERRIDEs (`key=value`) go to every run. `--stop-when-reached` stops each run (SIGTERM: it checkpoints and exits)
once it reached the target, to measure more seeds in less time. `--read-only` prints the curves of runs already
in OUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeedCurve:
    """What one seed's run logged: rewards and elapsed seconds per step, in step order."""

    seed: int
    rewards: list[float]
    elapsed_s: list[float]

    def window_means(self, window: int) -> list[float]:
        """The mean of the last `window` steps (fewer at the start) after each step."""
        return [sum(self.rewards[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
                for i in range(len(self.rewards))]

    def first_reaching(self, target: float, window: int) -> int | None:
        """The index of the first step whose last `window` steps (a full window) average `target` or more."""
        means = self.window_means(window)
        return next((i for i in range(window - 1, len(means)) if means[i] >= target), None)


def read_curve(run_dir: Path, seed: int) -> SeedCurve:
    rewards, elapsed = [], []
    metrics = run_dir / "metrics.jsonl"
    for number, line in enumerate(metrics.read_text().splitlines() if metrics.exists() else [], start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{run_dir / 'metrics.jsonl'}: line {number}: not JSON ({e})") from e
        if "reward/mean" in record:
            rewards.append(float(record["reward/mean"]))
            elapsed.append(float(record.get("time/elapsed_s", float("nan"))))
    return SeedCurve(seed=seed, rewards=rewards, elapsed_s=elapsed)


def train(config: str, seed: int, run_dir: Path, overrides: list[str], stop_when=None) -> float:
    """Runs `grpo-jax train` for one seed; returns its wall-clock seconds from launch (start-up included) to its
    end. `stop_when(curve)`, checked every 2 s, stops the run (SIGTERM) once true."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "grpo_jax.cli", "train", config, f"seed={seed}", f"run_dir={run_dir}", *overrides]
    with open(run_dir.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        stopped = False
        while process.poll() is None:
            time.sleep(2.0)
            if stop_when is not None and not stopped and stop_when(read_curve(run_dir, seed)):
                process.send_signal(signal.SIGTERM)
                stopped = True
    wall_s = time.perf_counter() - start
    if process.returncode not in ((0, 75) if stopped else (0,)):  # 75: stopped by the signal, checkpointed
        raise SystemExit(f"seed {seed}: grpo-jax train exited {process.returncode}; its output: "
                         f"{run_dir.with_suffix('.log')}")
    return wall_s


def report(curve: SeedCurve, args, wall_s: float | None) -> bool:
    every = [sum(curve.rewards[i:i + args.every]) / len(curve.rewards[i:i + args.every])
             for i in range(0, len(curve.rewards), args.every)]
    reached = curve.first_reaching(args.target, args.window)
    last = curve.window_means(args.window)[-1] if curve.rewards else float("nan")
    in_time = reached is not None and curve.elapsed_s[reached] <= args.minutes * 60
    when = (f"step {reached + 1} ({curve.elapsed_s[reached]:.0f} s)" if reached is not None else "never")
    wall = f", {wall_s:.0f} s from launch to end" if wall_s is not None else ""
    print(f"seed {curve.seed}: {len(curve.rewards)} steps{wall}; mean reward per {args.every} steps "
          f"{' '.join(f'{x:.2f}' for x in every)}; last-{args.window} mean {args.target} first at {when}; "
          f"last {args.window} steps {last:.2f} -> {'PASS' if in_time else 'FAIL'}")
    return in_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value, for every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path("runs/seed_curves"))
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--stop-when-reached", action="store_true", help="stop each run once it reached the target")
    parser.add_argument("--read-only", action="store_true", help="print the curves of the runs already in --out")
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    passed = 0
    for seed in args.seeds:
        run_dir = args.out / f"seed_{seed}"
        wall_s = None
        if not args.read_only:
            if run_dir.exists():
                raise SystemExit(f"{run_dir}: exists; remove it, or pass --read-only to read it")
            stop_when = ((lambda curve: curve.first_reaching(args.target, args.window) is not None)
                         if args.stop_when_reached else None)
            wall_s = train(args.config, seed, run_dir, args.overrides, stop_when)
        passed += report(read_curve(run_dir, seed), args, wall_s)
    print(f"{passed} of {len(args.seeds)} seeds reached a last-{args.window}-step mean reward of {args.target} "
          f"within {args.minutes:g} minutes")


if __name__ == "__main__":
    main()
