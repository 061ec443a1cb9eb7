"""Bad data end to end (issue 20 items 6 and 8): a huge row is dropped by its size, unread, and accounted in the
ledger; a dataset edited between runs (same size, same first and last rows) is refused on resume."""

import json

import pytest

from grpo_jax.data.tasks import make_synthetic_dataset
from grpo_jax.errors import CheckpointError
from grpo_jax.run.trainer import Trainer
from test_trainer import assert_every_ordinal_accounted_once, read_ledger, tiny_config

BIG_ROW = 2  # dataset index of the huge row


def test_a_huge_row_is_accounted_unread_and_an_edited_dataset_is_refused_on_resume(tmp_path):
    rows = make_synthetic_dataset("copy", 40, seed=0, min_digits=1, max_digits=1)
    rows[BIG_ROW] = {"prompt": "copy: " + "7" * (3 << 19) + "=", "answer": "7", "task": "copy"}  # 1.5 MiB
    path = tmp_path / "copy.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    overrides = ["data.source=jsonl", f"data.path={path}", "data.shuffle=false", "checkpoint.every_steps=1",
                 "trainer.tensorboard=false"]
    Trainer(tiny_config(run_dir, "trainer.max_steps=2", *overrides)).train()
    drops = [line for line in read_ledger(run_dir) if line["event"] == "drop" and line["reason"] == "bad_row"]
    assert [(d["dataset_index"], d["reason"]) for d in drops] == [(BIG_ROW, "bad_row")]
    # data.max_prompt_len=16 (tiny_cpu.yaml): the default row limit is 1 MiB.
    assert (
        drops[0]["detail"] == f"row_too_large: {len(json.dumps(rows[BIG_ROW])) + 1} bytes > data.max_row_bytes=1048576"
    )
    assert_every_ordinal_accounted_once(run_dir)

    # Edit a middle row: same size, same first and last rows, same row count.
    content = path.read_bytes()
    old, new = json.dumps(rows[20]).encode(), json.dumps({**rows[20], "task": "ypoc"}).encode()
    path.write_bytes(content.replace(old, new, 1))
    assert path.stat().st_size == len(content) and path.read_bytes() != content
    with pytest.raises(
        CheckpointError, match="another dataset, tokenizer, prompt format or shuffle.*allow_data_change"
    ):
        Trainer(tiny_config(run_dir, "trainer.max_steps=3", *overrides))
