"""Several JAX processes (one per host, as on a TPU pod): start-up, and the host-level agreements the
trainer needs each step.

Start-up (`initialize`), before anything asks JAX for its devices:
  - explicit: `distributed.coordinator_address` (or env GRPO_JAX_COORDINATOR_ADDRESS) with
    `num_processes` and `process_id` (or GRPO_JAX_NUM_PROCESSES / GRPO_JAX_PROCESS_ID);
  - auto: `distributed.auto: true` (or a TPU pod slice, detected from TPU_WORKER_HOSTNAMES naming more
    than one host) calls jax.distributed.initialize() with JAX's own cluster detection;
  - otherwise one process, and nothing happens.
On CPU, several processes need a collectives backend (gloo) for computations that span them.

`heartbeat_timeout_s` bounds how long the survivors of a killed process wait: JAX's coordination
service then aborts them instead of leaving them hanging in a collective. `shutdown_timeout_s` bounds
the wait for the others at exit (a survivor that stops with an error would otherwise wait 5 minutes).
A process that is alive but stuck (a hung mount, a reward holding the GIL) keeps its heartbeat: every
HostAgreement gather is bounded by its own timeout instead (`trainer.collective_timeout_s`), after which
the waiting process exits with EXIT_COLLECTIVE_TIMEOUT and one line naming the agreement and the absent
processes. A process that died closes its collective connections, and the gather it leaves waiting fails at
once: PeerLost, one line naming the agreement (the survivors exit instead of printing XLA's traceback).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import zlib

import jax
import numpy as np

from grpo_jax.config_io import config_key
from grpo_jax.errors import TrainerError

logger = logging.getLogger(__name__)

# A HostAgreement gather outlived its timeout (another process is alive but stuck): the process exits with this,
# without saving. Distinct from 2 (user error), 3 (diverged) and 75 (preempted and saved).
EXIT_COLLECTIVE_TIMEOUT = 4


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str = config_key("", "host:port of process 0; '' = from the environment, or one process.")
    num_processes: int = config_key(0, "0 = from GRPO_JAX_NUM_PROCESSES (explicit start-up only).")
    process_id: int = config_key(-1, "-1 = from GRPO_JAX_PROCESS_ID (explicit start-up only).")
    auto: bool = config_key(False, "Let JAX detect the cluster (TPU pod, SLURM, ...).")
    heartbeat_timeout_s: int = config_key(100, "A process silent this long is dead: the others abort.")
    initialization_timeout_s: int = config_key(300, "How long start-up waits for every process to connect.")
    shutdown_timeout_s: int = config_key(60, "At exit, how long to wait for the other processes (a dead one never "
                                             "comes).")
    cpu_collectives: str = config_key("gloo", "The collectives implementation of the CPU backend (CPU backend "
                                              "only): gloo or mpi.")

    def validate(self) -> list[str]:
        problems = []
        if min(self.heartbeat_timeout_s, self.initialization_timeout_s, self.shutdown_timeout_s) < 1:
            problems.append("heartbeat_timeout_s, initialization_timeout_s and shutdown_timeout_s must be >= 1")
        if self.cpu_collectives not in ("gloo", "mpi"):
            problems.append(f"cpu_collectives={self.cpu_collectives!r}: allowed gloo, mpi")
        return problems


def _env_int(name: str, fallback: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return fallback
    try:
        return int(value)
    except ValueError:
        from grpo_jax.config_io import ConfigError
        raise ConfigError(f"environment variable {name}={value!r}: must be an integer") from None


def _on_tpu_pod() -> bool:
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    return len(hosts) > 1


def initialize(config: DistributedConfig) -> bool:
    """Start jax.distributed when the config or environment says this is one of several processes.
    Returns True when it did. Must run before the first call that lists devices."""
    from grpo_jax.config_io import ConfigError

    address = config.coordinator_address or os.environ.get("GRPO_JAX_COORDINATOR_ADDRESS", "")
    common = {"initialization_timeout": config.initialization_timeout_s,
              "heartbeat_timeout_seconds": config.heartbeat_timeout_s,
              "shutdown_timeout_seconds": config.shutdown_timeout_s}
    if address:
        count = config.num_processes or _env_int("GRPO_JAX_NUM_PROCESSES", 0)
        index = config.process_id if config.process_id >= 0 else _env_int("GRPO_JAX_PROCESS_ID", -1)
        if count < 1 or not 0 <= index < count:
            raise ConfigError(f"distributed: coordinator {address!r} needs num_processes >= 1 and 0 <= process_id < "
                              f"num_processes (got num_processes={count}, process_id={index}); set them in the "
                              "config or in GRPO_JAX_NUM_PROCESSES / GRPO_JAX_PROCESS_ID")
        if count == 1:
            return False
        _cpu_collectives(config)
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index, **common)
    elif config.auto or _on_tpu_pod():
        _cpu_collectives(config)
        jax.distributed.initialize(**common)
    else:
        return False
    _orbax_barriers_through_the_coordinator()
    logger.info("JAX process %d of %d: %d local device(s), %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return True


def _orbax_barriers_through_the_coordinator() -> None:
    """Orbax's barriers default to a collective over every device, run from its background commit thread.
    That races the trainer's own collectives (issued from the learner thread in a different order on each
    host: an intermittent deadlock) and queues behind the actor's sampling. The coordination service's
    barrier needs no device."""
    import orbax.checkpoint  # noqa: F401 - defines the flag
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # outside absl.app.run nothing parses them; the defaults stand
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def _cpu_collectives(config: DistributedConfig) -> None:
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)


def by_process(devices) -> np.ndarray:
    """Devices as a [num_processes, per_process] array (process order, then device id). Refuses a set in
    which processes hold different numbers of devices: the layouts here cut every host the same way."""
    rows: dict[int, list] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        rows.setdefault(d.process_index, []).append(d)
    sizes = {len(r) for r in rows.values()}
    if len(sizes) != 1:
        raise ValueError(f"devices are spread unevenly over processes: {{process: count}} = "
                         f"{ {p: len(r) for p, r in rows.items()} }")
    return np.array([rows[p] for p in sorted(rows)])


class PeerLost(TrainerError):
    """A collective between the processes failed because one of them is gone (its connections closed)."""


class HostAgreement:
    """Gathers a small int32 vector from every process, over the given devices of every process: the
    learner's for the trainer's agreements (so they never queue behind the actor's sampling), the actor's
    for an actor mesh across hosts (its lockstep rounds). One process: no JAX at all.

    Every gather is bounded by `timeout_s`. JAX's heartbeat ends the wait for a dead process, not for one
    that is alive but stuck (a hung mount, a reward holding the GIL, a save far behind), and the gather, a
    collective inside XLA, cannot be abandoned from Python. So a watchdog thread ends the process when a
    gather outlives the timeout: one line on stderr naming the agreement (its caller and round), the time
    waited and the processes that had not arrived, then os._exit(EXIT_COLLECTIVE_TIMEOUT). Nothing is saved
    (a save is collective too): the last committed checkpoint is where a resume starts. To name the absent
    processes, each process records the round it reached in the coordination service's key-value store
    before it enters the collective (one small write per gather)."""

    def __init__(self, devices, timeout_s: float = 1800.0):
        self.processes = jax.process_count()
        self.timeout_s = timeout_s
        self.round = 0  # gathers so far: the same on every process, which all run the same sequence
        if self.processes == 1:
            return
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        by_host = by_process(devices)
        mesh = Mesh(by_host, ("process", "local"))
        self.row_sharding = NamedSharding(mesh, PartitionSpec("process"))  # row p lives on process p
        self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
        # The same key on every process for the same devices (the learner's and the actor's are disjoint).
        ids = ",".join(str(d.id) for d in by_host.reshape(-1))
        self._arrivals = f"grpo_jax/agreement/{zlib.crc32(ids.encode()):08x}/"
        self._waiting: tuple[float, float, int, str] | None = None  # (start, deadline, round, caller)
        self._watch_changed = threading.Condition()
        self._watchdog: threading.Thread | None = None

    def gather(self, values) -> np.ndarray:
        """[num_processes, len(values)]: row p is process p's values (int32: JAX runs without x64)."""
        local = np.asarray(values, np.int32)[None]
        if self.processes == 1:
            return local
        self.round += 1
        self._watch(self.round)
        try:
            client = _coordination_client()
            if client is not None:
                client.key_value_set(f"{self._arrivals}{jax.process_index()}", str(self.round), allow_overwrite=True)
            return self._collective(jax.make_array_from_process_local_data(self.row_sharding, local))
        finally:
            with self._watch_changed:
                self._waiting = None

    def _collective(self, x: jax.Array) -> np.ndarray:
        try:
            return np.asarray(self._gather(x).addressable_data(0))
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            # A peer that died (SIGKILL, OOM) closes its collective connections: the gather fails at once (gloo's
            # failure comes as either type, from XLA's status). The identity program fails for nothing else.
            why = " ".join(str(e).split())[:300]
            raise PeerLost(f"the agreement of all {self.processes} processes at {_caller()}, round {self.round}, "
                           f"failed ({why}): a process stopped or cannot be reached; once every process has "
                           "stopped, run the same command on each to resume from the last committed checkpoint"
                           ) from e

    def _watch(self, round_: int) -> None:
        start = time.monotonic()
        with self._watch_changed:
            self._waiting = (start, start + self.timeout_s, round_, _caller())
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watchdog_loop, name="grpo-agreement-watchdog",
                                                  daemon=True)
                self._watchdog.start()
            self._watch_changed.notify()

    def _watchdog_loop(self) -> None:
        with self._watch_changed:
            while True:
                if self._waiting is None:
                    self._watch_changed.wait()
                    continue
                left = self._waiting[1] - time.monotonic()
                if left <= 0:
                    break
                self._watch_changed.wait(left)
            start, _, round_, caller = self._waiting
        absent = self._absent(round_)
        os.write(2, (f"grpo-jax: error: the agreement of all {self.processes} processes at {caller}, round "
                     f"{round_}, waited {time.monotonic() - start:.0f}s (timeout {self.timeout_s:g}s: "
                     f"trainer.collective_timeout_s); {absent}; exiting with {EXIT_COLLECTIVE_TIMEOUT} without saving: "
                     "the last committed checkpoint is where a resume starts\n").encode())
        os._exit(EXIT_COLLECTIVE_TIMEOUT)

    def _absent(self, round_: int) -> str:
        """Which processes had not reached `round_`, from their marks in the key-value store; asked in a thread
        of its own, since a coordination service that does not answer must not keep the process alive."""
        answer: list = []  # the marks {process: round}, or the error that came instead

        def read() -> None:
            try:
                answer.append({int(key.rstrip("/").rsplit("/", 1)[-1]): int(value)
                               for key, value in _coordination_client().key_value_dir_get(self._arrivals)})
            except Exception as e:  # noqa: BLE001 - it goes into the line; the exit goes on
                answer.append(e)

        started = _coordination_client() is not None
        if started:
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(5.0)
        if not answer or isinstance(answer[0], Exception):
            why = str(answer[0]).splitlines()[0][:200] if answer else "no answer within 5 s" if started else "none"
            return f"which processes did not arrive is unknown (JAX's coordination service: {why})"
        marks = answer[0]
        late = [p for p in range(self.processes) if marks.get(p, 0) < round_]
        if not late:
            return "every process arrived, but the collective over their devices did not complete"
        return (f"process(es) {', '.join(map(str, late))} did not arrive (last at round "
                f"{', '.join(str(marks.get(p, 0)) for p in late)}: alive but stuck, or far behind)")

    def rows(self, data: np.ndarray) -> tuple[jax.Array, list[int]]:
        """A global [num_processes, len] uint8 array whose row p is process p's `data` (padded with zeros
        to the longest), and every row's true length: how each process's own state goes into one Orbax
        checkpoint."""
        lengths = [int(n) for n in self.gather([len(data)])[:, 0]]
        row = np.zeros((1, max(lengths)), np.uint8)
        row[0, :len(data)] = data
        return jax.make_array_from_process_local_data(self.row_sharding, row), lengths


def _coordination_client():
    from jax._src import distributed as jax_distributed  # its key-value store has no public API

    return jax_distributed.global_state.client


def _caller() -> str:
    """The first frame outside this module: which agreement a gather is (function, file and line)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return f"{frame.f_code.co_qualname} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
