"""The learner: one jitted GRPO learner step over a batch of finished groups.

Parameters and optimizer state are plain pytrees (nnx.split), so the step is a pure function that
jit compiles once per batch shape, shards by the parameters' layout, and checkpoints without pickling.

A learner step makes `optim.epochs x optim.mini_batches` optimizer updates (PPO mini-batches; GRPO's mu
is the number of epochs). Mini-batch m holds rows m, m + M, m + 2M, ... of the batch (strided, so each
one draws an equal share of rows from every data-parallel device), in the same order every epoch.

Old (proximal) log-probs: with one update per step they are the forward pass itself under stop_gradient
(the ratio is 1 in value, its gradient is the policy gradient). With several updates they are computed
once, by a forward pass with the weights of the step's first update, before any update: the ratio and
the clip act from the second update on. The reference model's log-probs (KL penalty) are computed in
the same pass. The sampler's behaviour log-probs enter through the off-policy correction of losses.py.

The policy is the distribution the sampler draws from: softmax(logits / T) truncated as the sampler
truncates it (top-k, then top-p on the renormalised top-k mass; tempered_logprobs) and renormalised over
the kept tokens, in the proximal, current and reference passes alike. So the importance weights compare
the same distributions: at staleness 0 they are 1 up to float rounding, with truncation or without. A
sampled token outside the learner's kept set (the weights moved since sampling, or its logit sits within
rounding of the cut) counts as kept, so that its log-prob stays finite.

Rows whose reward failed (pack_batch's `valid`) have loss_mask 0, exactly like padding rows: they add
nothing to the policy loss, the KL, any aggregation denominator or any metric.

Completion masks (multi-turn environments): a completion may interleave sampled tokens with tokens the
environment wrote (tool results). `completion_masks` (one 0/1 array per completion, 1 = sampled) multiply the
loss mask, so an environment token is context only: it is trained in no loss, counts in no denominator,
per-sequence count or metric, and its behaviour log-prob and advantage are never read. Without masks every
completion token is trained (the same batch, bit for bit).

Two layouts of a step's sequences (TrainBatch; laid out host side by algorithm.batch), trained alike: one
sequence per row (pack_batch), or packed rows (pack_sequences, optim.packing): first-fit decreasing into rows
of the same length, each token labelled with its sequence (attention within a sequence only, positions
restarting at 0), the vocabulary projection on the trained positions only (scored_positions), and every
per-sequence reduction of the losses a segment reduction over each row's sequence slots. A sequence stays in
the mini-batch of its padded row (sequence s in mini-batch s % M), and a sequence with no trained token is
left out (it counts in nothing anyway), so loss, gradients, metrics, mini-batches and epochs are those of the
padded layout up to float summation order (tests/test_packing.py). The number of packed rows varies with the
completions' lengths: callers round it up to one of a few sizes (packed_row_sizes) so that a run compiles a
few programs. Micro-batches hold a
number of rows (optim.micro_batch_size, or optim.micro_batch_tokens / the row length), packed or not.

Gradient accumulation runs the micro-batches of each update through `lax.scan`, so memory holds one
micro-batch of activations however large the group. Each micro-batch's loss is weighted by its share of
the update's loss denominator (tokens for token_mean, sequences otherwise), which makes the accumulated
gradient equal to the mini-batch's gradient, not an average of per-micro-batch means. The metrics
num_tokens and num_seqs count the rollout batch's trained tokens and sequences (summed over micro- and
mini-batches, once per row however many epochs).

Multi-turn trajectories (TrainBatch.trajectories): a trajectory cut into several sequences (segments) is one
sequence for the losses' sequence-level reductions (losses.Trajectories: its token mean over all its segments'
tokens, counted once among the sequences and in num_seqs, one GSPO ratio and clip). Its segments train in one
mini-batch (pack_layout assigns mini-batches by trajectory), but the rows of a mini-batch split into micro-batches
whatever their trajectories, so before the micro-batches each update takes from the whole mini-batch what a
micro-batch cannot see: each trajectory's trained tokens (a segment then counts its share of its trajectory in the
denominators, and the shares add up to 1 over the micro-batches), and for GSPO over several micro-batches each
trajectory's mean log-ratio under the current weights, which costs a forward pass over the mini-batch in every
update after a step's first (with one update per step the ratio is 1). The gradient then equals the mini-batch's
whatever the split, in either layout (tests/test_packing.py).

The learning rate is a function of the learner-step index (Learner.steps_done, the learner steps that
applied an update), passed into the step: every update of a step runs at that step's rate, whatever
updates were skipped before it. optax's own schedule count advances per applied update only (a skipped
update keeps the old optimizer state), so left to itself one skipped update would put every later
step's first update at the previous step's rate; the step sets that count from the index instead.

An update whose loss or gradient norm is not finite is skipped (parameters and moments unchanged); the
step reports which updates were applied, so the trainer can record which groups were really trained.

LoRA (lora.py): the trained parameters are the adapters; the base model's weights enter the step as a
separate argument that is neither differentiated nor donated, so optimizer moments exist for the
adapters alone and the base's weight gradients are never computed. The KL reference is that base with
the adapters off. Adapter dropout applies to the gradient only, with a key per update and micro-batch:
every value the loss uses (the ratio and its clip, the importance weight, the KL, the entropy) comes
from the same micro-batch's log-probs without dropout, the policy the sampler runs, and the proximal
log-probs are always computed without it. A micro-batch with dropout therefore runs its forward pass
twice (once without dropout and without gradient); otherwise the clip would bind on dropout noise even
at lr 0, and the importance weight would carry that noise at staleness 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax.algorithm.losses import LossConfig, Trajectories, count_sequences, policy_loss, sequences_of
from grpo_jax.algorithm.optim import (  # also importable from here, as before
    OptimConfig,
    at_learner_step,
    learning_rate_schedule,
    make_optimizer,
)
from grpo_jax.algorithm.sampling import tempered_logprobs
from grpo_jax.errors import UserError
from grpo_jax.model.lora import merge_adapters
from grpo_jax.model.transformer import Transformer, positions_from_mask
from grpo_jax.parallel.sharding import constrain_rows, traced_on


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    """One learner batch; sequence index t of the [B, L-1] arrays scores tokens[:, t + 1].

    Two layouts of the same sequences, which train alike (same loss, gradients and metrics):
    - one sequence per row (pack_batch): input_mask [B, L] bool, the real tokens (prompt left-padded,
      completion right-padded); advantages [B];
    - packed rows (pack_sequences): several sequences one after the other in a row; input_mask [B, L] int32
      segment labels (0: padding, k + 1: the tokens of the row's k-th sequence), so that attention stays
      within a sequence and positions restart at each (token_logprobs); advantages [B, K], one per sequence
      slot (K = L // 2, the most sequences a row can hold: each has a prompt and a completion token).
    tokens: [B, L] the sequences' tokens; loss_mask: [B, L-1] the completion tokens being trained (none in a
    padding row, an empty slot or a row whose reward failed: such a sequence counts in no loss, denominator or
    metric); behaviour_logprobs: [B, L-1] the sampler's log-probs of those tokens (0 elsewhere).
    """

    tokens: jax.Array
    input_mask: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    behaviour_logprobs: jax.Array
    # Static: the completions occupy the last completion_len tokens, so only the positions that score
    # them need the vocabulary projection (the costliest matmul at a 32k vocab). 0: score every position.
    completion_len: int = dataclasses.field(default=0, metadata=dict(static=True))
    # Packed rows: [B, C] the positions (of the L - 1) that score a trained token, in order, then -1; only they
    # go through the vocabulary projection (C = the completion bucket: the padded layout's cost per row).
    scored_positions: jax.Array | None = None
    # Routing replay: [B, L-1, layers with experts, experts per token] int32, the experts each input token (tokens[:,
    # :-1]) went through when it was sampled (Transformer.hidden_states' routing); None: the learner's router picks.
    routing: jax.Array | None = None
    # Multi-turn: per sequence, as advantages ([B], or [B, K] per slot), int32: the trajectory it is a segment of;
    # sequences with equal numbers are one trajectory for the losses' sequence-level reductions (losses.Trajectories),
    # and must lie in one mini-batch (rows of one r % mini_batches). None: each sequence its own trajectory.
    trajectories: jax.Array | None = None

    def scored(self, x: jax.Array) -> jax.Array:
        """The [B, L-1, ...] per-position array cut to the positions that score completion tokens."""
        if self.scored_positions is not None:
            return take_scored(x, self.scored_positions)
        return x if not self.completion_len else x[:, x.shape[1] - self.completion_len:]

    def sequence_ids(self) -> jax.Array | None:
        """[B, C] per scored position: the slot (in its row) of the sequence whose token it scores, for the
        losses' per-sequence reductions; None with one sequence per row."""
        if jnp.asarray(self.input_mask).dtype == jnp.bool_:
            return None
        return self.scored(self.input_mask[:, 1:]) - 1


def take_scored(x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, ...] at positions [B, C] of each row (a position -1 gives zeros), [B, C, ...]."""
    extra = (1,) * (x.ndim - 2)
    index = jnp.maximum(positions, 0).reshape(positions.shape + extra)
    taken = jnp.take_along_axis(x, index, axis=1)
    return jnp.where((positions >= 0).reshape(positions.shape + extra), taken, jnp.zeros((), taken.dtype))


def token_logprobs(model: Transformer, tokens: jax.Array, input_mask: jax.Array, with_entropy: bool = False,
                   last: int = 0, temperature: float = 1.0, adapters=None, dropout_key=None, top_k: int = 0,
                   top_p: float = 1.0, chunk: int = 0, scored_positions: jax.Array | None = None, routing=None):
    """Log-prob of each next token under the sampler's distribution (tempered_logprobs: softmax(logits /
    temperature), truncated by top_k / top_p), [B, L-1] (or only the last `last` positions, [B, last], or only
    `scored_positions` [B, C], [B, C]), and optionally the entropy of each next-token distribution.
    input_mask: bool real tokens (one sequence per row), or int segment labels (packed rows, TrainBatch):
    each token attends only to its own sequence, whose positions start at 0. adapters, dropout_key: LoRA on
    top of the model (Transformer.hidden_states). chunk: positions whose logits exist at once
    (chunked_logprobs); 0: all. routing: [B, L-1, ...] experts to route the input tokens to (routing replay)."""
    positions = positions_from_mask(input_mask)
    packed = jnp.asarray(input_mask).dtype != jnp.bool_
    key_mask = input_mask > 0 if packed else input_mask
    segments = input_mask[:, :-1] if packed else None
    hidden, _ = model.hidden_states(tokens[:, :-1], positions[:, :-1], key_mask[:, :-1], adapters=adapters,
                                    dropout_key=dropout_key, segment_ids=segments, routing=routing)
    targets = tokens[:, 1:]
    if scored_positions is not None:
        hidden, targets = take_scored(hidden, scored_positions), take_scored(targets, scored_positions)
    elif last:
        hidden, targets = hidden[:, -last:], targets[:, -last:]
    logits_of = functools.partial(model.logits, head=model.head_for(hidden.dtype))
    return chunked_logprobs(logits_of, hidden, targets, chunk, temperature, top_k, top_p, with_entropy)


def batch_logprobs(model: Transformer, batch: TrainBatch, **options):
    """token_logprobs at the batch's scored positions, [B, C] (either layout); options as token_logprobs's."""
    return token_logprobs(model, batch.tokens, batch.input_mask, last=batch.completion_len,
                          scored_positions=batch.scored_positions, routing=batch.routing, **options)


@jax.named_scope("logprobs")
def chunked_logprobs(logits_of, hidden: jax.Array, targets: jax.Array, chunk: int, temperature: float = 1.0,
                     top_k: int = 0, top_p: float = 1.0, with_entropy: bool = False):
    """tempered_logprobs of `targets` [B, T] from hidden states [B, T, E] (logits_of: [..., E] -> float32
    [..., V]), without a [B, T, V] array in the forward or the backward pass: the positions go through a scan
    in chunks of `chunk`, each chunk's logits made, used and dropped inside a rematerialised body (made again,
    chunk by chunk, when the gradient needs them). Every row is in every chunk, so a batch sharded by rows
    keeps all its devices busy. The values and gradients are those of the whole at once, up to float32
    rounding. chunk 0 (or >= T): all positions at once."""
    b, t, e = hidden.shape
    if not chunk or chunk >= t:
        return tempered_logprobs(logits_of(hidden), targets, temperature, top_k, top_p, with_entropy=with_entropy)
    n = -(-t // chunk)
    pad = n * chunk - t  # padded positions score token 0 and are cut off below
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, e).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(h, target):
        logprobs, entropy = tempered_logprobs(logits_of(constrain_rows(h)), target, temperature, top_k, top_p,
                                              with_entropy=with_entropy)
        return logprobs, (entropy if with_entropy else jnp.zeros_like(logprobs))

    logprobs, entropy = jax.lax.map(lambda xs: one_chunk(*xs), (hidden, targets))

    def unchunk(x):  # [n, B, chunk] -> [B, T]
        return x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]

    return unchunk(logprobs), (unchunk(entropy) if with_entropy else None)


def _aggregation_weight(batch: TrainBatch, loss_config: LossConfig, trajectories: Trajectories | None) -> jax.Array:
    """This micro-batch's share of the update's loss denominator (before division by the total)."""
    mask = batch.scored(batch.loss_mask)
    if loss_config.aggregation == "token_mean":
        return jnp.sum(mask)
    # policy_loss averages over sequences that have at least one token (padding rows, empty slots drop out); a
    # trajectory's segments count by their shares of it, which add up to 1 over the micro-batches.
    return count_sequences(mask, batch.advantages, batch.sequence_ids(), trajectories)


def trajectory_totals(batch: TrainBatch, log_ratio: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Per sequence slot of a batch with trajectories (shaped as its advantages): its trajectory's trained tokens
    over the whole batch, and with `log_ratio` ([B, C] at the scored positions) its trajectory's mean log-ratio
    (GSPO's), for micro-batches that hold only some of a trajectory's segments (losses.Trajectories)."""
    mask = batch.scored(batch.loss_mask)
    sequences = sequences_of(mask, batch.advantages, batch.sequence_ids(), Trajectories(batch.trajectories))
    shape = jnp.shape(batch.advantages)
    if log_ratio is None:
        return sequences.lengths.reshape(shape), None
    summed = sequences.over_trajectory(sequences.sum(jnp.where(mask > 0, log_ratio, 0.0)))
    return sequences.lengths.reshape(shape), (summed / jnp.maximum(sequences.lengths, 1.0)).reshape(shape)


def split_rows(tree, parts: int):
    """Every leaf [B, ...] -> [parts, B / parts, ...], part p holding rows p, p + parts, ... (strided: a
    batch sharded by rows keeps each part spread over all its devices, so a scan over parts stays local).
    Packed rows keep this: pack_sequences puts mini-batch m's sequences in rows m, m + M, ..."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // parts, parts, *x.shape[1:]), 0, 1), tree)


# Metrics that count (tokens, sequences): summed over micro-batches, not averaged like the rest.
COUNT_METRICS = ("num_tokens", "num_seqs")
# Aggregated losses: merged by each micro-batch's share of the update's loss denominator (as the loss itself).
LOSS_METRICS = ("loss", "pg_loss", "kl/loss")
# Means over sequences (the other means are over tokens); advantage/std is pooled from the micro-batches' means.
SEQUENCE_MEANS = ("advantage/mean", "advantage/std")


def _merge_micro_metrics(stacked: dict, weights: jax.Array) -> dict:
    """One update's metrics from its micro-batches' (stacked [parts]): each mean weighted by what it is a mean
    over (tokens, sequences, or the loss denominator `weights`), so that the result is the whole mini-batch's
    whatever the split, and the same for padded and packed rows (whose micro-batches hold other sequences)."""
    tokens, seqs = stacked["num_tokens"], stacked["num_seqs"]
    merged = _merge_metrics({k: v for k, v in stacked.items() if k in LOSS_METRICS}, weights)
    for key, value in stacked.items():
        if key in LOSS_METRICS:
            continue
        count = seqs if key in SEQUENCE_MEANS else tokens
        share = count / jnp.maximum(jnp.sum(count), 1e-9)
        if key in COUNT_METRICS:
            merged[key] = jnp.sum(value)
        elif key.endswith(("max", "min")):  # over the parts that hold any (an empty part reports 0)
            largest = key.endswith("max")
            held = jnp.where(count > 0, value, -jnp.inf if largest else jnp.inf)
            merged[key] = jnp.where(jnp.any(count > 0), jnp.max(held) if largest else jnp.min(held), 0.0)
        elif key == "advantage/std":  # pooled: within-part variances plus the parts' means' spread
            mean = jnp.sum(stacked["advantage/mean"] * share)
            merged[key] = jnp.sqrt(jnp.sum(share * (value ** 2 + (stacked["advantage/mean"] - mean) ** 2)))
        else:
            merged[key] = jnp.sum(value * share)
    return merged


def _merge_metrics(stacked: dict, weights: jax.Array) -> dict:
    share = weights / jnp.maximum(jnp.sum(weights), 1e-9)
    merged = {}
    for key, value in stacked.items():
        if key in COUNT_METRICS:
            merged[key] = jnp.sum(value)
        elif key.endswith("max"):
            merged[key] = jnp.max(value)
        elif key.endswith("min"):
            merged[key] = jnp.min(value)
        else:
            merged[key] = jnp.sum(value * share)
    return merged


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Rows:
    """A batch with the per-token log-probs computed before the step's first update ([B, T] or None), and, with
    trajectories, per sequence slot what a micro-batch needs of the whole mini-batch (trajectory_totals)."""

    batch: TrainBatch
    old_logprobs: jax.Array | None
    ref_logprobs: jax.Array | None
    trajectory_tokens: jax.Array | None = None
    trajectory_log_ratio: jax.Array | None = None

    def trajectories(self) -> Trajectories | None:
        if self.batch.trajectories is None:
            return None
        return Trajectories(self.batch.trajectories, self.trajectory_tokens, self.trajectory_log_ratio)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, loss_config: LossConfig,
                    optim_config: OptimConfig, ref_graphdef=None, temperature: float = 1.0, base_graphdef=None,
                    top_k: int = 0, top_p: float = 1.0):
    """A pure learner step (params, opt_state, batch, ref_params, frozen, dropout_key, step_index) -> (params,
    opt_state, metrics, applied), for jax.jit: optim.epochs x optim.mini_batches updates; `applied` [updates]
    says which were finite (update u works on mini-batch u % mini_batches). step_index (int32 scalar): the
    learner-step index that sets the learning rate (at_learner_step). `temperature`, `top_k`, `top_p` are the
    sampler's (temperature 0, greedy, counts as 1; training refuses it): every pass scores the sampler's
    truncated distribution (tempered_logprobs).

    LoRA (base_graphdef given): graphdef and params are the adapters (lora.Adapters), the only thing trained;
    `frozen` is the base model's state (of base_graphdef), never differentiated, and the KL reference is that
    base with the adapters off (ref_graphdef and ref_params unused). dropout_key: raw key data (uint32 [2]) for
    the adapters' dropout in the gradient pass, or None for none.
    """
    mini_batches, updates = optim_config.mini_batches, optim_config.updates_per_step
    temperature = temperature or 1.0

    def logprobs_of(gd, params, micro: TrainBatch, frozen=None, with_entropy=False, dropout_key=None):
        if base_graphdef is None:
            model, adapters = nnx.merge(gd, params), None
        else:  # params None: the base alone (the KL reference)
            model, adapters = nnx.merge(base_graphdef, frozen), None if params is None else nnx.merge(gd, params)
        return batch_logprobs(model, micro, with_entropy=with_entropy, temperature=temperature, adapters=adapters,
                              dropout_key=dropout_key, top_k=top_k, top_p=top_p, chunk=optim_config.logprob_chunk)

    def num_micro(batch: TrainBatch) -> int:
        micro_rows = optim_config.micro_batch_rows(batch.tokens.shape[1])
        return batch.tokens.shape[0] // micro_rows if micro_rows else 1

    def forward_logprobs(gd, params, batch: TrainBatch, frozen=None) -> jax.Array:
        """[B, T] log-probs without gradient (and without dropout), one micro-batch of activations at a time."""
        parts = num_micro(batch)
        out = jax.lax.map(lambda micro: logprobs_of(gd, params, micro, frozen)[0], split_rows(batch, parts))
        # Undo split_rows: [parts, B / parts, T] -> [B, T] with row r at (r % parts, r // parts).
        return jax.lax.stop_gradient(jnp.swapaxes(out, 0, 1).reshape(-1, out.shape[-1]))

    def micro_loss(params, rows: _Rows, weight_over_total, frozen, dropout_key):
        micro = rows.batch
        logprobs, entropy = logprobs_of(graphdef, params, micro, frozen, with_entropy=dropout_key is None,
                                        dropout_key=dropout_key)
        if dropout_key is not None:
            # Dropout shapes the gradient only: the values (ratio, clip, importance weight, KL, entropy) are those
            # of the policy without dropout, which the sampler runs (see the module docstring).
            clean, entropy = logprobs_of(graphdef, params, micro, frozen, with_entropy=True)
            logprobs = jax.lax.stop_gradient(clean) + logprobs - jax.lax.stop_gradient(logprobs)
        old = jax.lax.stop_gradient(logprobs) if rows.old_logprobs is None else rows.old_logprobs
        with jax.named_scope("loss"):
            loss, metrics = policy_loss(logprobs, old, micro.scored(micro.behaviour_logprobs), rows.ref_logprobs,
                                        micro.advantages, micro.scored(micro.loss_mask), loss_config,
                                        entropies=entropy, sequence_ids=micro.sequence_ids(),
                                        trajectories=rows.trajectories())
        return loss * weight_over_total, metrics

    def with_trajectory_totals(params, rows: _Rows, frozen, parts: int) -> _Rows:
        """A mini-batch with trajectories, with what its micro-batches need of the whole (trajectory_totals): each
        trajectory's tokens; for GSPO over several micro-batches also its mean log-ratio under the current weights,
        which needs a forward pass over the mini-batch first (0 with one update: the proximal policy is the current
        one). With one micro-batch the loss sums over the whole trajectory itself."""
        log_ratio = None
        if loss_config.loss_type == "gspo" and parts > 1:
            if rows.old_logprobs is None:
                log_ratio = jnp.zeros(rows.batch.scored(rows.batch.loss_mask).shape, jnp.float32)
            else:
                log_ratio = forward_logprobs(graphdef, params, rows.batch, frozen) - rows.old_logprobs
        tokens, mean_log_ratio = trajectory_totals(rows.batch, log_ratio)
        return dataclasses.replace(rows, trajectory_tokens=tokens, trajectory_log_ratio=mean_log_ratio)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def one_update(params, opt_state, rows: _Rows, frozen, dropout_key):
        parts = num_micro(rows.batch)
        if rows.batch.trajectories is not None:
            rows = with_trajectory_totals(params, rows, frozen, parts)
        micros = split_rows(rows, parts)
        weights = jax.vmap(lambda m: _aggregation_weight(m.batch, loss_config, m.trajectories()))(micros)
        total = jnp.maximum(jnp.sum(weights), 1.0)

        def accumulate(grads_sum, inputs):
            micro, weight, index = inputs
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
            (loss, metrics), grads = grad_fn(params, micro, weight / total, frozen, key)
            with jax.named_scope("accumulate"):
                return jax.tree.map(jnp.add, grads_sum, grads), (loss, metrics)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grads, (losses, stacked) = jax.lax.scan(accumulate, zeros, (micros, weights, jnp.arange(parts)))
        loss = jnp.sum(losses)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        with jax.named_scope("optimizer"):
            new_updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, new_updates)
        # A non-finite update changes nothing: parameters and optimizer moments stay as they were. The cast
        # keeps each leaf's dtype (bfloat16 master weights get float32 gradients) through the update loop.
        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype), new, old)
        metrics = _merge_micro_metrics(stacked, weights)
        metrics.update(loss=loss, grad_norm=grad_norm)
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics, finite

    def step(params, opt_state, batch: TrainBatch, ref_params, frozen, dropout_key, step_index):
        old = forward_logprobs(graphdef, params, batch, frozen) if updates > 1 else None
        # The KL reference is another policy: its own router routes (the replayed routing is the sampler's).
        unrouted = dataclasses.replace(batch, routing=None)
        if base_graphdef is not None:
            ref = forward_logprobs(graphdef, None, unrouted, frozen) if loss_config.needs_reference else None
        else:
            ref = forward_logprobs(ref_graphdef, ref_params, unrouted) if ref_params is not None else None
        minis = split_rows(_Rows(batch, old, ref), mini_batches)
        key = None if dropout_key is None else jax.random.wrap_key_data(dropout_key)

        def update(carry, u):
            params, opt_state = carry
            rows = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, u % mini_batches, keepdims=False), minis)
            update_key = None if key is None else jax.random.fold_in(key, u)
            opt_state = at_learner_step(opt_state, step_index)
            params, opt_state, metrics, finite = one_update(params, opt_state, rows, frozen, update_key)
            return (params, opt_state), (metrics, finite)

        (params, opt_state), (stacked, applied) = jax.lax.scan(update, (params, opt_state), jnp.arange(updates))
        # Every update counts equally in the step's metrics (skipped ones included: they show the fault).
        metrics = _merge_metrics(stacked, jnp.ones(updates))
        for key in COUNT_METRICS:  # summed over the updates, where each row is in `epochs` of them
            metrics[key] = metrics[key] / optim_config.epochs
        metrics["loss/last"] = stacked["loss"][-1]
        return params, opt_state, metrics, applied

    return step


class NonFiniteError(UserError, RuntimeError):
    """Training diverged: too many learner steps in a row had a non-finite loss or gradient. Not a traceback:
    the run's state is intact up to its last checkpoint, and the message says what to change."""

    exit_code = 3


def jit_train_step(step, params, opt_state):
    """The learner step (make_train_step) jitted as every run runs it, for the trainer (real `params` and
    `opt_state`) and grpo-jax compile (abstract ones) alike: the old parameters and moments donated (XLA updates
    them in place), and returned with the shardings they came in, pinned: left to XLA the first step can return
    a leaf sharded differently (a replicated vector coming back fsdp-sharded), and the second step would then
    compile again."""
    def current(x):
        sharding = getattr(x, "sharding", None)
        return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None

    out = (jax.tree.map(current, params), jax.tree.map(current, opt_state), None, None)
    mesh = next((s.mesh for s in jax.tree.leaves(out[0]) if s is not None), None)
    return jax.jit(traced_on(mesh, step), donate_argnums=(0, 1), out_shardings=out)


class Learner:
    """Holds the policy's trainable parameters and optimizer state and applies jitted GRPO learner steps.

    With LoRA (`adapters`, a lora.Adapters for `model`), `params` are the adapters' and the optimizer's
    moments exist for them alone; `frozen` holds the model's weights, which no update touches and which
    also serve as the KL reference (with the adapters off), so `reference_model` is not needed."""

    def __init__(self, model: Transformer, optim_config: OptimConfig, loss_config: LossConfig,
                 reference_model: Transformer | None = None, temperature: float = 1.0, adapters=None,
                 dropout_seed: int = 0, top_k: int = 0, top_p: float = 1.0):
        self.base_graphdef = self.frozen = None
        if adapters is None:
            self.graphdef, self.params = nnx.split(model)
        else:
            self.graphdef, self.params = nnx.split(adapters)
            self.base_graphdef, self.frozen = nnx.split(model)
        self.optim_config = optim_config
        self.loss_config = loss_config
        self.optimizer = make_optimizer(optim_config)
        self.opt_state = self.optimizer.init(self.params)
        self.ref_params = None
        ref_graphdef = None
        if loss_config.needs_reference and adapters is None:
            if reference_model is None:
                raise ValueError(f"loss.kl_coef={loss_config.kl_coef}: a KL penalty needs a reference model")
            ref_graphdef, self.ref_params = nnx.split(reference_model)
        # Dropout masks from (seed, optimizer updates done), so a resumed run draws as the original would.
        self.dropout_base = None
        if adapters is not None and adapters.config.dropout > 0:
            self.dropout_base = jax.random.key(dropout_seed)
        step = make_train_step(self.graphdef, self.optimizer, loss_config, optim_config, ref_graphdef,
                               temperature=temperature, base_graphdef=self.base_graphdef, top_k=top_k, top_p=top_p)
        self._step_fn, self._jitted_step = step, None
        self.steps_done = 0  # learner steps with at least one applied update (the learning-rate schedule's index)
        self.updates_done = 0  # applied optimizer updates (the dropout masks' count)
        self.nonfinite_in_row = 0  # learner steps in a row with a skipped update
        self.nonfinite_total = 0  # skipped updates in all
        self.last_finite_loss: float | None = None

    @property
    def _step(self):
        """The jitted step (jit_train_step), built on first use, when the state has its final placement."""
        if self._jitted_step is None:
            self._jitted_step = jit_train_step(self._step_fn, self.params, self.opt_state)
        return self._jitted_step

    def check_batch(self, batch: TrainBatch) -> None:
        size, length = batch.tokens.shape
        optim = self.optim_config
        mini, micro = optim.mini_batches, optim.micro_batch_rows(length)
        if size % mini or (micro and (size // mini) % micro):
            raise ValueError(f"batch of {size} rows does not split into optim.mini_batches={mini} mini-batches of "
                             f"micro-batches of {micro} rows (optim.micro_batch_size={optim.micro_batch_size}, "
                             f"optim.micro_batch_tokens={optim.micro_batch_tokens}, rows of {length})")

    def step_arguments(self, batch: TrainBatch) -> tuple:
        """The arguments of the jitted step (`_step`) for this batch, now: parameters, optimizer state, batch,
        reference, frozen base, dropout key and learner-step index. The last two are host data (NumPy), fine
        as an input on every process."""
        dropout_key = None
        if self.dropout_base is not None:
            dropout_key = np.asarray(jax.random.key_data(jax.random.fold_in(self.dropout_base, self.updates_done)))
        return (self.params, self.opt_state, batch, self.ref_params, self.frozen, dropout_key,
                np.int32(self.steps_done))

    def lowered_step(self, batch: TrainBatch) -> jax.stages.Lowered:
        """The step this batch would run, lowered and not run (for reading its program: compile().as_text())."""
        return self._step.lower(*self.step_arguments(batch))

    def step(self, batch: TrainBatch) -> tuple[dict[str, Any], np.ndarray]:
        """One learner step; returns host metrics and which updates were applied ([updates] bool; update u
        trained mini-batch u % mini_batches). The caller decides what a skipped update means for its rows
        and stops the run via `diverged`."""
        self.check_batch(batch)
        rate = float(learning_rate_schedule(self.optim_config)(self.steps_done))
        self.params, self.opt_state, metrics, applied = self._step(*self.step_arguments(batch))
        # Replicated values: read this process's copy (device_get would refuse an array spanning hosts).
        metrics = {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}
        applied = np.asarray(applied.addressable_data(0)).astype(bool)
        skipped = int((~applied).sum())
        self.nonfinite_total += skipped
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
        self.updates_done += int(applied.sum())
        if applied.any():
            self.steps_done += 1
        if applied[-1]:
            self.last_finite_loss = metrics["loss/last"]
        metrics.update({"nonfinite_total": self.nonfinite_total, "updates/applied": int(applied.sum()), "lr": rate})
        return metrics, applied

    def diverged(self, step: int) -> NonFiniteError | None:
        """The error that ends the run when optim.max_nonfinite_in_row learner steps in a row had a skipped
        update (None otherwise)."""
        limit = self.optim_config.max_nonfinite_in_row
        if self.nonfinite_in_row < limit:
            return None
        last = "none yet" if self.last_finite_loss is None else f"{self.last_finite_loss:.6g}"
        return NonFiniteError(
            f"learner step {step}: {self.nonfinite_in_row} steps in a row had a non-finite loss or gradient "
            f"(optim.max_nonfinite_in_row={limit}; last finite loss {last}); their updates were skipped and "
            "nothing more is saved. Lower optim.lr, check the rewards, or resume from the last checkpoint")

    def model(self) -> Transformer:
        """The policy as one Transformer: with LoRA a copy of the base with the adapters merged in."""
        if self.frozen is None:
            return nnx.merge(self.graphdef, self.params)
        return merge_adapters(nnx.merge(self.base_graphdef, self.frozen), self.adapters())

    def adapters(self):
        """The LoRA adapters (lora.Adapters) over the current parameters; None without LoRA."""
        return None if self.frozen is None else nnx.merge(self.graphdef, self.params)
