"""Attention's inner product, softmax and weighted sum, in three implementations that agree on every query that sees
at least one key:

- `dense`: the scores [B, KV, G, T, S] in float32 and the mask [B, T, S] made whole (short rows, decode steps).
- `blockwise`: online softmax over blocks of keys, forward and backward (a custom VJP that recomputes each block's
  scores from the saved log-sum-exp, as flash attention does): memory and HBM traffic linear in the sequence,
  never a [T, S] array. For CPU and GPU, where no kernel is wired.
- `splash`: TPU's splash-attention Pallas kernel (jax.experimental.pallas.ops.tpu.splash_attention), with the
  packed rows' segment ids, causal masking and a sliding window, under shard_map over the rows' and heads' axes;
  self-attention only (no KV cache: the learner step and admission's prefill).

Which keys a query sees is an `AttentionMask`: the keys' validity, the queries' cache slots (causal order), segment
ids of packed rows and a sliding window, from which each implementation makes only the part it needs. A query that
sees no key at all (padding) gets zeros from `blockwise` and a mean of every value from `dense`: its output is
never read by a real token.

Contract: q [B, KV, G, T, D] (G query heads share each key/value head), k and v [B, KV, S, D]; the output has q's
shape and dtype. Scores are float32 in every implementation.

Paged keys (`PagedKV`, the continuous engine's paged cache): one decode query per row reads the keys a page table
names, in position order: on TPU through the paged-attention Pallas kernel
(jax.experimental.pallas.ops.tpu.paged_attention), which reads only the pages a row holds; elsewhere by gathering
the row's pages and the dense path.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from grpo_jax.parallel.sharding import split_axes

ATTENTION_IMPLS = ("auto", "dense", "blockwise", "splash")  # ModelConfig.attention
# `auto` outside TPU: dense while a row's scores stay this small (keys per query over the block size), so short
# rows keep one fused softmax and long ones never hold [T, S].
DENSE_BLOCKS = 4
_MASKED = jnp.finfo(jnp.float32).min
PAGES_PER_BLOCK = 8  # paged attention's kernel: pages per compute block, at most (a divisor of the pages per row)
PAGE_TABLE_SMEM_BYTES = 512 * 1024  # paged attention's kernel: page-table bytes per call, at most (half of SMEM)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionMask:
    """Query t of row b sees key slot s when key_mask[b, s], s <= query_slot[t] (unless query_slot is None: a
    ring whose marked keys all precede the query), s > query_slot[t] - window (window > 0 only), and
    query_segments[b, t] == key_segments[b, s] (when given: packed rows)."""

    key_mask: jax.Array  # [B, S] bool: slots holding a real key
    query_slot: jax.Array | None = None  # [T] int32: each query's own slot (write_index + t)
    query_segments: jax.Array | None = None  # [B, T] int
    key_segments: jax.Array | None = None  # [B, S] int
    window: int = dataclasses.field(default=0, metadata={"static": True})
    # Queries and keys are the same slots 0 .. T-1 (nothing cached before them): what `splash` computes.
    self_attention: bool = dataclasses.field(default=False, metadata={"static": True})
    whole: jax.Array | None = None  # [B, T, S] bool, made once for every layer's dense path (with_whole)

    def with_window(self, window: int) -> AttentionMask:
        return dataclasses.replace(self, window=window, whole=None)

    def with_whole(self) -> AttentionMask:
        """The mask with its [B, T, S] array made now, once, for layers that take the dense path: as an input of
        each layer (a remat boundary included) rather than remade inside it, which cost the learner step memory."""
        return dataclasses.replace(self, whole=self.dense())

    def block(self, start, size: int) -> jax.Array:
        """[B, T, size] bool: which of the keys in slots start .. start + size - 1 each query sees."""
        keys = start + jnp.arange(size)
        allowed = jax.lax.dynamic_slice_in_dim(self.key_mask, start, size, axis=1)[:, None, :]
        if self.query_slot is not None:
            slot = self.query_slot[:, None]
            order = keys[None, :] <= slot
            if self.window:
                order = order & (keys[None, :] > slot - self.window)
            allowed = allowed & order[None]
        if self.query_segments is not None:
            key_segments = jax.lax.dynamic_slice_in_dim(self.key_segments, start, size, axis=1)
            allowed = allowed & (self.query_segments[:, :, None] == key_segments[:, None, :])
        return allowed

    def dense(self) -> jax.Array:
        """[B, T, S] bool, the whole mask."""
        return self.block(0, self.key_mask.shape[1]) if self.whole is None else self.whole

    def padded(self, keys: int) -> AttentionMask:
        """The same rule over `keys` slots: the added slots hold no key."""
        extra = keys - self.key_mask.shape[1]
        if extra == 0:
            return self
        key_segments = None if self.key_segments is None else jnp.pad(self.key_segments, ((0, 0), (0, extra)))
        return dataclasses.replace(self, key_mask=jnp.pad(self.key_mask, ((0, 0), (0, extra))),
                                   key_segments=key_segments, whole=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKV:
    """One layer's keys and values in pages shared by a bank's rows: row b's key at position p lives in page
    page_table[b, p // page_size], at offset p % page_size. A decode step writes each row's new key at position
    lengths[b] - 1 (into page `write_page[b]`: a scratch page for rows that write nothing) and its query sees
    positions 0 .. lengths[b] - 1."""

    k_pages: jax.Array  # [C, N, page_size, D]: C cache heads (Transformer.init_cache's `heads`), N pages
    v_pages: jax.Array
    page_table: jax.Array  # [B, P] int32: each row's pages in position order (unused entries: any page)
    write_page: jax.Array  # [B] int32
    lengths: jax.Array  # [B] int32: keys each row holds once this step's key is written
    # For grpo-jax compile's cost only: the keys a row holds on average (0: every page of its table), which the
    # kernel's scope names (planning.hlo_cost.paged_cost): the kernel reads only a row's pages up to its length.
    cost_keys: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    def written(self, k: jax.Array, v: jax.Array, impl: str = "scatter") -> PagedKV:
        """This step's keys and values [B, C, 1, D] written at each row's position lengths - 1. impl: "kernel"
        (TPU: model.page_writes.write_rows, in place in the pool's layout, under shard_map over the cache heads as
        paged_attention's kernel, where a device holds several cache heads) or "scatter" (XLA's scatter; on TPU,
        with several heads a device, it copies the pool to another layout and back)."""
        if impl not in ("kernel", "scatter"):
            raise ValueError(f"paged write: impl={impl!r}; allowed 'kernel', 'scatter'")
        offset = (self.lengths - 1) % self.page_size
        heads_axis = kernel_heads_axis(k.shape[1])
        local_heads = k.shape[1] // (jax.sharding.get_abstract_mesh().shape["tensor"] if heads_axis else 1)
        # One cache head a device: the scatter's layout is the pool's (the head dim is 1), and it writes only the
        # new rows, not their whole pages.
        if impl == "kernel" and local_heads > 1:
            from grpo_jax.model.page_writes import write_rows

            def write_both(k_pages, v_pages, page, offset, k, v):
                return write_rows(k_pages, page, offset, k[:, :, 0]), write_rows(v_pages, page, offset, v[:, :, 0])

            k_pages, v_pages = on_cache_heads(
                write_both, (PartitionSpec(heads_axis), PartitionSpec(heads_axis), PartitionSpec(), PartitionSpec(),
                             PartitionSpec(None, heads_axis), PartitionSpec(None, heads_axis)),
                (PartitionSpec(heads_axis), PartitionSpec(heads_axis)),
                self.k_pages, self.v_pages, self.write_page, offset, k, v)
            return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)

        def write(pages, new):  # indexing puts the [B] index dims first after the leading slice: [C, B, D]
            return pages.at[:, self.write_page, offset].set(new[:, :, 0].swapaxes(0, 1).astype(pages.dtype))

        return dataclasses.replace(self, k_pages=write(self.k_pages, k), v_pages=write(self.v_pages, v))


def kernel_heads_axis(heads: int) -> str | None:
    """The mesh axis a Pallas kernel over `heads` cache heads splits them on: tensor where it divides them, else
    none (the heads whole on every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 0 if mesh.empty or "tensor" not in mesh.axis_names else mesh.shape["tensor"]
    return "tensor" if tensor > 1 and heads % tensor == 0 else None


def on_cache_heads(fn, in_specs: tuple, out_specs, *args):
    """fn(*args) run as is on one device, or under shard_map with these specs on a multi-device mesh: XLA cannot
    partition a Pallas kernel, so each device runs it on its own cache heads (kernel_heads_axis), rows whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*args)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def paged_attention(q, cache: PagedKV, scale: float, *, impl: str = "gather"):
    """One query per row (q [B, C, G, 1, D]) over the row's paged keys. impl: "kernel" (TPU's paged-attention
    kernel, under shard_map over the cache heads on a multi-device mesh) or "gather" (the row's pages gathered into
    [B, C, P * page_size, D] and the dense path). The kernel has no interpreter mode: its path is checked by
    compiling for TPU (tests/test_paged_kv.py)."""
    b, c, g, _, d = q.shape
    if impl == "gather":
        def rows(pages):  # [C, N, page, D] -> [B, C, P * page, D]
            picked = pages[:, cache.page_table]  # [C, B, P, page, D]
            return picked.transpose(1, 0, 2, 3, 4).reshape(b, c, -1, d).astype(q.dtype)

        k, v = rows(cache.k_pages), rows(cache.v_pages)
        key_mask = jnp.arange(k.shape[2])[None, :] < cache.lengths[:, None]
        return dense_attention(q, k, v, AttentionMask(key_mask=key_mask), scale)
    if impl != "kernel":
        raise ValueError(f"paged attention: impl={impl!r}; allowed 'kernel', 'gather'")
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    pages_per_row = cache.page_table.shape[1]
    per_block = max(n for n in range(1, min(pages_per_row, PAGES_PER_BLOCK) + 1) if pages_per_row % n == 0)
    heads = (q.reshape(b, c * g, d) * jnp.asarray(scale, q.dtype)).astype(cache.k_pages.dtype)

    # The kernel prefetches its whole page table into SMEM (1 MiB a core): rows go through it in blocks whose
    # tables fit, each block one call.
    rows_per_call = max(n for n in range(1, b + 1) if b % n == 0 and n * pages_per_row * 4 <= PAGE_TABLE_SMEM_BYTES)

    @jax.named_scope(f"paged_keys_{cache.cost_keys or pages_per_row * cache.page_size}")
    def run(heads, k_pages, v_pages, lengths, page_table):
        return jnp.concatenate([
            kernel(heads[r:r + rows_per_call], k_pages, v_pages, lengths[r:r + rows_per_call],
                   page_table[r:r + rows_per_call], pages_per_compute_block=per_block)
            for r in range(0, b, rows_per_call)])

    heads_axis = kernel_heads_axis(c)
    out = on_cache_heads(run, (PartitionSpec(None, heads_axis), PartitionSpec(heads_axis), PartitionSpec(heads_axis),
                               PartitionSpec(), PartitionSpec()), PartitionSpec(None, heads_axis),
                         heads, cache.k_pages, cache.v_pages, cache.lengths, cache.page_table)
    return out.astype(q.dtype).reshape(b, c, g, 1, d)


def causal_mask(key_mask: jax.Array, queries: int, write_index=0, segment_ids: jax.Array | None = None
                ) -> AttentionMask:
    """Queries in slots write_index .. write_index + queries - 1 of a row of key_mask.shape[1] slots, each seeing
    the marked keys up to its own slot; segment_ids [B, T] (S == T only): a query sees only its own segment."""
    self_attention = isinstance(write_index, int) and write_index == 0 and queries == key_mask.shape[1]
    return AttentionMask(key_mask=key_mask, query_slot=write_index + jnp.arange(queries, dtype=jnp.int32),
                         query_segments=segment_ids, key_segments=segment_ids, self_attention=self_attention)


def choose(impl: str, mask: AttentionMask, block: int, platform: str) -> str:
    """The implementation `impl` ("auto" or one of ATTENTION_IMPLS) comes to for this call: splash on TPU for
    self-attention; elsewhere blockwise once keys span DENSE_BLOCKS blocks; dense for decode steps and short rows
    (and for splash where a cache is read)."""
    if mask.query_slot is None:  # a ring of cached keys read by one query per row
        return "dense"
    queries, keys = mask.query_slot.shape[0], mask.key_mask.shape[1]
    if impl == "auto":
        if platform == "tpu" and mask.self_attention and queries >= 128:
            return "splash"
        return "blockwise" if keys > DENSE_BLOCKS * block else "dense"
    if impl == "splash" and not mask.self_attention:
        return "blockwise"
    return impl


def target_platform() -> str:
    """The platform of the program being traced: its mesh's devices (the compile command traces for TPU on a
    CPU machine), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh.abstract_device.platform
    return jax.default_backend()


def attend(q, k, v, mask: AttentionMask, scale: float, *, impl: str = "dense", block: int = 512,
           interpret: bool = False):
    """softmax(q k^T * scale, masked) v with the implementation `impl` (after `choose`). interpret: run splash's
    kernels in Pallas's interpreter (CPU tests)."""
    if impl == "dense":
        return dense_attention(q, k, v, mask, scale)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, mask, scale, block)
    if impl == "splash":
        return splash_attention(q, k, v, mask, scale, block, interpret=interpret)
    raise ValueError(f"attention: impl={impl!r}; allowed {list(ATTENTION_IMPLS[1:])}")


def dense_attention(q, k, v, mask: AttentionMask, scale: float):
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask.dense()[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(q.dtype))


# ---- blockwise (online softmax) -----------------------------------------------------------------------------

def blockwise_attention(q, k, v, mask: AttentionMask, scale: float, block: int = 512):
    keys = k.shape[2]
    block = min(block, keys)
    padded = -(-keys // block) * block
    if padded != keys:  # added keys are marked absent
        widen = functools.partial(jnp.pad, pad_width=((0, 0), (0, 0), (0, padded - keys), (0, 0)))
        k, v, mask = widen(k), widen(v), mask.padded(padded)
    return _blockwise(q, k.astype(q.dtype), v.astype(q.dtype), mask, scale, block)


def _key_blocks(x, block: int):
    """[B, KV, S, D] -> [S / block, B, KV, block, D]: the scan's sequence of key blocks."""
    b, kv, s, d = x.shape
    return x.reshape(b, kv, s // block, block, d).transpose(2, 0, 1, 3, 4)


def _block_scores(q, k_block, mask: AttentionMask, start, block: int, scale: float):
    """Scores [B, KV, G, T, block] float32 of one key block and which of them count."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k_block, preferred_element_type=jnp.float32) * scale
    return scores, mask.block(start, block)[:, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blockwise(q, k, v, mask, scale, block):
    return _blockwise_forward(q, k, v, mask, scale, block)[0]


def _blockwise_forward(q, k, v, mask, scale, block):
    b, kv, g, t, d = q.shape

    def step(carry, xs):
        running_max, total, acc = carry
        index, k_block, v_block = xs
        scores, allowed = _block_scores(q, k_block, mask, index * block, block, scale)
        new_max = jnp.maximum(running_max, jnp.max(jnp.where(allowed, scores, _MASKED), axis=-1))
        probs = jnp.where(allowed, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(running_max - new_max)
        total = total * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum("bkgts,bksd->bkgtd", probs.astype(q.dtype), v_block,
                                                    preferred_element_type=jnp.float32)
        return (new_max, total, acc), None

    blocks = k.shape[2] // block
    start = (jnp.full((b, kv, g, t), _MASKED), jnp.zeros((b, kv, g, t), jnp.float32),
             jnp.zeros((b, kv, g, t, d), jnp.float32))
    (running_max, total, acc), _ = jax.lax.scan(
        step, start, (jnp.arange(blocks), _key_blocks(k, block), _key_blocks(v, block)))
    seen = total > 0
    out = (acc / jnp.where(seen, total, 1.0)[..., None]).astype(q.dtype)
    # A query that sees nothing gets log-sum-exp +inf, so the backward pass gives it probability 0 everywhere.
    logsumexp = jnp.where(seen, running_max + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
    return out, (q, k, v, mask, out, logsumexp)


def _blockwise_backward(scale, block, residuals, d_out):
    q, k, v, mask, out, logsumexp = residuals
    d_out = d_out.astype(q.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, KV, G, T]

    def step(d_q, xs):
        index, k_block, v_block = xs
        scores, allowed = _block_scores(q, k_block, mask, index * block, block, scale)
        probs = jnp.where(allowed, jnp.exp(scores - logsumexp[..., None]), 0.0)
        d_v = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(q.dtype), d_out, preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out, v_block, preferred_element_type=jnp.float32)
        d_scores = (probs * (d_probs - delta[..., None]) * scale).astype(q.dtype)
        d_q = d_q + jnp.einsum("bkgts,bksd->bkgtd", d_scores, k_block, preferred_element_type=jnp.float32)
        d_k = jnp.einsum("bkgts,bkgtd->bksd", d_scores, q, preferred_element_type=jnp.float32)
        return d_q, (d_k, d_v)

    blocks = k.shape[2] // block
    d_q, (d_k, d_v) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32),
                                   (jnp.arange(blocks), _key_blocks(k, block), _key_blocks(v, block)))

    def unblocked(x):  # [S / block, B, KV, block, D] -> [B, KV, S, D]
        return x.transpose(1, 2, 0, 3, 4).reshape(k.shape).astype(k.dtype)

    return d_q.astype(q.dtype), unblocked(d_k), unblocked(d_v), None  # the mask has no cotangent


_blockwise.defvjp(_blockwise_forward, _blockwise_backward)


# ---- splash (TPU) -------------------------------------------------------------------------------------------

def splash_attention(q, k, v, mask: AttentionMask, scale: float, block: int = 512, *, interpret: bool = False):
    """Self-attention through splash's multi-head kernel (GQA: query heads in groups of G per key/value head).
    The rows' validity and segments become splash segment ids (a real token's segment + 1, a padding slot 0), so
    no real query sees padding; rows are padded to a multiple of the kernel's block."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    if not mask.self_attention:
        raise ValueError("attention: splash computes self-attention only (no KV cache): use blockwise")
    b, kv, g, t, d = q.shape
    segments = jnp.ones_like(mask.key_mask, jnp.int32) if mask.key_segments is None else \
        mask.key_segments.astype(jnp.int32) + 1
    segments = jnp.where(mask.key_mask, segments, 0)
    block = min(block, max(128, 1 << (t - 1).bit_length()))
    length = -(-t // block) * block
    heads = q.reshape(b, kv * g, t, d) * jnp.asarray(scale, q.dtype)
    pad = ((0, 0), (0, 0), (0, length - t), (0, 0))
    heads, k, v = jnp.pad(heads, pad), jnp.pad(k.astype(q.dtype), pad), jnp.pad(v.astype(q.dtype), pad)
    segments = jnp.pad(segments, ((0, 0), (0, length - t)))

    rule = masks.CausalMask((length, length))
    if mask.window:
        rule = masks.LogicalAnd(rule, masks.LocalMask((length, length), (mask.window - 1, 0), offset=0))
    sizes = kernels.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                               block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mesh = jax.sharding.get_abstract_mesh()
    rows_axes, heads_axis = _splash_axes(mesh, kv)
    head_shards = 1 if heads_axis is None else mesh.shape[heads_axis]
    kernel = kernels.make_splash_mha(masks.MultiHeadMask([rule] * (kv * g // head_shards)), block_sizes=sizes,
                                     head_shards=1, q_seq_shards=1, interpret=interpret)

    # The blocks the kernels compute, named for the compile command's cost (planning.hlo_cost.splash_flops):
    # splash states no cost estimate of its own.
    @jax.named_scope(f"splash_blocks_{causal_blocks(length, block, mask.window)}_of_{(length // block) ** 2}")
    def run(heads, k, v, segments):
        ids = kernels.SegmentIds(q=segments, kv=segments)
        return jax.vmap(kernel)(heads, k, v, ids)

    if mesh.empty or mesh.size == 1:
        out = run(heads, k, v, segments)
    else:  # a Pallas kernel cannot be partitioned by XLA: every multi-device program needs the shard_map
        # Rows padded to split evenly (a micro-batch of fewer rows than devices): a padding row's slots are
        # segment 0, seen by no real query, and its output is dropped.
        extra = -b % math.prod(mesh.shape[a] for a in rows_axes or ())
        heads, k, v = (jnp.pad(a, ((0, extra), (0, 0), (0, 0), (0, 0))) for a in (heads, k, v))
        segments = jnp.pad(segments, ((0, extra), (0, 0)))
        qkv_spec = PartitionSpec(rows_axes, heads_axis)
        out = jax.shard_map(run, in_specs=(qkv_spec, qkv_spec, qkv_spec, PartitionSpec(rows_axes)),
                            out_specs=qkv_spec, check_vma=False)(heads, k, v, segments)[:b]
    return out[:, :, :t].reshape(b, kv, g, t, d)


def causal_blocks(length: int, block: int, window: int = 0) -> int:
    """How many of the (length / block)^2 query x key blocks hold a key some query sees under a causal mask
    (and a window of `window` slots, itself included): the blocks splash computes."""
    first = np.arange(0, length, block)  # each block's first slot
    last = first + block - 1
    seen = first[None, :] <= last[:, None]  # [query block, key block]: its first key precedes the block's last query
    if window:
        seen &= last[None, :] > first[:, None] - window
    return int(seen.sum())


def _splash_axes(mesh, kv_heads: int) -> tuple[tuple[str, ...] | None, str | None]:
    """The mesh axes splash's shard_map splits rows over (data x fsdp, as the activations are; the rows are padded
    to divide) and heads over (tensor, where the key/value heads divide); an axis not named keeps the whole
    operand on every device."""
    if mesh.empty:
        return None, None
    rows_axes = split_axes(mesh, ("data", "fsdp")) or None
    tensor = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
    heads_axis = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
    return rows_axes, heads_axis
