"""planning/hlo_cost.py: a compiled program's FLOPs and bytes with every loop counted as often as it runs,
checked against XLA's own cost analysis of the same work without loops (on CPU and on a described TPU), and
split by named scope."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.planning.compile import without_jax_cache
from grpo_jax.planning.hlo_cost import _valid_pairs, dot_flops, parse_module, program_cost, shape_bytes
from grpo_jax.planning.topology import tpu_topology

N, STEPS = 128, 6


def _scanned(x, w, xs):
    def body(c, xi):
        return jnp.tanh(c @ w + xi), None
    return jax.lax.scan(body, x, xs)[0]


def _unrolled(x, w, xs):
    for i in range(STEPS):
        x = jnp.tanh(x @ w + xs[i])
    return x


def _xla_cost(compiled) -> tuple[float, float]:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return analysis["flops"], analysis["bytes accessed"]


def _compile(f, args):
    return jax.jit(f).lower(*args).compile()


def test_a_loop_counts_its_body_as_often_as_it_runs_on_cpu():
    """XLA's cost analysis counts the scan's body once; program_cost counts it STEPS times, which is what the
    same work unrolled costs (XLA's figures for the unrolled program: matmul FLOPs exactly, bytes closely)."""
    args = (jnp.ones((N, N)), jnp.ones((N, N)), jnp.ones((STEPS, N, N)))
    scanned, unrolled = _compile(_scanned, args), _compile(_unrolled, args)
    matmuls = STEPS * 2 * N ** 3
    looped = program_cost(scanned.as_text())
    assert looped.flops == matmuls and looped.uncounted_loops == 0
    assert program_cost(scanned.as_text(), count_loops=False).flops == 2 * N ** 3
    assert _xla_cost(scanned)[0] < matmuls / 2  # what this module corrects
    flops, nbytes = _xla_cost(unrolled)
    assert matmuls <= flops <= 1.05 * matmuls
    assert 0.8 * nbytes <= looped.bytes <= 1.25 * nbytes
    assert program_cost(unrolled.as_text()).flops == matmuls


@pytest.fixture(scope="module")
def tpu_devices():
    with without_jax_cache():
        yield tpu_topology("v5e:2x2").devices


def test_on_tpu_the_trip_count_is_read_from_the_loop(tpu_devices):
    """The TPU compiler does not annotate trip counts: program_cost reads them from the loop's condition. The
    scanned program then costs what XLA says the unrolled one costs (FLOPs to 5%: elementwise work is not
    counted; bytes within 25%)."""
    sharding = NamedSharding(jax.sharding.Mesh(np.array(tpu_devices[:1]), ("x",)), PartitionSpec())
    args = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding)
                 for s in ((N, N), (N, N), (STEPS, N, N)))
    with without_jax_cache():
        scanned, unrolled = _compile(_scanned, args), _compile(_unrolled, args)
    looped = program_cost(scanned.as_text())
    assert looped.uncounted_loops == 0
    assert program_cost(scanned.as_text(), count_loops=False).flops == pytest.approx(looped.flops / STEPS)
    flops, nbytes = _xla_cost(unrolled)
    assert 0.95 * flops <= looped.flops <= 1.001 * flops
    assert 0.75 * nbytes <= looped.bytes <= 1.25 * nbytes


def test_a_kernel_costs_the_estimate_it_states(tpu_devices):
    """Megablox's grouped matmul (a Pallas kernel, a custom call to XLA) states its FLOPs and bytes in its backend
    config: program_cost counts them, as XLA's cost analysis does, as a "kernel"."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm
    sharding = NamedSharding(jax.sharding.Mesh(np.array(tpu_devices[:1]), ("x",)), PartitionSpec())
    args = (jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((4,), jnp.int32, sharding=sharding))
    compiled = _compile(gmm, args)
    cost = program_cost(compiled.as_text())
    kernels = [part for (_, kind), part in cost.parts.items() if kind == "kernel"]
    assert len(kernels) == 1 and kernels[0].flops == 2 * 512 * 256 * 512
    assert cost.flops == pytest.approx(_xla_cost(compiled)[0], rel=1e-3)


def test_a_kernel_in_a_loop_costs_its_estimate_once_per_trip(tpu_devices):
    """The scanned layers' kernels (megablox's tgmm for the expert weights' gradient): each trip of the loop
    counts the kernel's stated FLOPs, where XLA's cost analysis counts the body once."""
    from grpo_jax.model.experts import tgmm
    sharding = NamedSharding(jax.sharding.Mesh(np.array(tpu_devices[:1]), ("x",)), PartitionSpec())
    args = (jax.ShapeDtypeStruct((STEPS, 512, 256), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((4,), jnp.int32, sharding=sharding))

    def looped(lhs, grad, sizes):
        def body(total, x):
            return total + tgmm(x, grad, sizes).sum(), None
        return jax.lax.scan(body, jnp.float32(0), lhs)[0]

    compiled = _compile(looped, args)
    kernels = [part for (_, kind), part in program_cost(compiled.as_text()).parts.items() if kind == "kernel"]
    assert sum(part.flops for part in kernels) == pytest.approx(STEPS * 2 * 512 * 256 * 384, rel=0.01)
    assert _xla_cost(compiled)[0] == pytest.approx(2 * 512 * 256 * 384, rel=0.05)


@pytest.mark.parametrize("window", [0, 300])
def test_splash_attention_costs_the_matmuls_of_the_blocks_it_computes(tpu_devices, window):
    """Splash states no estimate: its forward, dq and dkv kernels cost 2, 3 and 4 matmuls of the query x key blocks
    that causal masking (and a window) leave, 10 of 16 blocks of 256 at 1,024 tokens (9 with a window of 300), and
    their bytes are a small part of the dense path's, which holds [T, S] scores."""
    from grpo_jax.model import attention
    heads, kv, length, dim = 4, 2, 1024, 128
    sharding = NamedSharding(jax.sharding.Mesh(np.array(tpu_devices[:1]), ("x",)), PartitionSpec())
    shapes = ((1, kv, heads // kv, length, dim), (1, kv, length, dim), (1, kv, length, dim))
    args = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes)
    blocks = attention.causal_blocks(length, 256, window)
    assert blocks == (9 if window else 10)

    def gradients(impl):
        def loss(q, k, v):
            mask = attention.causal_mask(jnp.ones((1, length), bool), length).with_window(window)
            return attention.attend(q, k, v, mask, 0.1, impl=impl, block=256).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))

    splash, dense = (program_cost(_compile(gradients(impl), args).as_text()) for impl in ("splash", "dense"))
    kernel_flops = sum(part.flops for (_, kind), part in splash.parts.items() if kind == "kernel")
    assert kernel_flops == 2 * (2 + 3 + 4) * heads * length * length * dim * blocks / 16
    assert splash.bytes < 0.3 * dense.bytes


def test_a_tpu_convolution_counts_only_the_windows_that_read_input(tpu_devices):
    """The TPU compiler writes some matmuls as padded convolutions; their FLOPs are counted over the valid
    window positions only, as XLA counts them: a strided, padded, dilated convolution program costs XLA's
    figure (it has no elementwise work)."""
    sharding = NamedSharding(jax.sharding.Mesh(np.array(tpu_devices[:1]), ("x",)), PartitionSpec())
    lhs = jax.ShapeDtypeStruct((2, 16, 40, 24), jnp.float32, sharding=sharding)  # NCHW
    rhs = jax.ShapeDtypeStruct((32, 16, 3, 5), jnp.float32, sharding=sharding)  # OIHW

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, window_strides=(2, 1), padding=((2, 1), (4, 3)),
                                            lhs_dilation=(1, 2), rhs_dilation=(2, 1))
    with without_jax_cache():
        compiled = _compile(conv, (lhs, rhs))
    flops, _ = _xla_cost(compiled)
    assert program_cost(compiled.as_text()).flops == pytest.approx(flops, rel=0.01)


@settings(max_examples=200, deadline=None)
@given(out=st.integers(1, 12), window=st.integers(1, 6), size=st.integers(1, 12), stride=st.integers(1, 3),
       pad=st.integers(0, 4), lhs_dilate=st.integers(1, 3), rhs_dilate=st.integers(1, 3))
def test_valid_window_pairs_match_counting_them(out, window, size, stride, pad, lhs_dilate, rhs_dilate):
    dilated = (size - 1) * lhs_dilate + 1
    expected = sum(1 for o, k in itertools.product(range(out), range(window))
                   if 0 <= o * stride + k * rhs_dilate - pad < dilated
                   and (o * stride + k * rhs_dilate - pad) % lhs_dilate == 0)
    assert _valid_pairs(out, window, size, stride, pad, lhs_dilate, rhs_dilate) == expected


def test_a_tpu_layout_counts_its_tile_padding():
    assert shape_bytes("f32[4,32,64]{2,1,0}") == 4 * 32 * 64 * 4
    assert shape_bytes("f32[4,32,64]{2,1,0:T(8,128)S(1)}") == 4 * 32 * 128 * 4
    assert shape_bytes("bf16[3,100]{0,1:T(8,128)(2,1)}") == 128 * 104 * 2  # dim 0 is minor: 3 -> 128, 100 -> 104
    assert shape_bytes("(s32[]{:T(128)}, f32[10]{0})") == 4 + 40


def test_a_dot_counts_its_contracted_elements():
    text = """HloModule m

ENTRY %main (a: bf16[8,64,32], b: bf16[32,16]) -> f32[8,64,16] {
  %a = bf16[8,64,32]{2,1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  ROOT %d = f32[8,64,16]{2,1,0} dot(%a, %b), lhs_contracting_dims={2}, rhs_contracting_dims={0}
}
"""
    computations, entry = parse_module(text)
    dot = computations[entry].root
    assert dot_flops(dot, computations[entry]) == 2 * 8 * 64 * 16 * 32
    cost = program_cost(text)
    assert cost.flops == 2 * 8 * 64 * 16 * 32
    assert cost.bytes == 8 * 64 * 32 * 2 + 32 * 16 * 2 + 8 * 64 * 16 * 4


def test_the_breakdown_names_the_scope_and_the_backward_pass():
    """Work made under jax.named_scope goes to that scope; the gradient's to the scope marked (backward). The
    parts add up to the whole."""
    def loss(w, x):
        with jax.named_scope("mlp"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("loss"):
            return jnp.sum(h * h)

    args = (jnp.ones((N, N)), jnp.ones((4 * N, N)))
    cost = program_cost(_compile(jax.grad(loss), args).as_text())
    matmul = 2 * 4 * N * N * N
    assert cost.parts[("mlp", "matmul")].flops == matmul
    assert cost.parts[("mlp (backward)", "matmul")].flops == matmul  # only dW: x needs no gradient
    assert sum(p.bytes for p in cost.parts.values()) == pytest.approx(cost.bytes)
    assert {"mlp", "mlp (backward)"} <= {scope for scope, _ in cost.parts}


UNROLLED_TWICE = """HloModule m

%body (p: (u32[], f32[64,64], f32[64,64])) -> (u32[], f32[64,64], f32[64,64]) {
  %p = (u32[], f32[64,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[64,64]{1,0} get-tuple-element(%p), index=1
  %w = f32[64,64]{1,0} get-tuple-element(%p), index=2
  %d = f32[64,64]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %c = u32[] copy(%i)
  %two = u32[] constant(2)
  %next = u32[] add(%c, %two)
  ROOT %t = (u32[], f32[64,64]{1,0}, f32[64,64]{1,0}) tuple(%next, %d, %w)
}

%cond (p: (u32[], f32[64,64], f32[64,64])) -> pred[] {
  %p = (u32[], f32[64,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %limit = u32[] constant(LIMIT)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

ENTRY %main (x: f32[64,64], w: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64]{1,0} parameter(0)
  %w = f32[64,64]{1,0} parameter(1)
  %zero = u32[] constant(START)
  %start = u32[] copy(%zero)
  %init = (u32[], f32[64,64]{1,0}, f32[64,64]{1,0}) tuple(%start, %x, %w)
  %loop = (u32[], f32[64,64]{1,0}, f32[64,64]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64]{1,0} get-tuple-element(%loop), index=1
}
"""


@pytest.mark.parametrize("start, limit, trips", [(0, 4, 2), (0, 7, 4), (1, 8, 4), (4, 4, 0)])
def test_a_loop_without_an_annotation_runs_from_its_start_to_its_limit_by_its_step(start, limit, trips):
    """TPU leaves trip counts out; its own loops (windowed einsums) step the counter by 2: the count is
    ceil((limit - start) / step), read from the condition, the initial tuple and the body's update."""
    text = UNROLLED_TWICE.replace("LIMIT", str(limit)).replace("START", str(start))
    cost = program_cost(text)
    assert cost.uncounted_loops == 0
    assert cost.flops == trips * 2 * 64 ** 3
    unknown = text.replace("%next = u32[] add(%c, %two)", "%next = u32[] multiply(%c, %two)")
    assert program_cost(unknown).uncounted_loops == 1 and program_cost(unknown).flops == 2 * 64 ** 3
