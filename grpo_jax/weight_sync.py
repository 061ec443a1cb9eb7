"""Weight sync: the learner's parameters onto the actor's layout after every step, by resharding.

The learner's parameters go to the actor's layout after every step without any device (or the host) ever
holding a whole copy of the model (unless the layout itself asks for one, e.g. a replicated leaf):
  1. (several processes) one jitted program on the learner mesh reshards them to a layout in which every
     host holds a whole copy spread over its own learner devices (host_copy_sharding), cast on the way to
     the compute dtype when the actor only needs that (halving the bytes moved);
  2. on each host, every shard of the actor's layout is put together on its actor device from the slices
     of the host's learner shards that overlap it (reshard_local): device-to-device copies of slices and
     a concatenation on the actor device. (jax.device_put between two device sets routes a layout it
     cannot copy shard for shard through a whole host copy of the array.)
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from grpo_jax.sharding import MESH_AXES


def host_copy_mesh(mesh: Mesh, hosts: int | None = None) -> Mesh | None:
    """A view of `mesh` (the same devices in the same order) in which each learner parameter spec, read
    on the view, gives every host a whole copy split over its own devices only: `mesh` itself when every
    host holds whole data rows of it (parameters are replicated over data), else `fsdp` cut into
    ("fsdp_host", "fsdp") where hosts split the fsdp axis. None when hosts do not cut the mesh that way.
    hosts: the processes among the mesh's devices (given: consecutive blocks of the mesh's devices taken
    as hosts, for tests on one process)."""
    if hosts is None:
        hosts = len({d.process_index for d in mesh.devices.flat})
        if hosts > 1 and not _process_major(mesh, hosts):
            return None
    if hosts == 1:
        return mesh
    data, fsdp, tensor = (mesh.shape[a] for a in MESH_AXES)
    rows = data * fsdp // hosts  # (data, fsdp) cells per host; tensor stays inside a host (make_mesh)
    if data * fsdp % hosts:
        return None
    if rows % fsdp == 0:
        return mesh
    if fsdp % rows:
        return None
    devices = mesh.devices.reshape(data, fsdp // rows, rows, tensor)
    return Mesh(devices, ("data", "fsdp_host", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 4)


def _process_major(mesh: Mesh, hosts: int) -> bool:
    flat = list(mesh.devices.flat)
    per = len(flat) // hosts
    return all(len({d.process_index for d in flat[h * per:(h + 1) * per]}) == 1 for h in range(hosts))


def host_copy_sharding(x, view: Mesh | None, hosts: int | None = None) -> NamedSharding:
    """Where `x` (a learner parameter) goes in step 1: its own spec on the view (host_copy_mesh); without
    a view, a (host, local) mesh of the same devices with the largest dimension that divides evenly split
    over a host's devices (replicated within the host when none does)."""
    sharding = x.sharding
    if view is not None and isinstance(sharding, NamedSharding):
        return NamedSharding(view, _spread(sharding.spec, x.shape, view))
    flat = list(sharding.mesh.devices.flat) if isinstance(sharding, NamedSharding) else \
        sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
    hosts = hosts or len({d.process_index for d in flat})
    mesh = Mesh(np.array(flat).reshape(hosts, -1), ("host", "local"), axis_types=(AxisType.Auto,) * 2)
    local = mesh.shape["local"]
    dims = sorted(range(len(x.shape)), key=lambda i: -x.shape[i])
    split = next((i for i in dims if x.shape[i] % local == 0), None)
    spec = [None] * len(x.shape)
    if split is not None:
        spec[split] = "local"
    return NamedSharding(mesh, PartitionSpec(*spec))


def _spread(spec: PartitionSpec, shape: tuple, view: Mesh) -> PartitionSpec:
    """`spec` with the host's own axes it leaves unused (fsdp, tensor: those of the view inside one host) put
    on the largest dimension they still divide: a leaf the learner replicates over them (an indivisible
    head count, say) is then still spread over the host's devices rather than copied whole onto each."""
    entries = [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in spec]
    entries += [()] * (len(shape) - len(entries))
    used = {a for e in entries for a in e}
    for axis in ("fsdp", "tensor"):
        if axis in used or view.shape[axis] == 1:
            continue
        for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):
            if shape[dim] % (math.prod(view.shape[a] for a in entries[dim]) * view.shape[axis]) == 0:
                entries[dim] += (axis,)
                break
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def narrowed(dtype, compute_dtype):
    """The dtype a weight of `dtype` is sent to the actor in: compute_dtype when it is a narrower float
    (the model casts every weight to it before use), else its own."""
    dtype = np.dtype(dtype)
    if compute_dtype is None or not np.issubdtype(dtype, np.floating):
        return dtype
    compute_dtype = np.dtype(compute_dtype)
    return compute_dtype if compute_dtype.itemsize < dtype.itemsize else dtype


def _box(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _contains(outer: tuple, inner: tuple) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _grid(box: tuple, sources: list) -> list:
    """`box` cut at every edge of the source boxes inside it, as a nested list (one level per dimension) of
    blocks: each block then lies inside one source block (the sources tile the array regularly)."""
    def cut(dim: int, prefix: tuple):
        if dim == len(box):
            return prefix
        lo, hi = box[dim]
        edges = [lo, *sorted({e for b, _ in sources for e in b[dim] if lo < e < hi}), hi]
        return [cut(dim + 1, prefix + ((a, b),)) for a, b in zip(edges, edges[1:])]
    return cut(0, ())


def _blocks(nested):
    if isinstance(nested, list):
        for x in nested:
            yield from _blocks(x)
    else:
        yield nested


class _Plan:
    """How one process puts arrays on target layouts from its own shards of them (reshard_local), worked out
    once per layout: every target shard is a grid of blocks, each sliced (and cast) out of one source shard
    by one jitted program per source device, moved by one batched device_put, and concatenated by one jitted
    program per target device where a shard has more than one block."""

    def __init__(self, arrays: list, shardings: list, dtypes: tuple, may_alias: bool):
        self.shardings, self.shapes = shardings, [x.shape for x in arrays]
        self.cut: dict = {}  # source device -> [(leaf, shard number, slices, dtype)]
        self.moves: list = []  # (source device, its output number or None, (leaf, shard number), target device)
        self.joins: dict = {}  # target device -> [(leaf, nested grid of piece numbers)]
        self.direct: dict = {}  # (leaf, target device) -> piece number: a shard made of one block
        self.targets: list = []  # per leaf: its target devices in order
        pieces = 0
        for i, (x, sharding, dtype) in enumerate(zip(arrays, shardings, dtypes)):
            sources = [(_box(s.index, x.shape), (n, s.device)) for n, s in enumerate(x.addressable_shards)]
            targets = sharding.addressable_devices_indices_map(x.shape)
            self.targets.append(list(targets))
            for device, index in targets.items():
                grid = _grid(_box(index, x.shape), sources)

                def place(block, device=device):
                    nonlocal pieces
                    holders = [(b, src) for b, src in sources if _contains(b, block)]
                    if not holders:
                        raise ValueError(f"no shard of this process holds the block {block} of an array {x.shape}")
                    b, (n, src) = next(((b, h) for b, h in holders if h[1] == device),
                                       holders[device.id % len(holders)])
                    whole = b == block and dtype == x.dtype and (src != device or may_alias)
                    if whole:
                        self.moves.append((src, None, (i, n), device))
                    else:
                        out = self.cut.setdefault(src, [])
                        rel = tuple(slice(lo - start, hi - start) for (lo, hi), (start, _) in zip(block, b))
                        self.moves.append((src, len(out), (i, n), device))
                        out.append((i, n, rel, dtype))
                    pieces += 1
                    return pieces - 1

                def build(nested):
                    return [build(x) for x in nested] if isinstance(nested, list) else place(nested)

                numbered = build(grid) if x.ndim else place(())
                flat = list(_blocks(numbered)) if x.ndim else [numbered]
                if len(flat) == 1:
                    self.direct[(i, device)] = flat[0]
                else:
                    self.joins.setdefault(device, []).append((i, numbered))
        self._cut_programs = {d: jax.jit(self._cutter(jobs)) for d, jobs in self.cut.items()}
        self._join_programs = {d: jax.jit(self._joiner(jobs)) for d, jobs in self.joins.items()}

    @staticmethod
    def _cutter(jobs):
        def cut(shards):
            return [x[rel].astype(dtype) for x, (_, _, rel, dtype) in zip(shards, jobs)]
        return cut

    @staticmethod
    def _joiner(jobs):
        def join(nested, dim=0):
            if not isinstance(nested, list):
                return nested
            parts = [join(x, dim + 1) for x in nested]
            return parts[0] if len(parts) == 1 else jax.numpy.concatenate(parts, axis=dim)

        def joined(grids):
            return [join(g) for g in grids]
        return joined

    def __call__(self, arrays: list) -> list:
        shards = [x.addressable_shards for x in arrays]
        cut = {d: self._cut_programs[d]([shards[i][n].data for i, n, _, _ in jobs]) for d, jobs in self.cut.items()}
        pieces = [shards[i][n].data if k is None else cut[src][k] for src, k, (i, n), _ in self.moves]
        pieces = jax.device_put(pieces, [device for *_, device in self.moves], may_alias=True)
        joined = {}
        for device, jobs in self.joins.items():
            grids = [jax.tree.map(lambda k: pieces[k], numbered) for _, numbered in jobs]
            for (i, _), out in zip(jobs, self._join_programs[device](grids)):
                joined[(i, device)] = out
        results = []
        for i, (shape, sharding) in enumerate(zip(self.shapes, self.shardings)):
            per_device = [pieces[self.direct[(i, d)]] if (i, d) in self.direct else joined[(i, d)]
                          for d in self.targets[i]]
            results.append(jax.make_array_from_single_device_arrays(shape, sharding, per_device))
        return results


_PLANS: dict = {}
GROUPS = 4  # reshard_local moves the arrays in about this many groups (see there)


def reshard_local(arrays: list, shardings: list, may_alias: bool = False, dtypes: tuple | None = None) -> list:
    """`arrays` on `shardings` (devices of this process), each put together shard by shard from its own
    shards on this process (which must hold all of it between them), cast to `dtypes` on the way (default:
    their own): no device, and not the host, ever holds more than one target shard plus the blocks it is
    assembled from. (jax.device_put between device sets with different tilings goes through a whole copy
    of each array on the host.) The arrays go in about GROUPS groups of consecutive ones, so that the blocks
    in flight add about 1/GROUPS of the target layout to a device, not a second copy of it. may_alias: the
    result may share the arrays' buffers where a shard is the same block on the same device (never where the
    learner may donate them)."""
    dtypes = tuple(np.dtype(x.dtype) for x in arrays) if dtypes is None else tuple(np.dtype(d) for d in dtypes)
    sizes = [x.size * d.itemsize for x, d in zip(arrays, dtypes)]
    budget = max(sum(sizes) // GROUPS, max(sizes, default=0))
    results, start, held = [], 0, 0
    for end in range(len(arrays) + 1):
        if end == len(arrays) or (end > start and held + sizes[end] > budget):
            if end > start:
                group = slice(start, end)
                results += _reshard_group(arrays[group], list(shardings[group]), may_alias, dtypes[group])
            start, held = end, 0
        if end < len(arrays):
            held += sizes[end]
    return results


def _reshard_group(arrays: list, shardings: list, may_alias: bool, dtypes: tuple) -> list:
    key = (tuple((x.shape, x.dtype, x.sharding) for x in arrays), tuple(shardings), dtypes, may_alias)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(arrays, shardings, dtypes, may_alias)
        if len(_PLANS) > 256:
            _PLANS.pop(next(iter(_PLANS)))
    return plan(arrays)


class WeightSync:
    """The learner's weights onto the actor's layout, as a separate copy (see above).

    compute_dtype: the model's compute dtype; float weights wider than it are cast to it inside the
    jitted first step (the actor keeps the narrow copy: the model casts every weight to the compute dtype
    before use, so sampling is bit-identical). may_alias (per call): the result may share the learner's
    buffers where both layouts agree (only for weights the learner never donates, the frozen LoRA base)."""

    def __init__(self, compute_dtype=None, hosts: int | None = None):
        self.compute_dtype = None if compute_dtype is None else np.dtype(compute_dtype)
        self.hosts = hosts  # tests: blocks of one process's devices taken as hosts (see host_copy_mesh)
        self._programs: dict = {}

    def stage(self, state):
        """Step 1, on several processes: the weights on a layout in which every host holds a whole copy on
        its learner devices, in the dtype the actor gets; `state` itself when it already is so (one process:
        always; the cast is then done with step 2)."""
        leaves, treedef = jax.tree.flatten(state)
        if (self.hosts or jax.process_count()) == 1 or not leaves:
            return state
        program = self.stage_program(leaves)
        return state if program is None else jax.tree.unflatten(treedef, program(leaves))

    def stage_program(self, leaves: list):
        """The jitted step 1 for these arrays (or jax.ShapeDtypeStructs with shardings: grpo-jax compile can
        lower it), a function of the list of leaves; None when nothing needs to move or be cast."""
        casts = tuple(narrowed(x.dtype, self.compute_dtype) for x in leaves)
        view = host_copy_mesh(leaves[0].sharding.mesh, self.hosts) if isinstance(
            leaves[0].sharding, NamedSharding) else None
        targets = tuple(host_copy_sharding(x, view, self.hosts) for x in leaves)
        if all(c == x.dtype for c, x in zip(casts, leaves)) and all(
                t.is_equivalent_to(x.sharding, len(x.shape)) for t, x in zip(targets, leaves)):
            return None
        key = (casts, targets)
        if key not in self._programs:
            def cast(tree):
                return [x.astype(c) for x, c in zip(tree, casts)]
            self._programs[key] = jax.jit(cast, out_shardings=list(targets))
        return self._programs[key]

    def __call__(self, state, shardings, may_alias: bool = False):
        staged = self.stage(state)
        leaves, treedef = jax.tree.flatten(staged)
        targets = jax.tree.leaves(shardings)  # one per leaf, in the same order (a Variable's sharding at its place)
        if len(targets) != len(leaves):
            raise ValueError(f"{len(targets)} shardings for {len(leaves)} arrays")
        dtypes = tuple(narrowed(x.dtype, self.compute_dtype) for x in leaves)
        return jax.tree.unflatten(treedef, reshard_local(leaves, targets, may_alias or staged is not state, dtypes))
