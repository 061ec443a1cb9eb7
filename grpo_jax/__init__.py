"""grpo_jax: asynchronous GRPO in JAX with exact (frontier) restore."""

import os

__version__ = "0.1.0"

# XLA:CPU copies the donated optimizer moments on every learner step unless copy insertion uses region
# analysis (a faster learner step and GRPO step on CPU, results identical: docs/benchmarks.md). The flag
# only concerns the CPU backend. It takes effect if set before JAX initialises its backends; set
# GRPO_JAX_KEEP_XLA_FLAGS=1 to leave XLA_FLAGS untouched.
_CPU_FLAG = "--xla_cpu_copy_insertion_use_region_analysis=true"
if (not os.environ.get("GRPO_JAX_KEEP_XLA_FLAGS")
        and "xla_cpu_copy_insertion_use_region_analysis" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _CPU_FLAG).strip()

# Before JAX starts: with libtpu installed and no TPU here, run on the GPU or the CPU instead of letting libtpu
# print its start-up errors (an explicit JAX_PLATFORMS is kept; see grpo_jax.platform).
from grpo_jax.platform import choose_platform  # noqa: E402 - after the XLA flags, which it does not touch

choose_platform()


# The public names, imported on first use so that `import grpo_jax` stays cheap (no JAX until then).
_PUBLIC = {
    "train": "grpo_jax.api",  # grpo-jax train from Python, with reward callables
    "Config": "grpo_jax.run.config",  # the whole run config (configs/*.yaml)
    "register_reward": "grpo_jax.algorithm.rewards",  # a reward factory under a name the config can use
    "audit": "grpo_jax.state.ledger",  # the prompt ledger's audit: lost and trained-twice prompts
    "read_metrics": "grpo_jax.run.metrics",  # RUN_DIR/metrics.jsonl as rows
    "UserError": "grpo_jax.errors",  # every error a user can fix (one line, exit 2)
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'grpo_jax' has no attribute {name!r}")
