"""A run directory written by an earlier version resumes with this one: tests/data/run_a458d4d is the tiny CPU
config (tests/test_trainer.py's FAST sizes, max_staleness 2) trained by grpo_jax at a458d4d, stopped by SIGTERM
after step 6 with groups waiting in its replay buffer (saved before Group was typed). Written by
tests/data/make_run_a458d4d.sh."""

import json
import pathlib
import shutil

from grpo_jax.config_io import load_config
from grpo_jax.run.config import Config
from grpo_jax.run.trainer import Trainer
from grpo_jax.state.ledger import audit

STORED = pathlib.Path(__file__).parent / "data" / "run_a458d4d"


def test_a_run_directory_written_at_a458d4d_resumes_trains_its_saved_groups_and_audits_clean(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(STORED, run_dir)
    config = load_config(Config, run_dir / "config.yaml", [f"run_dir={run_dir}", "trainer.max_steps=8"])
    history = Trainer(config).train()
    assert [m["step"] for m in history] == [7, 8]
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line["event"] == "run_start" and line.get("resumed_from"))
    assert lines[start]["resumed_from"]["step"] == 6
    # Groups generated before the stop (weights older than version 6) came back from the saved buffer and trained.
    resumed = [line for line in lines[start:] if line["event"] == "train"]
    restored = [v for line in resumed for v in line["weight_version"] if v < 6]
    assert restored, "no group of the saved replay buffer was trained after the resume"
    report = audit(run_dir)
    assert report.ok, report.summary()
