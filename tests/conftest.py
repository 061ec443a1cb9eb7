"""Shared test setup: eight simulated CPU devices for mesh tests, and small shared fixtures."""

import os

# XLA's CPU backend at LLVM's lowest optimisation level: the suite's programs are tiny, so compiling them costs
# far more than running them (test_trainer.py: 263 s with a cold compilation cache, 90 s warm), and level 0
# compiles them faster (204 s cold; measured with the default level and with 0 in one session). The programs
# compute the same operations in the same order (no fast-math either way); the speed of the compiled code is
# measured by tools/, not by tests. Processes the tests start get it too (xla_flags).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process a test starts: `devices` simulated CPU devices, and the suite's compile flags."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"


# Must happen before jax is imported anywhere: multi-device tests run on simulated host devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + TEST_XLA_FLAGS

import atexit
import pathlib
import shutil
import tempfile

# Many tests compile the same tiny programs (sampler, learner step) in fresh objects; a persistent
# compilation cache shared by the whole session turns the repeats into cache hits. .ci/run gives one
# directory to the whole run (the pytest-xdist workers and every process the tests start); otherwise a
# fresh directory per session: nothing carries over between runs, so every run compiles honestly.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _CACHE_DIR = tempfile.mkdtemp(prefix="grpo_jax_xla_cache_")
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest

GSM8K_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.fail(f"GSM8K test data not found at {GSM8K_DIR} (expected ../shared/data/gsm8k beside the repo)")
    return GSM8K_DIR


class SmallDisk:
    """A tmpfs of a few MiB mounted at `path`: `fill()` writes a filler file until the disk refuses a byte
    (ENOSPC), `free()` removes it. A real full disk, not a mocked write."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.filler = path / ".filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for chunk in (65536, 512, 1):
                try:
                    while True:
                        os.write(fd, b"x" * chunk)
                except OSError:
                    pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path, request):
    """A SmallDisk of `request.param` MiB (default 32), or skip where tmpfs cannot be mounted (not root)."""
    import subprocess

    size_mib = getattr(request, "param", 32)
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk tests need root")
    try:
        yield SmallDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# The README's test command runs the suite on two pytest-xdist workers with `--dist loadfile`: a module's tests
# all go to one worker, so its module fixtures (a TPU compile, a trained run: half a minute to two minutes
# each) are built once. (`--dist loadgroup` with xdist_group marks did not group them: pytest-xdist 3.8 renames
# node ids through an attribute pytest 9.2 no longer reads, so each test went to either worker and both paid
# for the fixtures.) `--no-loadscope-reorder` keeps the order below, longest modules first (measured with
# `--durations=0`), so that neither worker is left alone with a long one at the end; and the several-process
# runs of test_multiprocess stay on one worker, never two of them at once on the machine's 2 cores.
LONGEST_FIRST = ["test_multiprocess", "test_learner", "test_compile", "test_weight_sync", "test_fit", "test_lora",
                 "test_warm_start", "test_plan", "test_packing", "test_evaluation", "test_trainer", "test_engine",
                 "test_resume_e2e"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: modules stay contiguous
