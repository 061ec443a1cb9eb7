"""The prompt ledger (ledger.md): line format, run numbering, torn last lines, and the audit's surviving
chain across restarts. No JAX."""

from __future__ import annotations

import json

import pytest

from grpo_jax.errors import UserError
from grpo_jax.state.ledger import (
    LEDGER_FILE,
    Ledger,
    LedgerDamaged,
    LedgerFileMoved,
    LedgerWriteError,
    audit,
    check_covered,
    main,
)


def read(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / LEDGER_FILE).read_text().splitlines()]


def train(ledger: Ledger, step: int, ordinals: list[int], epoch: int = 0, version: int = 0) -> dict:
    return ledger.train(
        step, ordinals, dataset_index=ordinals, epoch=[epoch] * len(ordinals), weight_version=[version] * len(ordinals)
    )


def test_lines_follow_the_format_and_are_flushed_one_by_one(tmp_path):
    ledger = Ledger(tmp_path)
    assert read(tmp_path) == [{"run": 0, "seq": 0, "event": "run_start", "resumed_from": None}]
    assert ledger.train(1, [0, 1], dataset_index=[7, 3], epoch=[0, 0], weight_version=[0, 0]) == {"run": 0, "seq": 1}
    ledger.drop(2, dataset_index=5, epoch=0, reason="reward_error")
    covers = ledger.covers()
    assert ledger.checkpoint(1, frontier_ordinal=3, covers=covers) == {"run": 0, "seq": 2}
    lines = read(tmp_path)  # readable while the ledger is still open: flushed per line
    assert [(x["run"], x["seq"], x["event"]) for x in lines] == [
        (0, 0, "run_start"), (0, 1, "train"), (0, 2, "drop"), (0, 3, "checkpoint")
    ]
    assert lines[1] == {"run": 0, "seq": 1, "event": "train", "step": 1, "ordinals": [0, 1], "dataset_index": [7, 3],
                        "epoch": [0, 0], "weight_version": [0, 0]}
    assert lines[2] == {
        "run": 0,
        "seq": 2,
        "event": "drop",
        "ordinal": 2,
        "dataset_index": 5,
        "epoch": 0,
        "reason": "reward_error",
    }
    assert lines[3] == {
        "run": 0,
        "seq": 3,
        "event": "checkpoint",
        "step": 1,
        "frontier_ordinal": 3,
        "covers": {"run": 0, "seq": 2},
    }
    with pytest.raises(ValueError, match="reason"):
        ledger.drop(3, dataset_index=1, epoch=0, reason="Reward Error!")
    with pytest.raises(ValueError, match="length"):
        ledger.train(2, [3, 4], dataset_index=[1], epoch=[0, 0], weight_version=[0, 0])
    ledger.close()


def test_the_run_number_continues_from_the_file(tmp_path):
    Ledger(tmp_path).close()
    second = Ledger(tmp_path, resumed_from={"step": 0, "run": 0, "seq": 0})
    assert second.run == 1
    second.close()
    assert read(tmp_path)[-1] == {
        "run": 1,
        "seq": 0,
        "event": "run_start",
        "resumed_from": {"step": 0, "run": 0, "seq": 0},
    }
    with pytest.raises(ValueError, match="taken"):
        Ledger(tmp_path, run=1)
    assert Ledger(tmp_path, run=5).run == 5


def test_a_torn_last_line_is_ignored_by_the_audit_and_cut_off_on_reopen(tmp_path):
    ledger = Ledger(tmp_path)
    train(ledger, 1, [0, 1])
    ledger.checkpoint(1, 2, ledger.covers())
    ledger.close()
    with open(tmp_path / LEDGER_FILE, "ab") as f:
        f.write(b'{"run":0,"seq":3,"event":"train","step":2,"ordinals":[2,')  # crash mid-write
    report = audit(tmp_path)
    assert report.ok, report.summary()
    assert any("incomplete last line" in w for w in report.warnings)
    assert report.trained == 2 and report.handed_out == 2

    resumed = Ledger(tmp_path, resumed_from={"step": 1, "run": 0, "seq": 1})
    train(resumed, 2, [2, 3])
    resumed.checkpoint(2, 4, resumed.covers())
    resumed.close()
    lines = read(tmp_path)  # every line parses: the torn tail was cut off, not glued to
    assert [(x["run"], x["seq"]) for x in lines] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    report = audit(tmp_path)
    assert report.ok and report.warnings == [] and report.trained == 4 and report.frontier_ordinal == 4


def crashed_run_0(tmp_path) -> dict:
    """Run 0 trains 0-1, drops 2, checkpoints, trains 3-4, then dies before its next checkpoint."""
    ledger = Ledger(tmp_path)
    train(ledger, 1, [0, 1])
    ledger.drop(2, dataset_index=2, epoch=0, reason="overlong")
    covers = ledger.covers()
    ledger.checkpoint(1, 3, covers)
    train(ledger, 2, [3, 4])  # undone by the restore: past the covered seq
    ledger.close()
    return covers


def test_chain_across_restarts_ignores_undone_lines(tmp_path):
    covers = crashed_run_0(tmp_path)
    ledger = Ledger(tmp_path, resumed_from={"step": 1, **covers})
    train(ledger, 2, [3, 4], version=1)  # trained again: fine, the first time was undone
    train(ledger, 3, [5, 6], version=2)
    ledger.checkpoint(3, 7, ledger.covers())
    ledger.close()
    report = audit(tmp_path)
    assert report.ok, report.summary()
    assert report.chain == [(0, covers["seq"]), (1, None)]
    assert report.restarts == 1 and report.trained == 6 and report.dropped_by_reason == {"overlong": 1}
    assert report.trained_twice == [] and report.lost == [] and report.frontier_ordinal == 7 and report.handed_out == 7
    assert main([str(tmp_path)]) == 0


def test_resuming_past_the_covered_line_shows_up_as_trained_twice(tmp_path, capsys):
    crashed_run_0(tmp_path)
    ledger = Ledger(tmp_path, resumed_from={"step": 2, "run": 0, "seq": 4})  # claims the undone line too
    train(ledger, 2, [3, 4], version=1)
    ledger.checkpoint(2, 5, ledger.covers())
    ledger.close()
    report = audit(tmp_path)
    assert not report.ok and report.trained_twice == [3, 4]
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "trained twice:        2 [3, 4]" in out


def test_lost_prompts_below_the_frontier_fail_the_audit(tmp_path):
    covers = crashed_run_0(tmp_path)
    ledger = Ledger(tmp_path, resumed_from={"step": 1, **covers})
    train(ledger, 2, [4, 5], version=1)  # 3 never comes back
    ledger.checkpoint(2, 6, ledger.covers())
    ledger.close()
    report = audit(tmp_path)
    assert not report.ok and report.lost == [3]
    assert "lost:                 1 [3]" in report.summary()


def test_restart_from_an_older_checkpoint_abandons_a_whole_run(tmp_path):
    covers = crashed_run_0(tmp_path)
    run1 = Ledger(tmp_path, resumed_from={"step": 1, **covers})
    train(run1, 2, [3, 4], version=1)
    run1.checkpoint(2, 5, run1.covers())
    run1.close()
    run2 = Ledger(tmp_path, resumed_from={"step": 1, **covers})  # run 1's checkpoint was lost: start from run 0's
    assert run2.run == 2
    train(run2, 2, [3, 4], version=1)
    run2.checkpoint(2, 5, run2.covers())
    run2.close()
    report = audit(tmp_path)
    assert report.ok, report.summary()
    assert report.chain == [(0, covers["seq"]), (2, None)] and report.restarts == 2


def test_the_checkpoint_a_run_resumed_from_counts_even_if_its_line_was_written_past_the_cover(tmp_path):
    covers = crashed_run_0(tmp_path)  # its checkpoint line (frontier 3) comes after the covered seq
    Ledger(tmp_path, resumed_from={"step": 1, **covers}).close()  # crashed again at once
    report = audit(tmp_path)
    assert report.frontier_ordinal == 3 and report.ok and report.unresolved == 0


def test_trained_and_dropped_and_position_problems(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.train(1, [0, 1], dataset_index=[4, 4], epoch=[0, 0], weight_version=[0, 0])  # one index twice
    ledger.drop(1, dataset_index=9, epoch=0, reason="zero_variance")  # trained and dropped; other index
    ledger.checkpoint(1, 2, ledger.covers())
    ledger.close()
    report = audit(tmp_path)
    assert not report.ok
    assert report.trained_and_dropped == [1]
    assert any("ordinal 1 is (epoch, dataset_index) (0, 4) and also (0, 9)" in p for p in report.position_problems)
    assert any("(0, 4) at ordinals 0 and 1" in p for p in report.position_problems)


def test_a_full_epoch_must_hold_every_dataset_index(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.train(1, [0, 1, 2], dataset_index=[2, 0, 1], epoch=[0, 0, 0], weight_version=[0, 0, 0])
    ledger.train(2, [3, 4, 5], dataset_index=[1, 2, 0], epoch=[1, 1, 1], weight_version=[1, 1, 1])
    ledger.train(3, [6, 7], dataset_index=[0, 2], epoch=[2, 2], weight_version=[2, 2])  # epoch 2 misses 1
    ledger.train(4, [8], dataset_index=[0], epoch=[3], weight_version=[3])
    ledger.checkpoint(4, 9, ledger.covers())
    ledger.close()
    report = audit(tmp_path)
    assert report.position_problems == ["epoch 2 is fully accounted for but misses dataset indices [1]"]


def test_unreadable_middle_lines_and_missing_files_are_errors(tmp_path):
    assert not audit(tmp_path).ok  # no ledger at all
    ledger = Ledger(tmp_path)
    ledger.close()
    with open(tmp_path / LEDGER_FILE, "a") as f:
        f.write("not json\n")
    report = audit(tmp_path)
    assert not report.ok and "unreadable ledger line" in report.errors[0]


def test_per_process_ledgers_write_global_ordinals_and_the_audit_merges_them(tmp_path):
    # Two processes over a 6-row epoch: process P's k-th prompt is the stream's element 2k + P.
    ledgers = [Ledger(tmp_path, process_index=p, process_count=2) for p in range(2)]
    assert [ledger.path.name for ledger in ledgers] == ["events.process0.jsonl", "events.process1.jsonl"]
    order = [4, 0, 5, 2, 1, 3]  # dataset index of stream element 0..5
    for p, ledger in enumerate(ledgers):
        local = [0, 1, 2]
        ledger.train(
            1, local[:2], dataset_index=[order[2 * k + p] for k in local[:2]], epoch=[0, 0], weight_version=[0, 0]
        )
        ledger.drop(2, dataset_index=order[4 + p], epoch=0, reason="overlong")
        ledger.checkpoint(1, 3, ledger.covers())
        ledger.close()
    lines = [json.loads(x) for x in (tmp_path / "events.process1.jsonl").read_text().splitlines()]
    assert lines[0]["process"] == 1 and lines[0]["process_count"] == 2
    assert lines[1]["ordinals"] == [1, 3] and lines[2]["ordinal"] == 5 and lines[3]["frontier_ordinal"] == 7
    report = audit(tmp_path)
    assert report.ok, report.summary()
    assert (report.handed_out, report.trained, report.dropped_by_reason, report.frontier_ordinal) == (
        6,
        4,
        {"overlong": 2},
        6,
    )
    assert "events.process0.jsonl: run 0" in report.summary()

    # Process 1 loses its ordinal 3: its own frontier claims it, no line has it.
    path = tmp_path / "events.process1.jsonl"
    kept = [x for x in path.read_text().splitlines() if '"event":"train"' not in x]
    path.write_text("\n".join(kept) + "\n")
    report = audit(tmp_path)
    assert not report.ok and report.lost == [1, 3]


def test_a_missing_per_process_ledger_is_an_error(tmp_path):
    for p in (0, 2):
        Ledger(tmp_path, process_index=p, process_count=3).close()
    report = audit(tmp_path)
    assert not report.ok and any("do not match their process_count" in e for e in report.errors)


# ---------------------------------------------------------------------------------- a ledger that vanishes (issue 36)


def damage(path, how: str) -> None:
    """What a program (or a mistaken command) may do to a ledger: delete it, cut it back, cut it mid-line, or
    leave it holding another run directory's lines."""
    data = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "cut_at_a_line":
        path.write_bytes(data[:data.index(b"\n") + 1])  # only the run_start line
    elif how == "cut_mid_line":
        path.write_bytes(data[:len(data) // 2])
    elif how == "another_runs":
        path.write_bytes(b'{"run":0,"seq":0,"event":"run_start","resumed_from":null}\n')


@pytest.mark.parametrize("how", ["deleted", "cut_at_a_line", "cut_mid_line", "another_runs"])
def test_a_resume_over_a_ledger_without_the_covered_line_is_refused_in_one_line_and_changes_nothing(tmp_path, how):
    covers = crashed_run_0(tmp_path)
    assert covers == {"run": 0, "seq": 2}
    path = tmp_path / LEDGER_FILE
    damage(path, how)
    before = path.read_bytes() if path.exists() else None
    with pytest.raises(LedgerDamaged) as refused:
        Ledger(tmp_path, resumed_from={"step": 1, **covers})
    message = str(refused.value)
    assert isinstance(refused.value, UserError) and "\n" not in message
    assert str(path) in message and "run 0 seq 2" in message and "checkpoint step 1" in message
    assert "Put the file back" in message and "new run directory" in message, message
    assert (path.read_bytes() if path.exists() else None) == before  # not created, not cut: as it was


def test_a_torn_line_past_the_covered_one_is_what_a_crash_leaves_and_the_resume_goes_on(tmp_path):
    covers = crashed_run_0(tmp_path)  # lines up to seq 4; the checkpoint covers seq 2
    path = tmp_path / LEDGER_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # the last line (seq 4, past the cover) torn
    check_covered(tmp_path, 1, covers)  # no complaint
    resumed = Ledger(tmp_path, resumed_from={"step": 1, **covers})
    train(resumed, 2, [3, 4], version=1)
    resumed.checkpoint(2, 5, resumed.covers())
    resumed.close()
    report = audit(tmp_path)
    assert report.ok and report.trained == 4 and report.handed_out == 5, report.summary()


def test_each_process_checks_its_own_ledger_for_the_covered_line(tmp_path):
    for p in range(2):
        ledger = Ledger(tmp_path, process_index=p, process_count=2)
        train(ledger, 1, [0])
        ledger.checkpoint(1, 1, ledger.covers())
        ledger.close()
    (tmp_path / "events.process1.jsonl").unlink()
    check_covered(tmp_path, 1, {"run": 0, "seq": 1}, process_index=0, process_count=2)
    with pytest.raises(LedgerDamaged, match="events.process1.jsonl does not hold run 0 seq 1"):
        check_covered(tmp_path, 1, {"run": 0, "seq": 1}, process_index=1, process_count=2)


@pytest.mark.parametrize("how", ["deleted", "replaced", "cut", "appended_to"])
def test_a_ledger_changed_under_its_writer_takes_no_more_lines_and_loses_none(tmp_path, how):
    ledger = Ledger(tmp_path)
    train(ledger, 1, [0, 1])
    ledger.checkpoint(1, 2, ledger.covers())
    path = tmp_path / LEDGER_FILE
    written = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "replaced":
        other = tmp_path / "other.jsonl"
        other.write_bytes(written)  # the same bytes, another file
        other.rename(path)
    elif how == "cut":
        path.write_bytes(written[:20])  # truncated in place: the same inode
    else:
        with open(path, "ab") as f:
            f.write(b'{"run":0,"seq":3,"event":"drop"}\n')
    with pytest.raises(LedgerFileMoved) as stopped:
        train(ledger, 2, [2, 3])
    message = str(stopped.value)
    assert isinstance(stopped.value, LedgerWriteError) and isinstance(stopped.value, UserError)
    assert "\n" not in message and str(path) in message and "the run stops here" in message, message
    for refused in (lambda: train(ledger, 2, [2, 3]), ledger.covers, lambda: ledger.drop(2, 2, 0, "overlong")):
        with pytest.raises(LedgerFileMoved):  # nothing more, and no checkpoint can cover anything now
            refused()
    ledger.close()
    if how == "deleted":
        assert "3 lines were written back there" in message and "run the same command" in message, message
        assert path.read_bytes() == written  # every line it wrote, back at its path
        assert audit(tmp_path).ok
    elif how == "replaced":
        saved = next(tmp_path.glob(f"{LEDGER_FILE}.detached-*"))
        assert f"saved to {saved}" in message and f"mv {saved} {path}" in message, message
        assert saved.read_bytes() == written and path.read_bytes() == written  # the other file is left alone
    elif how == "cut":
        assert f"holds 20 bytes where this process wrote {len(written)}" in message, message
        assert path.read_bytes() == written[:20]
    else:
        assert "cut it or wrote to it" in message and path.read_bytes().startswith(written)


def test_a_ledger_deleted_after_its_last_line_gets_its_lines_back_when_it_closes(tmp_path, caplog):
    ledger = Ledger(tmp_path)
    train(ledger, 1, [0])
    path = tmp_path / LEDGER_FILE
    written = path.read_bytes()
    path.unlink()
    ledger.close()  # never raises
    assert path.read_bytes() == written
    assert "was deleted while this process was writing it" in caplog.text
