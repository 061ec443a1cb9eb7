"""Shared test setup: eight simulated CPU devices for mesh tests, and small shared fixtures."""

import os

# Must happen before jax is imported anywhere: multi-device tests run on simulated host devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import atexit
import pathlib
import shutil
import tempfile

# Many tests compile the same tiny programs (sampler, learner step) in fresh objects; a persistent
# compilation cache shared by the whole session turns the repeats into cache hits.
# A fresh directory per session: nothing carries over between runs, so every run compiles honestly.
_CACHE_DIR = tempfile.mkdtemp(prefix="grpo_jax_xla_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest

GSM8K_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.fail(f"GSM8K test data not found at {GSM8K_DIR} (expected ../shared/data/gsm8k beside the repo)")
    return GSM8K_DIR
