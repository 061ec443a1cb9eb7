"""The optimizer: OptimConfig (the `optim` section: learning rate, schedule, AdamW, clipping, and how the learner
splits a step's batch into mini- and micro-batches), learning_rate_schedule (a function of the learner-step index),
make_optimizer (clipping, then AdamW), at_learner_step (the schedule's count set to that index before an update).

Used by algorithm.learner, which re-exports these names.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from grpo_jax.config_io import config_key


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = config_key(1e-5, "The peak learning rate (AdamW).")
    warmup_steps: int = config_key(0, "Learner steps of linear warmup up to lr (from lr / (warmup_steps + 1)).")
    decay_steps: int = config_key(0, "Cosine decay over this many steps after warmup; 0 keeps lr constant.")
    min_lr_ratio: float = config_key(0.1, "The cosine ends at lr * min_lr_ratio.")
    weight_decay: float = config_key(0.0, "AdamW's decoupled weight decay.")
    b1: float = config_key(0.9, "AdamW's first-moment decay.")
    b2: float = config_key(0.999, "AdamW's second-moment decay.")
    eps: float = config_key(1e-8, "AdamW's epsilon.")
    grad_clip: float = config_key(1.0, "Global-norm clipping; 0 disables.")
    # A packed row is as long as a padded one, so a micro-batch's activations are the same size.
    micro_batch_size: int = config_key(0, "Rows per micro-batch: one sequence each, or several when packed. 0 = the "
                                          "whole mini-batch at once.")
    mini_batches: int = config_key(1, "Optimizer updates per pass over the rollout batch, each on an equal share of "
                                      "rows.")
    epochs: int = config_key(1, "Passes over the rollout batch per learner step (GRPO's mu).")
    max_nonfinite_in_row: int = config_key(3, "Learner steps in a row with a skipped (non-finite) update before the "
                                              "run stops.")
    logprob_chunk: int = config_key(128, "Completion positions whose logits exist at once (chunked_logprobs): the "
                                         "compiled step holds a few float32 buffers of rows x this x vocab (the "
                                         "logits, their softmax and its gradient; more with top-p or top-k and the "
                                         "entropy: docs/benchmarks.md), none of rows x max_new_tokens x vocab. 0: "
                                         "all positions at once.")
    micro_batch_tokens: int = config_key(0, "Micro-batches counted in tokens: each holds micro_batch_tokens // (the "
                                            "learner's row length, prompt bucket + completion bucket) rows. 0: "
                                            "micro_batch_size rows. Set at most one of the two.")
    packing: bool = config_key(True, "Several sequences per learner row (pack_sequences: first-fit decreasing into "
                                     "rows of the padded row's length; attention within each sequence only, "
                                     "positions restarting): the padded layout's loss, gradients and metrics on "
                                     "fewer rows. false: one sequence per row (pack_batch).")
    packing_buckets: int = config_key(8, "The packed row count is rounded up to one of at most this many sizes "
                                         "(packed_row_sizes): at most this many learner programs compile over a run.")
    # 0 promises nothing that was not measured; the learner's metrics report the real lengths (length/mean,
    # learner/padding_fraction*).
    expected_prompt_len: int = config_key(0, "For grpo-jax compile's projection only (time and MFU at the expected "
                                             "fill): the mean prompt length (tokens) a step is expected to have. 0: "
                                             "the bucket (every row full).")
    expected_completion_len: int = config_key(0, "For grpo-jax compile's projection only: the mean completion length "
                                                 "(tokens) a step is expected to have. 0: the bucket (every row "
                                                 "full).")
    expected_lengths_from: str = config_key("", "For grpo-jax compile's projection only: a previous run's directory "
                                                "(or its metrics.jsonl) whose last 100 learner steps' logged lengths "
                                                "(length/quantiles, prompt_length/mean) give the step's expected "
                                                "completion lengths, tail included, and mean prompt. Set it or "
                                                "expected_completion_len, not both; expected_prompt_len, if set, "
                                                "overrides the run's prompt mean. Empty: not used.")

    @property
    def updates_per_step(self) -> int:
        return self.mini_batches * self.epochs

    def micro_batch_rows(self, row_length: int) -> int:
        """Learner rows per micro-batch for rows of `row_length` tokens (0: the whole mini-batch at once)."""
        if self.micro_batch_tokens:
            return max(1, self.micro_batch_tokens // row_length)
        return self.micro_batch_size

    def validate(self) -> list[str]:
        problems = []
        if self.lr <= 0:
            problems.append(f"lr={self.lr}: must be > 0")
        for key in ("warmup_steps", "decay_steps", "micro_batch_size", "logprob_chunk", "micro_batch_tokens",
                    "expected_prompt_len", "expected_completion_len"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)}: must be >= 0")
        if self.expected_lengths_from and self.expected_completion_len:
            problems.append(f"expected_lengths_from={self.expected_lengths_from!r}: set it or expected_completion_len "
                            f"(now {self.expected_completion_len}), not both (set the other to 0)")
        if self.micro_batch_size and self.micro_batch_tokens:
            problems.append(f"micro_batch_tokens={self.micro_batch_tokens}: set it or micro_batch_size "
                            f"(now {self.micro_batch_size}), not both (set the other to 0)")
        for key in ("mini_batches", "epochs", "packing_buckets"):
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)}: must be >= 1")
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
    """The learning rate as a function of the learner-step index (every update of a step runs at its rate).

    Warm-up: steps 0 .. W-1 (W = warmup_steps) ramp linearly over lr / (W + 1), 2 lr / (W + 1), ...,
    W lr / (W + 1), and step W runs at lr, where the cosine decay over decay_steps (if any) starts. The ramp
    starts above zero because a step at lr 0 would change nothing while its groups are recorded as trained."""
    warmup = optax.linear_schedule(config.lr / (config.warmup_steps + 1), config.lr, max(config.warmup_steps, 1))
    if config.decay_steps:
        decay = optax.cosine_decay_schedule(config.lr, config.decay_steps, alpha=config.min_lr_ratio)
    else:
        decay = optax.constant_schedule(config.lr)
    return optax.join_schedules([warmup, decay], [config.warmup_steps])


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping and AdamW at learning_rate_schedule's rate. The schedule reads optax's own count,
    which the learner step sets to the learner-step index before every update (at_learner_step)."""
    parts = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip else []
    parts.append(optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                             weight_decay=config.weight_decay))
    return optax.chain(*parts)


def at_learner_step(opt_state, step_index):
    """opt_state with the learning-rate schedule's count set to the learner-step index. optax advances that
    count per applied update, and a skipped update keeps the old state, so the count alone would drift behind
    the steps; AdamW's own count (its bias correction) is left alone: it rightly counts applied updates. The
    state's structure is unchanged, so checkpoints written before this rule restore as they are."""
    def set_count(state):
        if isinstance(state, optax.ScaleByScheduleState):
            return state._replace(count=jnp.asarray(step_index, state.count.dtype))
        return state

    return jax.tree.map(set_count, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
