"""Weights & Biases as an optional logger (trainer.wandb).

wandb is an optional extra, not a test dependency: the required tests run against a stand-in module put in
sys.modules["wandb"] that records every call grpo_jax makes. The last test runs the real package in
offline mode, only where it is installed.
"""

import importlib.util
import sys
import types

import pytest

from grpo_jax.cli import EXIT_USER_ERROR, main
from grpo_jax.config_io import ConfigError, config_to_dict
from grpo_jax.run.metrics import read_metrics
from grpo_jax.run.trainer import Trainer
from grpo_jax.run.wandb_logger import RUN_ID_FILE, ledger_numbers
from grpo_jax.state.ledger import audit
from grpo_jax.state.run_lock import lock_file
from test_trainer import FAST, REPO, tiny_config

TINY = str(REPO / "configs" / "tiny_cpu.yaml")
WANDB = ["trainer.wandb.mode=offline", "trainer.wandb.project=grpo-test"]


class FakeRun:
    def __init__(self, **init_kwargs):
        self.init_kwargs = init_kwargs
        self.logged: list[tuple[int, dict]] = []
        self.summary: dict = {}
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in for the wandb package: init(**kwargs) returns a FakeRun, kept in `runs`."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_gets_each_metrics_row_the_config_and_the_ledger_summary(tmp_path, fake_wandb):
    config = tiny_config(tmp_path, "trainer.max_steps=3", *WANDB)
    Trainer(config).train()

    (run,) = fake_wandb.runs
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert run.init_kwargs == {"project": "grpo-test", "entity": None, "name": tmp_path.name, "mode": "offline",
                               "dir": str(tmp_path), "config": config_to_dict(config), "id": run_id,
                               "resume": "allow"}
    rows = read_metrics(tmp_path)
    assert [step for step, _ in run.logged] == [row["step"] for row in rows] == [1, 2, 3]
    for (_, logged), row in zip(run.logged, rows):
        # Every number of the row but the step (the x axis); lists and NaN (null in JSON) are not scalars.
        assert logged == {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        assert "reward/mean" in logged and "staleness/values" not in logged
    report = audit(tmp_path)
    assert run.summary == ledger_numbers(report)
    assert run.summary["ledger/ok"] is True and run.summary["ledger/trained"] == 3 * 4
    assert run.finished

    # A resumed run directory goes on logging into the same W&B run.
    Trainer(tiny_config(tmp_path, "trainer.max_steps=4", *WANDB)).train()
    assert fake_wandb.runs[1].init_kwargs["id"] == run_id
    assert [step for step, _ in fake_wandb.runs[1].logged] == [4]
    assert fake_wandb.runs[1].summary["ledger/restarts"] == 1


def test_evaluations_reach_wandb_at_steps_that_never_go_back(tmp_path, fake_wandb):
    """An evaluation of weight version k can finish after the learner wrote step k + n, and W&B drops a step
    below its last one: the row goes at the last learner step written, with the version it measured."""
    from grpo_jax.run.metrics import MetricsWriter
    from grpo_jax.run.wandb_logger import WandbConfig

    writer = MetricsWriter(tmp_path, total_steps=2, progress=False, tensorboard=False,
                           wandb=WandbConfig(mode="offline", project="p"), run_config={"seed": 0})
    step = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "staleness/mean": 0.0, "staleness/max": 0,
            "time/step_s": 1.0, "tokens_per_s": 10.0}
    writer.write_eval({"step": 0, "eval/requested_step": 0, "eval/pass@1": 0.25, "eval/pass@k": float("nan")})
    writer.write({"step": 1, **step})
    writer.write({"step": 2, **step})
    writer.write_eval({"step": 1, "eval/requested_step": 1, "eval/pass@1": 0.5, "eval/pass@k": 0.75})
    writer.close()
    (run,) = fake_wandb.runs
    assert [s for s, _ in run.logged] == [0, 1, 2, 2]
    assert run.logged[0][1] == {"eval/requested_step": 0, "eval/pass@1": 0.25, "eval/weight_version": 0}
    assert run.logged[3][1] == {"eval/requested_step": 1, "eval/pass@1": 0.5, "eval/pass@k": 0.75,
                                "eval/weight_version": 1}
    assert [row["step"] for row in read_metrics(tmp_path, "eval.jsonl")] == [0, 1]
    # metrics.jsonl holds them too, at the same steps as W&B: marked, with the version they measured.
    lines = read_metrics(tmp_path, kind="all")
    assert [(r.get("kind"), r["step"], r.get("eval/weight_version")) for r in lines] == [
        ("eval", 0, 0), (None, 1, None), (None, 2, None), ("eval", 2, 1)]
    assert lines[0]["eval/pass@k"] is None and lines[3]["eval/pass@k"] == 0.75
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    assert run.finished


def test_wandb_off_by_default_and_tensorboard_stays(tmp_path):
    config = tiny_config(tmp_path)
    assert config.trainer.wandb.mode == "disabled" and config.trainer.tensorboard


def test_wandb_requested_but_not_installed_is_one_config_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail, installed or not
    run_dir = tmp_path / "run"
    assert main(["train", TINY, "trainer.wandb.mode=online", "trainer.wandb.project=p", "--run-dir",
                 str(run_dir)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpo-jax: error: invalid config: trainer.wandb.mode=online: the wandb package is not installed: "
                   "pip install 'grpo_jax[wandb]' (or set trainer.wandb.mode=disabled)"]
    assert not run_dir.exists()
    assert main(["train", TINY, "trainer.wandb.mode=offline", "--run-dir", str(run_dir)]) == EXIT_USER_ERROR
    assert "trainer.wandb.project='': mode=offline needs a W&B project name" in capsys.readouterr().err
    assert main(["train", TINY, "trainer.wandb.mode=cloud", "--run-dir", str(run_dir)]) == EXIT_USER_ERROR
    assert "trainer.wandb.mode='cloud': allowed values are ['disabled', 'online', 'offline']" in capsys.readouterr().err


def test_an_installed_wandb_that_fails_to_import_is_one_config_line(tmp_path, monkeypatch):
    # A broken install raises what its dependencies raise (protobuf: TypeError), not only ImportError.
    from grpo_jax.run.wandb_logger import WandbConfig, WandbLogger

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "wandb.py").write_text('raise TypeError("Descriptors cannot be created directly.\\nDowngrade protobuf")\n')
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with pytest.raises(ConfigError) as info:
        WandbLogger(WandbConfig(mode="offline", project="p"), tmp_path / "run", {})
    assert str(info.value) == ("trainer.wandb.mode=offline: wandb cannot be imported (TypeError: Descriptors cannot be "
                               "created directly. Downgrade protobuf): reinstall it (pip install 'grpo_jax[wandb]') "
                               "or set trainer.wandb.mode=disabled")


def test_wandb_init_failure_is_one_line_and_releases_the_run_directory(tmp_path, capsys, fake_wandb):
    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty).\nCall wandb.login(key=[your_api_key])")

    fake_wandb.init = refuse
    run_dir = tmp_path / "run"
    assert main(["train", TINY, *FAST, "trainer.wandb.mode=online", "trainer.wandb.project=p", "--run-dir",
                 str(run_dir)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.wandb: wandb.init failed (RuntimeError: api_key not configured (no-tty). " \
                             "Call wandb.login(key=[your_api_key])); check `wandb login`" in err[0], err
    assert (run_dir / "config.yaml").is_file()  # the trainer had started: W&B starts with the first step
    assert not lock_file(run_dir, 0).exists()
    assert not (run_dir / RUN_ID_FILE).exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is an optional extra (pip install 'grpo_jax[wandb]'); the stand-in tests above "
                           "are the required ones")
def test_real_wandb_offline_run_writes_its_files(tmp_path, monkeypatch):
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever the config says
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, "trainer.max_steps=2", *WANDB)).train()
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    assert (offline / f"run-{run_id}.wandb").stat().st_size > 0
