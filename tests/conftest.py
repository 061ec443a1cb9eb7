"""Shared test setup: eight simulated CPU devices for mesh tests, and small shared fixtures."""

import os

# Must happen before jax is imported anywhere: multi-device tests run on simulated host devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pathlib

import pytest

GSM8K_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.fail(f"GSM8K test data not found at {GSM8K_DIR} (expected ../shared/data/gsm8k beside the repo)")
    return GSM8K_DIR
