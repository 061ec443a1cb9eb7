"""Per-step metrics: RUN_DIR/metrics.jsonl, TensorBoard event files under RUN_DIR/tb/, and a progress bar.

metrics.jsonl is the source of truth (one JSON object per learner step, flushed as written); TensorBoard
and the progress bar are views of the same numbers.
"""

from __future__ import annotations

import json
import math
import pathlib

from tqdm import tqdm

REQUIRED_KEYS = ("step", "reward/mean", "loss", "kl", "staleness/mean", "staleness/max", "time/step_s",
                 "tokens_per_s")


def _plain(value):
    """JSON has no NaN/inf: write them as null so every line stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    def __init__(self, run_dir: str | pathlib.Path, total_steps: int, start_step: int = 0,
                 progress: bool = True, tensorboard: bool = True):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # tensorboardX writes standard event files without TensorFlow.
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, disable=not progress)

    def write(self, metrics: dict) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in metrics]
        if missing:
            raise KeyError(f"metrics for step {metrics.get('step')} lack {missing}")
        step = int(metrics["step"])
        self._file.write(json.dumps({k: _plain(v) for k, v in metrics.items()}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        self._bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step_s']:.2f}",
                              stale=f"{metrics['staleness/mean']:.1f}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a grpo_jax run directory?")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
    return rows
