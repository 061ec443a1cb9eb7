"""TPU topologies described without a TPU (libtpu), and the figures of their chips.

With libtpu installed (`pip install 'jax[tpu]'`), `jax.experimental.topologies` describes the devices of
any TPU slice (e.g. `v5e:2x4`, or `v5p:4x4x4` with its 16 hosts) on a machine that has none; XLA compiles
for them. The chip figures (usable HBM, peak FLOP/s, HBM and ICI bandwidth) turn compiled costs into
roofline times.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax

from grpo_jax.errors import UserError

GIB = 1024 ** 3


class TopologyError(UserError):
    """An unknown topology name, or no TPU compiler (libtpu) installed."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """Figures of one TPU chip (a device may be half a chip: see Topology.devices_per_chip)."""

    name: str
    hbm_bytes: float  # what XLA lets programs use: the nominal capacity less what libtpu reserves
    peak_flops: float  # dense bfloat16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s into one chip: half the bidirectional per-chip figure


# By jax's device_kind. Usable HBM: the "available HBM" of the compiler's own out-of-memory refusals
# (libtpu 0.0.42, from jax[tpu]==0.10.2), per device: v4 15.25G (a device is one of a chip's two
# TensorCores), v5e 15.75G, v5p 95.74G, v6e 31.25G. The rest, from Google's published figures:
# - v4: https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s); ICI from
#   https://jax-ml.github.io/scaling-book/tpus/ (4.5e10 B/s one way per link, 6 links in a 3D torus).
# - v5e: https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GiB at 819 GB/s, 400 GB/s ICI
#   bidirectional per chip).
# - v5p: https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB at 2765 GB/s, 1200 GB/s ICI
#   bidirectional per chip).
# - v6e: https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB at 1638 GB/s, 800 GB/s ICI
#   bidirectional per chip).
CHIPS = {
    "TPU v4": Chip("TPU v4", 2 * 15.25 * GIB, 275e12, 1200e9, 6 * 45e9),
    "TPU v5 lite": Chip("TPU v5e", 15.75 * GIB, 197e12, 819e9, 400e9 / 2),
    "TPU v5": Chip("TPU v5p", 95.74 * GIB, 459e12, 2765e9, 1200e9 / 2),
    "TPU v6 lite": Chip("TPU v6e", 31.25 * GIB, 918e12, 1638e9, 800e9 / 2),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple
    chip: Chip
    devices_per_chip: int  # 2 where each TensorCore is its own device (v4 topologies here)

    @property
    def processes(self) -> int:
        return len({d.process_index for d in self.devices})

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_bytes / self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        return self.chip.peak_flops / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip

    @property
    def ici_bandwidth(self) -> float:
        return self.chip.ici_bandwidth / self.devices_per_chip


def tpu_topology(name: str, chips_per_host: str = "") -> Topology:
    """The devices of a TPU slice named like `v5e:2x4` or `v5p:2x2x2`, described by libtpu (no TPU needed).

    Hosts: `chips_per_host` like "2x4"; by default libtpu's (4 chips per host), except that a v5e or v6e slice
    of up to 8 chips is one host, as Cloud TPU provisions v5litepod-8 and v6e-8."""
    from jax.experimental import topologies

    examples = "e.g. v5e:2x4, v5p:2x2x2, v4:2x2x4, v6e:2x4"
    shape = re.fullmatch(r"(v[0-9a-z]+):(\d+(?:x\d+)+)", name)
    if not shape:
        raise TopologyError(f"--topology {name}: expected VERSION:AxB or VERSION:AxBxC ({examples})")
    dims = [int(n) for n in shape.group(2).split("x")]
    if not chips_per_host and shape.group(1) in ("v5e", "v6e") and math.prod(dims) <= 8:
        chips_per_host = shape.group(2)
    options = {}
    if chips_per_host:
        if not re.fullmatch(r"\d+(x\d+){0,2}", chips_per_host):
            raise TopologyError(f"--chips-per-host {chips_per_host}: expected AxB or AxBxC, e.g. 2x2")
        bounds = [int(n) for n in chips_per_host.split("x")]
        options["chips_per_host_bounds"] = tuple(bounds + [1] * (3 - len(bounds)))
    # libtpu takes /tmp/libtpu_lockfile for one process per TPU host; compiling drives no TPU, so it need not
    # wait for (or block) another process that loaded libtpu. Read when libtpu loads, at the first description.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, **options).devices)
    except Exception as e:  # noqa: BLE001 - jax raises bare RuntimeError/ValueError from the plugin
        if not _has_libtpu():
            raise TopologyError(f"--topology {name}: the TPU compiler is not installed; install it with "
                                f"pip install 'jax[tpu]=={jax.__version__}'") from e
        raise TopologyError(f"--topology {name}{' --chips-per-host ' + chips_per_host if chips_per_host else ''}: "
                            f"libtpu cannot describe it ({examples}): {str(e).splitlines()[0]}") from e
    kind = devices[0].device_kind
    if kind not in CHIPS:
        raise TopologyError(f"--topology {name}: no chip figures for {kind!r} (known: {', '.join(CHIPS)})")
    return Topology(name, devices, CHIPS[kind], max(len(devices) // math.prod(dims), 1))


def _has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None
