"""Running every step of a shutdown even when one fails, without hiding the error that caused it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

logger = logging.getLogger("grpo_jax")


def run_all(steps: Iterable[Callable[[], object]], failure: BaseException | None = None) -> None:
    """Run every cleanup step, each even if an earlier one failed (a failed ledger close must not leave the
    sampler's threads and the data workers running). With `failure` (an error already on its way out) the
    steps' own errors are logged, so that the first error is the one reported; otherwise the first is raised
    once all have run."""
    first = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - every step runs; the first error is raised or logged below
            if failure is None and first is None:
                first = e
            else:
                logger.warning("while stopping after an error: %s failed: %s: %s",
                               getattr(step, "__qualname__", step), type(e).__name__, e)
    if first is not None:
        raise first
