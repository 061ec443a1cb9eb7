"""What a checkpoint holds beyond the tensors, and whether this run may resume it: host side, no device.

- pack_process_state / unpack_process_state: with several processes, each process's collector and buffer state as
  sealed bytes (a row of the checkpoint's `processes` array; state.checkpoint).
- resume_facts / check_resumable: the facts a checkpoint records (data fingerprint, Grain worker count, process
  count, group size, LoRA) and the one-line CheckpointError for a checkpoint this config cannot resume exactly.
- group_fits: whether a restored group can still be trained under this config's token limits (a group that no
  longer fits is generated again, never dropped: ReplayBuffer.from_state's `fits`).

The trainer (run.trainer.Trainer) opens the ledger, buffer and collector, fresh or resumed, with these.
"""

from __future__ import annotations

import io
import json

import numpy as np

from grpo_jax.data.pipeline import FINGERPRINT_PREFIX
from grpo_jax.errors import CheckpointError
from grpo_jax.run.config import Config
from grpo_jax.state.checkpoint import DamagedStep, seal_bytes, unseal_bytes
from grpo_jax.state.replay_buffer import Group


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
