"""What a checkpoint holds beyond the tensors, and whether this run may resume it: host side, no device.

- pack_process_state / unpack_process_state: with several processes, each process's collector and buffer state as
  sealed bytes (a row of the checkpoint's `processes` array; state.checkpoint).
- resume_facts / check_resumable: the facts a checkpoint records (data fingerprint, Grain worker count, process
  count, group size, LoRA) and the one-line CheckpointError for a checkpoint this config cannot resume exactly.
- group_fits: whether a restored group can still be trained under this config's token limits (a group that no
  longer fits is generated again, never dropped: ReplayBuffer.from_state's `fits`).
- fresh_data_state / resumed_data_state: this process's ledger, replay buffer and collector (a DataState), for a new
  start or from a restored checkpoint: with the ledger's covered line checked on every process before any writes,
  or a new chain when the data changed (checkpoint.allow_data_change) or the checkpoint predates ordinals.

The trainer (run.trainer.Trainer) restores the weights itself and takes its DataState from here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pathlib
from collections.abc import Callable

import numpy as np

from grpo_jax.data.collector import Collector
from grpo_jax.data.pipeline import FINGERPRINT_PREFIX, DataError, DataIterator
from grpo_jax.errors import CheckpointError
from grpo_jax.run.config import Config
from grpo_jax.state.checkpoint import DamagedStep, Restored, seal_bytes, unseal_bytes
from grpo_jax.state.ledger import Ledger, LedgerDamaged, check_covered, global_ordinal, ledger_file
from grpo_jax.state.replay_buffer import ArrayPool, Group, ReplayBuffer

logger = logging.getLogger(__name__)


def pack_process_state(own: dict, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """One process's collector + buffer state as bytes (an .npz: JSON bytes plus plain arrays; loading it
    with allow_pickle=False never runs code), followed by their SHA-256 (checkpoint.seal_bytes)."""
    out = io.BytesIO()
    np.savez(out, __json__=np.frombuffer(json.dumps(own).encode("utf-8"), np.uint8), **arrays)
    return seal_bytes(np.frombuffer(out.getvalue(), np.uint8))


def unpack_process_state(data: np.ndarray, sealed: bool) -> tuple[dict, dict[str, np.ndarray]]:
    """pack_process_state() undone; DamagedStep when the bytes are not what was written (sealed: False for a
    checkpoint from before the checksum, read unchecked)."""
    if sealed:
        data = unseal_bytes(data, "this process's saved collector/buffer bytes")
    try:
        with np.load(io.BytesIO(data.tobytes()), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        own = json.loads(arrays.pop("__json__").tobytes().decode("utf-8"))
    except (ValueError, OSError, KeyError, UnicodeDecodeError) as e:
        raise DamagedStep(f"this process's saved collector/buffer state is unreadable: {e}") from e
    return own, arrays


def resume_facts(config: Config, data_fingerprint: str, processes: int, base_identity: str | None) -> dict:
    """What a checkpoint records and a resume must match (besides the tensor layout). base_identity: with LoRA, the
    base model's (model.lora.base_identity)."""
    lora = config.lora
    # The adapters only mean something on the base and with the scale they were trained with (dropout may change).
    adapters = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
                "base": base_identity} if lora.enabled else None
    return {"data_fingerprint": data_fingerprint, "worker_count": config.data.worker_count,
            "process_count": processes, "group_size": config.grpo.group_size, "lora": adapters}


def check_resumable(meta: dict, now: dict, config: Config, where: str) -> None:
    """Refuse, with the reason in one line, a checkpoint (its `meta`, written at `where`) this config cannot resume
    exactly; `now`: resume_facts of this run."""
    facts = meta.get("facts", {})
    if facts.get("lora") != now["lora"]:
        def described(lora):
            if lora is None:
                return "without LoRA (every weight trained)"
            return (f"with LoRA rank={lora['rank']} alpha={lora['alpha']} targets={lora['targets']} on base "
                    f"{lora['base']}")
        raise CheckpointError(
            f"{where} was trained {described(facts.get('lora'))}; this config has {described(now['lora'])} "
            f"(model_path={config.model_path!r}): resume with the lora section and base model the run "
            "was started with, or start a new run directory")
    saved_fingerprint = str(facts.get("data_fingerprint"))
    if (saved_fingerprint != now["data_fingerprint"] and not config.checkpoint.allow_data_change
            and not saved_fingerprint.startswith(FINGERPRINT_PREFIX)):
        raise CheckpointError(
            f"{where} was written by an earlier grpo_jax, whose data fingerprint ({saved_fingerprint}) did not "
            "hash the data file's content, so this version cannot check that the data is the same. Finish the run "
            "with the grpo_jax that started it, start a new run directory, or set "
            "checkpoint.allow_data_change=true to keep the weights and optimizer and start a new data stream")
    if facts.get("data_fingerprint") != now["data_fingerprint"] and not config.checkpoint.allow_data_change:
        raise CheckpointError(
            f"{where} was written for another dataset, tokenizer, prompt format or shuffle (data fingerprint "
            f"{facts.get('data_fingerprint')}, now {now['data_fingerprint']}). Resume with the original data "
            "config, start a new run directory, or set checkpoint.allow_data_change=true to keep the weights "
            "and optimizer and start a new data stream")
    if facts.get("data_fingerprint") == now["data_fingerprint"]:
        if facts.get("worker_count") != now["worker_count"]:
            raise CheckpointError(
                f"{where} was written with data.worker_count={facts.get('worker_count')}, this config has "
                f"{now['worker_count']}: Grain cannot restore its iterator under another worker count (set "
                f"data.worker_count={facts.get('worker_count')})")
        if facts.get("process_count") != now["process_count"]:
            raise CheckpointError(
                f"{where} was written by {facts.get('process_count')} JAX process(es), this run has "
                f"{now['process_count']}: each process's data shard and iterator state would differ")
    if (config.checkpoint.load_replay_buffer and meta.get("buffered_groups")
            and facts.get("group_size") != now["group_size"]):
        raise CheckpointError(
            f"{where} holds groups of {facts.get('group_size')} completions, grpo.group_size is now "
            f"{now['group_size']}: set checkpoint.load_replay_buffer=false to generate them again")


def group_fits(group: Group, prompt_bucket: int, completion_bucket: int, row_length: int) -> str | None:
    """Why a restored group cannot be trained under this config (None: it can). A config may lower the token limits
    between runs. A segment group: each segment in one packed row (prompt + completion within the row's tokens, its
    sampled tokens within the completion bucket, the row's trained budget)."""
    if group.segmented:
        for i, (prompt, completion, mask) in enumerate(zip(group.segments.prompts, group.completions,
                                                           group.segments.masks)):
            if len(prompt) + len(completion) > row_length:
                return (f"segment {i} has {len(prompt)} + {len(completion)} tokens, over a learner row of "
                        f"{row_length} (prompt limit {prompt_bucket} + sampler.max_new_tokens={completion_bucket})")
            sampled = int(np.sum(np.asarray(mask, np.float32)))
            if sampled > completion_bucket:
                return f"segment {i} has {sampled} sampled tokens, over sampler.max_new_tokens={completion_bucket}"
        return None
    if len(group.prompt["prompt_ids"]) > prompt_bucket:
        return (f"its prompt has {len(group.prompt['prompt_ids'])} tokens, over the prompt limit "
                f"{prompt_bucket} (data.max_prompt_len / sampler.max_prompt_len)")
    longest = max(len(c) for c in group.completions)
    if longest > completion_bucket:
        return f"a completion has {longest} tokens, over sampler.max_new_tokens={completion_bucket}"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataStateSpec:
    """What this process's ledger, replay buffer and collector are built with (the trainer fills it from its plan)."""
    run_dir: pathlib.Path
    process_index: int
    process_count: int
    handout_size: int  # this process's groups per step
    buffer_capacity: int
    max_staleness: int
    prompts_per_step: int  # all processes': what an older-format resume may lose is counted with it
    snapshot_ring: int
    load_replay_buffer: bool


@dataclasses.dataclass(frozen=True)
class DataState:
    """This process's prompt accounting: the ledger the collector writes, the buffer and the collector."""
    ledger: Ledger
    buffer: ReplayBuffer
    collector: Collector


def _ledger(spec: DataStateSpec, on_ledger: Callable[[Ledger], None], resumed_from: dict | None = None) -> Ledger:
    ledger = Ledger(spec.run_dir, resumed_from=resumed_from, process_index=spec.process_index,
                    process_count=spec.process_count)
    on_ledger(ledger)  # registered for closing at once: a failure further on must not leave it open
    return ledger


def _buffer(spec: DataStateSpec, learner_version: int) -> ReplayBuffer:
    return ReplayBuffer(spec.buffer_capacity, spec.max_staleness, spec.handout_size, learner_version=learner_version)


def _new_chain(spec: DataStateSpec, iterator: DataIterator, learner_version: int,
               on_ledger: Callable[[Ledger], None]) -> DataState:
    ledger = _ledger(spec, on_ledger)
    return DataState(ledger, _buffer(spec, learner_version),
                     Collector(iterator, handout_size=spec.handout_size, snapshot_ring=spec.snapshot_ring,
                               ledger=ledger))


def fresh_data_state(spec: DataStateSpec, iterator: DataIterator, on_ledger: Callable[[Ledger], None]) -> DataState:
    """A new start (no usable checkpoint). on_ledger: called with the ledger as soon as it is open."""
    if (spec.run_dir / ledger_file(spec.process_index, spec.process_count)).exists():
        logger.warning("%s has a ledger but no usable checkpoint: starting from scratch; the ledger starts a "
                       "new chain and the audit counts only this start", spec.run_dir)
    return _new_chain(spec, iterator, 0, on_ledger)


def resumed_data_state(spec: DataStateSpec, iterator: DataIterator, restored: Restored, *,
                       fits: Callable[[Group], str | None], gather: Callable[[list], np.ndarray],
                       on_ledger: Callable[[Ledger], None]) -> DataState:
    """The ledger, buffer and collector of `restored` (a checkpoint check_resumable accepted). fits: group_fits
    under this config; gather: the hosts' agreement (each process's row of a small array), so that a ledger
    missing its covered line on any process stops every process before one writes."""
    step, saved_collector = restored.step, restored.collector.get("collector", {})
    if restored.meta["facts"]["data_fingerprint"] != iterator.fingerprint:
        logger.warning("resuming weights and optimizer from step %d with another dataset/tokenizer/prompt "
                       "format (checkpoint.allow_data_change): the data stream starts at ordinal 0 and the "
                       "ledger starts a new chain", step)
        return _new_chain(spec, iterator, step, on_ledger)
    if "frontier_ordinal" not in saved_collector:
        return _resume_without_ordinals(spec, iterator, step, saved_collector, on_ledger)
    # The ledger must hold the line the checkpoint covers (deleted or cut back, resuming would leave the
    # prompts trained before it unaccounted for): every process looks at its own before any writes to it.
    try:
        check_covered(spec.run_dir, step, saved_collector["ledger_covers"], spec.process_index, spec.process_count)
        damaged = None
    except LedgerDamaged as e:
        damaged = e
    elsewhere = gather([damaged is not None])[:, 0]
    if damaged is not None:
        raise damaged
    if elsewhere.any():
        raise LedgerDamaged(f"process {int(np.argmax(elsewhere))}'s prompt ledger does not hold the line that "
                            f"checkpoint step {step} covers (its own message names the file), so no process "
                            f"resumes; nothing in {spec.run_dir} was changed")
    ledger = _ledger(spec, on_ledger, resumed_from={"step": step, **saved_collector["ledger_covers"]})
    where = (spec.process_index, spec.process_count)  # ordinals in the log are global, as in the ledger
    if spec.load_replay_buffer:
        buffer = ReplayBuffer.from_state(
            restored.collector["buffer"], spec.buffer_capacity, spec.max_staleness, spec.handout_size,
            pool=ArrayPool(restored.buffer_arrays), learner_version=step, fits=fits)
        if buffer.left_out:
            ordinal, reason = buffer.left_out[0]
            logger.warning("%d restored group(s) no longer fit this config and will be generated again "
                           "(first: ordinal %d, %s)", len(buffer.left_out), global_ordinal(ordinal, *where), reason)
    else:
        buffer = _buffer(spec, step)
    try:
        collector = Collector.restore(iterator, saved_collector, buffer.ordinals(), handout_size=spec.handout_size,
                                      snapshot_ring=spec.snapshot_ring, ledger=ledger)
    except DataError as e:
        raise CheckpointError(f"checkpoint step {step}: {e}") from e
    logger.info("resumed from checkpoint step %d: frontier ordinal %d, %d group(s) restored into the buffer, "
                "the data stream goes back to ordinal %d", step, global_ordinal(collector.frontier, *where),
                len(buffer), global_ordinal(saved_collector["resume_base_ordinal"], *where))
    return DataState(ledger, buffer, collector)


def _resume_without_ordinals(spec: DataStateSpec, iterator: DataIterator, step: int, saved_collector: dict,
                             on_ledger: Callable[[Ledger], None]) -> DataState:
    """A checkpoint from before ordinals (it holds only the iterator's live position): resume there, with the old
    lossy behaviour, and say what is lost."""
    in_flight = (spec.max_staleness + 1) * spec.prompts_per_step
    logger.warning(
        "checkpoint step %d has no ordinal data (an older format): the data stream resumes at the "
        "iterator's live position at save time, so the prompts that were being generated or waiting in "
        "the replay buffer then are lost (up to %d with this config) and cannot be counted; the ledger "
        "starts a new chain. Checkpoints written from now on are exact.", step, in_flight)
    try:
        iterator.set_state(saved_collector["iterator_state"]["json"])
    except (KeyError, TypeError, DataError) as e:
        raise CheckpointError(f"checkpoint step {step}: unusable iterator state in an older-format "
                              f"collector record ({e})") from e
    return _new_chain(spec, iterator, step, on_ledger)
