"""The lengths a step's sequences are expected to have, for grpo-jax compile's projection: ExpectedLengths, a mean
prompt and a set of equally likely completion lengths, which the learner's packed rows, the engine's concurrency
and chunk count, and the step's useful FLOPs all read (one record, so the three agree).

Where they come from (expected_lengths):
- optim.expected_lengths_from: a previous run's metrics (RUN_DIR/metrics.jsonl). Every learner step logs
  length/quantiles (its samples' sampled tokens at 0%, 5%, ..., 100%: length_quantiles) and prompt_length/mean;
  the last HISTORY_STEPS steps' quantiles are pooled into REPRESENTATIVES equally likely lengths
  (pooled_lengths), so a long tail weighs as it did in that run rather than as its mean;
- optim.expected_prompt_len / expected_completion_len: one mean length each;
- neither: the buckets (every sequence at its longest: the worst case).

JAX-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

QUANTILES = 21  # length/quantiles: a step's sampled tokens per sample at 0%, 5%, ..., 100%
REPRESENTATIVES = 20  # the equally likely completion lengths a profile from a run keeps
HISTORY_STEPS = 100  # a profile from a run pools its last this many learner steps
BUCKETS = "the buckets"  # the source of a profile nothing was given for: every sequence at its longest


def length_quantiles(lengths: Sequence[int] | np.ndarray) -> list[int]:
    """The QUANTILES quantiles (0%, 5%, ..., 100%) of a step's sample lengths, rounded to tokens: what the trainer
    logs as length/quantiles."""
    values = np.quantile(np.asarray(lengths, np.float64), np.linspace(0.0, 1.0, QUANTILES))
    return [int(round(v)) for v in values]


def pooled_lengths(steps: Sequence[Sequence[float]], count: int = REPRESENTATIVES) -> tuple[int, ...]:
    """`count` equally likely lengths of the mixture of several steps' length distributions, each given by its
    QUANTILES quantiles (length_quantiles): a step's mass between two neighbouring quantiles is spread evenly
    between them, each step weighs the same, and the mixture's quantile function is read at the midpoints of
    `count` equal bins. Every value is at least 1."""
    if not steps:
        raise ValueError("pooled_lengths: no steps")
    grid = np.linspace(0.0, 1.0, QUANTILES)
    probes = (np.arange(count) + 0.5) / count
    points = np.linspace(0.0, 1.0, 4 * count * QUANTILES + 1)
    samples = np.concatenate([np.interp(points, grid, np.asarray(q, np.float64)) for q in steps])
    return tuple(max(1, int(round(v))) for v in np.quantile(samples, probes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedLengths:
    """A step's expected sequences: every prompt `prompt` tokens, completions equally likely to have each of
    `completions` tokens (one value: a mean). `source` says where they came from, for the report."""

    prompt: int
    completions: tuple[int, ...]
    source: str

    def __post_init__(self):
        if self.prompt < 1 or not self.completions or min(self.completions) < 1:
            raise ValueError(f"ExpectedLengths: prompt={self.prompt}, completions={self.completions}: every length "
                             "must be >= 1")

    @classmethod
    def at_buckets(cls, prompt: int, new: int) -> ExpectedLengths:
        """Every sequence at its longest: `prompt` + `new` tokens (the worst case; given is False)."""
        return cls(prompt=prompt, completions=(new,), source=BUCKETS)

    @property
    def mean_completion(self) -> float:
        return float(np.mean(self.completions))

    @property
    def longest_completion(self) -> int:
        return max(self.completions)

    @property
    def given(self) -> bool:
        """Whether the lengths were given (a run's history or optim.expected_*_len), not the buckets."""
        return self.source != BUCKETS

    @property
    def spread(self) -> bool:
        """Whether the completions differ (a distribution, not one mean)."""
        return len(set(self.completions)) > 1

    def for_sequences(self, n: int) -> list[int]:
        """Completion lengths of n sequences spread over the profile as evenly as n allows (sequence i takes the
        value at quantile (i + 0.5) / n), so n sequences carry the profile's tail in proportion."""
        ordered = sorted(self.completions)
        return [ordered[int((i + 0.5) * len(ordered) / n)] for i in range(n)]

    def decode_keys(self) -> int:
        """The keys a decoding sequence holds on average over a step's decode steps: every sampled token weighs
        the same, so a long completion, decoding for longer, counts for more than a short one (a completion of c
        tokens holds prompt + c / 2 keys on average over its c steps)."""
        c = np.asarray(self.completions, np.float64)
        return int(round(float((c * (self.prompt + c / 2)).sum() / c.sum())))

    def mean_of(self, per_sequence) -> float:
        """The mean over the profile's completions of per_sequence(prompt, completion): e.g. a row's FLOPs, which
        grow faster than linearly in its length, so the mean length alone would undercount them."""
        return float(np.mean([per_sequence(self.prompt, c) for c in self.completions]))

    def clipped(self, prompt: int, new: int) -> ExpectedLengths:
        """The same with the prompt at most `prompt` tokens and each completion at most `new`."""
        return ExpectedLengths(prompt=min(self.prompt, prompt), completions=tuple(min(c, new) for c in
                                                                                  self.completions),
                               source=self.source)

    def describe(self) -> str:
        """e.g. '256 + 4096 tokens' or '256 + 3512 tokens on average, up to 16384 (runs/a/metrics.jsonl)'."""
        if not self.spread:
            return f"{self.prompt} + {self.completions[0]} tokens"
        return (f"{self.prompt} + {self.mean_completion:.0f} tokens on average, up to {self.longest_completion} "
                f"({self.source})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthHistory:
    """What a previous run logged about its lengths (run.metrics.length_history): each learner step's
    length/quantiles, and its prompts' mean length over those steps."""

    quantiles: tuple[tuple[float, ...], ...]
    prompt_mean: float | None  # None: the run logged no prompt_length/mean
    source: str  # e.g. "runs/a/metrics.jsonl, steps 3-102"


def expected_lengths(*, prompt_bucket: int, completion_bucket: int, expected_prompt_len: int = 0,
                     expected_completion_len: int = 0, history: LengthHistory | None = None) -> ExpectedLengths:
    """The step's expected lengths (module docstring), each at most its bucket: from `history` where given (its
    prompt mean unless expected_prompt_len is set), else optim.expected_*_len (0: the bucket)."""
    if history is not None:
        logged = None if history.prompt_mean is None else max(1, int(round(history.prompt_mean)))
        prompt = expected_prompt_len or logged or prompt_bucket
        return ExpectedLengths(prompt=prompt, completions=pooled_lengths(history.quantiles),
                               source=history.source).clipped(prompt_bucket, completion_bucket)
    if not (expected_prompt_len or expected_completion_len):
        return ExpectedLengths.at_buckets(prompt_bucket, completion_bucket)
    return ExpectedLengths(prompt=expected_prompt_len or prompt_bucket,
                           completions=(expected_completion_len or completion_bucket,),
                           source="optim.expected_*_len").clipped(prompt_bucket, completion_bucket)
