"""What compiling a program for a topology found (per-device memory, FLOPs and HBM bytes, or the compiler's
out-of-memory refusal), kept on disk so that a program already compiled is not compiled again: `grpo-jax
compile` run again after a change to one part of a run (the sampler's settings, say) compiles only the programs
that change, and `--fit`'s layouts that share a side (the same actor layout beside another learner layout)
compile it once. A real model's learner step takes tens of minutes to compile here.

XLA's own persistent cache cannot serve this: an executable compiled for a described topology cannot be loaded
back without a TPU, and only these figures are needed. An entry is keyed by everything the compiler sees: the
lowered program's text (its shapes, shardings, donations and partition count; without source locations), the
devices it is placed on (with their hosts), the topology, and the versions of jax, jaxlib and libtpu and the
XLA and libtpu flags of the environment. Anything else that changes the compile changes one of these.

Where: $GRPO_JAX_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/grpo_jax/compile (~/.cache/grpo_jax/compile); set
the variable to an empty string to compile every program afresh. One small JSON file per program, written
whole (a temporary file renamed), so processes compiling at once (--fit's children) can share the directory.
An entry that cannot be read is compiled again and rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile

import jax

CACHE_DIR_ENV = "GRPO_JAX_COMPILE_CACHE_DIR"
# Bumped when an entry's fields, or how hlo_cost reads a program, change: older entries are then never looked up.
FORMAT = 3


@dataclasses.dataclass(frozen=True)
class Entry:
    """One program's compile as it was found: the memory figures and costs are None when it was refused."""

    memory: dict | None  # programs.Memory's fields
    flops: float | None
    bytes: float | None
    refusal: str  # the compiler's own words when it refused, else ""
    seconds: float  # how long that compile took
    breakdown: dict | None = None  # hlo_cost.Breakdown.as_dict(): FLOPs and bytes with loops counted, by part


def cache_dir() -> pathlib.Path | None:
    """The directory entries live in, or None when the cache is off (the variable set to an empty string)."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return pathlib.Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "grpo_jax" / "compile"


@functools.cache  # read once per process: importlib.metadata walks every installed distribution
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def program_key(lowered: jax.stages.Lowered, args: tuple, topology_name: str) -> str:
    """The hex digest that names a lowered program's entry (see the module docstring for what it covers)."""
    # Ids, hosts and places in the slice: --chips-per-host changes the hosts of the same ids.
    devices = sorted({(d.id, d.process_index, tuple(getattr(d, "coords", ()))) for x in jax.tree.leaves(args)
                      if getattr(x, "sharding", None) is not None for d in x.sharding.device_set})
    parts = [f"format {FORMAT}", f"jax {jax.__version__}", f"jaxlib {_version('jaxlib')}",
             f"libtpu {_version('libtpu')}", f"topology {topology_name}", f"devices {devices}",
             f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
             f"LIBTPU_INIT_ARGS {os.environ.get('LIBTPU_INIT_ARGS', '')}", lowered.as_text()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def load(key: str) -> Entry | None:
    """The entry under `key`, or None when there is none, the cache is off, or the file cannot be read back."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        fields = json.loads((directory / f"{key}.json").read_text())
        return Entry(**{f.name: fields[f.name] for f in dataclasses.fields(Entry)})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: str, entry: Entry) -> None:
    """Write the entry whole; a cache directory that cannot be written (full, read-only) costs only a compile
    next time."""
    directory = cache_dir()
    if directory is None:
        return
    temporary = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=f"{key}.", suffix=".tmp", delete=False) as f:
            temporary = f.name
            json.dump(dataclasses.asdict(entry), f)
        os.replace(temporary, directory / f"{key}.json")
    except OSError:
        if temporary is not None:
            pathlib.Path(temporary).unlink(missing_ok=True)
