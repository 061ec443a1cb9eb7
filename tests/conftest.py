"""Shared test setup: eight simulated CPU devices for mesh tests, and small shared fixtures."""

import os

# XLA's CPU backend set to compile fast: the suite's programs are tiny, so compiling them costs far more than
# running them. LLVM's lowest optimisation level (test_trainer.py: 263 s with a cold compilation cache at the
# default level, 204 s at 0), and fusions emitted by the older elemental emitters run by the older runtime
# (XLA's new fusion emitters and thunk runtime make codegen slower: a learner step of the tiny test model
# compiled in 6.0 s, now 2.6 s; 200 small slicing programs in 13.1 s, now 8.1 s; the whole suite on two workers
# 2,066 s before these two flags, 1,474 s with them and one test's reference jitted). Either way the programs
# compute the same operations (no fast-math); the speed of compiled code is measured by tools/, not by tests.
# Processes the tests start get the same flags (xla_flags).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_use_thunk_runtime=false")


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
import functools
import pathlib
import shutil
import tempfile

# Many tests compile the same tiny programs (sampler, learner step) in fresh objects; a persistent
# compilation cache shared by the whole session turns the repeats into cache hits. .ci/run gives one
# directory to the whole run (the pytest-xdist workers and every process the tests start); otherwise a
# fresh directory per session: nothing carries over between runs, so every run compiles honestly.
# The same for `grpo-jax compile`'s own cache of what compiling a program for a TPU topology found
# (planning/compile_cache.py), so that the tests never read or write the user's ~/.cache.
for _variable, _prefix in (("JAX_COMPILATION_CACHE_DIR", "grpo_jax_xla_cache_"),
                           ("GRPO_JAX_COMPILE_CACHE_DIR", "grpo_jax_compile_cache_")):
    if not os.environ.get(_variable):
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _share_cached_programs_between_devices() -> None:
    """One persistent-cache entry for a program whatever CPU devices it runs on, in the test processes. JAX
    leaves the device assignment out of the cache key on GPU only: on CPU the same tiny program placed on device
    3 instead of device 0 (a weight-sync slice per device, an actor on devices 0-1 in one test and 4-5 in the
    next) compiles again. Loaded from the cache, an executable gets the devices and the assignment it is called
    with (jax's `deserialize_executable`), as on GPU. Processes the tests start do not import this file: they
    key as JAX does. jax is pinned; should the private hook move, the suite only compiles more."""
    import inspect

    from jax._src import cache_key

    hash_options = cache_key._hash_serialized_compile_options
    if "strip_device_assignment" not in inspect.signature(hash_options).parameters:
        return

    def without_device_assignment(hash_obj, compile_options, strip_device_assignment=False):
        return hash_options(hash_obj, compile_options, strip_device_assignment=True)

    cache_key._hash_serialized_compile_options = without_device_assignment


_share_cached_programs_between_devices()

import pytest


@functools.cache
def _jitted_token_logprobs():
    from flax import nnx

    from grpo_jax.algorithm.learner import token_logprobs
    return nnx.jit(token_logprobs, static_argnames=("with_entropy", "last", "temperature", "top_k", "top_p", "chunk"))


def jitted_token_logprobs(model, tokens, input_mask, **options):
    """grpo_jax's token_logprobs as one compiled program, for the tests' checks. Called outside jit it runs
    operation by operation, each compiled for its shapes on first use: a few hundred small compilations for
    every new batch shape (half a minute of a check's time on this machine's 2 cores)."""
    return _jitted_token_logprobs()(model, tokens, input_mask, **options)


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
LONGEST_FIRST = ["test_multiprocess", "test_multiturn_training", "test_compile", "test_lora", "test_learner",
                 "test_gguf", "test_trainer", "test_resume_e2e", "test_weight_sync", "test_packing", "test_moe",
                 "test_evaluation", "test_engine", "test_warm_start", "test_run_dir_faults", "test_fit", "test_plan",
                 "test_checkpoint", "test_sampler", "test_losses", "test_checkpoint_faults"]
# The fast tier's complement (pytest -m "not long"): tools/long_tests.py writes it from measured durations. (The
# `slow` marker is another thing: the few tests that train a run to a learning target, marked where they are
# written, which the README's test command leaves out.)
LONG_TESTS = pathlib.Path(__file__).with_name("long_tests.txt")


def long_test_ids() -> set[str]:
    lines = LONG_TESTS.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers added here
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: modules stay contiguous
    long = long_test_ids()
    for item in items:
        if item.nodeid in long:
            item.add_marker(pytest.mark.long)
    # A whole-suite collection must find every listed test: a renamed one would silently turn fast.
    collected = {item.nodeid for item in items}
    if len(collected) > 1000 and not config.option.keyword and (long - collected):
        raise pytest.UsageError(f"{LONG_TESTS}: no such test(s) {sorted(long - collected)[:3]}: run "
                                "tools/long_tests.py again")


def random_packed_batch(seed: int, size: int, vocab: int, prompt_len: int, completion_len: int, mini_batches: int):
    """A learner batch of `size` random sequences (prompts up to prompt_len, completions up to completion_len tokens)
    packed into rows of prompt_len + completion_len, in `mini_batches` mini-batches."""
    import numpy as np

    from grpo_jax.algorithm.batch import pack_layout, pack_sequences, sequence_lengths
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, rng.integers(1, prompt_len + 1)) for _ in range(size)]
    completions = [rng.integers(1, vocab, rng.integers(1, completion_len + 1)) for _ in range(size)]
    behaviour = [rng.normal(-3.0, 0.3, len(c)) for c in completions]
    advantages = rng.normal(size=size).astype(np.float32)
    row = prompt_len + completion_len
    layout = pack_layout(*sequence_lengths(prompts, completions)[:2], row, completion_len, mini_batches)
    return pack_sequences(prompts, completions, behaviour, advantages, 0, row, completion_len, mini_batches,
                          layout=layout)
