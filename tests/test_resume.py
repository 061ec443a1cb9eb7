"""run.resume's ledger, buffer and collector, fresh or from a restored checkpoint, without a trainer or a model."""

import pathlib

import numpy as np
import pytest

from grpo_jax.errors import CheckpointError
from grpo_jax.run.resume import DataStateSpec, fresh_data_state, resumed_data_state
from grpo_jax.state.checkpoint import Restored
from grpo_jax.state.ledger import Ledger, LedgerDamaged, ledger_file


class Records:
    """An iterator of three records with the get_state/set_state the collector uses."""

    fingerprint = "data-v1"

    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position == 3:
            raise StopIteration
        self.position += 1
        return {"prompt_ids": [self.position], "answer": str(self.position), "epoch": 0,
                "dataset_index": self.position - 1}

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        if "position" not in state:
            raise TypeError("no position")
        self.position = state["position"]


def spec(run_dir: pathlib.Path, **changes) -> DataStateSpec:
    values = dict(run_dir=run_dir, process_index=0, process_count=2, handout_size=2, buffer_capacity=4,
                  max_staleness=1, prompts_per_step=4, snapshot_ring=8, load_replay_buffer=True)
    return DataStateSpec(**{**values, **changes})


def one_process_rows(*others_damaged: bool):
    """The hosts' agreement seen from process 0 (its own row first), with the other rows given."""
    return lambda row: np.array([row, *[[d] for d in others_damaged]])


def checkpoint_of(run_dir: pathlib.Path, step: int, fingerprint: str = "data-v1", **collector) -> Restored:
    ledger = Ledger(run_dir, process_index=0, process_count=2)
    covers = ledger.checkpoint(step, 0)
    ledger.close()
    saved = {"frontier_ordinal": 0, "ledger_covers": covers, **collector}
    return Restored(step=step, state={}, buffer_arrays={}, collector={"collector": saved, "buffer": {}},
                    meta={"facts": {"data_fingerprint": fingerprint}})


def test_a_fresh_start_opens_a_ledger_an_empty_buffer_and_a_collector_at_ordinal_0(tmp_path):
    opened = []
    state = fresh_data_state(spec(tmp_path), Records(), opened.append)
    assert opened == [state.ledger] and len(state.buffer) == 0 and state.collector.frontier == 0
    assert [p.ordinal for p in state.collector.handout()] == [0, 1]
    state.ledger.close()


def test_a_ledger_damaged_on_another_process_stops_this_one_before_it_opens_or_writes_its_own(tmp_path):
    restored = checkpoint_of(tmp_path, 3)
    before = (tmp_path / ledger_file(0, 2)).read_bytes()
    opened = []
    with pytest.raises(LedgerDamaged, match="process 1's prompt ledger does not hold the line that checkpoint step 3"):
        resumed_data_state(spec(tmp_path), Records(), restored, fits=lambda g: None,
                           gather=one_process_rows(True), on_ledger=opened.append)
    assert opened == [] and (tmp_path / ledger_file(0, 2)).read_bytes() == before


def test_a_ledger_missing_its_covered_line_here_is_refused_even_when_the_others_are_whole(tmp_path):
    restored = checkpoint_of(tmp_path, 3)
    (tmp_path / ledger_file(0, 2)).write_text("")
    with pytest.raises(LedgerDamaged, match="does not hold run 0 seq 0"):
        resumed_data_state(spec(tmp_path), Records(), restored, fits=lambda g: None,
                           gather=one_process_rows(False), on_ledger=lambda ledger: None)


def test_changed_data_starts_a_new_chain_at_ordinal_0_with_the_checkpoints_version(tmp_path):
    restored = checkpoint_of(tmp_path, 5, fingerprint="data-v0")
    opened = []
    state = resumed_data_state(spec(tmp_path), Records(), restored, fits=lambda g: None,
                               gather=one_process_rows(False), on_ledger=opened.append)
    assert opened == [state.ledger] and state.ledger.run == 1  # a new chain in the same file
    assert state.buffer.learner_version == 5 and state.collector.frontier == 0
    state.ledger.close()


def test_a_checkpoint_from_before_ordinals_resumes_at_its_iterators_position_or_names_its_bad_state(tmp_path):
    old = Restored(step=2, state={}, buffer_arrays={}, meta={"facts": {"data_fingerprint": "data-v1"}},
                   collector={"collector": {"iterator_state": {"json": {"position": 2}}}})
    records = Records()
    state = resumed_data_state(spec(tmp_path), records, old, fits=lambda g: None,
                               gather=one_process_rows(False), on_ledger=lambda ledger: None)
    assert records.position == 2 and [p.record["answer"] for p in state.collector.handout()] == ["3"]
    state.ledger.close()
    old.collector["collector"]["iterator_state"] = {"json": {}}
    with pytest.raises(CheckpointError, match="checkpoint step 2: unusable iterator state in an older-format"):
        resumed_data_state(spec(tmp_path), Records(), old, fits=lambda g: None,
                           gather=one_process_rows(False), on_ledger=lambda ledger: None)
