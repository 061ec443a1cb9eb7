"""Several JAX processes on this machine, as on a pod: each `grpo-jax train` process gets its own simulated
CPU devices, the processes talk through jax.distributed (gloo collectives), and the run is preempted
(SIGTERM to one process), killed (SIGKILL to one process: the others must stop, not hang) and resumed.
The audit must then report nothing lost and nothing trained twice, and every process must have held the
same parameters after every step."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import xla_flags
from grpo_jax.parallel.distributed import EXIT_COLLECTIVE_TIMEOUT
from test_distributed import read_until
from test_trainer import FAST, REPO

MAX_STEPS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_all(run_dir: pathlib.Path, processes: int, devices: int, actor_devices: int,
              overrides=()) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for index in range(processes):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(GRPO_JAX_COORDINATOR_ADDRESS=f"localhost:{port}", GRPO_JAX_NUM_PROCESSES=str(processes),
                   GRPO_JAX_PROCESS_ID=str(index), JAX_PLATFORMS="cpu",
                   XLA_FLAGS=xla_flags(devices))
        command = [sys.executable, "-m", "grpo_jax.cli", "train", str(REPO / "configs" / "tiny_cpu.yaml"),
                   "--run-dir", str(run_dir), *FAST, f"trainer.max_steps={MAX_STEPS}", "grpo.max_staleness=1",
                   "checkpoint.every_steps=2", "trainer.tensorboard=false", f"mesh.actor_devices={actor_devices}",
                   "trainer.check_replicas=true", "distributed.heartbeat_timeout_s=10",
                   "distributed.initialization_timeout_s=120", "distributed.shutdown_timeout_s=10", *overrides]
        log = open(run_dir.parent / f"process{index}.log", "ab")
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def ledger_lines(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "events.process0.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines()]


def wait_lines(run_dir, procs, event: str, n: int, timeout: float = 400) -> None:
    """Wait until the processes just started have written n `event` lines (their ledger run is a new one)."""
    runs_before = max((line["run"] for line in ledger_lines(run_dir)), default=-1)
    deadline = time.monotonic() + timeout
    while sum(1 for line in ledger_lines(run_dir) if line["run"] > runs_before and line["event"] == event) < n:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"no {n} steps: exit codes {[p.poll() for p in procs]}; see {run_dir.parent}/process*.log")
        time.sleep(0.1)


def exit_codes(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process still runs {timeout} s later: it hangs instead of stopping")
    return codes


# One actor per host (its mesh fits a host's actor devices), then one actor mesh across hosts: fsdp over both
# hosts' 2 actor devices each, and tensor over 4 hosts' 1 each (the static sampler: one batch of all hosts' prompts).
# The fsdp layout's data runs out (50 prompts, one epoch: about 8 steps) in its last run: rounds where only some
# hosts still have prompts, whose others generate with them and finish nothing, after a preemption and a kill.
# The 4-host runs, never preempted, end at step 6: killed after their first checkpoint (step 2), they resume for 4.
ACROSS_HOSTS = ("sampler.engine=static",)
FINITE_PROMPTS = 50
FINITE = ("data.num_epochs=1", f"data.synthetic_size={FINITE_PROMPTS}", "trainer.max_steps=50")
SHORT_STEPS = 6
SHORT = (f"trainer.max_steps={SHORT_STEPS}",)
LAYOUTS = [(2, 4, 2, ()), (4, 2, 1, SHORT),
           (2, 3, 2, ("mesh.actor.fsdp=4", *ACROSS_HOSTS, *FINITE)),
           (4, 2, 1, ("mesh.actor.tensor=4", *ACROSS_HOSTS, *SHORT))]


@pytest.mark.parametrize("processes, devices, actor_devices, overrides", LAYOUTS,
                         ids=["2-hosts", "4-hosts", "2-hosts-actor-fsdp-across", "4-hosts-actor-tensor-across"])
def test_preempted_killed_and_resumed_on_several_processes_loses_nothing(tmp_path, processes, devices, actor_devices,
                                                                         overrides):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    across, finite = any(x.startswith("mesh.actor.") for x in overrides), FINITE[0] in overrides

    if processes == 2:
        # SIGTERM to one process: every process stops after the same step, with one checkpoint, exit 75.
        procs = start_all(run_dir, processes, devices, actor_devices, overrides)
        wait_lines(run_dir, procs, "train", 3)
        procs[-1].send_signal(signal.SIGTERM)
        assert exit_codes(procs, 120) == [75] * processes
        steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        assert steps and steps[-1] >= 3

    # SIGKILL to one process once this start has committed a checkpoint: the others stop (JAX's
    # heartbeat) instead of hanging, and the resume goes back to that checkpoint.
    procs = start_all(run_dir, processes, devices, actor_devices, overrides)
    wait_lines(run_dir, procs, "checkpoint", 1)
    procs[1].kill()
    codes = exit_codes(procs, 90)
    assert all(code != 0 for code in codes), codes

    # Resume and run to the end.
    procs = start_all(run_dir, processes, devices, actor_devices, overrides)
    assert exit_codes(procs, 600) == [0] * processes, (tmp_path / "process0.log").read_text()[-3000:]

    audit = subprocess.run(
        [sys.executable, "-m", "grpo_jax.cli", "audit", str(run_dir)], capture_output=True, text=True
    )
    print(audit.stdout)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "lost:                 0" in audit.stdout and "trained twice:        0" in audit.stdout
    assert f"events.process0.jsonl: run {2 if processes == 2 else 1} <- run" in audit.stdout  # resumed
    assert sorted(p.name for p in run_dir.glob("events.process*.jsonl")) == [
        f"events.process{i}.jsonl" for i in range(processes)]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") != "eval"]  # the learner-step lines
    log = (tmp_path / "process0.log").read_text()
    if finite:  # every prompt handed out and accounted for, and the run ended at the data's end, not by its stop
        exhausted = re.findall(r"data exhausted after (\d+) steps", log)
        assert exhausted and max(r["step"] for r in rows) == int(exhausted[-1]), exhausted
        assert f"prompts handed out:   {FINITE_PROMPTS}" in audit.stdout and "run_ended" not in audit.stdout
    else:
        assert max(r["step"] for r in rows) == (SHORT_STEPS if SHORT[0] in overrides else MAX_STEPS)
    assert ("actor: one mesh across" in log) == across
    # Written by process 0 from weights gathered one at a time by all processes: loadable, finite.
    from grpo_jax.model.hf import load_hf_model
    from grpo_jax.model.transformer import param_dict
    final, _ = load_hf_model(run_dir / "final_model")
    assert all(np.isfinite(np.asarray(w)).all() for w in param_dict(final).values())
    for row in rows:  # every process held the same weights after every step (across hosts: one copy, none to compare)
        if across:
            assert "replica_digests" not in row
        else:
            assert len(row["replica_digests"]) == processes and len(set(row["replica_digests"])) == 1, row["step"]
    # Ordinals are global: the processes' trained ordinals never overlap and each is its own residue class.
    for i in range(processes):
        lines = [json.loads(x) for x in (run_dir / f"events.process{i}.jsonl").read_text().splitlines()]
        ordinals = [o for line in lines if line["event"] == "train" for o in line["ordinals"]]
        assert ordinals and all(o % processes == i for o in ordinals)


def test_an_actor_across_hosts_with_several_devices_per_process_on_both_sides_is_refused_on_cpu(tmp_path):
    # 2 actor + 2 learner devices per process: XLA's CPU client deadlocks running both programs at once.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_all(run_dir, 2, 4, 2, ("mesh.actor.fsdp=4", *ACROSS_HOSTS))
    assert exit_codes(procs, 120) == [2, 2]
    for index in range(2):
        lines = [x for x in (tmp_path / f"process{index}.log").read_text().splitlines() if "error" in x]
        assert len(lines) == 1 and "needs one device per process on the actor's or on the learner's side" in lines[0]


# Process 1 is alive (its heartbeats go on) but does not come to the second agreement: process 0 waits in it,
# inside the collective, where Python runs no signal handler.
LATE_PEER = r"""
import sys, time
import jax
process, port, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process,
                           heartbeat_timeout_seconds=10, initialization_timeout=60, shutdown_timeout_seconds=5)
from grpo_jax.parallel.distributed import HostAgreement
agreement = HostAgreement(jax.devices(), timeout_s=timeout_s)
assert agreement.gather([process]).tolist() == [[0], [1]]
if process == 1:
    time.sleep(120)
    sys.exit(0)
from grpo_jax.run.trainer import StopSignals
with StopSignals() as signals:
    print("waiting", flush=True)
    agreement.gather([process])
"""


def test_an_agreement_with_a_live_but_stuck_peer_ends_after_the_collective_timeout(tmp_path):
    port, timeout_s = free_port(), 6
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one CPU device per process
    procs = [subprocess.Popen([sys.executable, "-c", LATE_PEER, str(p), str(port), str(timeout_s)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in (0, 1)]
    try:
        while (line := procs[0].stdout.readline()) not in (b"waiting\n", b""):
            pass  # gloo's own lines
        assert line == b"waiting\n", procs[0].stderr.read().decode()[-3000:]
        waiting = time.monotonic()
        time.sleep(1)
        # A signal while blocked in the collective is taken at once (a stop asked for, the wait goes on) ...
        procs[0].send_signal(signal.SIGTERM)
        assert "received SIGTERM" in read_until(procs[0], "received SIGTERM", 5)
        assert procs[0].poll() is None
        # ... and the wait itself ends at the timeout: one line naming the agreement and the absent process.
        assert procs[0].wait(timeout_s + 20) == EXIT_COLLECTIVE_TIMEOUT
        waited = time.monotonic() - waiting
        assert timeout_s - 1 <= waited < timeout_s + 10
        lines = [x for x in procs[0].stderr.read().decode().splitlines() if x.strip()]
        assert lines[-1].startswith("grpo-jax: error: ") and len([x for x in lines if "error" in x]) == 1, lines
        gather_line = LATE_PEER.splitlines().index("    agreement.gather([process])") + 1
        for part in (f"<module> (<string>:{gather_line})", "round 2", f"{timeout_s}s", "process(es) 1 did not arrive",
                     "last committed checkpoint"):
            assert part in lines[-1], (part, lines[-1])
        assert procs[1].poll() is None  # the late one was alive all along
    finally:
        for p in procs:
            p.kill()
            p.wait()


# Process 1 dies (as under SIGKILL: no cleanup) after the first agreement; process 0 comes to the second.
DEAD_PEER = r"""
import os, sys
import jax
process, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process,
                           heartbeat_timeout_seconds=30, initialization_timeout=60, shutdown_timeout_seconds=5)
from grpo_jax.parallel.distributed import HostAgreement, PeerLost
agreement = HostAgreement(jax.devices(), timeout_s=60)
assert agreement.gather([process]).tolist() == [[0], [1]]
if process == 1:
    os._exit(9)
try:
    agreement.gather([process])
except PeerLost as e:
    print(f"grpo-jax: error: {e}", file=sys.stderr, flush=True)
    os._exit(e.exit_code)
"""


def test_an_agreement_whose_peer_died_fails_at_once_in_one_line_naming_it(tmp_path):
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    procs = [subprocess.Popen([sys.executable, "-c", DEAD_PEER, str(p), str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in (0, 1)]
    try:
        assert procs[1].wait(60) == 9
        started = time.monotonic()
        code = procs[0].wait(25)  # well before the heartbeat (30 s) or the agreement's own timeout (60 s)
        stderr = procs[0].stderr.read().decode()
        assert code == 2 and time.monotonic() - started < 20, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        line = [x for x in stderr.splitlines() if x.startswith("grpo-jax: error: ")][-1]
        gather_line = DEAD_PEER.splitlines().index("    agreement.gather([process])") + 1
        for part in (f"<module> (<string>:{gather_line})", "round 2", "a process stopped or cannot be reached",
                     "last committed checkpoint"):
            assert part in line, (part, line)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_moe_model_trains_on_two_processes_each_routing_its_own_rows(tmp_path):
    """Qwen3-MoE on 2 processes (learner fsdp over both hosts' 2 devices: each device routes and computes its own
    rows, the experts' weights gathered): at staleness 0 the learner's log-probs of each process's rows equal its
    engine's (importance weights 1), which routing replayed to the wrong rows would break; every process held the
    same weights after every step, and nothing is lost or trained twice."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    moe = ("model.architecture=qwen3_moe", "model.head_dim=16", "model.qkv_bias=false", "model.num_layers=2",
           "model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
           "model.mlp_only_layers=[1]", "grpo.max_staleness=0", "loss.off_policy=tis", "optim.warmup_steps=0",
           "optim.lr=1e-2", "trainer.max_steps=3")
    procs = start_all(run_dir, 2, 4, 2, moe)
    assert exit_codes(procs, 400) == [0, 0], (tmp_path / "process0.log").read_text()[-3000:]
    audit = subprocess.run([sys.executable, "-m", "grpo_jax.cli", "audit", str(run_dir)], capture_output=True,
                           text=True)
    assert audit.returncode == 0 and "lost:                 0" in audit.stdout, audit.stdout + audit.stderr
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") != "eval"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert abs(row["tis/weight_max"] - 1) < 1e-4 and row["tis/mismatch_kl"] < 1e-8, row
        assert len(set(row["replica_digests"])) == 1, row["step"]
    config_json = json.loads((run_dir / "final_model" / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen3MoeForCausalLM"]
