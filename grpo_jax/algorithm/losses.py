"""Policy losses: GRPO (token-level clipped surrogate, with DAPO clip-higher, dual clip, Dr. GRPO
aggregation) and GSPO (sequence-level ratio), plus an optional KL penalty and an off-policy correction
for the gap between the sampler's (behaviour) policy and the learner's.

Three kinds of log-probs of the sampled completion tokens, all [B, T]:
  logprobs            learner, current weights (the only input with a gradient)
  old_logprobs        learner, the proximal policy: the weights at the start of the learner step, before
                      its first update (ratio = exp(logprobs - old_logprobs); the clip acts on it)
  behaviour_logprobs  the sampler's log-probs at generation: older weights in async training (staleness),
                      and other numerics or kernels; importance weight w = exp(old - behaviour)

Off-policy corrections (`off_policy`), both clipping the ratio against the proximal policy:
  "tis"        truncated importance sampling (Yao et al. 2025; verl's TIS): each token's policy loss
               times min(w, tis_cap).
  "decoupled"  the decoupled PPO objective of AReaL (Fu et al. 2025): each token's policy loss times w,
               and tokens whose w exceeds tis_cap are dropped (weight 0) rather than truncated.
  "none"       no correction (only right when behaviour and proximal policies agree: synchronous
               training with matched numerics).

`mask` [B, T] marks completion tokens (1) versus padding (0). Padding may hold any values, even
inf/NaN: it is excluded from the loss, its gradient and every metric.

Sequences. Every per-sequence quantity (the sequence means of the aggregations, GSPO's sequence ratio, the
advantage statistics, num_seqs) is a segment reduction over a static number of sequence slots (Sequences):
either one sequence per row (`sequence_ids` None, advantages [B]: the padded layout), or K slots per row
(`sequence_ids` [B, T], each token's slot in [0, K) in its row, advantages [B, K]: rows packed with several
sequences, batch.pack_sequences). A slot without tokens counts nowhere, so the two layouts of the same
sequences give the same loss, gradient and metrics (up to float summation order).

Trajectories. A multi-turn trajectory may be cut into several sequences (segments; Trajectories says which): every
sequence-level quantity is then the trajectory's, its segments counting as one sequence of all their tokens: the
token mean of seq_mean_token_mean divides by the trajectory's tokens, each trajectory counts once in the mean over
sequences and in num_seqs (each segment by its share of the trajectory's tokens, so that parts of a batch add up),
GSPO's ratio (and so its clip) is the trajectory's, and the advantage statistics weigh each trajectory once.
Token-level quantities (token_mean, the per-token ratio, the importance weights) are unchanged, and a trajectory of
one segment is a sequence as before.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.config_io import config_key

LOSS_TYPES = ("grpo", "gspo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
OFF_POLICY_MODES = ("none", "tis", "decoupled")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Hashable, so it can be a static argument of jax.jit.

    loss_type: "grpo" clips the per-token ratio with clip_low/clip_high; "gspo" clips the sequence
      ratio exp(mean_t log-ratio) with the much tighter gspo_clip_low/gspo_clip_high.
    clip_low, clip_high: GRPO clip range [1 - clip_low, 1 + clip_high]; DAPO clip-higher: 0.28.
    dual_clip: c > 1 or None; for negative advantages the per-token loss is capped at c * |A|.
    aggregation: how per-token losses become a scalar (padding never counts):
      "token_mean"               sum over all tokens / number of tokens (DAPO)
      "seq_mean_token_mean"      mean over sequences of each sequence's token mean (GRPO, GSPO)
      "seq_mean_token_sum_norm"  mean over sequences of token sum / max_completion_len (Dr. GRPO)
      GSPO's sequence-level objective is seq_mean_token_mean (each sequence's clipped ratio term once); with
      token_mean each sequence weighs by its length (config.Config.warnings says so at the start of a run).
    kl_coef, kl_estimator: adds kl_coef * KL(pi || ref) per token, aggregated the same way;
      k1 = logp - logref, k2 = (logp - logref)^2 / 2, k3 = exp(logref - logp) - (logref - logp) - 1.
      As a loss term (differentiated through logp on samples of pi) k1's expected gradient is zero: its
      gradient is the score function, whose mean under pi is 0, so it adds noise only (warned); k2's is the
      gradient of KL(pi || ref), k3's that of KL(ref || pi).
    off_policy, tis_cap: the correction for behaviour != proximal policy (module docstring): "tis"
      weights each token's policy loss by min(w, tis_cap); "decoupled" by w, zeroing tokens whose w
      exceeds tis_cap; "none" ignores the behaviour log-probs. The weight is a constant (no gradient)
      and multiplies the policy term only, not the KL term.
    entropy_coef: subtracts entropy_coef * H(pi) per token, aggregated the same way (an entropy bonus, as verl's
      entropy_coeff): H is the entropy of each next-token distribution at the sampler's temperature, before its
      top-k / top-p truncation (sampling.tempered_logprobs: truncated, a position whose top token holds top_p of
      the mass has entropy 0 and no gradient, however collapsed), differentiated through the current policy. It
      keeps a policy from collapsing onto one answer before the reward tells the answers apart (a collapsed group
      has no advantage left to learn from). 0 (the default) adds nothing and costs nothing. The metric `entropy`
      is the mean of the same H over the trained tokens.
    entropy_floor: None (the default) or a number of nats: the bonus acts only on sampled tokens whose entropy (the
      same untruncated H) is below it (the bonus is on min(entropy, floor)). An unbounded bonus keeps raising the
      entropy wherever the reward does not care (with Adam, a full step once the advantages vanish), which fills
      turns with junk; with a floor it pushes only the positions under it, never one above it.
    """

    loss_type: str = config_key("grpo", "grpo clips the per-token ratio with clip_low/clip_high; gspo clips the "
                                        "sequence ratio exp(mean_t log-ratio) with the much tighter "
                                        "gspo_clip_low/gspo_clip_high.")
    clip_low: float = config_key(0.2, "GRPO clip range [1 - clip_low, 1 + clip_high].")
    clip_high: float = config_key(0.2, "GRPO clip range [1 - clip_low, 1 + clip_high]; DAPO clip-higher: 0.28.")
    dual_clip: float | None = config_key(None, "c > 1 or None; for negative advantages the per-token loss is capped "
                                               "at c * |A|.")
    gspo_clip_low: float = config_key(3e-4, "GSPO's clip range [1 - gspo_clip_low, 1 + gspo_clip_high] of the "
                                            "sequence ratio.")
    gspo_clip_high: float = config_key(4e-4, "GSPO's clip range [1 - gspo_clip_low, 1 + gspo_clip_high] of the "
                                             "sequence ratio.")
    aggregation: str = config_key("token_mean", "How per-token losses become a scalar (padding never counts): "
                                                "token_mean (sum over all tokens / number of tokens, DAPO), "
                                                "seq_mean_token_mean (mean over sequences of each sequence's token "
                                                "mean, GRPO, GSPO) or seq_mean_token_sum_norm (mean over sequences "
                                                "of token sum / max_completion_len, Dr. GRPO).")
    max_completion_len: int = config_key(0, "The constant normaliser of seq_mean_token_sum_norm (required for it).")
    kl_coef: float = config_key(0.0, "Adds kl_coef * KL(pi || ref) per token, aggregated the same way; 0: no "
                                     "reference model.")
    kl_estimator: str = config_key("k3", "k1 = logp - logref (zero expected gradient as a loss term: noise only, "
                                         "warned), k2 = (logp - logref)^2 / 2, k3 = exp(logref - logp) - (logref - "
                                         "logp) - 1.")
    off_policy: str = config_key("tis", "The correction for behaviour != proximal policy: tis weights each token's "
                                        "policy loss by min(w, tis_cap); decoupled by w, zeroing tokens whose w "
                                        "exceeds tis_cap; none ignores the behaviour log-probs.")
    tis_cap: float = config_key(2.0, "The cap of the off-policy weight w (off_policy tis and decoupled).")
    entropy_coef: float = config_key(0.0, "Subtracts entropy_coef * H(pi) per token, aggregated the same way (an "
                                          "entropy bonus, as verl's entropy_coeff); 0 adds nothing and costs nothing.")
    entropy_floor: float | None = config_key(None, "None or a number of nats: the bonus acts only on sampled tokens "
                                                   "whose entropy is below it (the bonus is on min(entropy, floor)).")

    @property
    def needs_reference(self) -> bool:
        """Whether ref_logprobs (a reference-model forward pass) is needed."""
        return self.kl_coef != 0.0

    def validate(self) -> list[str]:
        """Problems with this config, as 'key=value: allowed ...' strings (empty when valid)."""
        p = []
        for key, allowed in (("loss_type", LOSS_TYPES), ("aggregation", AGGREGATIONS),
                             ("kl_estimator", KL_ESTIMATORS), ("off_policy", OFF_POLICY_MODES)):
            if getattr(self, key) not in allowed:
                p.append(f"{key}={getattr(self, key)!r}: allowed {', '.join(allowed)}")
        for key in ("clip_low", "gspo_clip_low"):
            if not 0.0 <= getattr(self, key) < 1.0:
                p.append(f"{key}={getattr(self, key)}: allowed 0 <= {key} < 1")
        for key in ("clip_high", "gspo_clip_high", "kl_coef", "entropy_coef"):
            if not getattr(self, key) >= 0.0:
                p.append(f"{key}={getattr(self, key)}: allowed >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            p.append(f"dual_clip={self.dual_clip}: allowed None or a value > 1")
        if self.entropy_floor is not None and not self.entropy_floor > 0.0:
            p.append(f"entropy_floor={self.entropy_floor}: allowed None (the bonus on every token) or > 0 nats")
        if self.entropy_floor is not None and self.entropy_coef == 0.0:
            p.append(f"entropy_floor={self.entropy_floor}: needs entropy_coef > 0 (the bonus it bounds)")
        if not self.tis_cap > 0.0:
            p.append(f"tis_cap={self.tis_cap}: allowed > 0")
        if self.aggregation == "seq_mean_token_sum_norm" and not self.max_completion_len > 0:
            p.append(f"max_completion_len={self.max_completion_len}: allowed > 0 "
                     "(required by aggregation='seq_mean_token_sum_norm')")
        return p


def kl_per_token(logprobs, ref_logprobs, estimator: str):
    """Per-token estimate of KL(pi || ref) from samples of pi, [B, T]."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return jnp.exp(-d) + d - 1.0
    raise ValueError(f"kl_estimator={estimator!r}: allowed {', '.join(KL_ESTIMATORS)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trajectories:
    """Which sequences are segments of one trajectory (a multi-turn episode cut into several learner sequences): the
    sequence-level reductions (the sequence means of the aggregations, GSPO's ratio and its clip, the advantage
    statistics, num_seqs) count a trajectory's segments as one sequence, its tokens being all of theirs. Per sequence
    slot, shaped as policy_loss's advantages ([B], or [B, K] with sequence_ids):

    ids: int, equal for the segments of one trajectory (any values; a slot without tokens counts nowhere).
    tokens: None, or each slot's trajectory's trained tokens over all its segments. None: counted over the slots of
      this call, which is right only when every segment of a trajectory is in it.
    log_ratio: None, or (GSPO) each slot's trajectory's mean log-ratio over all its tokens. None: computed from the
      slots of this call (the same condition). The learner gives both when a trajectory's segments are spread over
      micro-batches.
    """

    ids: jax.Array
    tokens: jax.Array | None = None
    log_ratio: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Which sequence each token of a [B, T] array belongs to: `ids` [B, T], a flat slot index in [0, count)
    (row * K + the token's slot in its row), each slot's advantage [count] (0 where given for none), and per slot
    (all [count]): `tokens`, its trained tokens; `lengths`, the token mean's denominator: its trajectory's trained
    tokens (its own without Trajectories); `shares`, what it counts as in a mean over sequences: 1 for a whole
    sequence, a segment its share of its trajectory's tokens (a trajectory's sum to 1), 0 without tokens;
    `trajectory`, its trajectory as an index in [0, count) (None: each slot its own)."""

    ids: jax.Array
    count: int
    advantages: jax.Array
    tokens: jax.Array
    lengths: jax.Array
    shares: jax.Array
    trajectory: jax.Array | None = None

    def sum(self, x):
        """[B, T] -> [count]: each sequence's sum (a segment sum; 0 for a slot without tokens)."""
        return jax.ops.segment_sum(x.reshape(-1), self.ids.reshape(-1), self.count)

    def spread(self, per_sequence):
        """[count] -> [B, T]: each token gets its sequence's value."""
        return per_sequence[self.ids]

    def over_trajectory(self, per_sequence):
        """[count] -> [count]: each slot gets the sum of per_sequence over its trajectory's slots (itself alone
        without Trajectories)."""
        if self.trajectory is None:
            return per_sequence
        return jax.ops.segment_sum(per_sequence, self.trajectory, self.count)[self.trajectory]

    @property
    def total(self):
        """The number of sequences (trajectories) with a trained token, for the means over them (1 if none)."""
        n = self.shares.sum()
        return jnp.where(n > 0, n, 1.0)


def sequences_of(mask, advantages, sequence_ids=None, trajectories: Trajectories | None = None,
                 dtype=jnp.float32) -> Sequences:
    """The Sequences of a batch: one per row (sequence_ids None, advantages [B]) or K slots per row
    (sequence_ids [B, T] int in [0, K), advantages [B, K]), optionally grouped into trajectories (Trajectories,
    per slot as advantages). Ids of masked-out tokens are never trusted: they are clipped into range (their values
    are zeroed by the mask anyway)."""
    b, t = mask.shape
    advantages = jnp.asarray(advantages)
    if sequence_ids is None:
        if advantages.shape != (b,):
            raise ValueError(f"advantages of shape {advantages.shape}: one per row ({b},) without sequence_ids")
        ids, count = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)), b
    else:
        if advantages.ndim != 2 or advantages.shape[0] != b:
            raise ValueError(f"advantages of shape {advantages.shape}: [rows, slots] ({b}, K) with sequence_ids")
        slots = advantages.shape[1]
        ids = jnp.clip(jnp.where(jnp.asarray(mask) > 0, sequence_ids, 0), 0, slots - 1).astype(jnp.int32)
        ids, count = jnp.arange(b, dtype=jnp.int32)[:, None] * slots + ids, b * slots
    tokens = jax.ops.segment_sum(jnp.asarray(mask).astype(dtype).reshape(-1), ids.reshape(-1), count)
    if trajectories is None:
        return Sequences(ids, count, advantages.reshape(-1), tokens, tokens, (tokens > 0).astype(dtype))
    if jnp.shape(trajectories.ids) != advantages.shape:
        raise ValueError(f"trajectory ids of shape {jnp.shape(trajectories.ids)}: one per sequence slot, as the "
                         f"advantages {advantages.shape}")
    # Dense trajectory indices: at most `count` distinct ids, so none is cut off.
    _, trajectory = jnp.unique(jnp.asarray(trajectories.ids).reshape(-1), return_inverse=True, size=count)
    sequences = Sequences(ids, count, advantages.reshape(-1), tokens, tokens, tokens, trajectory.reshape(-1))
    if trajectories.tokens is None:
        lengths = sequences.over_trajectory(tokens)
    else:
        lengths = jnp.asarray(trajectories.tokens, dtype).reshape(-1)
    shares = jnp.where(tokens > 0, tokens / jnp.maximum(lengths, 1.0), 0.0)
    return dataclasses.replace(sequences, lengths=lengths, shares=shares)


def count_sequences(mask, advantages, sequence_ids=None, trajectories: Trajectories | None = None):
    """The number of sequences with at least one token under `mask` (float32 scalar); with Trajectories, of
    trajectories (each segment counting its share of its trajectory's tokens, so that the counts of the parts of a
    batch add up to the whole's)."""
    return sequences_of(mask, advantages, sequence_ids, trajectories).shares.sum().astype(jnp.float32)


def aggregate(per_token, mask, aggregation: str, max_completion_len: int = 0, sequences: Sequences | None = None):
    """Scalar from per-token values [B, T] under a float mask [B, T]; see LossConfig.aggregation.
    Sequences with no tokens (padding rows, empty slots) count in no denominator. sequences: which sequence
    each token belongs to (None: one per row), and which trajectory each sequence (a trajectory's segments are
    one sequence: its token mean over all their tokens, counted once in the mean over sequences)."""
    x = jnp.where(mask > 0, per_token, 0.0) * mask
    if sequences is None:
        sequences = sequences_of(mask, jnp.zeros(mask.shape[0], x.dtype), dtype=x.dtype)
    if aggregation == "token_mean":
        return x.sum() / jnp.maximum(mask.sum(), 1.0)
    if aggregation == "seq_mean_token_mean":
        return (sequences.sum(x) / jnp.maximum(sequences.lengths, 1.0)).sum() / sequences.total
    if aggregation == "seq_mean_token_sum_norm":
        if not max_completion_len > 0:
            raise ValueError("aggregation='seq_mean_token_sum_norm' needs max_completion_len > 0")
        return (sequences.sum(x) / max_completion_len).sum() / sequences.total
    raise ValueError(f"aggregation={aggregation!r}: allowed {', '.join(AGGREGATIONS)}")


def _masked_mean(x, m):
    return jnp.where(m, x, 0.0).sum() / jnp.maximum(m.sum(), 1)


def _masked_max(x, m):
    return jnp.where(m.any(), jnp.where(m, x, -jnp.inf).max(), 0.0)


def _masked_min(x, m):
    return jnp.where(m.any(), jnp.where(m, x, jnp.inf).min(), 0.0)


def policy_loss(logprobs, old_logprobs, behaviour_logprobs, ref_logprobs, advantages, mask,
                config: LossConfig, entropies=None, sequence_ids=None, trajectories: Trajectories | None = None):
    """(loss scalar, metrics dict of scalars).

    logprobs, old_logprobs, behaviour_logprobs, ref_logprobs: [B, T] per completion token;
      behaviour_logprobs may be None when config.off_policy == "none" (then no mismatch metrics),
      ref_logprobs may be None when not config.needs_reference.
    advantages: one per sequence, [B] (one sequence per row) or [B, K] (K sequence slots per row, with
    sequence_ids [B, T]: each token's slot in its row; see the module docstring). mask: [B, T] bool or
    float. entropies: optional [B, T], required when config.entropy_coef != 0. trajectories: which sequences are
    segments of one trajectory (Trajectories; None: each its own). Gradients flow through `logprobs`, and through
    `entropies` when config.entropy_coef != 0.
    """
    if config.off_policy != "none" and behaviour_logprobs is None:
        raise ValueError(f"off_policy={config.off_policy!r} needs behaviour_logprobs")
    if config.needs_reference and ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs")
    if config.entropy_coef != 0.0 and entropies is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropies")
    dtype = jnp.result_type(logprobs.dtype, jnp.float32)
    m = jnp.asarray(mask).astype(bool)
    mf = m.astype(dtype)
    sequences = sequences_of(m, advantages, sequence_ids, trajectories, dtype)
    seq_has_tokens = sequences.tokens > 0
    # Sanitize padding before any exp: garbage there would otherwise become inf * 0 = NaN.
    logp = jnp.where(m, logprobs, 0.0).astype(dtype)
    old = jax.lax.stop_gradient(jnp.where(m, old_logprobs, 0.0).astype(dtype))
    adv_seq = jnp.where(seq_has_tokens, sequences.advantages.astype(dtype), 0.0)
    adv = sequences.spread(adv_seq) * mf
    log_ratio = logp - old

    if config.loss_type == "grpo":
        ratio = jnp.exp(log_ratio)
        lo, hi = 1.0 - config.clip_low, 1.0 + config.clip_high
    elif config.loss_type == "gspo":
        if trajectories is not None and trajectories.log_ratio is not None:  # over segments outside this call too
            seq_log_ratio = jnp.where(seq_has_tokens, jnp.asarray(trajectories.log_ratio, dtype).reshape(-1), 0.0)
        else:  # per trajectory: all its tokens
            seq_log_ratio = sequences.over_trajectory(sequences.sum(log_ratio * mf)) / jnp.maximum(sequences.lengths,
                                                                                                  1.0)
        # GSPO-token: value is the sequence ratio s_i; the gradient reaches each token as s_i * dlogp_t.
        seq_ratio = sequences.spread(jax.lax.stop_gradient(jnp.exp(seq_log_ratio)))
        ratio = seq_ratio * jnp.exp(logp - jax.lax.stop_gradient(logp))
        lo, hi = 1.0 - config.gspo_clip_low, 1.0 + config.gspo_clip_high
    else:
        raise ValueError(f"loss_type={config.loss_type!r}: allowed {', '.join(LOSS_TYPES)}")

    pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    if config.dual_clip is not None:
        pg = jnp.where(adv < 0, jnp.minimum(pg, config.dual_clip * -adv), pg)

    metrics = {}
    if behaviour_logprobs is not None:
        behaviour = jnp.where(m, behaviour_logprobs, 0.0).astype(dtype)
        is_log = jax.lax.stop_gradient(old - behaviour)
        is_w = jnp.exp(is_log)
        capped = m & (is_w > config.tis_cap)
        metrics |= {"tis/weight_mean": _masked_mean(is_w, m), "tis/weight_max": _masked_max(is_w, m),
                    "tis/frac_capped": _masked_mean(capped, m),
                    # KL(behaviour || old), k3 estimate from the sampler's own samples.
                    "tis/mismatch_kl": _masked_mean(is_w - is_log - 1.0, m)}
        if config.off_policy == "tis":
            pg = pg * jnp.minimum(is_w, config.tis_cap)
        elif config.off_policy == "decoupled":
            pg = pg * jnp.where(capped, 0.0, is_w)

    pg_loss = aggregate(pg, mf, config.aggregation, config.max_completion_len, sequences)
    loss = pg_loss
    if ref_logprobs is not None:
        ref = jax.lax.stop_gradient(jnp.where(m, ref_logprobs, 0.0).astype(dtype))
        kl = kl_per_token(logp, ref, config.kl_estimator)
        kl_loss = aggregate(kl, mf, config.aggregation, config.max_completion_len, sequences)
        if config.kl_coef != 0.0:
            loss = loss + config.kl_coef * kl_loss
        metrics |= {"kl/loss": kl_loss, "kl/mean": _masked_mean(kl, m)}
    if config.entropy_coef != 0.0:
        bonused = entropies if config.entropy_floor is None else jnp.minimum(entropies, config.entropy_floor)
        entropy_loss = aggregate(jnp.where(m, bonused, 0.0).astype(dtype), mf, config.aggregation,
                                 config.max_completion_len, sequences)
        loss = loss - config.entropy_coef * entropy_loss
        if config.entropy_floor is not None:
            below = (entropies < config.entropy_floor).astype(dtype)  # a comparison: no gradient to stop
            metrics["entropy/below_floor"] = _masked_mean(below, m)

    sg = jax.lax.stop_gradient
    r, a = sg(ratio), sg(adv)
    adv_mean = jnp.sum(sequences.shares * adv_seq) / sequences.total
    metrics |= {
        "loss": sg(loss),
        "pg_loss": sg(pg_loss),
        # Where the clip binds, i.e. the token's gradient is zeroed, given the advantage sign.
        "clip/frac_low": _masked_mean((a < 0) & (r < lo), m),
        "clip/frac_high": _masked_mean((a > 0) & (r > hi), m),
        # KL(old || current), k3 estimate from samples of old: (r - 1) - log r.
        "approx_kl_old": _masked_mean(sg(jnp.exp(log_ratio) - log_ratio - 1.0), m),
        "ratio/mean": _masked_mean(r, m),
        "ratio/max": _masked_max(r, m),
        "ratio/min": _masked_min(r, m),
        # Over sequences, a trajectory's segments weighted by their shares of it: each trajectory once.
        "advantage/mean": adv_mean,
        "advantage/std": jnp.sqrt(jnp.sum(sequences.shares * (adv_seq - adv_mean) ** 2) / sequences.total),
        "advantage/min": _masked_min(adv_seq, seq_has_tokens),
        "advantage/max": _masked_max(adv_seq, seq_has_tokens),
        "num_tokens": mf.sum(),
        "num_seqs": sequences.shares.sum(),
    }
    if config.dual_clip is not None:
        metrics["clip/frac_dual"] = _masked_mean((a < 0) & (r > config.dual_clip), m)
    if entropies is not None:
        metrics["entropy"] = _masked_mean(sg(jnp.where(m, entropies, 0.0).astype(dtype)), m)
    return loss, metrics
