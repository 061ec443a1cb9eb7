"""Groups that can no longer be trained are generated again, never lost: restored groups that no longer fit
a changed config, and groups that grow too stale after a finite dataset has run out."""

import json
import logging
import time

from grpo_jax.run.trainer import Trainer
from grpo_jax.state.ledger import audit
from test_checkpoint import preempt_after
from test_trainer import assert_every_ordinal_accounted_once, read_ledger, tiny_config


def force_staleness_once_at_the_end(trainer: Trainer) -> list[list[int]]:
    """Makes the buffer find the groups waiting too stale once, the first time the learner takes groups after
    the actor has seen the end of the data (max_staleness 1 then -1 for that take). Returns the list that
    receives the ordinals found too stale."""
    take, forced = trainer.buffer.take, []

    def take_forcing_staleness_once(n, version, timeout=None):
        if not (trainer.collector.exhausted and not forced):
            return take(n, version, timeout=timeout)
        trainer.buffer.max_staleness = -1
        try:
            taken = take(n, version, timeout=timeout)
        finally:
            trainer.buffer.max_staleness = 1
        if taken.too_stale:
            forced.append([g.ordinal for g in taken.too_stale])
        return taken

    trainer.buffer.take = take_forcing_staleness_once
    return forced


def test_resume_after_lowering_limits_and_capacity_generates_misfits_again(tmp_path, monkeypatch, caplog):
    overrides = ["grpo.max_staleness=2", "checkpoint.every_steps=0", "trainer.tensorboard=false"]
    learn = Trainer._learn

    def slow_learn(self, groups, step):
        time.sleep(0.5)  # a slow learner: the actor runs ahead and fills the buffer
        return learn(self, groups, step)

    monkeypatch.setattr(Trainer, "_learn", slow_learn)
    preempt_after(monkeypatch, 3)
    first = Trainer(tiny_config(tmp_path, "trainer.max_steps=8", *overrides))
    first.train()
    monkeypatch.undo()
    meta = json.loads((tmp_path / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta["buffered_groups"] > 0, "the test needs groups in the saved buffer"

    lowered = ["sampler.max_new_tokens=2", "trainer.buffer_capacity=4"]
    with caplog.at_level(logging.WARNING):
        second = Trainer(tiny_config(tmp_path, "trainer.max_steps=6", *overrides, *lowered))
    left_out = second.buffer.left_out
    assert left_out and len(second.buffer) + len(left_out) == meta["buffered_groups"]
    assert len(second.buffer) <= 4
    assert all(len(c) <= 2 for o in second.buffer.ordinals() for c in second.buffer._groups[o].completions)
    assert "no longer fit this config and will be generated again" in caplog.text
    second.train()
    report = audit(tmp_path)
    assert report.ok and not report.lost and not report.trained_twice, report.summary()
    # Generated again and then trained or dropped for what the new answers were (with 2 new tokens many are
    # overlong), never dropped for not fitting.
    accounted = {}
    for line in read_ledger(tmp_path):
        if line["run"] == 1 and line["event"] == "train":
            accounted.update({o: "trained" for o in line["ordinals"]})
        elif line["run"] == 1 and line["event"] == "drop":
            accounted[line["ordinal"]] = line["reason"]
    assert all(accounted.get(o) in ("trained", "overlong", "reward_error") for o, _ in left_out), accounted


def test_a_group_grown_too_stale_after_the_data_ran_out_is_generated_again(tmp_path):
    config = tiny_config(tmp_path, "data.num_epochs=1", "data.synthetic_size=22", "trainer.max_steps=50",
                         "grpo.max_staleness=1", "trainer.tensorboard=false")
    trainer = Trainer(config)
    forced = force_staleness_once_at_the_end(trainer)
    trainer.train()
    assert forced, "the data never ran out with groups waiting"
    trained, dropped = assert_every_ordinal_accounted_once(tmp_path)
    assert sorted(trained + dropped) == list(range(22))
    reasons = {line["ordinal"]: line["reason"] for line in read_ledger(tmp_path) if line["event"] == "drop"}
    assert "run_ended" not in reasons.values(), reasons
    regenerated = {o: line["weight_version"][line["ordinals"].index(o)] for line in read_ledger(tmp_path)
                   if line["event"] == "train" for o in line["ordinals"] if o in forced[0]}
    assert regenerated, "no regenerated group was trained"


class PeerAgreement:
    """Stands in for HostAgreement with one simulated peer process: the peer never has its groups, and asks
    to stop from round `peer_stops_at` on (None: never). Records every round."""

    def __init__(self, peer_stops_at=None):
        self.rounds, self.peer_stops_at = [], peer_stops_at

    def gather(self, values):
        import numpy as np
        self.rounds.append(list(values))
        peer_stop = self.peer_stops_at is not None and len(self.rounds) >= self.peer_stops_at
        return np.array([[int(v) for v in values], [int(peer_stop), 0]])


def waiting_trainer(tmp_path, agreement):
    trainer = Trainer(tiny_config(tmp_path, "trainer.max_steps=2", "trainer.group_timeout_s=30"))
    trainer.processes, trainer.agreement = 2, agreement  # the step's other half is on a peer
    trainer.actor.start()
    deadline = time.monotonic() + 120
    while len(trainer.buffer) < trainer.local_prompts and time.monotonic() < deadline:
        time.sleep(0.1)  # this process's groups are ready: only the peer keeps the step waiting
    return trainer


def test_a_signal_while_a_peer_waits_abandons_the_step_within_a_round(tmp_path):
    agreement = PeerAgreement()
    trainer = waiting_trainer(tmp_path, agreement)
    try:
        import threading
        start = time.monotonic()  # before the timer starts, so a busy machine cannot make the wait look short
        threading.Timer(1.0, trainer.stop_signals.stop).start()  # this process is signalled after 1 s
        assert trainer._take_step_groups(0) is None
        waited = time.monotonic() - start
        assert 1.0 <= waited < 1.0 + 2 * trainer.STOP_ROUND_S + 0.5
        assert agreement.rounds[0] == [False, True]
        assert agreement.rounds[-1][0] is True  # the round that carried the stop
        assert len(trainer.buffer) >= trainer.local_prompts  # the taken groups went back for the checkpoint
    finally:
        trainer.actor.stop()
        trainer.ledger.close()
        trainer.checkpoints.close()


def test_a_peer_signal_stops_this_process_too(tmp_path):
    trainer = waiting_trainer(tmp_path, PeerAgreement(peer_stops_at=3))
    try:
        assert trainer._take_step_groups(0) is None
        assert trainer.stop_signals.received is not None
    finally:
        trainer.actor.stop()
        trainer.ledger.close()
        trainer.checkpoints.close()
