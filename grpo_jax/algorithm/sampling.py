"""The token distribution a policy samples from, and the log-probs under it: one definition for both sides.

The sampler draws tokens from softmax(logits / temperature), truncated to the top-k logits and then to the
top-p nucleus of the renormalised top-k mass (`sample_logits`); the learner scores tokens under exactly that
distribution (`tempered_logprobs`, with `truncation_mask` built on the same `nucleus_cut`), so that at
staleness 0 the importance weight is 1 with truncation too. Pure JAX functions, no model.

Sampling is exact inverse-CDF sampling on exp(logits - max), done hierarchically (block sums over vocab
chunks, pick a block, then a token inside it): one exp pass plus small reductions, instead of a Gumbel draw
per vocab entry or a full-vocab sort (both cost as much as the model on CPU). It works vocab-major (rows on
the minor axis), the layout in which the sampler's LM head is fastest.

The entropy the learner's entropy bonus acts on (tempered_logprobs' `with_entropy`) is the tempered distribution's
before truncation, not the sampled one's (see tempered_logprobs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

VOCAB_BLOCK = 128  # inverse-CDF block size: ~sqrt(vocab) keeps both levels cheap


def _sortable(x: jnp.ndarray) -> jnp.ndarray:
    """float32 <-> int32 with the same order (an involution), so a bisection can run over integers."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def nucleus_cut(x: jnp.ndarray, e: jnp.ndarray, top_p: jnp.ndarray) -> jnp.ndarray:
    """[B] cut such that x >= cut is the smallest set of highest-x entries whose mass e reaches
    top_p of the total (x, e: [V, B], vocab-major): "sort descending, keep while the mass before the
    entry is < top_p", with ties at the cut all kept. Found by bisecting the cut over the float order
    in 32 passes, because XLA's CPU comparator sort of a 32k vocab costs many model steps. The passes run on
    [B, V] copies: XLA:CPU fuses their masked sums along the minor axis, not the major one (figures:
    docs/benchmarks.md).
    """
    k, e = _sortable(x).T, e.T
    target = top_p * e.sum(-1)
    lo, hi = k.min(-1), k.max(-1)  # invariant: mass(k >= lo) >= target, and the answer is in [lo, hi]

    def body(_, carry):
        lo, hi = carry
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)  # ceil((lo + hi) / 2), no overflow
        ok = jnp.where(k >= mid[:, None], e, 0).sum(-1) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jax.lax.bitcast_convert_type(_sortable(lo), jnp.float32)


def _blocks(x: jnp.ndarray, block: int) -> jnp.ndarray:
    """[V, B] -> [ceil(V / block), block, B], padded with -inf (zero probability)."""
    v, b = x.shape
    nb = -(-v // block)
    return jnp.pad(x, ((0, nb * block - v), (0, 0)), constant_values=-jnp.inf).reshape(nb, block, b)


def _pick(x: jnp.ndarray, i: jnp.ndarray) -> jnp.ndarray:
    """x[i[b], ..., b] for each row b: entry i along the leading axis of a row-minor array."""
    return jnp.take_along_axis(x, i.reshape(1, *(1,) * (x.ndim - 2), -1), axis=0)[0]


def _inverse_cdf(weight, x: jnp.ndarray, u: jnp.ndarray, block: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Index i with probability w[i] / sum(w) for u ~ U[0, 1), and sum(w); w = weight(x) >= 0 is
    elementwise, and weight is called on [blocks, block, B] slices of x [V, B] (vocab-major).

    Two levels: cumulative block sums pick a block, then a cumsum inside the block picks the entry.
    The weights are recomputed for the chosen block instead of kept, so the full [V, B] pass is a
    single fused exp-and-sum. Clipping to the last entry with positive weight guards against float
    rounding at the top end.
    """
    blocks = _blocks(x, block)
    nb = blocks.shape[0]
    sums = weight(blocks).sum(1)  # [nb, B]
    csum = jnp.cumsum(sums, axis=0)
    total = csum[-1]
    target = u * total
    last_block = nb - 1 - jnp.argmax((sums > 0)[::-1], axis=0)
    j = jnp.minimum((csum <= target).sum(0), last_block)
    within = weight(_pick(blocks, j)[None])[0]  # [block, B]
    rest = target - (_pick(csum, j) - _pick(sums, j))
    last_in = block - 1 - jnp.argmax((within > 0)[::-1], axis=0)
    i = jnp.minimum((jnp.cumsum(within, axis=0) <= rest).sum(0), last_in)
    return j * block + i, total


def sample_logits(logits, u, temperature, top_p, *, greedy: bool, top_k: int, use_top_p: bool,
                  block: int = VOCAB_BLOCK, vocab_major: bool = False):
    """Sample one token per row of float32 logits [B, V] ([V, B] if vocab_major) given uniforms u [B].

    Returns (tokens [B] int32, logprobs [B] float32): the log-probability of the token under the
    distribution actually sampled from (temperature, then top-k, then top-p on the renormalised
    top-k mass). Greedy returns the argmax and its log-softmax under the raw (temperature 1) logits.

    The work is done vocab-major (rows on the minor axis): the layout in which the sampler's LM head
    is fastest (see the module docstring).
    """
    x = logits.astype(jnp.float32)
    x = x if vocab_major else x.T
    if greedy:  # block maxima, then the argmax inside the winning block: one pass, not a [V, B] argmax
        blocks = _blocks(x, block)
        block_max = blocks.max(1)
        j = jnp.argmax(block_max, axis=0)
        i = jnp.argmax(_pick(blocks, j), axis=0)
        m = block_max.max(0)
        lp = -jnp.log(jnp.exp(blocks - m).sum((0, 1)))  # log-softmax at the argmax
        return (j * block + i).astype(jnp.int32), lp
    # Top-k and top-p only need the order of the logits, which temperature does not change, so the
    # temperature is folded into the one exp pass instead of a separate pass over [V, B].
    ids = None
    if top_k:
        # Sorted candidates: cheap for small k, unlike a full sort. The barrier keeps XLA from folding the
        # transpose into the LM head's dot, which then takes its slower [B, V] form.
        x, ids = jax.lax.top_k(jax.lax.optimization_barrier(x).T, top_k)
        x, ids = x.T, ids.T
    inv_t = 1.0 / temperature
    m = x.max(0)
    cut = nucleus_cut(x, jnp.exp((x - m) * inv_t), top_p) if use_top_p else None

    def weight(xs):  # xs: [n, block, B]
        e = jnp.exp((xs - m) * inv_t)
        return e if cut is None else jnp.where(xs >= cut, e, 0.0)

    idx, total = _inverse_cdf(weight, x, u, block)
    lp = (_pick(x, idx) - m) * inv_t - jnp.log(total)
    tok = idx if ids is None else _pick(ids, idx)
    return tok.astype(jnp.int32), lp


def truncation_mask(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """[..., V] bool: the tokens the sampler keeps for float32 logits [..., V] (untempered): top-k, then top-p
    on the renormalised top-k mass at the temperature, by the sampler's own rule (sample_logits: the
    nucleus cut of the tempered mass over the top-k candidates, ties at the cut all kept). Top-k keeps every
    token at or above the k-th largest logit; the sampler's lax.top_k keeps exactly k, which differs only on
    an exact float tie at the k-th value."""
    vocab = logits.shape[-1]
    keep = jnp.ones(logits.shape, bool)
    candidates = logits
    if 0 < top_k < vocab:
        candidates = jax.lax.top_k(logits, top_k)[0]  # [..., k], descending, as the sampler's
        keep = logits >= candidates[..., -1:]
    if top_p < 1.0:
        n = candidates.shape[-1]
        flat = candidates.reshape(-1, n)
        inv_t = np.float32(1.0) / np.float32(temperature)  # the sampler's float32 reciprocal
        mass = jnp.exp((flat - flat.max(-1, keepdims=True)) * inv_t)
        # The sampler's nucleus cut works vocab-major ([n, rows]), as its logits come.
        cut = nucleus_cut(flat.T, mass.T, jnp.float32(top_p)).reshape(*logits.shape[:-1], 1)
        keep = keep & (logits >= cut)
    return keep


def tempered_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0, with_entropy: bool = False):
    """Log-prob of each target [...] under the distribution the sampler draws from given float32 logits
    [..., V]: softmax(logits / temperature) truncated to truncation_mask's tokens and renormalised; and
    optionally the entropy [...] of the untruncated tempered distribution softmax(logits / temperature)
    (differentiable: the loss's entropy bonus and entropy_floor).

    The entropy is taken before top-k / top-p, as verl's entropy_coeff takes it: the truncated distribution's
    entropy is 0, and locally constant, wherever the top token alone holds top_p of the mass (or top_k is 1), so a
    bonus on it could not pull back a position that has collapsed past the nucleus, the case the bonus is for; and
    it would reach only the kept tokens' logits. The log-probs (the ratio, the importance weight) stay the
    truncated distribution's: the sampler's.

    The target always counts as kept: a token the sampler drew may fall outside the learner's set when the weights
    moved since (or by rounding at the cut), and a log-prob of -inf would make its ratio 0 and its gradient NaN; at
    staleness 0 it is in the set anyway."""
    tempered = logits / temperature if temperature != 1.0 else logits
    if top_k or top_p < 1.0:
        is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
        keep = truncation_mask(logits, temperature, top_k, top_p) | is_target
        kept = jnp.where(keep, tempered, -jnp.inf)
        logprobs = jnp.take_along_axis(kept, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(kept, axis=-1)
        if not with_entropy:
            return logprobs, None
        log_norm = jax.nn.logsumexp(tempered, axis=-1)
        entropy = log_norm - jnp.sum(jnp.exp(tempered - log_norm[..., None]) * tempered, axis=-1)
        return logprobs, entropy
    # Untruncated: one exp pass for the log-probs and the entropy, shifted by the top logit (no gradient through the
    # shift: the values do not depend on it).
    shifted = tempered - jax.lax.stop_gradient(tempered.max(axis=-1, keepdims=True))
    weights = jnp.exp(shifted)
    log_norm = jnp.log(jnp.sum(weights, axis=-1))
    logprobs = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - log_norm
    if not with_entropy:
        return logprobs, None
    entropy = log_norm - jnp.sum(weights * shifted, axis=-1) / jnp.exp(log_norm)
    return logprobs, entropy
