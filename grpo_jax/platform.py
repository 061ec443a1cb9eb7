"""The JAX platform a process starts on when nobody chose one, set before JAX initialises its backends.

With libtpu installed (jax[tpu], which `grpo-jax compile` needs, or the test extra) JAX's default start tries
the TPU backend on every machine, and on one without a TPU libtpu prints its start-up errors (`E0000 ...
INVALID_ARGUMENT: Error: unexpected worker hostname`, `Failed to find host bounds`) before anything else: a
new user reads that as a failure. choose_platform() then sets JAX_PLATFORMS to the machine's GPU backend
(cuda or rocm, when such a device and JAX's plugin for it are both there) followed by cpu, or to cpu.

It changes nothing when the choice is someone else's or JAX's own is right:
  - JAX_PLATFORMS set (not empty), jax's jax_platforms option set, or JAX_FORCE_TPU_INIT set;
  - libtpu not installed (nothing is noisy);
  - a TPU may be present: a Google TPU on the PCI bus (what jax's hardware_utils reads), a TPU device file
    (/dev/accel* up to v4, /dev/vfio/N from v5e), or a TPU runtime's environment (Cloud TPU VMs and GKE set
    TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES, ...). Erring towards "present" only leaves JAX to choose;
  - jax's backends are initialised already (too late to choose).
`grpo-jax compile` asks for cpu (choose_platform("cpu")): it compiles for a described TPU topology, which
libtpu provides whatever platform the process runs on, and must not take this machine's accelerator.

Layer 0: imports no JAX (jax.config is used only when the caller imported jax already).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

DEV = pathlib.Path("/dev")
PCI_DEVICES = pathlib.Path("/sys/bus/pci/devices")
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on the PCI bus (jax._src.hardware_utils)
TPU_ENVIRONMENT = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_HOST_BOUNDS",
                   "TPU_TOPOLOGY")
NVIDIA_DEVICES = ("nvidia0", "nvidiactl", "dxg")  # as jax looks for a visible NVIDIA GPU (dxg: WSL2)
AMD_DEVICES = ("kfd",)

_chosen: str | None = None  # the value this module put in JAX_PLATFORMS (so not the user's)


def tpu_present(environ=os.environ) -> bool:
    """Whether a TPU may be attached to this machine, found without starting libtpu."""
    if any(environ.get(name) for name in TPU_ENVIRONMENT):
        return True
    if any(DEV.glob("accel*")) or any(p.name.isdigit() for p in _listed(DEV / "vfio")):
        return True
    for device in _listed(PCI_DEVICES):
        try:
            if (device / "vendor").read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def gpu_platform() -> str | None:
    """'cuda' or 'rocm' when such a device and JAX's plugin for it are both on this machine, else None."""
    plugins = {p.name for p in _jax_plugins()}
    if any((DEV / name).exists() for name in NVIDIA_DEVICES) and any(n.startswith("xla_cuda") for n in plugins):
        return "cuda"
    if any((DEV / name).exists() for name in AMD_DEVICES) and any(n.startswith("xla_rocm") for n in plugins):
        return "rocm"
    return None


def libtpu_installed(environ=os.environ) -> bool:
    return bool(environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


def default_platforms(environ=os.environ) -> str | None:
    """JAX_PLATFORMS for a machine where nobody chose one, or None to leave JAX's own choice."""
    if environ.get("JAX_FORCE_TPU_INIT") is not None or not libtpu_installed(environ) or tpu_present(environ):
        return None
    gpu = gpu_platform()
    return f"{gpu},cpu" if gpu else "cpu"


def explicit(environ=os.environ) -> bool:
    """Whether someone other than this module chose the platform (JAX_PLATFORMS, or jax's option)."""
    value = environ.get("JAX_PLATFORMS", "")
    if value and value != _chosen:
        return True
    jax = sys.modules.get("jax")
    configured = getattr(getattr(jax, "config", None), "jax_platforms", None)
    return bool(configured) and configured != _chosen


def choose_platform(platforms: str | None = None) -> str | None:
    """Set the platform unless someone chose one (see the module docstring): `platforms`, or by default
    default_platforms(). Returns the value set, or None when nothing was changed."""
    global _chosen
    if explicit():
        return None
    value = platforms or default_platforms()
    if value is None:
        return None
    jax = sys.modules.get("jax")
    if jax is not None:
        from jax._src import xla_bridge  # no public way to ask whether the backends have started

        initialised = getattr(xla_bridge, "backends_are_initialized", None)
        if initialised is None or initialised():
            return None  # too late to choose (or no way to tell): JAX keeps what it has
        jax.config.update("jax_platforms", value)
    os.environ["JAX_PLATFORMS"] = value  # this process's JAX if not imported yet, and its child processes
    _chosen = value
    return value


def _listed(directory: pathlib.Path) -> list[pathlib.Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _jax_plugins() -> list[pathlib.Path]:
    """The modules of the jax_plugins namespace package (where JAX's cuda and rocm plugins install), unimported."""
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [p for location in spec.submodule_search_locations for p in _listed(pathlib.Path(location))]
