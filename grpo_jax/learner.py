"""The learner: one jitted GRPO update over a batch of finished groups.

Parameters and optimizer state are plain pytrees (nnx.split), so the step is a pure function that
jit compiles once per batch shape, shards by the parameters' layout, and checkpoints without pickling.

Gradient accumulation runs the micro-batches through `lax.scan`, so memory holds one micro-batch of
activations however large the group. Each micro-batch's loss is weighted by its share of the loss's
denominator (tokens for token_mean, sequences otherwise), which makes the accumulated gradient equal
to the whole-batch gradient, not an average of per-micro-batch means.

Old log-probs: the learner takes one optimizer step per batch, so the log-probs of the weights that
start the step are the forward pass itself under stop_gradient (the ratio is 1 in value, its gradient is
the policy gradient). The sampler's behaviour log-probs enter through the importance-sampling
correction of losses.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax.losses import LossConfig, policy_loss
from grpo_jax.model import Transformer, positions_from_mask


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine decay over this many steps after warmup; 0 keeps lr constant
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    micro_batch_size: int = 0  # sequences per micro-batch; 0 = the whole batch at once
    max_nonfinite_in_row: int = 3  # skipped updates in a row before the run stops

    def validate(self) -> list[str]:
        problems = []
        if self.lr <= 0:
            problems.append(f"lr={self.lr}: must be > 0")
        for key in ("warmup_steps", "decay_steps", "micro_batch_size"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)}: must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.weight_decay < 0:
            problems.append(f"weight_decay={self.weight_decay}: must be >= 0")
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)}: must be in [0, 1)")
        if self.eps <= 0:
            problems.append(f"eps={self.eps}: must be > 0")
        if self.grad_clip < 0:
            problems.append(f"grad_clip={self.grad_clip}: must be >= 0 (0 disables clipping)")
        if self.max_nonfinite_in_row < 1:
            problems.append(f"max_nonfinite_in_row={self.max_nonfinite_in_row}: must be >= 1")
        return problems


def learning_rate_schedule(config: OptimConfig) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0 if config.warmup_steps else config.lr, config.lr,
                                   max(config.warmup_steps, 1))
    if config.decay_steps:
        decay = optax.cosine_decay_schedule(config.lr, config.decay_steps, alpha=config.min_lr_ratio)
    else:
        decay = optax.constant_schedule(config.lr)
    return optax.join_schedules([warmup, decay], [config.warmup_steps])


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip else []
    parts.append(optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                             weight_decay=config.weight_decay))
    return optax.chain(*parts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    """One learner batch; sequence index t of the [B, L-1] arrays scores tokens[:, t + 1].

    tokens: [B, L] prompt + completion; input_mask: [B, L] real tokens (prompt left-padded, completion
    right-padded); loss_mask: [B, L-1] the completion tokens being trained; advantages: [B];
    behaviour_logprobs: [B, L-1] the sampler's log-probs of those tokens (0 elsewhere).
    """

    tokens: jax.Array
    input_mask: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    behaviour_logprobs: jax.Array
    # Static: the completions occupy the last completion_len tokens, so only the positions that score
    # them need the vocabulary projection (the costliest matmul at a 32k vocab). 0: score every position.
    completion_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    def scored(self, x: jax.Array) -> jax.Array:
        """The [B, L-1, ...] per-position array cut to the positions that score completion tokens."""
        return x if not self.completion_len else x[:, x.shape[1] - self.completion_len:]


def token_logprobs(model: Transformer, tokens: jax.Array, input_mask: jax.Array, with_entropy: bool = False,
                   last: int = 0):
    """Log-prob of each next token, [B, L-1] (or only the last `last` positions, [B, last]), and optionally
    the entropy of each next-token distribution."""
    positions = positions_from_mask(input_mask)
    hidden, _ = model.hidden_states(tokens[:, :-1], positions[:, :-1], input_mask[:, :-1])
    targets = tokens[:, 1:]
    if last:
        hidden, targets = hidden[:, -last:], targets[:, -last:]
    logits = model.logits(hidden)  # float32
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logprobs = target - log_norm
    if not with_entropy:
        return logprobs, None
    probs = jnp.exp(logits - log_norm[..., None])
    entropy = log_norm - jnp.sum(probs * logits, axis=-1)
    return logprobs, jax.lax.stop_gradient(entropy)


def _aggregation_weight(batch: TrainBatch, loss_config: LossConfig) -> jax.Array:
    """This micro-batch's share of the whole batch's loss denominator (before division by the total)."""
    if loss_config.aggregation == "token_mean":
        return jnp.sum(batch.loss_mask)
    # policy_loss averages over sequences that have at least one token (fully padded rows drop out).
    return jnp.sum(jnp.any(batch.loss_mask > 0, axis=-1)).astype(jnp.float32)


def _split_micro(batch, num_micro: int):
    return jax.tree.map(lambda x: x.reshape(num_micro, x.shape[0] // num_micro, *x.shape[1:]), batch)


def _merge_metrics(stacked: dict, weights: jax.Array) -> dict:
    share = weights / jnp.maximum(jnp.sum(weights), 1e-9)
    merged = {}
    for key, value in stacked.items():
        if key.endswith("max"):
            merged[key] = jnp.max(value)
        elif key.endswith("min"):
            merged[key] = jnp.min(value)
        else:
            merged[key] = jnp.sum(value * share)
    return merged


def make_train_step(graphdef, optimizer: optax.GradientTransformation, loss_config: LossConfig,
                    micro_batch_size: int, ref_graphdef=None):
    """A pure step (params, opt_state, batch, ref_params) -> (params, opt_state, metrics), for jax.jit."""

    def micro_loss(params, micro: TrainBatch, ref_logprobs, weight_over_total):
        model = nnx.merge(graphdef, params)
        logprobs, entropy = token_logprobs(model, micro.tokens, micro.input_mask, with_entropy=True,
                                           last=micro.completion_len)
        loss, metrics = policy_loss(logprobs, jax.lax.stop_gradient(logprobs), micro.scored(micro.behaviour_logprobs),
                                    ref_logprobs, micro.advantages, micro.scored(micro.loss_mask), loss_config,
                                    entropies=entropy)
        return loss * weight_over_total, metrics

    def reference_logprobs(ref_params, micro: TrainBatch):
        if ref_params is None:
            return None
        ref_model = nnx.merge(ref_graphdef, ref_params)
        return jax.lax.stop_gradient(token_logprobs(ref_model, micro.tokens, micro.input_mask,
                                                    last=micro.completion_len)[0])

    def step(params, opt_state, batch: TrainBatch, ref_params=None):
        size = batch.advantages.shape[0]
        num_micro = size // micro_batch_size if micro_batch_size else 1
        micros = _split_micro(batch, num_micro)
        weights = jax.vmap(lambda m: _aggregation_weight(m, loss_config))(micros)
        total = jnp.maximum(jnp.sum(weights), 1.0)
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def accumulate(grads_sum, inputs):
            micro, weight = inputs
            (loss, metrics), grads = grad_fn(params, micro, reference_logprobs(ref_params, micro), weight / total)
            return jax.tree.map(jnp.add, grads_sum, grads), (loss, metrics)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grads, (losses, stacked) = jax.lax.scan(accumulate, zeros, (micros, weights))
        loss = jnp.sum(losses)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite step changes nothing: parameters and optimizer moments stay as they were.
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        metrics = _merge_metrics(stacked, weights)
        metrics.update(loss=loss, grad_norm=grad_norm, finite=finite)
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    return step


class NonFiniteError(RuntimeError):
    pass


class Learner:
    """Holds the policy's parameters and optimizer state and applies jitted GRPO steps."""

    def __init__(self, model: Transformer, optim_config: OptimConfig, loss_config: LossConfig,
                 reference_model: Transformer | None = None):
        self.graphdef, self.params = nnx.split(model)
        self.optim_config = optim_config
        self.loss_config = loss_config
        self.optimizer = make_optimizer(optim_config)
        self.opt_state = self.optimizer.init(self.params)
        self.ref_params = None
        ref_graphdef = None
        if loss_config.needs_reference:
            if reference_model is None:
                raise ValueError(f"loss.kl_coef={loss_config.kl_coef}: a KL penalty needs a reference model")
            ref_graphdef, self.ref_params = nnx.split(reference_model)
        step = make_train_step(self.graphdef, self.optimizer, loss_config, optim_config.micro_batch_size,
                               ref_graphdef)
        # Donating the old parameters and moments lets XLA update them in place.
        self._step = jax.jit(step, donate_argnums=(0, 1))
        self.steps_done = 0
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0

    def check_batch(self, batch: TrainBatch) -> None:
        size = batch.advantages.shape[0]
        micro = self.optim_config.micro_batch_size
        if micro and size % micro:
            raise ValueError(f"batch of {size} sequences does not split into micro-batches of "
                             f"optim.micro_batch_size={micro}")

    def step(self, batch: TrainBatch) -> dict[str, Any]:
        """One update; returns host metrics. Stops after optim.max_nonfinite_in_row skipped updates."""
        self.check_batch(batch)
        self.params, self.opt_state, metrics = self._step(self.params, self.opt_state, batch, self.ref_params)
        # Replicated scalars: read this process's copy (device_get would refuse an array spanning hosts).
        metrics = {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}
        if metrics.pop("finite") < 0.5:
            self.nonfinite_in_row += 1
            self.nonfinite_total += 1
            if self.nonfinite_in_row >= self.optim_config.max_nonfinite_in_row:
                raise NonFiniteError(
                    f"{self.nonfinite_in_row} learner steps in a row had a non-finite loss or gradient "
                    f"(loss={metrics['loss']}, grad_norm={metrics['grad_norm']}); updates were skipped. "
                    "Lower optim.lr, check the rewards, or raise optim.max_nonfinite_in_row.")
        else:
            self.nonfinite_in_row = 0
            self.steps_done += 1
        metrics["nonfinite_total"] = self.nonfinite_total
        metrics["lr"] = float(learning_rate_schedule(self.optim_config)(self.steps_done))
        return metrics

    def model(self) -> Transformer:
        return nnx.merge(self.graphdef, self.params)


def pack_batch(prompts: list[list[int]], completions: list[list[int]], behaviour_logprobs: list[np.ndarray],
               advantages: np.ndarray, pad_id: int, prompt_len: int, completion_len: int) -> TrainBatch:
    """Lay out prompt (left-padded to prompt_len) + completion (right-padded) rows for the learner."""
    size = len(prompts)
    length = prompt_len + completion_len
    tokens = np.full((size, length), pad_id, np.int32)
    input_mask = np.zeros((size, length), bool)
    loss_mask = np.zeros((size, length - 1), np.float32)
    behaviour = np.zeros((size, length - 1), np.float32)
    for i, (prompt, completion, logp) in enumerate(zip(prompts, completions, behaviour_logprobs)):
        if len(prompt) > prompt_len or len(completion) > completion_len:
            raise ValueError(f"row {i}: prompt {len(prompt)} / completion {len(completion)} tokens exceed the "
                             f"bucket {prompt_len} / {completion_len}")
        start = prompt_len - len(prompt)
        tokens[i, start:prompt_len] = prompt
        tokens[i, prompt_len:prompt_len + len(completion)] = completion
        input_mask[i, start:prompt_len + len(completion)] = True
        # Position t scores token t+1: the completion's tokens sit at prompt_len .. prompt_len+n-1.
        loss_mask[i, prompt_len - 1:prompt_len - 1 + len(completion)] = 1.0
        behaviour[i, prompt_len - 1:prompt_len - 1 + len(completion)] = np.asarray(logp)[:len(completion)]
    # Position prompt_len - 1 (the last prompt token) scores the first completion token: the scored
    # positions are the last completion_len of the L - 1.
    return TrainBatch(tokens=jnp.asarray(tokens), input_mask=jnp.asarray(input_mask),
                      loss_mask=jnp.asarray(loss_mask), advantages=jnp.asarray(advantages, jnp.float32),
                      behaviour_logprobs=jnp.asarray(behaviour), completion_len=completion_len)
