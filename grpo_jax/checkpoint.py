"""Orbax checkpoints of the whole asynchronous state, and finding the newest good one on resume.

One Orbax CheckpointManager per run directory, steps under RUN_DIR/checkpoints/<step>/, four items each:

    state      arrays: policy parameters, optimizer state, the run's base random key (learner layout)
    buffer     arrays: the replay buffer's contents, one flat array per dtype (replay_buffer.ArrayPool)
    collector  JSON: the collector state (frontier, iterator snapshot, exact accounting above the cut,
               ledger line covered) and the replay buffer's structure, which points into `buffer`
    meta       JSON: format, step, the data fingerprint and the facts a resume must match

Everything is arrays or JSON, so loading a checkpoint never runs code. Orbax writes a step into a
temporary directory and renames it when complete: a save killed half-way never becomes a step (the
leftover is cleaned up when the manager opens). Saves are asynchronous: save() returns once the arrays
are copied on their devices and the JSON is taken; Orbax's host copy, the files and the commit happen
in a background thread.

`Checkpoints.poll()` reports saves that have committed since the last call, so the trainer writes the
ledger's `checkpoint` line only for a step that really is on disk.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pathlib
import shutil
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "grpo_jax.checkpoint/1"
ITEMS = ("state", "buffer", "collector", "meta")
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints.corrupt"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 50  # save after every N learner steps (0: not by steps)
    every_seconds: float = 0.0  # save when this long has passed since the last save (0: not by time)
    keep_last: int = 3  # keep the newest N steps ...
    keep_every: int = 0  # ... plus every step that is a multiple of K (0: none)
    async_save: bool = True  # write in the background; the learner only waits for the host copy
    save_at_end: bool = True  # a final checkpoint when the run reaches max_steps or runs out of data
    load_replay_buffer: bool = True  # False: resume with an empty buffer and generate its prompts again
    snapshot_ring: int = 512  # iterator snapshots kept by the collector (handouts a restore can go back)
    # Resume weights and optimizer from a checkpoint of another dataset, tokenizer or prompt format. The
    # data stream then starts afresh at ordinal 0 and the ledger starts a new chain: the old run's prompt
    # accounting does not describe the new data.
    allow_data_change: bool = False

    def validate(self) -> list[str]:
        problems = []
        for key in ("every_steps", "keep_every"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)}: must be >= 0 (0 = off)")
        if self.every_seconds < 0:
            problems.append(f"every_seconds={self.every_seconds}: must be >= 0 (0 = off)")
        if self.keep_last < 1:
            problems.append(f"keep_last={self.keep_last}: must be >= 1")
        if self.snapshot_ring < 1:
            problems.append(f"snapshot_ring={self.snapshot_ring}: must be >= 1")
        return problems


@dataclasses.dataclass
class Restored:
    step: int
    state: Any  # the pytree given to save(), with arrays placed like the abstract target
    buffer_arrays: dict[str, np.ndarray]
    collector: dict  # {"collector": collector state, "buffer": buffer state (pooled)}
    meta: dict


def tree_layout(tree: Any) -> dict[str, list]:
    """{path: [shape, dtype]} of every array leaf: saved in meta, so a resume can name the tensor whose
    shape changed instead of failing inside Orbax (or mistaking a config change for a corrupt step)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[jax.tree_util.keystr(path)] = [list(np.shape(leaf)), str(leaf.dtype)]
    return out


def layout_difference(saved: dict, current: dict) -> str | None:
    """One line naming the first tensor that differs between two tree_layout()s, or None if they match.
    Parameters are looked at first: a model change then names a weight, not its optimizer moment."""
    for path in sorted(set(saved) | set(current), key=lambda p: (not p.startswith("['params']"), p)):
        if path not in current:
            return f"tensor {path} is in the checkpoint but not in this model/optimizer"
        if path not in saved:
            return f"tensor {path} of this model/optimizer is not in the checkpoint"
        if list(saved[path][0]) != list(current[path][0]) or saved[path][1] != current[path][1]:
            return (f"tensor {path} is {saved[path][1]}{saved[path][0]} in the checkpoint and "
                    f"{current[path][1]}{current[path][0]} now")
    return None


# One dispatch for the whole tree (a copy per leaf would cost a dispatch each); outputs never alias
# non-donated inputs, so these are new buffers the learner's next step cannot donate away.
_device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class Checkpoints:
    """The run directory's checkpoints: when to save, async saves, commit tracking, resume with fallback."""

    def __init__(self, run_dir: str | pathlib.Path, config: CheckpointConfig):
        self.config = config
        self.run_dir = pathlib.Path(run_dir)
        self.directory = self.run_dir / CHECKPOINT_DIR
        self._manager = self._open()
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None  # the background save in flight, if any
        self._committed: list[int] = []  # committed, not yet reported by poll()
        self._uncommitted: list[int] = []  # several processes: saved by Orbax's own async, not yet committed
        self._error: BaseException | None = None  # a background save's failure, raised by the next call
        self._last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.blocked_seconds: list[float] = []  # per save: how long save() held the caller

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.keep_last,
            keep_period=self.config.keep_every or None,
            enable_async_checkpointing=self.config.async_save,
            cleanup_tmp_directories=True,  # leftovers of saves killed half-way
            create=True,
        )
        return ocp.CheckpointManager(self.directory.absolute(), options=options, item_names=ITEMS)

    # -- saving -------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the periodic rule asks for a save after `step`."""
        by_steps = self.config.every_steps and step % self.config.every_steps == 0
        by_time = self.config.every_seconds and time.monotonic() - self._last_save_time >= self.config.every_seconds
        return bool(by_steps or by_time) and step != self.last_saved_step

    def save(self, step: int, state: Any, buffer_arrays: dict, collector: dict, meta: dict) -> None:
        """Save step `step`; poll() tells when it has committed.

        async_save: the caller is held only while the arrays are copied on their devices (the learner
        donates its buffers to the next step, so the save needs its own copy) and, if the previous save
        is still being written, until it is done. The Orbax save (host copy, files, commit) runs in a
        background thread. Otherwise the save is written before this returns.

        Several processes: the Orbax save is started from the caller's thread (Orbax's own async mode
        still writes in the background). Its collectives must be issued in the same order on every
        process, which a second thread racing the learner's collectives would not guarantee.
        """
        start = time.perf_counter()
        self._raise_background_error()
        meta = {**meta, "format": FORMAT, "step": int(step), "saved_at": datetime.datetime.now().isoformat(),
                "layout": tree_layout(state)}
        if self.config.async_save and jax.process_count() > 1:
            self._manager.save(step, args=self._args(state, buffer_arrays, collector, meta), force=True)
            self._uncommitted.append(step)
        elif self.config.async_save:
            state = _device_copy(state)
            if self._writer is not None:
                self._writer.join()  # one save in flight at a time, as Orbax itself does
            self._raise_background_error()
            self._writer = threading.Thread(target=self._write, args=(step, state, buffer_arrays, collector, meta),
                                            name="grpo-checkpoint", daemon=True)
            self._writer.start()
        else:
            self._write(step, state, buffer_arrays, collector, meta)
            self._raise_background_error()
        self.blocked_seconds.append(time.perf_counter() - start)
        self._last_save_time = time.monotonic()
        self.last_saved_step = step

    @staticmethod
    def _args(state: Any, buffer_arrays: dict, collector: dict, meta: dict) -> ocp.args.Composite:
        # Saved with force=True: the trainer decides when (due()), not Orbax's own interval rule.
        return ocp.args.Composite(state=ocp.args.StandardSave(state), buffer=ocp.args.StandardSave(buffer_arrays),
                                  collector=ocp.args.JsonSave(collector), meta=ocp.args.JsonSave(meta))

    def _write(self, step: int, state: Any, buffer_arrays: dict, collector: dict, meta: dict) -> None:
        try:
            self._manager.save(step, args=self._args(state, buffer_arrays, collector, meta), force=True)
            self._manager.wait_until_finished()
            if step not in self._manager.all_steps():
                raise CheckpointError(f"checkpoint step {step} was written but is not listed in {self.directory}")
            with self._lock:
                self._committed.append(step)
        except BaseException as e:  # noqa: BLE001 - reported to the learner by poll()/save()/wait()
            with self._lock:
                self._error = e

    def _raise_background_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"saving a checkpoint in {self.directory} failed: {type(error).__name__}: "
                                  f"{error}") from error

    def poll(self) -> list[int]:
        """Steps whose save has committed since the last call (oldest first). Never blocks; a failed
        background save raises here."""
        self._raise_background_error()
        if self._uncommitted and not self._manager.is_saving_in_progress():
            self._manager.check_for_errors()
            on_disk = set(self._manager.all_steps())
            with self._lock:
                self._committed += [s for s in self._uncommitted if s in on_disk]
            self._uncommitted = [s for s in self._uncommitted if s not in on_disk]
        with self._lock:
            done, self._committed = self._committed, []
        return done

    def wait(self) -> list[int]:
        """Block until every save started has committed; returns those steps (see poll())."""
        if self._writer is not None:
            self._writer.join()
        if self._uncommitted:
            self._manager.wait_until_finished()
        return self.poll()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.join()
        self._manager.close()

    # -- resuming -----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def load_latest(self, abstract_state: Callable[[dict], Any], check: Callable[[dict], None]) -> Restored | None:
        """The newest step that reads back completely, or None when there is none.

        abstract_state(meta) gives the restore target (shapes, dtypes, shardings) for that step's arrays.
        check(meta) raises CheckpointError when the run cannot resume from it (another
        dataset, another model...): that is the user's decision, so it propagates. A step that cannot be
        read (truncated or missing files, bad JSON) is moved to RUN_DIR/checkpoints.corrupt/ with a
        warning, and the one before it is tried: nothing is deleted.
        """
        for step in reversed(self.steps()):
            try:
                json_items = self._manager.restore(step, args=ocp.args.Composite(
                    collector=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
                meta, collector = json_items["meta"], json_items["collector"]
                if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("step") != step:
                    raise CheckpointError(f"meta is not a {FORMAT} record of step {step}")
            except Exception as e:  # noqa: BLE001 - any read failure of a step means "not usable"
                self._set_aside(step, e)
                continue
            check(meta)
            target = abstract_state(meta)
            difference = layout_difference(meta.get("layout", {}), tree_layout(target))
            if difference:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} does not fit this model or "
                                      f"optimizer: {difference}. Resume with the config the run was started with, "
                                      "or start a new run directory.")
            try:
                arrays = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), buffer=ocp.args.StandardRestore()))
            except Exception as e:  # noqa: BLE001
                self._set_aside(step, e)
                continue
            buffer_arrays = {k: np.asarray(v) for k, v in arrays["buffer"].items()}
            return Restored(step, arrays["state"], buffer_arrays, collector, meta)
        return None

    def _set_aside(self, step: int, error: BaseException) -> None:
        target = self.run_dir / CORRUPT_DIR / f"{step}-{int(time.time())}"
        if jax.process_index() == 0:  # one mover; every process then sees the same steps
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
        if jax.process_count() > 1:
            from orbax.checkpoint import multihost
            multihost.sync_global_processes(f"grpo_jax_set_aside_{step}")
        self._manager.reload()
        logger.warning("checkpoint step %d cannot be read (%s: %s); moved it to %s and trying the step before it",
                       step, type(error).__name__, str(error)[:300], target)
