"""A decode step's new keys (or values) written into their pages on TPU: write_rows, a Pallas kernel.

Why a kernel: XLA lowers `pages.at[:, page, offset].set(new)` to a scatter that wants the pool in another layout
than the paged-attention kernel reads ([heads, pages, page size, head_dim], row-major), so every layer of every
decode step copied its whole pool there and back (four copies of the pool per layer: most of a decode step's
HBM traffic at 16k tokens). The kernel writes in place, in the pool's own layout: it copies each row's page into
VMEM (a DMA can only move whole tiles, and a page's positions are a tiled dimension), puts the row's new key at
its offset, and copies the page back; every row's copies are in flight together. Rows must write distinct pages,
except rows whose writes do not matter (the engine's scratch page): the engine's pages are copy-on-write, so a
page a row writes is that row's alone.

Elsewhere (and in tests) the scatter is the reference; `interpret=True` runs the kernel on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# VMEM one call may stage (each row's page and its new key, padded to a tile); more rows go in several calls.
STAGED_VMEM_BYTES = 8 << 20


def _write_kernel(page_ref, offset_ref, new_ref, pages_in, pages_out, staged, sems):
    del pages_in  # the same buffer as pages_out (aliased)
    rows = new_ref.shape[0]

    def copy_in(b):
        return pltpu.make_async_copy(pages_out.at[:, pl.ds(page_ref[b], 1)], staged.at[b], sems.at[0])

    def copy_out(b):
        return pltpu.make_async_copy(staged.at[b], pages_out.at[:, pl.ds(page_ref[b], 1)], sems.at[1])

    def start_in(b, carry):
        copy_in(b).start()
        return carry

    def wait_in(b, carry):
        copy_in(b).wait()
        return carry

    def merge_and_start_out(b, carry):
        page = staged[b]  # [C, 1, page_size, D]
        at_offset = jax.lax.broadcasted_iota(jnp.int32, page.shape, 2) == offset_ref[b]
        staged[b] = jnp.where(at_offset, jnp.broadcast_to(new_ref[b], page.shape), page)
        copy_out(b).start()
        return carry

    def wait_out(b, carry):
        copy_out(b).wait()
        return carry

    jax.lax.fori_loop(0, rows, start_in, 0)
    jax.lax.fori_loop(0, rows, wait_in, 0)
    jax.lax.fori_loop(0, rows, merge_and_start_out, 0)
    jax.lax.fori_loop(0, rows, wait_out, 0)


def rows_per_call(rows: int, heads: int, page_size: int, head_dim: int, itemsize: int) -> int:
    """The most rows (a divisor of `rows`) whose staged pages and new keys fit STAGED_VMEM_BYTES."""
    tile_rows = 32 // itemsize  # a new key [1, D] is padded to a whole tile of rows in VMEM
    per_row = heads * (page_size + tile_rows) * head_dim * itemsize
    return max(n for n in range(1, rows + 1) if rows % n == 0 and (n * per_row <= STAGED_VMEM_BYTES or n == 1))


def write_rows(pages: jax.Array, page: jax.Array, offset: jax.Array, new: jax.Array, *,
               interpret: bool = False) -> jax.Array:
    """pages [C, N, page_size, D] with new [B, C, D] written at (page[b], offset[b]) for each row b: what
    `pages.at[:, page, offset].set(new.swapaxes(0, 1))` computes, in place (callers donate `pages`)."""
    c, _, page_size, d = pages.shape
    b = page.shape[0]
    itemsize = pages.dtype.itemsize
    block = rows_per_call(b, c, page_size, d, itemsize)
    new = new.astype(pages.dtype).reshape(b, c, 1, 1, d)
    page_bytes = c * page_size * d * itemsize

    def call(pages, page, offset, new):
        rows = page.shape[0]
        return pl.pallas_call(
            _write_kernel,
            out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec(memory_space=pl.ANY),
                scratch_shapes=[pltpu.VMEM((rows, c, 1, page_size, d), pages.dtype), pltpu.SemaphoreType.DMA((2,))]),
            input_output_aliases={3: 0},
            cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                          bytes_accessed=rows * (2 * page_bytes + c * d * itemsize)),
            interpret=pltpu.InterpretParams() if interpret else False,
        )(page, offset, new, pages)

    for r in range(0, b, block):
        pages = call(pages, page[r:r + block], offset[r:r + block], new[r:r + block])
    return pages
