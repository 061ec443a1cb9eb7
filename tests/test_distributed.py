"""Start-up decisions of grpo_jax.distributed that need no second process (those are in test_multiprocess)."""

import numpy as np
import pytest

from grpo_jax import distributed
from grpo_jax.config_io import ConfigError
from grpo_jax.distributed import DistributedConfig, HostAgreement, initialize


def test_one_process_starts_nothing(monkeypatch):
    for name in ("GRPO_JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    called = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: called.append(kw))
    assert initialize(DistributedConfig()) is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "only-this-host")
    assert initialize(DistributedConfig()) is False and not called


def test_explicit_and_pod_start_up_pass_the_right_arguments(monkeypatch):
    called = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: called.append(kw))
    monkeypatch.setattr(distributed, "_cpu_collectives", lambda config: None)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
    monkeypatch.setenv("GRPO_JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("GRPO_JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("GRPO_JAX_PROCESS_ID", "3")
    assert initialize(DistributedConfig(heartbeat_timeout_s=7)) is True
    assert called[-1] == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                          "initialization_timeout": 300, "heartbeat_timeout_seconds": 7,
                          "shutdown_timeout_seconds": 60}
    monkeypatch.delenv("GRPO_JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    assert initialize(DistributedConfig()) is True
    assert called[-1] == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 100,
                          "shutdown_timeout_seconds": 60}  # JAX detects the pod


@pytest.mark.parametrize("env, message", [
    ({"GRPO_JAX_NUM_PROCESSES": "two"}, "GRPO_JAX_NUM_PROCESSES='two': must be an integer"),
    ({"GRPO_JAX_NUM_PROCESSES": "2", "GRPO_JAX_PROCESS_ID": "2"}, "0 <= process_id < num_processes"),
    ({}, "needs num_processes >= 1"),
])
def test_an_incomplete_explicit_start_up_is_a_clear_error(monkeypatch, env, message):
    for name in ("GRPO_JAX_NUM_PROCESSES", "GRPO_JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        initialize(DistributedConfig(coordinator_address="localhost:1"))


def test_one_process_agreement_needs_no_collective():
    agreement = HostAgreement(devices=[])
    assert agreement.gather([3, 1]).tolist() == [[3, 1]]
    assert np.asarray(agreement.gather([True, False])).any(axis=0).tolist() == [True, False]
