"""The platform a process starts on when nobody chose one (grpo_jax.platform, issue 36 item 14): with libtpu
installed and no TPU here, grpo-jax runs on the GPU or the CPU without libtpu's start-up errors; an explicit
JAX_PLATFORMS, a TPU, or no libtpu leave JAX's own choice."""

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import xla_flags
from grpo_jax import platform

REPO = pathlib.Path(__file__).resolve().parents[1]
CLI = os.path.join(os.path.dirname(sys.executable), "grpo-jax")
LIBTPU_NOISE = ("E0000", "host bounds", "unexpected worker hostname", "TPU_WORKER_HOSTNAMES")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An empty /dev and PCI bus, and no JAX plugins: fill them in to describe a machine."""
    dev, pci, plugins = tmp_path / "dev", tmp_path / "pci", tmp_path / "jax_plugins"
    for folder in (dev, pci, plugins):
        folder.mkdir()
    monkeypatch.setattr(platform, "DEV", dev)
    monkeypatch.setattr(platform, "PCI_DEVICES", pci)
    monkeypatch.setattr(platform, "_jax_plugins", lambda: list(plugins.iterdir()))
    return dev, pci, plugins


def pci_device(pci, name: str, vendor: str) -> None:
    (pci / name).mkdir()
    (pci / name / "vendor").write_text(vendor + "\n")


def test_without_a_tpu_the_gpu_or_the_cpu_is_chosen_and_a_tpu_or_no_libtpu_leaves_jax_to_choose(machine):
    dev, pci, plugins = machine
    with_libtpu = {"TPU_LIBRARY_PATH": "/somewhere/libtpu.so"}
    pci_device(pci, "0000:00:04.0", "0x10de")  # another vendor's card
    assert platform.default_platforms(with_libtpu) == "cpu"
    (dev / "nvidia0").touch()
    assert platform.default_platforms(with_libtpu) == "cpu"  # a GPU but no JAX plugin for it: cpu
    (plugins / "xla_cuda12").mkdir()
    assert platform.default_platforms(with_libtpu) == "cuda,cpu"
    (dev / "nvidia0").unlink()
    (dev / "kfd").touch()
    (plugins / "xla_rocm7").mkdir()
    assert platform.default_platforms(with_libtpu) == "rocm,cpu"
    assert platform.default_platforms({**with_libtpu, "JAX_FORCE_TPU_INIT": "1"}) is None


@pytest.mark.parametrize("tpu", ["accel0", "vfio/0", "pci", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES"])
def test_any_sign_of_a_tpu_leaves_jax_to_choose(machine, tpu):
    dev, pci, _ = machine
    environ = {"TPU_LIBRARY_PATH": "/somewhere/libtpu.so"}
    (dev / "vfio").mkdir()
    (dev / "vfio" / "vfio").touch()  # the vfio control device alone is no TPU (GPU passthrough hosts have it)
    assert platform.default_platforms(environ) == "cpu"
    if tpu == "pci":
        pci_device(pci, "0000:00:05.0", platform.GOOGLE_PCI_VENDOR)
    elif tpu.startswith("TPU_"):
        environ[tpu] = "v5litepod-8" if tpu == "TPU_ACCELERATOR_TYPE" else "host-a,host-b"
    else:
        (dev / tpu).touch()
    assert platform.tpu_present(environ) and platform.default_platforms(environ) is None


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"XLA_FLAGS": xla_flags(1)} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=environ)


def test_import_grpo_jax_sets_the_platform_before_jax_starts_and_keeps_an_explicit_one():
    done = run_python("import grpo_jax, os; print(os.environ.get('JAX_PLATFORMS'))")
    chosen = done.stdout.strip()
    assert chosen == (platform.default_platforms() or "None"), done.stderr
    # jax imported first, its backends not started: jax's option is set instead.
    done = run_python("import jax, grpo_jax; print(jax.config.jax_platforms); jax.devices()")
    assert done.returncode == 0 and done.stdout.strip() == (platform.default_platforms() or "None"), done.stderr
    assert not any(noise in done.stderr for noise in LIBTPU_NOISE), done.stderr
    done = run_python("import grpo_jax, os; print(os.environ['JAX_PLATFORMS'])", JAX_PLATFORMS="cuda")
    assert done.stdout.strip() == "cuda", done.stderr
    done = run_python("import jax; jax.config.update('jax_platforms', 'cpu,tpu'); import grpo_jax, os; "
                      "print(jax.config.jax_platforms, os.environ.get('JAX_PLATFORMS'))")
    assert done.stdout.split() == ["cpu,tpu", "None"], done.stderr


@pytest.mark.skipif(platform.default_platforms() is None, reason="libtpu is not installed or a TPU is here: "
                    "JAX chooses, as it should")
def test_a_command_without_jax_platforms_prints_no_libtpu_errors_and_works(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"XLA_FLAGS": xla_flags(1)}
    done = subprocess.run([CLI, "init-model", str(REPO / "configs" / "tiny_cpu.yaml"), "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=180, cwd=REPO, env=environ)
    assert done.returncode == 0 and (tmp_path / "m" / "config.json").exists(), done.stderr
    assert not any(noise in done.stderr for noise in LIBTPU_NOISE), done.stderr
