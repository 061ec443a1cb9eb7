"""Weight sync: the learner's parameters onto the actor's layout after every step, by resharding.

The learner's parameters go to the actor's layout after every step without any device (or the host) ever
holding a whole copy of the model (unless the layout itself asks for one, e.g. a replicated leaf), in about
GROUPS_STAGED groups of consecutive leaves, one after the other (WeightSync.__call__):
  1. (several processes) one jitted program on the learner mesh reshards the group so that every host holds,
     spread over its own learner devices, what its own actor devices need (WeightSync.stage_shardings): for an
     actor per host, a whole copy (host_copy_sharding); for an actor mesh spanning the hosts, only the block of
     each leaf its own actor devices hold between them (host_box_sharding). It casts on the way to the compute
     dtype when the actor only needs that (halving the bytes moved);
  2. on each host, every shard of the actor's layout is put together on its actor device from the slices
     of the host's learner shards that overlap it (reshard_local): device-to-device copies of slices and
     a concatenation on the actor device. (jax.device_put between two device sets routes a layout it
     cannot copy shard for shard through a whole host copy of the array.)
"""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from grpo_jax.parallel.sharding import MESH_AXES


def host_copy_mesh(mesh: Mesh, hosts: int | None = None) -> Mesh | None:
    """A view of `mesh` (the same devices in the same order) in which each learner parameter spec, read
    on the view, gives every host a whole copy split over its own devices only: `mesh` itself when every
    host holds whole data rows of it (parameters are replicated over data), else `fsdp` cut into
    ("fsdp_host", "fsdp") where hosts split the fsdp axis. None when hosts do not cut the mesh that way.
    hosts: the processes among the mesh's devices (given: consecutive blocks of the mesh's devices taken
    as hosts, for tests on one process)."""
    if hosts is None:
        hosts = len({d.process_index for d in mesh.devices.flat})
        if hosts > 1 and not _process_major(list(mesh.devices.flat), hosts):
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


def _in_order(sharding) -> list:
    """A sharding's devices in its mesh order (process, then id, for a sharding without a mesh)."""
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))


def _process_major(flat: list, hosts: int) -> bool:
    per = len(flat) // hosts
    return all(len({d.process_index for d in flat[h * per:(h + 1) * per]}) == 1 for h in range(hosts))


def host_copy_sharding(x, view: Mesh | None, hosts: int | None = None) -> NamedSharding:
    """Where `x` (a learner parameter) goes in step 1: its own spec on the view (host_copy_mesh); without
    a view, a (host, local) mesh of the same devices with the largest dimension that divides evenly split
    over a host's devices (replicated within the host when none does)."""
    sharding = x.sharding
    if view is not None and isinstance(sharding, NamedSharding):
        return NamedSharding(view, _spread(sharding.spec, x.shape, view))
    flat = _in_order(sharding)
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


def _groups(sizes: list, groups: int) -> list:
    """Consecutive slices of items of these byte sizes, about `groups` of them: each closes before it would pass
    1/groups of the total (an item larger than that is a group of its own)."""
    budget = max(sum(sizes) // groups, max(sizes, default=0))
    slices, start, held = [], 0, 0
    for end, size in enumerate(sizes):
        if end > start and held + size > budget:
            slices.append(slice(start, end))
            start, held = end, 0
        held += size
    if start < len(sizes):
        slices.append(slice(start, len(sizes)))
    return slices


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
    results = []
    for group in _groups([x.size * d.itemsize for x, d in zip(arrays, dtypes)], GROUPS):
        results += _reshard_group(arrays[group], list(shardings[group]), may_alias, dtypes[group])
    return results


def _reshard_group(arrays: list, shardings: list, may_alias: bool, dtypes: tuple) -> list:
    key = (tuple((x.shape, x.dtype, x.sharding) for x in arrays), tuple(shardings), dtypes, may_alias)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(arrays, shardings, dtypes, may_alias)
        if len(_PLANS) > 256:
            _PLANS.pop(next(iter(_PLANS)))
    return plan(arrays)


# ------------------------------------------------------------------------------------------ staging by host


def learner_hosts(sharding, hosts: int | None = None) -> list | None:
    """The learner devices of each host, in the order of `sharding`'s devices (process-major: host h is the
    h-th block of them). hosts: as in host_copy_mesh. None when the devices are not process-major."""
    flat = _in_order(sharding)
    n = hosts or len({d.process_index for d in flat})
    if len(flat) % n or (hosts is None and n > 1 and not _process_major(flat, n)):
        return None
    per = len(flat) // n
    return [flat[h * per:(h + 1) * per] for h in range(n)]


def target_hosts(target, blocks: list, hosts: int | None = None) -> dict | None:
    """Which host (a number of learner_hosts' blocks) each device of the actor's `target` sharding is on, when
    that actor spans every host: then each host stages only what its own actor devices need. None when it does
    not (an actor per host, its mesh on this process's devices alone: every host needs every leaf whole).
    hosts: as in host_copy_mesh, for the target too: its devices, in mesh order, taken in `hosts` blocks."""
    flat = _in_order(target)
    if hosts is not None:
        if len(flat) % hosts:
            return None
        per = len(flat) // hosts
        return {d: i // per for i, d in enumerate(flat)}
    number = {block[0].process_index: h for h, block in enumerate(blocks)}
    if {d.process_index for d in flat} != set(number):
        return None
    return {d: number[d.process_index] for d in flat}


def host_boxes(target, shape: tuple, host_of: dict, count: int) -> list | None:
    """Per host (0..count-1), the box of an array of `shape` that its devices of `target` hold between them:
    ((lo, hi) per dimension). None when some host's shards do not make one box (or it has none)."""
    shards: list = [set() for _ in range(count)]
    for device, index in target.devices_indices_map(shape).items():
        shards[host_of[device]].add(_box(index, shape))
    boxes = []
    for held in shards:
        if not held:
            return None
        bound = tuple((min(b[d][0] for b in held), max(b[d][1] for b in held)) for d in range(len(shape)))
        # The shards are blocks of one regular grid: distinct ones never overlap, so they fill their bounding
        # box exactly when their volumes add up to it.
        if sum(math.prod(hi - lo for lo, hi in b) for b in held) != math.prod(hi - lo for lo, hi in bound):
            return None
        boxes.append(bound)
    return boxes


def host_box_sharding(boxes: list, shape: tuple, blocks: list) -> NamedSharding | None:
    """A sharding over the learner devices (`blocks`, one per host, in the learner's device order) that puts
    each host's box (host_boxes) on its own devices, split further over them on the largest dimension of the
    box that they divide (replicated over them when none does). The boxes must tile the array as a grid of
    equal blocks, each held by the same number of hosts, and the hosts must be in an order some mesh of
    (grid axes, replicas) reads row-major (jit needs every sharding of a program over the devices in one
    order); None when they do not."""
    hosts, local = len(blocks), len(blocks[0])
    counts = []
    for d, n in enumerate(shape):
        sizes = {b[d][1] - b[d][0] for b in boxes}
        size = sizes.pop()
        if sizes or size == 0 or n % size or any(b[d][0] % size for b in boxes):
            return None
        counts.append(n // size)
    if hosts % math.prod(counts):
        return None
    axes = [(d, k) for d, k in enumerate(counts) if k > 1]
    replicas = hosts // math.prod(counts)
    if replicas > 1:
        axes.append((None, replicas))
    for order in itertools.permutations(axes):
        if all(_reads(order, h, box, shape, counts) for h, box in enumerate(boxes)):
            break
    else:
        return None
    names = tuple("host_replica" if d is None else f"host_dim{d}" for d, _ in order)
    mesh = Mesh(np.array([x for block in blocks for x in block]).reshape(*(k for _, k in order), local),
                (*names, "local"), axis_types=(AxisType.Auto,) * (len(order) + 1))
    entries = [[f"host_dim{d}"] if k > 1 else [] for d, k in enumerate(counts)]
    split = next((d for d in sorted(range(len(shape)), key=lambda i: -shape[i] // counts[i])
                  if (shape[d] // counts[d]) % local == 0), None)
    if split is not None and local > 1:
        entries[split].append("local")
    return NamedSharding(mesh, PartitionSpec(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)))


def _reads(order: tuple, host: int, box: tuple, shape: tuple, counts: list) -> bool:
    """Whether `host`'s place in a row-major mesh of `order`'s axes is its box's cell of the grid."""
    for d, k in reversed(order):
        host, digit = divmod(host, k)
        if d is not None:
            size = shape[d] // counts[d]
            if box[d] != (digit * size, (digit + 1) * size):
                return False
    return True


GROUPS_STAGED = 4  # WeightSync stages and reshards the leaves in about this many groups (see __call__)


class WeightSync:
    """The learner's weights onto the actor's layout, as a separate copy (see above).

    compute_dtype: the model's compute dtype; float weights wider than it are cast to it inside the
    jitted first step (the actor keeps the narrow copy: the model casts every weight to the compute dtype
    before use, so sampling is bit-identical). may_alias (per call): the result may share the learner's
    buffers where both layouts agree (only for weights the learner never donates, the frozen LoRA base).
    hosts (tests): blocks of one process's devices taken as hosts: the learner's devices in its mesh order,
    and each target's devices in its mesh order, each in `hosts` consecutive blocks (host h: block h of both)."""

    def __init__(self, compute_dtype=None, hosts: int | None = None, groups: int = GROUPS_STAGED):
        self.compute_dtype = None if compute_dtype is None else np.dtype(compute_dtype)
        self.hosts = hosts
        self.groups = groups
        self._programs: dict = {}

    def _several(self) -> bool:
        return (self.hosts or jax.process_count()) > 1

    def stage(self, state, shardings=None):
        """Step 1, on several processes, for the whole state at once (tests, benchmarks; __call__ stages in
        groups): the weights on a layout in which every host holds, on its learner devices, the blocks its own
        devices of `shardings` (the actor's targets, one per leaf) need, in the dtype the actor gets; without
        shardings, or for an actor per host, a whole copy per host. `state` itself when it already is so (one
        process: always; the cast is then done with step 2)."""
        leaves, treedef = jax.tree.flatten(state)
        if not self._several() or not leaves:
            return state
        targets = None if shardings is None else _targets(shardings, leaves)
        program = self.stage_program(leaves, targets)
        return state if program is None else jax.tree.unflatten(treedef, program(leaves))

    def stage_shardings(self, leaves: list, targets: list | None = None) -> tuple:
        """Where step 1 puts each leaf: its host boxes (host_box_sharding) when the actor spans the hosts and
        they tile, else a whole copy per host spread over the host's learner devices (host_copy_sharding)."""
        first = leaves[0].sharding
        view = host_copy_mesh(first.mesh, self.hosts) if isinstance(first, NamedSharding) else None
        blocks = learner_hosts(first, self.hosts)
        out = []
        for i, x in enumerate(leaves):
            sharding = None
            target = None if targets is None else targets[i]
            host_of = None if target is None or blocks is None else target_hosts(target, blocks, self.hosts)
            if host_of is not None and len(set(host_of.values())) == len(blocks):
                boxes = host_boxes(target, x.shape, host_of, len(blocks))
                whole = tuple((0, n) for n in x.shape)
                if boxes is not None and any(b != whole for b in boxes):
                    sharding = host_box_sharding(boxes, x.shape, blocks)
            out.append(sharding or host_copy_sharding(x, view, self.hosts))
        return tuple(out)

    def stage_program(self, leaves: list, targets: list | None = None):
        """The jitted step 1 for these arrays (or jax.ShapeDtypeStructs with shardings: grpo-jax compile can
        lower it) and the actor's `targets` (one sharding per leaf; None: a whole copy per host), a function of
        the list of leaves; None when nothing needs to move or be cast."""
        casts = tuple(narrowed(x.dtype, self.compute_dtype) for x in leaves)
        staged = self.stage_shardings(leaves, targets)
        if all(c == x.dtype for c, x in zip(casts, leaves)) and all(
                t.is_equivalent_to(x.sharding, len(x.shape)) for t, x in zip(staged, leaves)):
            return None
        key = (casts, staged)
        if key not in self._programs:
            def cast(tree):
                return [x.astype(c) for x, c in zip(tree, casts)]
            self._programs[key] = jax.jit(cast, out_shardings=list(staged))
        return self._programs[key]

    def group_slices(self, leaves: list) -> list:
        """The consecutive groups of leaves __call__ stages and reshards one at a time: about `groups` of them by
        the bytes sent (the same on every process: shapes and dtypes only)."""
        return _groups([math.prod(x.shape) * narrowed(x.dtype, self.compute_dtype).itemsize for x in leaves],
                       self.groups)

    def __call__(self, state, shardings, may_alias: bool = False):
        """`state` on the actor's `shardings` (a tree of them, one per leaf of state, or a Variable's at its
        place). Group by group (group_slices): stage it (several processes), put the actor's shards together
        from the staged ones (reshard_local), drop the staged group; so the staged copy and its temporaries are
        about 1/groups of the weights at any time."""
        leaves, treedef = jax.tree.flatten(state)
        targets = _targets(shardings, leaves)
        dtypes = tuple(narrowed(x.dtype, self.compute_dtype) for x in leaves)
        out = []
        for group in self.group_slices(leaves):
            part, part_targets = leaves[group], targets[group]
            program = self.stage_program(part, part_targets) if self._several() else None
            staged = part if program is None else program(part)
            # Staged arrays are this call's own: the result may share their buffers.
            out += reshard_local(staged, part_targets, may_alias or program is not None, dtypes[group])
            del staged
        return jax.tree.unflatten(treedef, out)


def _targets(shardings, leaves: list) -> list:
    targets = jax.tree.leaves(shardings)  # one per leaf, in the same order (a Variable's sharding at its place)
    if len(targets) != len(leaves):
        raise ValueError(f"{len(targets)} shardings for {len(leaves)} arrays")
    return targets
