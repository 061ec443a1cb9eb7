"""Meshes and parameter layouts.

Parameters carry logical axis names (model.py); a rule table maps each name to a mesh axis. The same
model runs on one device (every rule maps to an axis of size 1) and on an N-device mesh with FSDP
(`embed` over `fsdp`) and tensor parallelism (heads, MLP and vocab over `tensor`). A dimension that
does not divide evenly over its mesh axis stays replicated rather than failing, so e.g. 2 KV heads on
a 4-way tensor axis are replicated while the 8 query heads are split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from grpo_jax.config_io import config_key

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    # Experts: split over fsdp (FSDP: gathered where used; with model.expert_parallel each device computes its own),
    # each expert's hidden units over tensor; the router replicated over its experts.
    "expert": "fsdp",
    "moe_mlp": "tensor",
    "router": None,
    "norm": None,
    "lora_rank": None,  # LoRA adapters: A [in, rank] and B [rank, out] split like their weight's in / out
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; -1 on one axis means 'all remaining devices'."""

    data: int = config_key(1, "Devices on the data axis (batch rows split, weights replicated); -1: all remaining.")
    fsdp: int = config_key(-1, "Devices on the fsdp axis (batch rows and weights split, weights gathered where "
                               "used); -1: all remaining.")
    tensor: int = config_key(1, "Devices on the tensor axis (heads, MLP and vocab split); -1: all remaining.")

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


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None,
              tensor_across_hosts: bool = False) -> Mesh:
    """The (data, fsdp, tensor) mesh of `devices`. Across hosts the order is process-major, so data and fsdp
    split over hosts and the batch rows a process feeds land on its own devices. The tensor axis stays inside
    one host unless tensor_across_hosts (an actor mesh spanning hosts, whose model may not fit on one): its
    collectives are the chattiest, so the learner keeps them on a host's own links."""
    devices = list(devices if devices is not None else jax.devices())
    shape = config.resolve(len(devices))
    processes = {d.process_index for d in devices}
    # Auto axes: the sharding of activations is left to the compiler's propagation.
    if len(processes) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    per_process = len(devices) // len(processes)
    tensor = shape[2]
    whole_hosts = tensor_across_hosts and tensor % per_process == 0
    if not whole_hosts and (tensor > per_process or per_process % tensor):
        where = ("divide one process's devices or be a multiple of them" if tensor_across_hosts
                 else "divide one process's devices")
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} over {len(processes)} processes with {per_process} "
                         f"device(s) each: the tensor axis ({tensor}) must {where}")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@dataclasses.dataclass(frozen=True)
class DeviceCut:
    """How a run's devices split between actor and learner (trainer.split_devices, grpo-jax compile)."""

    actor: list  # the devices of this host's actor mesh; with actor_spans_hosts, every host's actor devices
    learner: list  # the learner mesh's devices: every host's own learner devices, process-major
    actor_spans_hosts: bool  # one actor mesh over all hosts (else one actor per host, each on its own devices)
    shared: bool  # mesh.actor_devices=0: actor and learner on the same devices


def cut_devices(hosts: np.ndarray, actor_devices: int, actor: MeshConfig, this_host: int = 0) -> DeviceCut:
    """Split `hosts` ([processes, devices per process], distributed.by_process) for mesh.actor_devices and
    mesh.actor. The learner gets every host's devices after the first actor_devices (all of them when 0).
    The actor's mesh is this host's first actor_devices (all when 0) when mesh.actor fits that many devices:
    one sampler per host, no traffic between hosts. When it does not, but fits the actor devices of all hosts
    together, it is one mesh across hosts, for a model whose sampler does not fit on one host. ValueError,
    naming the fix, for a cut that cannot work."""
    processes, per_host = hosts.shape
    n = actor_devices
    host_word = " per host" if processes > 1 else ""
    if n >= per_host:
        raise ValueError(f"mesh.actor_devices={n}: leaves no device for the learner ({per_host} devices{host_word}; "
                         "use 0 to share all devices between actor and learner)")
    local = list(hosts[this_host]) if n == 0 else list(hosts[this_host][:n])
    learner = [d for host in hosts for d in (host if n == 0 else host[n:])]
    try:
        actor.resolve(len(local))
        return DeviceCut(local, learner, False, n == 0)
    except ValueError as on_one_host:
        if processes == 1:
            raise
        try:
            actor.resolve(len(local) * processes)
        except ValueError:
            raise ValueError(f"mesh.actor {dataclasses.asdict(actor)} fits neither one host's {len(local)} actor "
                             f"device(s) nor the {len(local) * processes} of all {processes} hosts together "
                             f"({on_one_host})") from None
    if n == 0:
        raise ValueError(f"mesh.actor {dataclasses.asdict(actor)} spans hosts ({len(local) * processes} devices): an "
                         "actor mesh across hosts needs devices of its own, so set mesh.actor_devices > 0 (on shared "
                         "devices its collectives and the learner's would queue in a different order on each host)")
    return DeviceCut([d for host in hosts for d in host[:n]], learner, True, False)


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


def split_axes(mesh, axes: Sequence[str]) -> tuple[str, ...]:
    """Those of `axes` the (abstract) mesh has with more than one device: the ones a shard_map splits over."""
    return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def traced_on(mesh: Mesh | None, fn):
    """fn traced with `mesh` as the abstract mesh in context, so that the model code that reads it (constrain,
    the experts' and splash attention's shard_maps, the platform attention and the experts choose for) lays
    itself out for that mesh; fn itself without a mesh. Every program that runs the model on a mesh is traced so:
    the learner step, the engines' and the sampler's."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)
    return traced


def constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """x laid out as `spec` when traced under a mesh that has its axes (the learner step is:
    learner.jit_train_step) and each split dimension divides; else x unchanged (the actor, one device, eager
    code), as the parameters' rules leave a dimension whole that does not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    for dim, axes in zip(x.shape, spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        if not set(axes) <= set(mesh.axis_names) or dim % math.prod(mesh.shape[a] for a in axes):
            return x
    return jax.lax.with_sharding_constraint(x, spec)


def constrain_rows(x: jax.Array) -> jax.Array:
    """x's leading (row) dimension split over data x fsdp, the rest whole (see constrain): FSDP's activation
    layout, stated. Left to itself XLA's partitioner also splits activations' embed dimension over fsdp, as the
    weights are, and then moves whole activations between the two layouts (all-to-alls, and partial sums
    all-reduced) instead of gathering the weights: measured on Qwen2.5-1.5B on v5e-8 with planning/hlo_cost.py
    (docs/compile.md)."""
    return constrain(x, PartitionSpec(("data", "fsdp")))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over data and fsdp (the usual FSDP data layout)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def batch_split_problem(mesh: Mesh, processes: int, rows: int, process: str = "process") -> str | None:
    """Why a batch cannot be laid out over `mesh` with batch_sharding, or None when it can. Each of the
    `processes` feeds its own `rows` (prompts_per_step / processes x group_size), split over data x fsdp in
    process order. `process` is the word for one in the message ("process", or "host" for grpo-jax compile)."""
    return rows_split_problem(mesh.shape["data"] * mesh.shape["fsdp"], processes, rows, process)


def rows_split_problem(splits: int, processes: int, rows: int, process: str = "process") -> str | None:
    """batch_split_problem for a mesh whose data x fsdp is `splits`, without the mesh (grpo-jax compile --fit
    prunes layouts with it before any device is involved)."""
    if splits % processes == 0 and rows % (splits // processes) == 0:
        return None
    plural = process + ("es" if process.endswith("s") else "s")
    where = (f" over {processes} {plural}; each {process}'s {rows} rows (prompts_per_step / {plural} x "
             f"group_size)" if processes > 1 else f"; its {rows} rows (prompts_per_step x group_size)")
    return f"mesh.learner: the batch is split {splits} ways (data x fsdp){where} must split evenly over those devices"


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How devices split between the actor (sampling) and the learner (updates)."""

    actor_devices: int = config_key(0, "0: actor and learner share all devices; n: the first n devices sample.")
    actor: MeshConfig = config_key(help="The actor's (sampling) mesh over its devices.", default_factory=MeshConfig)
    learner: MeshConfig = config_key(help="The learner's (updates) mesh over its devices.",
                                     default_factory=MeshConfig)

    def validate(self) -> list[str]:
        return [] if self.actor_devices >= 0 else [f"actor_devices={self.actor_devices}: must be >= 0"]
