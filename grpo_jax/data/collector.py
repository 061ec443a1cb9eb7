"""Hands prompts out with ordinals, keeps exact accounting of them, and restores without loss or repeats.

Implements ../shared/reference/frontier-restore.md (binding). In short:

- Every prompt handed out gets an ordinal: 0, 1, 2, ... across epochs. Each ordinal maps to one
  (epoch, dataset_index); the map is kept for the ordinals a restore may have to hand out again.
- Before every handout the iterator state is copied into a bounded ring, keyed by the ordinal the next
  record pulled from the iterator will get.
- Every ordinal ends up accounted for exactly once: trained, or dropped with a reason. `Accounting` keeps
  that set as sorted disjoint ranges and refuses a second entry for an ordinal (the "trained twice" bug).
- Between handout and accounting an ordinal is "unfinished" (being generated, or queued again after it
  grew too stale) or "finished" (its group waits in the replay buffer).
- `checkpoint_state` picks, in one call under the lock, the newest snapshot at or before the cut
  (cut = min(frontier, lowest unfinished)) and saves the exact accounting above it. `Collector.restore`
  hands that stretch out again and throws away, as they arrive, the ordinals already accounted for or
  still in the restored buffer; everything else is answered again.

Pure Python (no JAX) so that it can be tested on its own. All public methods are thread-safe: the actor
thread calls handout/mark_finished/mark_dropped/requeue/take_requeued while the learner calls
mark_trained/requeue/checkpoint_state and mark_dropped (nonfinite_update, run_ended). Each method holds the one
lock for its whole duration, so a checkpoint never sees a half-made handout or a half-accounted step.

The ledger (grpo_jax.state.ledger.Ledger), when given, is written under the same lock as the accounting it
records, and `checkpoint_state` fsyncs it and records which ledger line it covers. That makes "the
checkpoint covers exactly the ledger lines whose effect it contains" hold even with two threads. Each
line is written BEFORE the accounting it records changes: a line that cannot be written (a full disk)
raises ledger.LedgerWriteError and leaves the ordinal exactly where it was, and the ledger then refuses
every later line and checkpoint, so the run stops and resumes from its last committed checkpoint.
"""

from __future__ import annotations

import base64
import bisect
import collections
import dataclasses
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from grpo_jax.errors import CheckpointError

logger = logging.getLogger(__name__)

STATE_FORMAT = "grpo_jax.data.collector/1"
# Drop reason for prompts a restore cannot hand out again because the snapshot ring no longer reached
# back far enough when the checkpoint was taken (see Collector.checkpoint_state).
RING_OVERRUN_REASON = "snapshot_ring_overrun"


class AccountedTwiceError(RuntimeError):
    """An ordinal was about to be trained or dropped a second time: a bug that would train a prompt twice."""


class CollectorStateError(RuntimeError):
    """A call that does not fit an ordinal's state, e.g. training an ordinal whose group never finished."""


class DataOrderMismatch(CheckpointError):
    """After a restore the iterator yields different data for an ordinal than before the save: the dataset,
    its shuffle or its sharding changed, so the saved accounting does not describe this data."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A record as handed out, with its ordinal. The record is opaque except for the keys read here."""

    ordinal: int
    record: dict

    @property
    def epoch(self) -> int:
        return int(self.record["epoch"])

    @property
    def dataset_index(self) -> int:
        return int(self.record["dataset_index"])

    @property
    def bad_row(self) -> str | None:
        """Why this row cannot be used (from the data path), or None. Such a prompt is handed out like any
        other, so it has an ordinal; the actor drops it with mark_dropped(ordinal, "bad_row")."""
        return self.record.get("bad_row")


def record_position(record: Any) -> tuple[int, int]:
    """(epoch, dataset_index) of a record, with a clear error when the data path did not set them."""
    try:
        return int(record["epoch"]), int(record["dataset_index"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"prompt record needs integer 'epoch' and 'dataset_index' keys, got {type(record).__name__} "
            f"with keys {sorted(record) if isinstance(record, dict) else '?'}"
        ) from e


# ----------------------------------------------------------------------------------------------------
# Exact accounting.


class RangeSet:
    """A set of non-negative ints stored as sorted disjoint half-open ranges [a, b), adjacent ones merged.

    Accounted ordinals are almost all below the frontier, so the set stays a handful of ranges however
    long the run is.
    """

    def __init__(self, ranges: Iterable[Iterable[int]] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for a, b in ranges:
            self.add_range(int(a), int(b))

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._starts, x) - 1
        return i >= 0 and x < self._ends[i]

    def add_range(self, a: int, b: int) -> None:
        """Add [a, b); raises ValueError if any of it is already present (callers never add twice)."""
        if not 0 <= a <= b:
            raise ValueError(f"bad range [{a}, {b})")
        if a == b:
            return
        i = bisect.bisect_right(self._starts, a)  # ranges [0, i) start at or before a
        if (i > 0 and self._ends[i - 1] > a) or (i < len(self._starts) and self._starts[i] < b):
            raise ValueError(f"range [{a}, {b}) overlaps {self.overlapping(a, b)}")
        merge_left = i > 0 and self._ends[i - 1] == a
        merge_right = i < len(self._starts) and self._starts[i] == b
        if merge_left and merge_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif merge_left:
            self._ends[i - 1] = b
        elif merge_right:
            self._starts[i] = a
        else:
            self._starts.insert(i, a)
            self._ends.insert(i, b)

    def overlapping(self, a: int, b: int) -> list[int]:
        """The members in [a, b), smallest first (for error messages and small windows)."""
        return [x for x in range(a, b) if x in self]

    def first_missing(self, start: int = 0) -> int:
        """The smallest non-member >= start."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and start < self._ends[i]:
            return self._ends[i]
        return start

    def ranges(self, start: int = 0) -> list[list[int]]:
        """The ranges clipped to [start, inf), as [[a, b), ...]."""
        out = []
        for a, b in zip(self._starts, self._ends):
            if b > start:
                out.append([max(a, start), b])
        return out

    def count(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._ends))


class Accounting:
    """Which ordinals are trained or dropped, exactly; refuses to account for an ordinal twice."""

    def __init__(self, accounted_ranges: Iterable[Iterable[int]] = ()):
        self.accounted = RangeSet(accounted_ranges)
        self.trained_count = 0
        self.dropped_counts: collections.Counter[str] = collections.Counter()

    @property
    def frontier(self) -> int:
        """The lowest ordinal not accounted for: every ordinal below it is trained or dropped."""
        return self.accounted.first_missing(0)

    def __contains__(self, ordinal: int) -> bool:
        return ordinal in self.accounted

    def check_new(self, ordinals: Iterable[int], what: str) -> list[int]:
        """The ordinals as a list, after checking none is repeated or already accounted for."""
        ordinals = [int(o) for o in ordinals]
        seen = set()
        for o in ordinals:
            if o < 0:
                raise ValueError(f"ordinal {o} < 0")
            if o in seen:
                raise AccountedTwiceError(f"ordinal {o} appears twice in one {what} call: it would be {what} twice")
            if o in self.accounted:
                raise AccountedTwiceError(
                    f"ordinal {o} is already accounted for (trained or dropped); marking it {what} again "
                    "would count one prompt twice"
                )
            seen.add(o)
        return ordinals

    def mark_trained(self, ordinals: Iterable[int]) -> None:
        ordinals = self.check_new(ordinals, "trained")  # all checked before any is added
        for o in ordinals:
            self.accounted.add_range(o, o + 1)
        self.trained_count += len(ordinals)

    def mark_dropped(self, ordinal: int, reason: str) -> None:
        (ordinal,) = self.check_new([ordinal], "dropped")
        self.accounted.add_range(ordinal, ordinal + 1)
        self.dropped_counts[reason] += 1


# ----------------------------------------------------------------------------------------------------
# Iterator states in checkpoints: plain JSON, never pickled.


def encode_iterator_state(state: Any) -> dict:
    """{"json": state} for a JSON-serialisable state, {"base64": ...} for bytes. Also a deep copy, so a
    snapshot cannot change when the iterator later mutates the object it returned."""
    if isinstance(state, (bytes, bytearray)):
        return {"base64": base64.b64encode(bytes(state)).decode("ascii")}
    try:
        return {"json": json.loads(json.dumps(state, allow_nan=False))}
    except (TypeError, ValueError) as e:
        raise TypeError(f"iterator.get_state() must return bytes or a JSON-serialisable value: {e}") from e


def decode_iterator_state(encoded: dict) -> Any:
    if "base64" in encoded:
        return base64.b64decode(encoded["base64"])
    if "json" in encoded:
        return encoded["json"]
    raise CheckpointError(f"collector state: iterator_state has neither 'json' nor 'base64': {sorted(encoded)}")


# ----------------------------------------------------------------------------------------------------
# The collector.


class Collector:
    """Hands prompts out in handouts of `handout_size`, with ordinals, snapshots and exact accounting.

    Lifecycle of an ordinal (each arrow is one call; anything else raises):

        handout() -> unfinished --mark_finished--> finished (group in the replay buffer)
        unfinished/finished --mark_dropped(reason)--> accounted      finished --mark_trained--> accounted
        finished --requeue--> unfinished (too stale: take_requeued() hands it out again)

    Order of calls that matters:
      - the actor calls mark_finished(o) BEFORE buffer.put(group): the learner may take the group at once;
      - a checkpoint takes buffer.to_state() FIRST, then checkpoint_state(its "ordinals") (see there).

    `ledger` (optional, grpo_jax.state.ledger.Ledger): mark_trained and mark_dropped then write their ledger
    line under the collector's lock, and checkpoint_state fsyncs the ledger and records the line covered,
    so the checkpoint covers exactly the ledger lines whose effect it contains, whatever the actor does
    meanwhile. Without one the caller writes the ledger and must keep that consistency itself.
    """

    def __init__(self, iterator: Iterator, handout_size: int, snapshot_ring: int = 512, ledger: Any = None):
        if handout_size < 1:
            raise ValueError(f"handout_size={handout_size}: must be >= 1")
        if snapshot_ring < 1:
            raise ValueError(f"snapshot_ring={snapshot_ring}: must be >= 1")
        self._lock = threading.Lock()
        self._iterator = iterator
        self.handout_size = int(handout_size)
        self.snapshot_ring = int(snapshot_ring)
        self._ledger = ledger
        # (ordinal the next record pulled will get, encoded iterator state), oldest first.
        self._ring: collections.deque[tuple[int, dict]] = collections.deque(maxlen=self.snapshot_ring)
        self._next_ordinal = 0
        # ordinal -> (epoch, dataset_index), kept from min(frontier, oldest snapshot) upward.
        self._positions: dict[int, tuple[int, int]] = {}
        self._positions_floor = 0
        self._highest_known = -1  # highest ordinal ever stamped, by this process or before the restore
        self._accounting = Accounting()
        self._unfinished: set[int] = set()
        self._finished: set[int] = set()
        self._requeued: collections.deque[Prompt] = collections.deque()
        # After a restore: up to this ordinal, arriving records are checked against the saved positions
        # and the ones already known (accounted, buffered, unfinished) are thrown away. -1: no checking.
        self._replay_through = -1
        self.exhausted = False
        # Drops made by restore() itself (ring overrun), for the trainer's log: (ordinal, epoch, index).
        self.restore_drops: list[tuple[int, int, int]] = []
        self._remember_snapshot()

    # -- handing out ---------------------------------------------------------------------------------

    def handout(self, size: int | None = None) -> list[Prompt]:
        """The next `size` (default handout_size) prompts, each stamped with its ordinal.

        Returns fewer (possibly none) only when the iterator is exhausted; `exhausted` is then True.
        Holds the lock while reading the iterator: a handout is atomic with respect to checkpoint_state.
        """
        with self._lock:
            if self.exhausted:
                return []
            self._remember_snapshot()
            prompts: list[Prompt] = []
            size = self.handout_size if size is None else int(size)
            while len(prompts) < size:
                try:
                    record = next(self._iterator)
                except StopIteration:
                    self._on_exhausted()
                    break
                ordinal = self._next_ordinal
                self._next_ordinal += 1
                position = record_position(record)
                if ordinal <= self._replay_through:
                    expected = self._positions.get(ordinal)
                    if expected is not None and expected != position:
                        raise DataOrderMismatch(
                            f"after restore, ordinal {ordinal} is (epoch, dataset_index) = {position} but was "
                            f"{expected} before the save: the dataset, its shuffle seed or its sharding changed"
                        )
                self._positions[ordinal] = position
                if ordinal <= self._replay_through and self._is_known(ordinal):
                    continue  # already trained/dropped, or its group is in the restored buffer
                self._highest_known = max(self._highest_known, ordinal)
                self._unfinished.add(ordinal)
                prompts.append(Prompt(ordinal, record))
            self._prune_positions()
            return prompts

    def take_requeued(self) -> list[Prompt]:
        """Prompts sent back by requeue() (their group grew too stale), to be generated again; oldest first."""
        with self._lock:
            out, seen = [], set()
            while self._requeued:
                prompt = self._requeued.popleft()
                # Skip ones dropped meanwhile, and duplicates from requeueing twice before this call.
                if prompt.ordinal in self._unfinished and prompt.ordinal not in seen:
                    seen.add(prompt.ordinal)
                    out.append(prompt)
            return sorted(out, key=lambda p: p.ordinal)

    # -- the trainer's reports -----------------------------------------------------------------------

    def mark_finished(self, ordinal: int) -> None:
        """The group of `ordinal` is complete and now waits in the replay buffer."""
        with self._lock:
            if ordinal not in self._unfinished:
                raise CollectorStateError(f"mark_finished({ordinal}): ordinal is {self._status(ordinal)}, "
                                          "not unfinished")
            self._unfinished.remove(ordinal)
            self._finished.add(ordinal)

    def mark_trained(self, ordinals: Iterable[int], step: int | None = None,
                     weight_versions: Iterable[int] | None = None) -> None:
        """One learner step trained these groups. With a ledger, `step` (the step number after this update)
        and `weight_versions` (one per ordinal) are required and one `train` line is written.
        Raises AccountedTwiceError, before changing anything, if any ordinal is already accounted for."""
        with self._lock:
            ordinals = self._accounting.check_new(ordinals, "trained")
            for o in ordinals:
                if o not in self._finished:
                    raise CollectorStateError(f"mark_trained({o}): ordinal is {self._status(o)}; "
                                              "only finished groups are trained")
            if self._ledger is not None:
                weight_versions = [int(v) for v in (weight_versions if weight_versions is not None else ())]
                if step is None or len(weight_versions) != len(ordinals):
                    raise ValueError("with a ledger, mark_trained needs step and one weight version per ordinal")
            if self._ledger is not None:  # the line first: if it cannot be written, nothing has changed
                positions = [self._positions[o] for o in ordinals]
                self._ledger.train(
                    step,
                    ordinals,
                    dataset_index=[p[1] for p in positions],
                    epoch=[p[0] for p in positions],
                    weight_version=weight_versions,
                )
            self._accounting.mark_trained(ordinals)
            self._finished.difference_update(ordinals)

    def mark_dropped(self, ordinal: int, reason: str, detail: str | None = None) -> None:
        """`ordinal` will never be trained (reward_error, overlong, zero_variance, bad_row, ...); `detail`, if
        given, goes into its ledger line (e.g. which field of a bad row is wrong)."""
        with self._lock:
            (ordinal,) = self._accounting.check_new([ordinal], "dropped")
            if ordinal not in self._unfinished and ordinal not in self._finished:
                raise CollectorStateError(f"mark_dropped({ordinal}): ordinal is {self._status(ordinal)}")
            self._drop(ordinal, reason, detail)

    def requeue(self, prompt: Prompt) -> None:
        """The group of `prompt` grew too stale and was taken out of the buffer: generate it again. The
        ordinal stays unfinished (it is neither trained nor dropped); take_requeued() hands it back."""
        with self._lock:
            o = prompt.ordinal
            if o in self._finished:
                self._finished.remove(o)
                self._unfinished.add(o)
            elif o not in self._unfinished:
                raise CollectorStateError(f"requeue({o}): ordinal is {self._status(o)}")
            self._requeued.append(prompt)

    # -- reading ------------------------------------------------------------------------------------

    @property
    def frontier(self) -> int:
        with self._lock:
            return self._accounting.frontier

    @property
    def next_ordinal(self) -> int:
        with self._lock:
            return self._next_ordinal

    def position(self, ordinal: int) -> tuple[int, int]:
        """(epoch, dataset_index) of a handed-out ordinal that is not yet far below the frontier."""
        with self._lock:
            return self._positions[ordinal]

    def counts(self) -> dict:
        """For logging: unfinished, finished, trained, dropped by reason, frontier, next ordinal."""
        with self._lock:
            return {
                "unfinished": len(self._unfinished),
                "finished": len(self._finished),
                "trained": self._accounting.trained_count,
                "dropped": dict(self._accounting.dropped_counts),
                "frontier": self._accounting.frontier,
                "next_ordinal": self._next_ordinal,
            }

    def outstanding(self) -> list[int]:
        """Ordinals handed out and not yet trained or dropped (unfinished or waiting in the buffer)."""
        with self._lock:
            return sorted(self._unfinished | self._finished)

    def is_drained(self) -> bool:
        """True once the iterator is exhausted and every ordinal handed out is trained or dropped."""
        with self._lock:
            return self.exhausted and not self._unfinished and not self._finished

    # -- checkpoint and restore ---------------------------------------------------------------------

    def checkpoint_state(self, buffered_ordinals: Iterable[int]) -> dict:
        """Everything a restore needs, as plain JSON, taken in one call under the lock.

        `buffered_ordinals`: the ordinals of the groups in the replay-buffer state saved with this
        checkpoint. Take the buffer state FIRST, then call this with its ordinals: a group finished in
        between is then missing from both and is generated again; the other order could save a group in
        the buffer that the collector state does not know is buffered, and it would be trained twice.

        Fields:
          format, handout_size
          iterator_state        the snapshot restored: {"json": ...} or {"base64": ...}
          resume_base_ordinal   the ordinal the first record pulled after restoring that snapshot gets
          frontier_ordinal      lowest ordinal not accounted for (all below are trained or dropped)
          lowest_unfinished     lowest ordinal handed out and neither finished nor accounted (else the
                                next ordinal to hand out)
          cut_ordinal           min(frontier_ordinal, lowest_unfinished): the snapshot chosen is the
                                newest whose first ordinal is <= this
          accounted_from        min(resume_base_ordinal, frontier_ordinal): every ordinal below it is
                                accounted for
          accounted_ranges      the exact accounted ordinals >= accounted_from, as [[a, b), ...]
          buffered_ordinals     sorted, as given
          max_ordinal_handed_out  the highest ordinal known at save time (-1 if none); a restore checks
                                arriving records up to here
          positions             {"first": accounted_from, "epoch": [...], "dataset_index": [...]} for
                                ordinals accounted_from .. max_ordinal_handed_out
          ring                  {"capacity", "size", "oldest_ordinal", "newest_ordinal"}
          ring_reaches_cut      False when even the oldest snapshot is past the cut
          prompts_at_risk       ordinals in [frontier, resume_base) neither accounted for nor buffered:
                                a restore cannot hand them out again and drops them with reason
                                "snapshot_ring_overrun" (0 when the ring reaches the cut)
          trained_count, dropped_counts   statistics
          ledger_covers         {"run", "seq"}: the last ledger line this state contains (after fsync),
                                or None without a ledger
        """
        with self._lock:
            buffered = sorted({int(o) for o in buffered_ordinals})
            for o in buffered:
                if o not in self._finished:
                    raise CollectorStateError(
                        f"checkpoint_state: ordinal {o} is given as buffered but is {self._status(o)}; take the "
                        "replay buffer state first and pass exactly its ordinals"
                    )
            frontier = self._accounting.frontier
            lowest_unfinished = min(self._unfinished, default=self._next_ordinal)
            # frontier is the lowest ordinal not accounted for, so it never exceeds lowest_unfinished and
            # cut == frontier; the min is the reference mechanism's rule, kept as a guard.
            cut = min(frontier, lowest_unfinished)
            chosen = next(((k, s) for k, s in reversed(self._ring) if k <= cut), None)
            ring_reaches_cut = chosen is not None
            if chosen is None:
                chosen = self._ring[0]
            resume_base, iterator_state = chosen
            accounted_from = min(resume_base, frontier)
            buffered_set = set(buffered)
            at_risk = [
                o for o in range(frontier, resume_base) if o not in self._accounting and o not in buffered_set
            ]
            if not ring_reaches_cut:
                logger.warning(
                    "snapshot ring (%d handouts) no longer reaches back to ordinal %d: the checkpoint restores "
                    "from ordinal %d and %d prompt(s) still being generated below it cannot be handed out again "
                    "(a restore records them as dropped: %s). Raise snapshot_ring or lower max_staleness.",
                    self.snapshot_ring, cut, resume_base, len(at_risk), RING_OVERRUN_REASON,
                )
            covers = None
            if self._ledger is not None:
                covers = self._ledger.covers()  # flush + fsync: only durable lines are covered
            span = range(accounted_from, self._highest_known + 1)
            return {
                "format": STATE_FORMAT,
                "handout_size": self.handout_size,
                "iterator_state": iterator_state,
                "resume_base_ordinal": resume_base,
                "frontier_ordinal": frontier,
                "lowest_unfinished": lowest_unfinished,
                "cut_ordinal": cut,
                "accounted_from": accounted_from,
                "accounted_ranges": self._accounting.accounted.ranges(accounted_from),
                "buffered_ordinals": buffered,
                "max_ordinal_handed_out": self._highest_known,
                "positions": {
                    "first": accounted_from,
                    "epoch": [self._positions[o][0] for o in span],
                    "dataset_index": [self._positions[o][1] for o in span],
                },
                "ring": {
                    "capacity": self.snapshot_ring,
                    "size": len(self._ring),
                    "oldest_ordinal": self._ring[0][0],
                    "newest_ordinal": self._ring[-1][0],
                },
                "ring_reaches_cut": ring_reaches_cut,
                "prompts_at_risk": len(at_risk),
                "trained_count": self._accounting.trained_count,
                "dropped_counts": dict(self._accounting.dropped_counts),
                "ledger_covers": covers,
            }

    @classmethod
    def restore(
        cls,
        iterator: Iterator,
        state: dict,
        buffered_ordinals: Iterable[int] = (),
        *,
        handout_size: int | None = None,
        snapshot_ring: int = 512,
        ledger: Any = None,
    ) -> Collector:
        """A collector that continues from `state` (from checkpoint_state) on a fresh `iterator` over the
        same data.

        `buffered_ordinals`: the ordinals of the groups actually restored into the replay buffer; empty
        when the buffer is not loaded (load_replay_buffer: false), and then those prompts are generated
        again. The iterator is set to the saved snapshot and the ordinal counter to resume_base_ordinal;
        handout() then throws away each arriving ordinal that is accounted for or buffered (after checking
        its (epoch, dataset_index) against the saved one: DataOrderMismatch if they differ) until it is
        past max_ordinal_handed_out. `handout_size` may differ from the saved one.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"collector state: format {got!r}, expected {STATE_FORMAT!r}")
        try:
            resume_base = int(state["resume_base_ordinal"])
            frontier = int(state["frontier_ordinal"])
            accounted_from = int(state["accounted_from"])
            highest = int(state["max_ordinal_handed_out"])
            positions = state["positions"]
            saved_buffered = {int(o) for o in state["buffered_ordinals"]}
            iterator_state = decode_iterator_state(state["iterator_state"])
            accounted = Accounting([[0, accounted_from]] + [list(r) for r in state["accounted_ranges"]])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"collector state is malformed: {type(e).__name__}: {e}") from e
        if accounted.frontier != frontier or int(positions["first"]) != accounted_from:
            raise CheckpointError(
                f"collector state is inconsistent: frontier_ordinal={frontier}, but the accounted ranges give "
                f"{accounted.frontier}; positions start at {positions['first']}, accounted_from={accounted_from}"
            )
        buffered = {int(o) for o in buffered_ordinals}
        if not buffered <= saved_buffered:
            raise CheckpointError(
                f"restored replay buffer holds ordinals {sorted(buffered - saved_buffered)} that the collector "
                "state does not list as buffered: buffer and collector state are from different checkpoints"
            )

        self = cls(iterator, handout_size or int(state["handout_size"]), snapshot_ring, ledger)
        iterator.set_state(iterator_state)
        with self._lock:
            self._ring.clear()
            self._ring.append((resume_base, state["iterator_state"]))
            self._next_ordinal = resume_base
            self._accounting = accounted
            self._accounting.trained_count = int(state.get("trained_count", 0))
            self._accounting.dropped_counts.update(state.get("dropped_counts", {}))
            first = accounted_from
            self._positions = {
                first + i: (int(e), int(d))
                for i, (e, d) in enumerate(zip(positions["epoch"], positions["dataset_index"]))
            }
            self._positions_floor = first
            self._highest_known = highest
            self._replay_through = highest
            self._finished = set(buffered)
            # Ring overrun at save time: these were being generated below the oldest snapshot; nothing can
            # hand them out again, so record them as dropped instead of losing them silently.
            for o in range(frontier, resume_base):
                if o not in self._accounting and o not in buffered:
                    self._drop(o, RING_OVERRUN_REASON)
                    self.restore_drops.append((o, *self._positions[o]))
            if self.restore_drops:
                logger.warning(
                    "restore: %d prompt(s) below the oldest saved snapshot (ordinal %d) cannot be handed out "
                    "again; recorded as dropped with reason %r: ordinals %s",
                    len(self.restore_drops), resume_base, RING_OVERRUN_REASON, [d[0] for d in self.restore_drops][:20],
                )
        return self

    # -- internals (lock held) ----------------------------------------------------------------------

    def _remember_snapshot(self) -> None:
        key = self._next_ordinal
        state = encode_iterator_state(self._iterator.get_state())
        if self._ring and self._ring[-1][0] == key:
            self._ring[-1] = (key, state)  # nothing was pulled since: same position
        else:
            self._ring.append((key, state))  # the deque drops the oldest when full

    def _prune_positions(self) -> None:
        # A restore needs positions from min(frontier, oldest snapshot) upward; older ones can go.
        floor = min(self._accounting.frontier, self._ring[0][0])
        for o in range(self._positions_floor, floor):
            self._positions.pop(o, None)
        self._positions_floor = max(self._positions_floor, floor)

    def _on_exhausted(self) -> None:
        self.exhausted = True
        if self._next_ordinal <= self._replay_through:
            raise DataOrderMismatch(
                f"after restore the data ended at ordinal {self._next_ordinal}, but the checkpoint had handed "
                f"out ordinals up to {self._replay_through}: the dataset changed"
            )

    def _is_known(self, ordinal: int) -> bool:
        return ordinal in self._accounting or ordinal in self._finished or ordinal in self._unfinished

    def _drop(self, ordinal: int, reason: str, detail: str | None = None) -> None:
        self._accounting.check_new([ordinal], "dropped")
        if self._ledger is not None:  # the line first: if it cannot be written, nothing has changed
            epoch, index = self._positions[ordinal]
            self._ledger.drop(ordinal, dataset_index=index, epoch=epoch, reason=reason, detail=detail)
        self._accounting.mark_dropped(ordinal, reason)
        self._unfinished.discard(ordinal)
        self._finished.discard(ordinal)

    def _status(self, ordinal: int) -> str:
        if ordinal in self._accounting:
            return "already trained or dropped"
        if ordinal in self._finished:
            return "finished (in the replay buffer)"
        if ordinal in self._unfinished:
            return "unfinished (being generated)"
        if ordinal >= self._next_ordinal:
            return f"not handed out yet (next ordinal is {self._next_ordinal})"
        return "not handed out in this process (thrown away on restore, or never)"
