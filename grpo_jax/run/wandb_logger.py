"""Weights & Biases as an optional logger (`trainer.wandb`), beside metrics.jsonl and TensorBoard.

wandb is an optional dependency (`pip install 'grpo_jax[wandb]'`), imported only by a run that asks for
it. Process 0's MetricsWriter sends the resolved config when the run starts, the scalars of every metrics
row at its learner step, and the ledger audit's numbers (those of `grpo-jax audit`) as the run summary at
the end. The W&B run id is kept in RUN_DIR/wandb_run_id, so a resumed run directory goes on logging into
the same W&B run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
import uuid
from typing import Literal

from grpo_jax.config_io import config_key
from grpo_jax.errors import ConfigError

INSTALL = "pip install 'grpo_jax[wandb]'"
RUN_ID_FILE = "wandb_run_id"


def wandb_installed() -> bool:
    # A module already imported counts, whether or not it has a spec to find (a test's stand-in has none).
    return sys.modules.get("wandb") is not None or importlib.util.find_spec("wandb") is not None


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    mode: Literal["disabled", "online", "offline"] = config_key(
        "disabled", "disabled: no W&B, wandb is not imported; online: log to the W&B server; offline: write "
                    "RUN_DIR/wandb/ only (no network), to upload later with `wandb sync`.")
    project: str = config_key("", "The W&B project the run is logged to (needed when mode is online or offline).")
    entity: str = config_key("", "The W&B entity (user or team); '': the logged-in user's default entity.")
    name: str = config_key("", "The W&B run's display name; '': the run directory's name.")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    def validate(self) -> list[str]:
        if not self.enabled:
            return []
        problems = []
        if not self.project:
            problems.append(f"project='': mode={self.mode} needs a W&B project name")
        if not wandb_installed():
            problems.append(f"mode={self.mode}: the wandb package is not installed: {INSTALL} (or set "
                            "trainer.wandb.mode=disabled)")
        return problems


def ledger_numbers(report) -> dict:
    """A grpo_jax.state.ledger.AuditReport's numbers, as W&B summary keys."""
    numbers = {
        "ledger/ok": report.ok, "ledger/handed_out": report.handed_out, "ledger/trained": report.trained,
        "ledger/dropped": sum(report.dropped_by_reason.values()), "ledger/lost": len(report.lost),
        "ledger/trained_twice": len(report.trained_twice),
        "ledger/trained_and_dropped": len(report.trained_and_dropped),
        "ledger/not_yet_accounted": report.unresolved, "ledger/restarts": report.restarts,
    }
    numbers.update({f"ledger/dropped/{reason}": n for reason, n in sorted(report.dropped_by_reason.items())})
    return numbers


class WandbLogger:
    """One W&B run per run directory (see the module docstring)."""

    def __init__(self, config: WandbConfig, run_dir: str | pathlib.Path, run_config: dict):
        try:
            import wandb
        except Exception as e:  # noqa: BLE001 - an install that fails to import (e.g. a protobuf clash) raises
            # whatever its dependencies raise, not only ImportError; either way the fix is the user's install.
            message = " ".join(str(e).split())
            raise ConfigError(f"trainer.wandb.mode={config.mode}: wandb cannot be imported ({type(e).__name__}: "
                              f"{message}): reinstall it ({INSTALL}) or set trainer.wandb.mode=disabled") from e
        self.run_dir = pathlib.Path(run_dir)
        id_file = self.run_dir / RUN_ID_FILE
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else uuid.uuid4().hex[:16]
        try:
            self.run = wandb.init(project=config.project, entity=config.entity or None,
                                  name=config.name or self.run_dir.resolve().name, mode=config.mode,
                                  dir=str(self.run_dir), config=run_config, id=run_id, resume="allow")
        except Exception as e:  # noqa: BLE001 - login, network and permission failures all come through here
            message = " ".join(str(e).split())
            raise ConfigError(f"trainer.wandb: wandb.init failed ({type(e).__name__}: {message}); check `wandb "
                              "login`, trainer.wandb.project and entity, or set trainer.wandb.mode=offline") from e
        id_file.write_text(run_id + "\n", encoding="utf-8")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        from grpo_jax.state.ledger import audit

        self.run.summary.update(ledger_numbers(audit(self.run_dir)))
        self.run.finish()
