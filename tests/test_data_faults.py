"""Bad data end to end (issue 20 items 6 and 8, issue 36 item 6): a huge row is dropped by its size, unread, and rows
json.loads cannot read (nested 2000 deep, a 5000-digit integer) are dropped as bad rows, on the first run and on a
resume, all accounted in the ledger; a dataset edited between runs (same size, same first and last rows) is refused on
resume."""

import json

import pytest

from grpo_jax.data.tasks import make_synthetic_dataset
from grpo_jax.errors import CheckpointError
from grpo_jax.run.trainer import Trainer
from test_trainer import assert_every_ordinal_accounted_once, read_ledger, tiny_config

BIG_ROW = 2  # dataset index of the huge row
# From row 3 on, every third row holds valid JSON that json.loads cannot read, so each run meets some.
UNREADABLE = {"[" * 2000 + "]" * 2000: "nested 2001 deep, more than the 100 levels read",
              "1" * 5000: "an integer longer than the 4300 digits read"}


def unreadable_line(row: dict, index: int) -> tuple[str, str]:
    """The row as a JSONL line with an unreadable field, and the drop's detail."""
    value, why = list(UNREADABLE.items())[index % 2]
    return json.dumps(row)[:-1] + f', "meta": {value}}}', f"bad_json: copy.jsonl line {index + 1}: {why}"


def test_bad_rows_are_accounted_on_every_run_and_an_edited_dataset_is_refused_on_resume(tmp_path):
    rows = make_synthetic_dataset("copy", 40, seed=0, min_digits=1, max_digits=1)
    rows[BIG_ROW] = {"prompt": "copy: " + "7" * (3 << 19) + "=", "answer": "7", "task": "copy"}  # 1.5 MiB
    # data.max_prompt_len=16 (tiny_cpu.yaml): the default row limit is 1 MiB.
    lines = [json.dumps(row) for row in rows]
    details = {BIG_ROW: f"row_too_large: {len(lines[BIG_ROW]) + 1} bytes > data.max_row_bytes=1048576"}
    for index in range(3, len(rows), 3):
        lines[index], details[index] = unreadable_line(rows[index], index)
    path = tmp_path / "copy.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    run_dir = tmp_path / "run"
    overrides = ["data.source=jsonl", f"data.path={path}", "data.shuffle=false", "checkpoint.every_steps=1",
                 "trainer.tensorboard=false"]

    def bad_row_drops():
        return {d["dataset_index"]: d["detail"] for d in read_ledger(run_dir)
                if d["event"] == "drop" and d["reason"] == "bad_row"}

    Trainer(tiny_config(run_dir, "trainer.max_steps=2", *overrides)).train()
    first = bad_row_drops()
    assert {BIG_ROW, 3, 6} <= set(first) and all(first[i] == details[i] for i in first)
    # The resume goes on past the rows the first run met, and meets more.
    Trainer(tiny_config(run_dir, "trainer.max_steps=3", *overrides)).train()
    resumed = bad_row_drops()
    assert set(resumed) > set(first) and all(resumed[i] == details[i] for i in resumed)
    assert max(line["step"] for line in read_ledger(run_dir) if line["event"] == "train") == 3
    assert_every_ordinal_accounted_once(run_dir)

    # Edit a middle row: same size, same first and last rows, same row count.
    content = path.read_bytes()
    old, new = json.dumps(rows[20]).encode(), json.dumps({**rows[20], "task": "ypoc"}).encode()
    path.write_bytes(content.replace(old, new, 1))
    assert path.stat().st_size == len(content) and path.read_bytes() != content
    with pytest.raises(
        CheckpointError, match="another dataset, tokenizer, prompt format or shuffle.*allow_data_change"
    ):
        Trainer(tiny_config(run_dir, "trainer.max_steps=4", *overrides))
