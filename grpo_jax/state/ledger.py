"""The prompt ledger RUN_DIR/events.jsonl (format: ../shared/reference/ledger.md, binding) and its audit.

Writing: `Ledger` appends one JSON object per line ({"run", "seq", "event", ...}) through a LineFile (one
write per line, no user-space buffer); `fsync()`/`covers()` make lines durable before a checkpoint may cover
them. A torn last line (a crash mid-write) is cut off when the ledger is opened again: it was never
complete, so nothing covers it. A line that cannot be written (a full disk, EIO, a read-only mount) is cut
off at once, its `seq` is not used, and the ledger refuses every later line and `covers()`
(LedgerWriteError, one line naming the file): callers write the line BEFORE they change the accounting it
records, so a failed line changes nothing, and no checkpoint can cover anything after it. The run stops;
its next start resumes from the last committed checkpoint. The file is also checked before each line and
sync (LineFile.check_in_place): deleted, replaced, cut or written to by another program while the run writes
it, it takes no more lines either (LedgerFileMoved, one line saying where its lines are now: a deleted
ledger's lines are written back at its path).

Resuming: the line the restored checkpoint covers (its `ledger_covers`) must be in the file, complete: a
ledger deleted or cut back past it (LedgerDamaged, one line; nothing in the file is touched) would leave
the prompts trained before the checkpoint unaccounted for, and the audit failed for good. A torn last line
past the covered one is what a crash mid-write leaves, and is cut off as before.

Reading: `audit(run_dir)` follows the surviving chain (the last run, then the run it resumed from up to
the covered seq, and so on back to run 0; lines past a covered seq were undone by the restore) and
reports prompts lost or trained twice. `python -m grpo_jax.state.ledger RUN_DIR` prints the summary and exits
1 when the audit fails.

Several JAX processes: each process keeps its own ledger, RUN_DIR/events.process{P}.jsonl, whose
run_start lines carry `process` and `process_count`. Process P reads every N-th element of the data
stream (N processes), so its k-th prompt is the stream's element k * N + P, and that global position is
the ordinal written in its lines; a checkpoint line's frontier_ordinal means "every ordinal of this
process below it is trained or dropped". The audit follows each file's chain on its own, then merges:
the global frontier is the lowest of the processes' frontiers.

Pure Python (no JAX).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from grpo_jax.errors import RunDirError
from grpo_jax.state.line_file import FileMoved, LineFile

logger = logging.getLogger(__name__)

LEDGER_FILE = "events.jsonl"


def global_ordinal(local: int, process_index: int, process_count: int) -> int:
    """Process P's k-th prompt is element k * N + P of the whole stream (N processes): its global ordinal."""
    return int(local) * process_count + process_index


def ledger_file(process_index: int = 0, process_count: int = 1) -> str:
    """events.jsonl for one process; events.process{P}.jsonl for each of several."""
    return LEDGER_FILE if process_count == 1 else f"events.process{process_index}.jsonl"

EVENT_KINDS = ("run_start", "train", "drop", "checkpoint")
_REASON = re.compile(r"^[a-z][a-z0-9_]*$")


def _line_id(run: Any, seq: Any) -> dict:
    return {"run": int(run), "seq": int(seq)}


def read_lines(path: Path) -> tuple[list[dict], list[str], list[str], int]:
    """(parsed lines, warnings, errors, byte length of the complete lines). A final line without its
    newline is torn (a crash mid-write): ignored with a warning. A complete line that is not a JSON
    object with integer run/seq and a known event is an error and is skipped."""
    data = path.read_bytes() if path.exists() else b""
    complete_len = data.rfind(b"\n") + 1
    warnings, errors, lines = [], [], []
    if complete_len < len(data):
        warnings.append(f"{path}: ignored an incomplete last line ({len(data) - complete_len} bytes, "
                        "a crash mid-write)")
    for number, raw in enumerate(data[:complete_len].splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            if not isinstance(line, dict):
                raise ValueError("not a JSON object")
            if not isinstance(line.get("run"), int) or not isinstance(line.get("seq"), int):
                raise ValueError("run and seq must be integers")
            if line.get("event") not in EVENT_KINDS:
                raise ValueError(f"unknown event {line.get('event')!r}")
        except ValueError as e:
            errors.append(f"{path}:{number}: unreadable ledger line ({e}): {raw[:120]!r}")
            continue
        lines.append(line)
    return lines, warnings, errors, complete_len


class LedgerWriteError(RunDirError):
    """A ledger line could not be written (or synced): nothing it records has taken effect, and the ledger
    takes no further line. The message is one line naming the file and the fix."""


class LedgerFileMoved(LedgerWriteError):
    """The ledger file was deleted, replaced, cut or written to by another program while this run wrote it;
    the message says where its lines are now and what to do."""


class LedgerDamaged(RunDirError):
    """The ledger lacks the line a checkpoint being resumed covers: the run does not start, and the message
    names the file and the fix (restore it, or start a new run directory)."""


def check_covered(run_dir: str | os.PathLike, step: int, covers: dict, process_index: int = 0,
                  process_count: int = 1) -> None:
    """LedgerDamaged unless this process's ledger holds the complete line `covers` ({"run", "seq"}) that
    checkpoint `step` covers. Reads only: call it before anything writes to the run directory."""
    path = Path(run_dir) / ledger_file(process_index, process_count)
    _check_covered(path, read_lines(path)[0] if path.exists() else None, step, covers)


def _check_covered(path: Path, lines: list[dict] | None, step: int, covers: dict) -> None:
    """check_covered on the file's lines as read_lines parsed them (None: there is no file)."""
    run, seq = int(covers["run"]), int(covers["seq"])
    if lines is None:
        found = "the file does not exist"
    else:
        seqs = [line["seq"] for line in lines if line["run"] == run]
        if seq in seqs:
            return
        found = (f"its lines of run {run} end at seq {max(seqs)}" if seqs else
                 f"it holds no line of run {run}" if lines else "it holds no complete line")
    raise LedgerDamaged(
        f"the prompt ledger {path} does not hold run {run} seq {seq}, the last line that checkpoint step {step} "
        f"covers ({found}): it was deleted or cut after that checkpoint was written, and resuming would leave "
        "every prompt trained before it unaccounted for. Put the file back from a copy and run the same command "
        f"again, or start a new run directory; nothing in {path.parent} was changed")


class Ledger:
    """Appends ledger lines for one process start (`run`) of a run directory. Thread-safe.

    run: the lineage number; None = one more than the highest run already in the file (0 if none).
    resumed_from: None on a fresh start, else {"step": S, "run": R, "seq": N}: the checkpoint step restored
    and the last ledger line it covers (the collector state's `ledger_covers`, plus the step); LedgerDamaged
    (nothing written) when the file does not hold that line.
    process_index, process_count: with several processes, the ordinals given to train/drop/checkpoint
    are this process's own (0, 1, 2, ...) and are written as global ones, local * count + index.
    """

    def __init__(self, run_dir: str | os.PathLike, run: int | None = None, resumed_from: dict | None = None,
                 process_index: int = 0, process_count: int = 1):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index}, process_count={process_count}")
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.path = Path(run_dir) / ledger_file(process_index, process_count)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        existed = self.path.exists()
        lines, warnings, errors, _ = read_lines(self.path)
        if resumed_from is not None:  # before the file is opened (created, its torn tail cut): refused, it is as it was
            resumed_from = {"step": int(resumed_from["step"]), **_line_id(resumed_from["run"], resumed_from["seq"])}
            _check_covered(self.path, lines if existed else None, resumed_from["step"], resumed_from)
        for message in warnings + errors:
            logger.warning("ledger: %s", message)
        runs = {line["run"] for line in lines}
        highest = max(runs, default=-1)
        if run is None:
            run = highest + 1
        elif run <= highest:
            raise ValueError(f"ledger {self.path}: run {run} is taken (highest run in the file is {highest})")
        self.run = int(run)
        self._next_seq = 0
        self._file = LineFile(self.path)  # cuts a torn last line off; a failed line is cut off and ends it
        process = {} if process_count == 1 else {"process": self.process_index, "process_count": self.process_count}
        self._write("run_start", {"resumed_from": resumed_from, **process})
        self.fsync()

    def _global(self, ordinal: int) -> int:
        return global_ordinal(ordinal, self.process_index, self.process_count)

    # -- writing ------------------------------------------------------------------------------------

    @property
    def failed(self) -> OSError | None:
        """The write or sync that failed, after which the ledger takes no line (None while all is well)."""
        return self._file.failed

    def _write(self, event: str, fields: dict) -> dict:
        with self._lock:
            line = {"run": self.run, "seq": self._next_seq, "event": event, **fields}
            with self._one_line_error(f"its {event} line (seq {self._next_seq}) could not be written"):
                self._file.append(json.dumps(line, separators=(",", ":"), allow_nan=False) + "\n")
            self._next_seq += 1
            return _line_id(self.run, line["seq"])

    @contextlib.contextmanager
    def _one_line_error(self, what: str):
        earlier = self._file.failed
        try:
            yield
        except (OSError, ValueError) as e:
            moved = earlier if isinstance(earlier, FileMoved) else e if isinstance(e, FileMoved) else None
            if moved is not None:
                raise LedgerFileMoved(f"the prompt ledger {self.path}: {moved.strerror}: the run stops here, and "
                                      f"nothing it did after its last ledger line counts; {moved.remedy}") from e
            if earlier is not None:
                what = f"it takes no more lines since a write failed ({earlier.strerror or earlier})"
            elif isinstance(e, OSError):
                what = f"{what} ({e.strerror or e})"
            else:
                what = "it is closed"
            raise LedgerWriteError(f"the prompt ledger {self.path}: {what}: the run stops here, and nothing it did "
                                   "after its last ledger line counts; free space (or fix the mount) and run the same "
                                   "command to resume from the last committed checkpoint") from e

    def train(self, step: int, ordinals: Iterable[int], dataset_index: Iterable[int], epoch: Iterable[int],
              weight_version: Iterable[int]) -> dict:
        """One learner step: the ordinals it trained, with their dataset index, epoch and weight version."""
        ordinals, dataset_index = [self._global(o) for o in ordinals], [int(i) for i in dataset_index]
        epoch, weight_version = [int(e) for e in epoch], [int(v) for v in weight_version]
        if not len(ordinals) == len(dataset_index) == len(epoch) == len(weight_version):
            raise ValueError("ledger train: ordinals, dataset_index, epoch and weight_version differ in length")
        return self._write(
            "train",
            {"step": int(step), "ordinals": ordinals, "dataset_index": dataset_index, "epoch": epoch,
             "weight_version": weight_version},
        )

    def drop(self, ordinal: int, dataset_index: int, epoch: int, reason: str, detail: str | None = None) -> dict:
        """A prompt handed out that will not be trained; `reason` is a short stable word (e.g. bad_row).
        `detail` (optional, free text) says more, e.g. "missing_field: no field 'question'"."""
        if not _REASON.match(reason):
            raise ValueError(f"ledger drop reason {reason!r}: use a short lowercase word like 'reward_error'")
        fields = {"ordinal": self._global(ordinal), "dataset_index": int(dataset_index), "epoch": int(epoch),
                  "reason": reason}
        if detail is not None:
            fields["detail"] = str(detail)
        return self._write("drop", fields)

    def checkpoint(self, step: int, frontier_ordinal: int, covers: dict | None = None) -> dict:
        """Record a committed checkpoint; returns its `covers`. Pass the `covers` taken with the collector
        state (state["ledger_covers"]). None means the line just before this one, which is right only if
        nothing was written between taking the collector state and now."""
        with self._lock:
            if covers is None:
                covers = _line_id(self.run, self._next_seq - 1)
            covers = _line_id(covers["run"], covers["seq"])
        self._write("checkpoint", {"step": int(step), "frontier_ordinal": self._global(frontier_ordinal),
                                   "covers": covers})
        self.fsync()
        return covers

    def fsync(self) -> None:
        self.covers()

    def covers(self) -> dict:
        """fsync, then {"run", "seq"} of the last line written: what a checkpoint taken now may cover.
        LedgerWriteError after a failed line or sync (a checkpoint must not cover anything past it)."""
        with self._lock:
            with self._one_line_error("its lines could not be synced to disk"):
                self._file.sync()
            return _line_id(self.run, self._next_seq - 1)

    def close(self) -> None:
        """Sync and close; never raises (what could not be synced is covered by no checkpoint, and the next
        start cuts an incomplete last line off). A file deleted since the last line gets its lines back."""
        with self._lock:
            try:
                self._file.check_in_place()
            except FileMoved as e:
                logger.warning("the prompt ledger %s: %s; %s", self.path, e.strerror, e.remedy)
            self._file.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------
# The audit.


@dataclasses.dataclass
class AuditReport:
    run_dir: str
    handed_out: int = 0  # highest ordinal seen in the surviving chain + 1 (ordinals are handed out in order)
    trained: int = 0  # distinct ordinals in train lines
    dropped_by_reason: dict = dataclasses.field(default_factory=dict)  # distinct ordinals, by their first reason
    frontier_ordinal: int = 0  # the highest frontier of a checkpoint whose covered line survives
    lost: list = dataclasses.field(default_factory=list)  # below the frontier, in no train or drop line
    trained_twice: list = dataclasses.field(default_factory=list)  # in two or more train lines
    trained_and_dropped: list = dataclasses.field(default_factory=list)
    unresolved: int = 0  # ordinals >= frontier seen but not accounted for yet (in flight at the end)
    position_problems: list = dataclasses.field(default_factory=list)  # epoch/dataset_index inconsistencies
    restarts: int = 0  # process starts after the first (all runs in the file)
    process_count: int = 1  # JAX processes (one ledger file each when more than one)
    # [(run, last seq counted or None = all)], oldest first; with several processes [(file name, that list)]
    chain: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)  # unreadable lines, a broken chain

    @property
    def ok(self) -> bool:
        return not (self.lost or self.trained_twice or self.trained_and_dropped or self.position_problems
                    or self.errors)

    def summary(self) -> str:
        def few(xs: list) -> str:
            return "" if not xs else " " + (str(xs[:20]) + (f" ... ({len(xs)} in all)" if len(xs) > 20 else ""))

        def links(chain: list) -> str:
            return " <- ".join(f"run {r}" + ("" if s is None else f" (to seq {s})") for r, s in reversed(chain))

        if self.process_count > 1:  # [(file name, chain)] per process
            chain = "; ".join(f"{name}: {links(c) or '-'}" for name, c in self.chain)
        else:
            chain = links(self.chain)
        dropped = sum(self.dropped_by_reason.values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped_by_reason.items()))
        lines = [
            f"ledger audit of {self.run_dir}: {'OK' if self.ok else 'FAILED'}",
            f"  prompts handed out:   {self.handed_out}",
            f"  trained:              {self.trained}",
            f"  dropped:              {dropped}" + (f" ({reasons})" if reasons else ""),
            f"  lost:                 {len(self.lost)}{few(self.lost)}",
            f"  trained twice:        {len(self.trained_twice)}{few(self.trained_twice)}",
            f"  trained and dropped:  {len(self.trained_and_dropped)}{few(self.trained_and_dropped)}",
            f"  frontier ordinal:     {self.frontier_ordinal} ({self.unresolved} above it not yet accounted for)",
            f"  restarts:             {self.restarts}; surviving chain: {chain or '-'}",
        ]
        lines += [f"  position problem: {p}" for p in self.position_problems[:20]]
        lines += [f"  error: {e}" for e in self.errors[:20]]
        lines += [f"  warning: {w}" for w in self.warnings[:20]]
        return "\n".join(lines)


def _surviving_chain(by_run: dict[int, list[dict]], report: AuditReport) -> list[dict]:
    """The lines that count, oldest first: the last run, plus each resumed-from run up to its covered seq."""
    segments = []
    run, upto = max(by_run), None
    visited = set()
    while True:
        visited.add(run)
        lines = by_run[run]
        segments.append([line for line in lines if upto is None or line["seq"] <= upto])
        report.chain.append((run, upto))
        first = lines[0]
        if first["seq"] != 0 or first["event"] != "run_start":
            report.errors.append(f"run {run} does not begin with a run_start line at seq 0")
            break
        resumed = first.get("resumed_from")
        if resumed is None:
            break
        try:
            prev, upto = int(resumed["run"]), int(resumed["seq"])
        except (KeyError, TypeError, ValueError):
            report.errors.append(f"run {run}: malformed resumed_from {resumed!r}")
            break
        if prev >= run or prev in visited or prev not in by_run:
            report.errors.append(f"run {run} resumed from run {prev}, which is not an earlier run in the ledger")
            break
        if upto > by_run[prev][-1]["seq"]:
            report.errors.append(f"run {run} resumed from run {prev} seq {upto}, past that run's last line")
        run = prev
    report.chain.reverse()
    return [line for segment in reversed(segments) for line in segment]


def audit(run_dir: str | os.PathLike) -> AuditReport:
    """Check the run's ledger(s) against the ledger.md rules; see AuditReport for what is reported. Several
    per-process ledgers are each checked on their own chain, then merged (see the module docstring)."""
    run_dir = Path(run_dir)
    per_process = sorted(run_dir.glob("events.process*.jsonl"), key=lambda p: p.name)
    if (run_dir / LEDGER_FILE).exists() or not per_process:
        report = AuditReport(run_dir=str(run_dir))
        positions = _audit_file(run_dir / LEDGER_FILE, report)
        _check_epochs(positions, report)
        return report
    merged = AuditReport(run_dir=str(run_dir))
    positions: dict[int, tuple[int, int]] = {}
    frontiers, counts = [], set()
    for path in per_process:
        part = AuditReport(run_dir=str(run_dir))
        positions.update(_audit_file(path, part))
        frontiers.append(part.frontier_ordinal)
        counts.add(part.process_count)
        merged.handed_out += part.handed_out
        merged.trained += part.trained
        for reason, n in part.dropped_by_reason.items():
            merged.dropped_by_reason[reason] = merged.dropped_by_reason.get(reason, 0) + n
        for field in ("lost", "trained_twice", "trained_and_dropped"):
            getattr(merged, field).extend(getattr(part, field))
        merged.unresolved += part.unresolved
        merged.restarts = max(merged.restarts, part.restarts)
        merged.chain.append((path.name, part.chain))
        merged.position_problems += part.position_problems
        merged.warnings += [f"{path.name}: {w}" for w in part.warnings]
        merged.errors += [f"{path.name}: {e}" for e in part.errors]
    expected = [ledger_file(p, len(per_process)) for p in range(len(per_process))]
    if counts != {len(per_process)} or [p.name for p in per_process] != expected:
        merged.errors.append(f"per-process ledgers {[p.name for p in per_process]} do not match their process_count "
                             f"{sorted(counts)}: expected {expected}")
    merged.process_count = len(per_process)
    merged.frontier_ordinal = min(frontiers)  # every process accounted for its ordinals below this
    for field in ("lost", "trained_twice", "trained_and_dropped"):
        getattr(merged, field).sort()
    _check_epochs(positions, merged)
    return merged


def _audit_file(path: Path, report: AuditReport) -> dict[int, tuple[int, int]]:
    """Audit one ledger file into `report`; returns ordinal -> (epoch, dataset_index) for the epoch check."""
    if not path.exists():
        report.errors.append(f"{path} does not exist")
        return {}
    lines, report.warnings, report.errors, _ = read_lines(path)
    if not lines:
        report.errors.append(f"{path} holds no ledger lines")
        return {}

    by_run: dict[int, list[dict]] = collections.defaultdict(list)
    for line in lines:
        by_run[line["run"]].append(line)
    for run, run_lines in by_run.items():
        seqs = [line["seq"] for line in run_lines]
        if seqs != list(range(len(seqs))):
            report.errors.append(f"run {run}: seq is not 0, 1, 2, ... in file order")
    report.restarts = len(by_run) - 1
    chain = _surviving_chain(by_run, report)
    in_chain = {(line["run"], line["seq"]) for line in chain}
    # This file's ordinals: every process_count-th, from its process index (all of them for one process).
    first = by_run[max(by_run)][0]
    stride, offset = int(first.get("process_count", 1)), int(first.get("process", 0))
    report.process_count = stride

    # A checkpoint counts when the line it covers survives: then everything it claims is in the chain.
    # Its own line may lie past the covered seq (it is written after the commit), and still count.
    for line in lines:
        if line["event"] == "checkpoint":
            covers = line.get("covers") or {}
            if (covers.get("run"), covers.get("seq")) in in_chain:
                report.frontier_ordinal = max(report.frontier_ordinal, int(line["frontier_ordinal"]))

    train_lines: collections.Counter[int] = collections.Counter()
    drop_reason: dict[int, str] = {}
    position: dict[int, tuple[int, int]] = {}

    def note_position(ordinal: int, epoch: int, index: int) -> None:
        if ordinal % stride != offset:
            report.errors.append(f"ordinal {ordinal} does not belong to process {offset} of {stride}")
        seen = position.setdefault(ordinal, (epoch, index))
        if seen != (epoch, index):
            report.position_problems.append(f"ordinal {ordinal} is (epoch, dataset_index) {seen} "
                                            f"and also {(epoch, index)}")

    for line in chain:
        try:
            if line["event"] == "train":
                for o, e, i in zip(line["ordinals"], line["epoch"], line["dataset_index"], strict=True):
                    train_lines[int(o)] += 1
                    note_position(int(o), int(e), int(i))
            elif line["event"] == "drop":
                o = int(line["ordinal"])
                drop_reason.setdefault(o, str(line["reason"]))
                note_position(o, int(line["epoch"]), int(line["dataset_index"]))
        except (KeyError, TypeError, ValueError) as e:
            report.errors.append(f"run {line['run']} seq {line['seq']}: malformed {line['event']} line ({e})")

    report.trained = len(train_lines)
    report.trained_twice = sorted(o for o, n in train_lines.items() if n > 1)
    report.trained_and_dropped = sorted(o for o in drop_reason if o in train_lines)
    report.dropped_by_reason = dict(collections.Counter(r for o, r in drop_reason.items() if o not in train_lines))
    accounted = set(train_lines) | set(drop_reason)
    highest = max(accounted, default=offset - stride)
    report.handed_out = (highest - offset) // stride + 1
    report.lost = [o for o in range(offset, report.frontier_ordinal, stride) if o not in accounted]
    report.unresolved = sum(1 for o in range(report.frontier_ordinal, highest + 1)
                            if o % stride == offset and o not in accounted)
    return position


def _check_epochs(position: dict[int, tuple[int, int]], report: AuditReport) -> None:
    """Each (epoch, dataset_index) at one ordinal; epochs never go back as ordinals rise; and every epoch
    fully accounted for (a later epoch starts below the frontier) holds the same dataset indices."""
    where: dict[tuple[int, int], int] = {}
    for o in sorted(position):
        first = where.setdefault(position[o], o)
        if first != o:
            report.position_problems.append(f"(epoch, dataset_index) {position[o]} at ordinals {first} and {o}")
    ordered = [position[o][0] for o in sorted(position)]
    if any(a > b for a, b in zip(ordered, ordered[1:])):
        report.position_problems.append("epochs go backwards as ordinals rise: the data order changed between restarts")
    below = [position[o] for o in sorted(position) if o < report.frontier_ordinal]
    if not below:
        return
    last_epoch = max(e for e, _ in below)
    indices: dict[int, set[int]] = collections.defaultdict(set)
    for e, i in below:
        indices[e].add(i)
    full = {e: s for e, s in indices.items() if e < last_epoch}
    reference = max(full.values(), key=len, default=None)
    for e, s in sorted(full.items()):
        if s != reference:
            report.position_problems.append(
                f"epoch {e} is fully accounted for but misses dataset indices {sorted(reference - s)[:20]}"
            )
    if reference is not None and reference != set(range(len(reference))):
        report.warnings.append(f"a full epoch holds dataset indices that are not 0..{len(reference) - 1}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m grpo_jax.state.ledger RUN_DIR", file=sys.stderr)
        return 2
    report = audit(argv[0])
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
