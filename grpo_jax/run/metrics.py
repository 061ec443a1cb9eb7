"""Per-step metrics: RUN_DIR/metrics.jsonl, TensorBoard event files under RUN_DIR/tb/, a progress bar and,
when trainer.wandb asks for it, Weights & Biases (grpo_jax.run.wandb_logger).

metrics.jsonl is the source of truth (each line one write, grpo_jax.state.line_file: a full disk stops the run
with one line naming the file, never leaves a torn line); TensorBoard, W&B and the progress bar are views of
the same numbers. It holds one JSON object per learner step (no "kind" key) and, with evaluations
(grpo_jax.run.evaluation), one more line per finished evaluation, marked "kind": "eval", whose "step" is the last
learner step written before it (so "step" never goes back over the file) and whose "eval/weight_version" is
the weight version it measured: evaluations finish out of step order (one of version k finishes while the
learner is past k, the last one after the last step). Each evaluation is also a line of RUN_DIR/eval.jsonl,
with "step" = the weight version. read_metrics(run_dir) returns the learner-step lines only; kind="eval" the
evaluation lines.
"""

from __future__ import annotations

import json
import math
import pathlib

from tqdm import tqdm

from grpo_jax.algorithm.lengths import HISTORY_STEPS, QUANTILES, LengthHistory
from grpo_jax.cleanup import run_all
from grpo_jax.errors import RunDirError
from grpo_jax.run.wandb_logger import WandbConfig, WandbLogger
from grpo_jax.state.line_file import LineFile

EVAL_KIND = "eval"  # the "kind" of an evaluation line of metrics.jsonl; learner-step lines have no "kind"
KINDS = ("step", "eval", "all")
# What a user does about a run directory that stopped taking writes (metrics are written after the step's ledger
# line, so a step whose metrics line failed is trained and recorded; the resume starts at the last checkpoint).
_FIX = ("the run stops here; free space (or fix the mount) and run the same command to resume from the last "
        "committed checkpoint")
REQUIRED_KEYS = ("step", "reward/mean", "loss", "kl", "staleness/mean", "staleness/max", "time/step_s",
                 "tokens_per_s")


def _plain(value):
    """JSON has no NaN/inf: write them as null so every line stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_line(row: dict) -> str:
    """`row` as one line of standard JSON (NaN and infinities anywhere in it as null), newline included."""
    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return _plain(value)

    return json.dumps(plain(row)) + "\n"


def _scalars(metrics: dict) -> dict:
    """The finite numbers of a metrics row, without `step`: what TensorBoard and W&B plot."""
    return {k: v for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


def reward_failure_rates(metrics: dict) -> dict[str, float]:
    """{label: rate} of the reward functions that failed samples, from a row's `reward/<label>/failure_rate` keys
    (grpo_jax.algorithm.rewards.RewardSuite.metrics); rates of 0 or NaN (nothing scored) left out."""
    prefix, suffix = "reward/", "/failure_rate"
    return {key[len(prefix):-len(suffix)]: value for key, value in metrics.items()
            if key.startswith(prefix) and key.endswith(suffix) and len(key) > len(prefix) + len(suffix)
            and isinstance(value, (int, float)) and value > 0}


class MetricsWriter:
    """`wandb` (enabled) also sends each row to Weights & Biases, with `run_config` (the resolved config)
    at the start and the ledger audit's numbers at close()."""

    def __init__(self, run_dir: str | pathlib.Path, total_steps: int, start_step: int = 0,
                 progress: bool = True, tensorboard: bool = True, wandb: WandbConfig | None = None,
                 run_config: dict | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # First, because W&B is the part that may refuse to start (not logged in, no network): nothing is open yet.
        self._wandb = None
        if wandb is not None and wandb.enabled:
            self._wandb = WandbLogger(wandb, self.run_dir, run_config or {})
        self._file = self._open("metrics.jsonl")
        self._tb = None
        if tensorboard:
            # tensorboardX writes standard event files without TensorFlow.
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._eval_file = None  # RUN_DIR/eval.jsonl, opened at the first evaluation
        self._last_step = start_step
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, disable=not progress)

    def write(self, metrics: dict) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in metrics]
        if missing:
            raise KeyError(f"metrics for step {metrics.get('step')} lack {missing}")
        step = self._last_step = int(metrics["step"])
        self._append(self._file, json.dumps({k: _plain(v) for k, v in metrics.items()}) + "\n")
        scalars = _scalars(metrics)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step)
        postfix = {"reward": f"{metrics['reward/mean']:.3f}", "step_s": f"{metrics['time/step_s']:.2f}",
                   "stale": f"{metrics['staleness/mean']:.1f}"}
        failing = reward_failure_rates(metrics)
        if failing:  # e.g. "failed=format 25%,gsm8k 3%": the samples each reward failed since the last step
            postfix["failed"] = ",".join(f"{label} {rate:.0%}" for label, rate in failing.items())
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def write_eval(self, row: dict) -> None:
        """One evaluation (row["step"]: the weight version evaluated): a line of RUN_DIR/eval.jsonl as is; a
        line of metrics.jsonl marked "kind": "eval", at the last learner step written, with
        "eval/weight_version"; TensorBoard scalars at the weight version. W&B takes steps in increasing order
        only, so there the row is logged at the last learner step written, with eval/weight_version too."""
        if self._eval_file is None:
            self._eval_file = self._open("eval.jsonl")
        self._append(self._eval_file, json_line(row))
        version = int(row["step"])
        values = {k: v for k, v in row.items() if k != "step"}
        self._append(self._file, json_line({"kind": EVAL_KIND, "step": self._last_step,
                                            "eval/weight_version": version, **values}))
        scalars = _scalars(row)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, version)
        if self._wandb is not None:
            self._wandb.log({**scalars, "eval/weight_version": version}, self._last_step)

    def _open(self, name: str) -> LineFile:
        try:
            return LineFile(self.run_dir / name)
        except OSError as e:
            raise RunDirError(f"cannot open {self.run_dir / name} ({e.strerror or e}): {_FIX}") from e

    @staticmethod
    def _append(file: LineFile, line: str) -> None:
        """One whole line, or RunDirError naming the file (the line is cut off; the file takes no more)."""
        try:
            file.append(line)
        except OSError as e:
            raise RunDirError(f"cannot write {file.path} ({e.strerror or e}): {_FIX}") from e

    def close(self) -> None:
        """Close every part, each even if another fails (TensorBoard's last flush on a full disk)."""
        steps = [self._bar.close, self._file.close]
        if self._eval_file is not None:
            steps.append(self._eval_file.close)
        if self._tb is not None:
            steps.append(self._close_tensorboard)
        if self._wandb is not None:
            steps.append(self._wandb.finish)
        run_all(steps)

    def _close_tensorboard(self) -> None:
        try:
            self._tb.close()
        except OSError as e:
            raise RunDirError(f"cannot write the TensorBoard events under {self.run_dir / 'tb'} ({e.strerror or e}); "
                              "metrics.jsonl holds the same numbers") from e


def is_eval_line(row: dict) -> bool:
    """Whether a metrics.jsonl row is an evaluation line (not a learner step's)."""
    return row.get("kind") == EVAL_KIND


def read_metrics(run_dir: str | pathlib.Path, name: str = "metrics.jsonl", kind: str = "step") -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (or of `name`, e.g. eval.jsonl); a torn last line is skipped.

    kind: "step" (default), the learner-step lines (one per step: evaluation lines left out); "eval", the
    evaluation lines ("kind": "eval"); "all", every line in file order. eval.jsonl's rows carry no "kind": any
    kind but "eval" returns them all."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    path = pathlib.Path(run_dir) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a grpo_jax run directory?")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
        if kind == "all" or is_eval_line(row) == (kind == "eval"):
            rows.append(row)
    return rows


def length_history(run_dir: str | pathlib.Path, steps: int = HISTORY_STEPS) -> LengthHistory:
    """The sample lengths a run's last `steps` learner steps logged (length/quantiles, prompt_length/mean): what
    optim.expected_lengths_from reads. ValueError, one line naming the file, for a run that logged none."""
    path = pathlib.Path(run_dir)
    if path.is_file():
        path, name = path.parent, path.name
    else:
        name = "metrics.jsonl"
    rows = [r for r in read_metrics(path, name) if isinstance(r.get("length/quantiles"), list)
            and len(r["length/quantiles"]) == QUANTILES and None not in r["length/quantiles"]][-steps:]
    where = path / name
    if not rows:
        raise ValueError(f"{where}: no learner step logged length/quantiles (runs before this release log only "
                         "length/mean: set optim.expected_completion_len to it instead)")
    prompts = [r["prompt_length/mean"] for r in rows if isinstance(r.get("prompt_length/mean"), (int, float))]
    return LengthHistory(quantiles=tuple(tuple(float(v) for v in r["length/quantiles"]) for r in rows),
                         prompt_mean=sum(prompts) / len(prompts) if prompts else None,
                         source=f"{where}, steps {rows[0].get('step')}-{rows[-1].get('step')}")
