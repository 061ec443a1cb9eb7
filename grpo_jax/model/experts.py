"""The experts of a mixture-of-experts layer, given the routing: which rows go to which experts, the grouped
matmuls that compute them, and how the work is laid out over a mesh. Pure functions of arrays; the layer that
routes and holds the weights is model.transformer.MoE.

Contract:
- `rows` [N, E], `experts` [N, k] int32 (an id >= the experts given counts for no expert: padding, or another
  device's expert), `weights` [N, k], `gate`/`up` [X, E, M], `down` [X, M, E]; every function returns [N, E],
  the weighted sum of each row's chosen experts' SwiGLU, in the rows' dtype.
- `dense_experts` is the reference (every expert on every row); `ragged_experts` computes only the chosen
  (row, expert) pairs, sorted by expert, as grouped matmuls: no capacity, no token dropped.
- `grouped_matmul` impl "ragged" is jax.lax.ragged_dot with its own gradient; "megablox" keeps ragged_dot for
  the forward pass and the rows' gradient and takes the expert weights' gradient from megablox's tgmm (a Pallas
  TPU kernel): ragged_dot's own weight gradient compiles on TPU to a masked dense product, num_experts times
  the work. Off TPU the kernel runs in Pallas's interpreter (the CPU tests).
- `local_experts`: under a mesh, each device routes and computes its own rows (shard_map over the row axes,
  data x fsdp), the experts' weights gathered as FSDP gathers any weight, each expert's hidden units split over
  tensor and the outputs summed over it. Without it XLA's partitioner gathers every row onto every device.
- `expert_parallel`: each device computes its own experts (split over fsdp) on the rows routed to them.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.model.attention import target_platform
from grpo_jax.parallel.sharding import split_axes

MOE_MATMULS = ("auto", "ragged", "megablox")  # ModelConfig.moe_matmul
ROW_AXES = ("data", "fsdp")  # the mesh axes that split rows (parallel.sharding.constrain_rows)
EXPERT_AXIS = "fsdp"  # the mesh axis that splits the experts (parallel.sharding's rule for `expert`)
HIDDEN_AXIS = "tensor"  # the mesh axis that splits each expert's hidden units (the rule for `moe_mlp`)
TGMM_ROW_TILE = 128  # tgmm needs its row count (the pairs) a multiple of its row tile


def matmul_impl(setting: str, platform: str) -> str:
    """ModelConfig.moe_matmul for a program compiled for `platform`: auto is megablox on TPU, else ragged."""
    if setting == "auto":
        return "megablox" if platform == "tpu" else "ragged"
    return setting


def grouped_matmul(lhs, rhs, group_sizes, impl: str = "ragged"):
    """[M, K] x [G, K, N] -> [M, N]: the rows of group g (consecutive, group_sizes[g] of them, from the first)
    times rhs[g]; rows past sum(group_sizes) give zeros. impl: "ragged" or "megablox" (module docstring)."""
    if impl == "ragged":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if impl == "megablox":
        return _ragged_dot_tgmm(lhs, rhs, group_sizes, target_platform() != "tpu")
    raise ValueError(f"grouped_matmul: impl={impl!r}; allowed ['ragged', 'megablox']")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot_tgmm(lhs, rhs, group_sizes, interpret: bool):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _ragged_dot_tgmm_fwd(lhs, rhs, group_sizes, interpret: bool):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _ragged_dot_tgmm_bwd(interpret: bool, residual, grad):
    lhs, rhs, group_sizes = residual
    grad_lhs = jax.lax.ragged_dot(grad.astype(rhs.dtype), rhs.swapaxes(1, 2), group_sizes)
    return grad_lhs.astype(lhs.dtype), tgmm(lhs, grad, group_sizes, interpret).astype(rhs.dtype), None


_ragged_dot_tgmm.defvjp(_ragged_dot_tgmm_fwd, _ragged_dot_tgmm_bwd)


def _tile(size: int, largest: int = 512) -> int:
    """A tile for a dimension of `size`: the largest power of two from 128 to `largest` it needs no more than."""
    tile = 128
    while tile < largest and tile < size:
        tile *= 2
    return tile


def tgmm(lhs, grad, group_sizes, interpret: bool = False):
    """[M, K], [M, N] -> [G, K, N]: per group g, lhs's rows of g transposed times grad's (megablox's tgmm, its
    row count padded to a whole tile with rows of no group). An empty group gives zeros."""
    kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")  # the package binds gmm
    pad = -lhs.shape[0] % TGMM_ROW_TILE
    lhs, grad = (jnp.pad(a, ((0, pad), (0, 0))) for a in (lhs, grad))
    tiling = (TGMM_ROW_TILE, _tile(lhs.shape[1]), _tile(grad.shape[1]))
    return kernels.tgmm(lhs.T, grad, group_sizes, jnp.float32, tiling, interpret=interpret)


def dense_experts(rows, experts, weights, gate, up, down):
    """Every expert on every row, combined by a [N, X] matrix that is zero off the chosen experts: the reference
    (num_experts / k times the FLOPs of the chosen experts)."""
    combine = jnp.zeros((rows.shape[0], gate.shape[0]), weights.dtype)
    combine = combine.at[jnp.arange(rows.shape[0])[:, None], experts].add(weights)
    hidden = jax.nn.silu(jnp.einsum("ne,xem->nxm", rows, gate)) * jnp.einsum("ne,xem->nxm", rows, up)
    return jnp.einsum("nxm,xme,nx->ne", hidden, down, combine)


def ragged_experts(rows, experts, weights, gate, up, down, impl: str = "ragged"):
    """Capacity-free dispatch: the N x k (row, expert) pairs sorted by expert, each expert's run of rows one group
    of a grouped matmul, then each output scaled by its weight and added back to its row. No token is dropped and
    no padding computed: FLOPs and activations of the chosen experts only. An expert id past the last of `gate`
    sorts after every group, where the grouped matmul gives zeros."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    source = order // k  # the row of each sorted pair
    group_sizes = jnp.bincount(flat, length=gate.shape[0] + 1)[:-1].astype(jnp.int32)
    sorted_rows = rows[source]
    matmul = functools.partial(grouped_matmul, group_sizes=group_sizes, impl=impl)
    hidden = jax.nn.silu(matmul(sorted_rows, gate)) * matmul(sorted_rows, up)
    out = matmul(hidden, down) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(rows).at[source].add(out)


def _hidden_axis(mesh, hidden_units: int) -> str | None:
    """The axis each expert's hidden units split over inside the shard_map, where it divides them."""
    axes = split_axes(mesh, (HIDDEN_AXIS,))
    return axes[0] if axes and hidden_units % mesh.shape[HIDDEN_AXIS] == 0 else None


def _padded(rows, experts, weights, splits: int, no_expert: int):
    """The rows padded to split evenly `splits` ways; a padding row goes to no expert, with weight 0."""
    pad = -rows.shape[0] % splits
    widen = functools.partial(jnp.pad, pad_width=((0, pad), (0, 0)))
    return widen(rows), jnp.pad(experts, ((0, pad), (0, 0)), constant_values=no_expert), widen(weights)


def _on_own_rows(local, rows, experts, weights, gate, up, down, expert_axis: str | None = None):
    """local(rows, experts, weights, gate, up, down, hidden) under a shard_map with every mesh axis manual (a
    Pallas kernel cannot be partitioned by XLA): each device's rows (data x fsdp, padded to split: a padding row
    goes to no expert, with weight 0), the experts whole or split over `expert_axis`, each expert's hidden units
    over tensor where they divide (`hidden`: that axis, or None). Returns the first N rows of local's output."""
    mesh = jax.sharding.get_abstract_mesh()
    n = rows.shape[0]
    row_axes, hidden = split_axes(mesh, ROW_AXES), _hidden_axis(mesh, gate.shape[2])
    rows, experts, weights = _padded(rows, experts, weights, math.prod(mesh.shape[a] for a in row_axes),
                                     gate.shape[0])
    split = PartitionSpec(row_axes or None)
    weight_specs = (PartitionSpec(expert_axis, None, hidden), PartitionSpec(expert_axis, None, hidden),
                    PartitionSpec(expert_axis, hidden, None))
    return jax.shard_map(functools.partial(local, hidden=hidden), in_specs=(split,) * 3 + weight_specs,
                         out_specs=split, axis_names=set(mesh.axis_names), check_vma=False)(
        rows, experts, weights, gate, up, down)[:n]


def local_experts(rows, experts, weights, gate, up, down, impl: str = "ragged"):
    """ragged_experts with each device's own rows (module docstring); the plain call without a multi-device mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return ragged_experts(rows, experts, weights, gate, up, down, impl)

    def local(rows, experts, weights, gate, up, down, hidden):
        out = ragged_experts(rows, experts, weights, gate, up, down, impl)
        return jax.lax.psum(out, hidden) if hidden else out

    return _on_own_rows(local, rows, experts, weights, gate, up, down)


def expert_parallel_axis(num_experts: int) -> str | None:
    """The mesh axis expert parallelism splits the experts over, from the mesh of the program being traced
    (jax.sharding.use_abstract_mesh: learner.jit_train_step sets it), or None where there is none to split over."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return None
    size = mesh.shape[EXPERT_AXIS]
    return EXPERT_AXIS if size > 1 and num_experts % size == 0 else None


def expert_parallel(rows, experts, weights, gate, up, down, axis: str, impl: str = "ragged"):
    """Expert parallelism over mesh axis `axis`: each device holds num_experts / D experts and the rows of 1/D of
    the tokens. It gathers every token of its group (rows, experts, weights), runs its own experts on the pairs
    routed to them (ragged, capacity-free; the others' pairs fall outside its groups), and the partial outputs
    are summed and scattered back to the tokens' devices. Per device: the FLOPs of 1/D of the pairs, its own
    experts' weights only (never gathered), an all-gather of the tokens and a reduce-scatter of the outputs.
    Rows are padded to split evenly over the row axes (a padding row has weight 0); every axis is manual, as in
    local_experts, each expert's hidden units split over tensor where they divide."""
    def local(rows, experts, weights, gate, up, down, hidden):
        everyone = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
        rows_all, experts_all, weights_all = everyone(rows), everyone(experts), everyone(weights)
        held = gate.shape[0]
        local_ids = experts_all - jax.lax.axis_index(axis) * held
        mine = (local_ids >= 0) & (local_ids < held)
        out = ragged_experts(rows_all, jnp.where(mine, local_ids, held), jnp.where(mine, weights_all, 0), gate, up,
                             down, impl)
        if hidden:
            out = jax.lax.psum(out, hidden)
        return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)

    return _on_own_rows(local, rows, experts, weights, gate, up, down, expert_axis=axis)
