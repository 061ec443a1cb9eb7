"""Meshes and parameter layouts.

Parameters carry logical axis names (model.py); a rule table maps each name to a mesh axis. The same
model runs on one device (every rule maps to an axis of size 1) and on an N-device mesh with FSDP
(`embed` over `fsdp`) and tensor parallelism (heads, MLP and vocab over `tensor`). A dimension that
does not divide evenly over its mesh axis stays replicated rather than failing, so e.g. 2 KV heads on
a 4-way tensor axis are replicated while the 8 query heads are split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "lora_rank": None,  # LoRA adapters: A [in, rank] and B [rank, out] split like their weight's in / out
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; -1 on one axis means 'all remaining devices'."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def validate(self) -> list[str]:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        problems = [f"{k}={v}: must be a positive integer or -1" for k, v in sizes.items()
                    if v == 0 or v < -1]
        if sum(v == -1 for v in sizes.values()) > 1:
            problems.append(f"{sizes}: at most one axis may be -1")
        return problems

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes ({known} devices) "
                                 f"do not divide the {num_devices} available devices")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                             f"but {num_devices} are given")
        return tuple(sizes)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = config.resolve(len(devices))
    processes = {d.process_index for d in devices}
    # Auto axes: the sharding of activations is left to the compiler's propagation.
    if len(processes) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    # Across hosts: process-major order, so data and fsdp split over hosts and the batch rows a process
    # feeds land on its own devices; the tensor axis must stay inside one host (its collectives are the
    # chattiest, and cross-host tensor parallelism is not a layout this trainer supports).
    per_process = len(devices) // len(processes)
    if shape[2] > per_process or per_process % shape[2]:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} over {len(processes)} processes with {per_process} "
                         f"device(s) each: the tensor axis ({shape[2]}) must divide one process's devices")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def spec_for(axes: tuple, shape: tuple, mesh: Mesh, rules: dict[str, str | None]) -> PartitionSpec:
    """PartitionSpec for one parameter: logical names mapped by `rules`, unsplittable dims replicated."""
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        mesh_axis = rules.get(name)
        if mesh_axis is None or mesh_axis in used or dim % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh, rules: dict[str, str | None] = DEFAULT_RULES):
    """A NamedSharding for every array in `state` (variables without axis names are replicated)."""
    def one(variable):
        axes = variable.get_metadata().get("axes")
        value = variable.get_value()
        if axes is None or len(axes) != getattr(value, "ndim", 0):
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, spec_for(axes, value.shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_module(module: nnx.Module, mesh: Mesh, rules: dict[str, str | None] = DEFAULT_RULES) -> nnx.Module:
    """Place every parameter of `module` on `mesh` according to its logical axes (in place)."""
    state = nnx.state(module)
    shardings = state_shardings(state, mesh, rules)
    if jax.process_count() > 1:
        # A host-local array cannot be resharded onto other processes' devices; every process built the
        # same values (same seed or checkpoint), so each places its own slices from a host copy.
        state = jax.tree.map(np.asarray, state)
    nnx.update(module, jax.device_put(state, shardings))
    return module


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over data and fsdp (the usual FSDP data layout)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def batch_split_problem(mesh: Mesh, processes: int, rows: int, process: str = "process") -> str | None:
    """Why a batch cannot be laid out over `mesh` with batch_sharding, or None when it can. Each of the
    `processes` feeds its own `rows` (prompts_per_step / processes x group_size), split over data x fsdp in
    process order. `process` is the word for one in the message ("process", or "host" for grpo-jax compile)."""
    splits = mesh.shape["data"] * mesh.shape["fsdp"]
    if splits % processes == 0 and rows % (splits // processes) == 0:
        return None
    plural = process + ("es" if process.endswith("s") else "s")
    where = (f" over {processes} {plural}; each {process}'s {rows} rows (prompts_per_step / {plural} x "
             f"group_size)" if processes > 1 else f"; its {rows} rows (prompts_per_step x group_size)")
    return f"mesh.learner: the batch is split {splits} ways (data x fsdp){where} must split evenly over those devices"
