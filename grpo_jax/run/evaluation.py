"""Evaluation on held-out prompts: during `grpo-jax train` (eval.every_steps) and by `grpo-jax eval`.

Held-out rows come from the training data's source with another split or path (GSM8K test.jsonl), or, for
the synthetic tasks, from another seed. "Never a training prompt" is enforced, not assumed: every row of
the training source is read once at start, and an eval row whose prompt text (the data template applied,
before any chat template, which is the same function for both) equals a training row's is left out, as are
repeated eval prompts. The eval set is the first eval.num_prompts rows left, in dataset order: the same
prompts at every evaluation.

Each prompt gets one greedy completion and eval.samples (n) sampled ones at eval.temperature (the sampler's
top-p/top-k), scored by the config's rewards. A sample is correct when eval.correct_reward (a reward term's
label; "": the weighted total) is at least eval.correct_threshold; a sample whose reward failed is not.
Metrics (means over prompts):

    eval/pass@1          greedy completion correct
    eval/mean@k          correct samples / n
    eval/pass@k          1 - C(n - c, k) / C(n, k), Chen et al. 2021's unbiased estimator of "at least one of
                         k samples is correct", with c correct of n and k = eval.pass_k (default n)
    eval/reward/mean, eval/reward/greedy, eval/length/mean, eval/length/greedy, eval/truncated (samples that
    hit max_new_tokens), eval/failed_samples, eval/prompts, eval/samples, eval/k

Sampling keys depend only on the config's seed, the row's dataset index and the sample number, so every
evaluation of a run draws the same random numbers (differences between evaluations are the weights'), and
`grpo-jax eval` reproduces an evaluation made during training.

During training (EvalDuringTraining) process 0's actor thread runs each evaluation between generation calls
(Actor.submit_side_job) with the weights it holds then: the learner waits only when the groups it needs
were not generated because the actor was evaluating. An evaluation touches no ledger, collector or replay
buffer state: the audit of a run is the same with or without it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.algorithm.rewards import RewardSpec, RewardSuite
from grpo_jax.config_io import config_key
from grpo_jax.data.pipeline import BadRow, DataConfig, RowReader, check_fields, json_value, open_source, source_file
from grpo_jax.errors import DataError

if TYPE_CHECKING:
    from grpo_jax.data.tokenizer import Tokenizer
    from grpo_jax.rollout.actor import Actor
    from grpo_jax.rollout.sampler import Sampler
    from grpo_jax.run.config import Config

logger = logging.getLogger("grpo_jax.run.evaluation")

# Eval keys are fold_in(fold_in(key(seed), EVAL_KEY_STREAM), dataset_index) then the sample number: a stream
# apart from the training groups' fold_in(key(seed), ordinal) (no run hands out 2**31 - 1 prompts).
EVAL_KEY_STREAM = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every_steps: int = config_key(0, "Evaluate at step 0, every N learner steps and at the end of the run; 0: off.")
    split: str = config_key("", "Held-out rows: a split of the training source (data.path/{split}.jsonl, a TFDS "
                                "split); or set path.")
    path: str = config_key("", "Held-out rows: a JSONL/Parquet file or directory in place of data.path; or set "
                               "split.")
    synthetic_seed: int = config_key(1, "Synthetic tasks: the held-out rows are those of this seed; must differ "
                                        "from data.seed.")
    synthetic_size: int = config_key(1000, "Synthetic rows generated, before training prompts are left out.")
    num_prompts: int = config_key(64, "The first N held-out prompts in dataset order; 0: all of them.")
    samples: int = config_key(8, "Sampled completions per prompt (n), besides the greedy one.")
    pass_k: int = config_key(0, "k of eval/pass@k, at most samples; 0: samples.")
    temperature: float = config_key(1.0, "Of the sampled completions (pass@1 is greedy).")
    max_new_tokens: int = config_key(0, "The most tokens sampled per completion; 0: sampler.max_new_tokens.")
    correct_reward: str = config_key("", "Label of the reward term that decides correctness; '': the weighted "
                                         "total.")
    correct_threshold: float = config_key(1.0, "Correct: that reward >= this.")

    def validate(self) -> list[str]:
        problems = []
        for key in ("every_steps", "num_prompts", "pass_k", "max_new_tokens", "synthetic_seed"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)}: must be >= 0")
        if self.samples < 1:
            problems.append(f"samples={self.samples}: must be >= 1")
        elif self.pass_k > self.samples:
            problems.append(f"pass_k={self.pass_k}: must be at most samples={self.samples} (0: samples)")
        if self.synthetic_size < 1:
            problems.append(f"synthetic_size={self.synthetic_size}: must be >= 1")
        if not self.temperature > 0:
            problems.append(f"temperature={self.temperature}: must be > 0 (eval/pass@1 is the greedy completion)")
        if not math.isfinite(self.correct_threshold):
            problems.append(f"correct_threshold={self.correct_threshold}: must be a finite number")
        return problems


def eval_data_config(config: Config) -> DataConfig:
    """The data section that reads the held-out rows: the training one with eval's split, path or seed."""
    data, ev = config.data, config.eval
    if data.source == "synthetic":
        return dataclasses.replace(data, seed=ev.synthetic_seed, synthetic_size=ev.synthetic_size)
    return dataclasses.replace(data, path=ev.path or data.path, split=ev.split or data.split)


def eval_problems(config: Config) -> list[str]:
    """What keeps `config` from evaluating (held-out source, correctness reward), as 'key=value: what is
    allowed' strings. Config.validate checks them when eval.every_steps > 0, `grpo-jax eval` always."""
    data, ev = config.data, config.eval
    problems = []
    if data.source == "synthetic":
        for key in ("split", "path"):
            if getattr(ev, key):
                problems.append(f"eval.{key}={getattr(ev, key)!r}: data.source=synthetic reads no files; held-out "
                                "synthetic rows come from eval.synthetic_seed (remove this key)")
        if ev.synthetic_seed == data.seed:
            problems.append(f"eval.synthetic_seed={ev.synthetic_seed}: equals data.seed; held-out synthetic rows "
                            "need another seed")
    elif data.source == "tfds":
        if ev.path:
            problems.append(f"eval.path={ev.path!r}: data.source=tfds reads a prepared dataset; name its held-out "
                            "split with eval.split")
        if ev.split in ("", data.split):
            problems.append(f"eval.split={ev.split!r}: must name a held-out split of tfds {data.tfds_name!r} other "
                            f"than the training split data.split={data.split!r}, e.g. test")
    elif not ev.split and not ev.path:
        problems.append(f"eval.split='', eval.path='': data.source={data.source} needs held-out rows: set eval.split "
                        f"(e.g. test: {{data.path}}/test.{data.source}) or eval.path (a file or directory)")
    labels = [RewardSpec.parse(spec).label or RewardSpec.parse(spec).name for spec in config.rewards]
    if ev.correct_reward and ev.correct_reward not in labels:
        problems.append(f"eval.correct_reward={ev.correct_reward!r}: allowed the label of a reward term "
                        f"({', '.join(map(str, labels))}), or '' for the weighted total")
    return problems


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased estimator of pass@k from n samples of which c are correct:
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct one."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers; comb is 0 when n - c < k


# ------------------------------------------------------------------------------------------ held-out rows


def _prompt_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _template_text(source, data: DataConfig, tokenizer: Tokenizer) -> Callable[[dict], str]:
    """row -> its prompt text before any chat template (raises BadRow for a bad row)."""
    plain = dataclasses.replace(data, prompt_format="plain", system_prompt="", chat_template_kwargs={})
    return RowReader(source, plain, tokenizer).prompt_text


def _training_prompts(data: DataConfig, tokenizer: Tokenizer) -> set[bytes]:
    """Digests of the prompt texts of every usable row of the training source (all shards, all epochs)."""
    source = open_source(data)
    text_of = _template_text(source, data, tokenizer)
    digests = set()
    for index in range(len(source)):
        try:
            digests.add(_prompt_digest(text_of(json_value(source[index]))))
        except BadRow:
            continue  # a bad row is never trained
    return digests


def held_out_records(config: Config, tokenizer: Tokenizer) -> list[dict]:
    """The eval prompts: records like the training stream's ({"dataset_index", "row", "prompt_text",
    "prompt_ids"}), none of whose prompts is a training prompt (see the module docstring). DataError when
    no row is left."""
    train_data, eval_data = config.data, eval_data_config(config)
    source = open_source(eval_data)
    where = _describe_eval(eval_data)
    if eval_data.source in ("jsonl", "parquet") and (
            source_file(eval_data).resolve() == source_file(train_data).resolve()):
        raise DataError(f"eval.split={config.eval.split!r}, eval.path={config.eval.path!r}: evaluation would read "
                        f"the training file {source_file(train_data)}; point eval.path (or, when data.path is a "
                        "directory, eval.split) at held-out rows")
    check_fields(eval_data, source)
    if eval_data.prompt_format == "chat" and tokenizer.chat_template is None:
        raise DataError(f"prompt_format=chat: tokenizer {tokenizer.source} has no chat template")
    training = _training_prompts(train_data, tokenizer)

    to_record = RowReader(source, eval_data, tokenizer, config.sampler.max_prompt_len)
    text_of = _template_text(source, eval_data, tokenizer)
    wanted = config.eval.num_prompts or len(source)
    records, seen, overlapping, repeated, bad = [], set(), 0, 0, collections.Counter()
    for index in range(len(source)):
        if len(records) == wanted:
            break
        record = to_record((0, index))
        if "bad_row" in record:
            bad[record["bad_row"]] += 1
            continue
        digest = _prompt_digest(text_of(record["row"]))
        if digest in training:
            overlapping += 1
        elif digest in seen:
            repeated += 1
        else:
            seen.add(digest)
            records.append(record)
    reasons = f" ({', '.join(f'{reason} {n}' for reason, n in sorted(bad.items()))})" if bad else ""
    left_out = (f"{overlapping} are training prompts, {repeated} repeat an earlier eval prompt, "
                f"{sum(bad.values())} are bad rows{reasons}")
    if not records:
        raise DataError(f"eval: no held-out prompt in {where}: of its {len(source)} rows {left_out}; evaluate on "
                        "other rows (eval.split, eval.path, or for synthetic tasks eval.synthetic_seed with a task "
                        "that has more distinct prompts than the training data holds)")
    if len(records) < wanted and config.eval.num_prompts:
        logger.warning("eval: %d held-out prompts in %s, fewer than eval.num_prompts=%d (%s)", len(records), where,
                       config.eval.num_prompts, left_out)
    return records


def _describe_eval(data: DataConfig) -> str:
    if data.source == "synthetic":
        return f"synthetic {data.synthetic_task} (seed {data.seed}, {data.synthetic_size} rows)"
    if data.source == "tfds":
        return f"tfds {data.tfds_name}:{data.split}"
    return str(source_file(data))


# ------------------------------------------------------------------------------------------ evaluating


@dataclasses.dataclass
class EvalResult:
    summary: dict  # the eval/* metrics (module docstring)
    prompts: list[dict]  # one per prompt: its row, greedy and sampled completions with rewards, c, pass@k


class Evaluator:
    """Evaluates a sampler's current weights on fixed held-out records (see the module docstring)."""

    def __init__(self, config: Config, tokenizer: Tokenizer, records: list[dict], rewards: RewardSuite,
                 batch_rows: int):
        ev = config.eval
        self.tokenizer, self.records, self.rewards = tokenizer, records, rewards
        self.batch_rows = batch_rows  # rows per generate call: the actor's usual batch, so memory stays as in training
        self.samples, self.k = ev.samples, ev.pass_k or ev.samples
        self.temperature = ev.temperature
        self.max_new_tokens = ev.max_new_tokens or config.sampler.max_new_tokens
        self.correct_reward, self.correct_threshold = ev.correct_reward, ev.correct_threshold
        self.seed = config.seed

    def evaluate(self, sampler: Sampler, cancelled: Callable[[], bool] = lambda: False) -> EvalResult | None:
        """Greedy and sampled completions of every record, scored; None when `cancelled()` turns true
        between two generate calls."""
        greedy = self._completions(sampler, [(i, 0) for i in range(len(self.records))], 0.0, cancelled)
        if greedy is None:
            return None
        sampled = self._completions(sampler, [(i, j) for i in range(len(self.records)) for j in range(self.samples)],
                                    self.temperature, cancelled)
        if sampled is None:
            return None
        prompts = []
        for i, record in enumerate(self.records):
            own = sampled[i * self.samples:(i + 1) * self.samples]
            correct = sum(s["correct"] for s in own)
            prompts.append({"dataset_index": record["dataset_index"], "prompt": record["prompt_text"],
                            "row": record["row"], "greedy": greedy[i], "samples": own, "correct": correct,
                            "mean@k": correct / self.samples, "pass@k": pass_at_k(self.samples, correct, self.k)})
        return EvalResult(self._summary(prompts, greedy, sampled), prompts)

    def _summary(self, prompts: list[dict], greedy: list[dict], sampled: list[dict]) -> dict:
        def mean(values) -> float:
            values = [v for v in values if v is not None]
            return float(np.mean(values)) if values else float("nan")

        return {
            "eval/pass@1": mean(g["correct"] for g in greedy),
            "eval/mean@k": mean(p["mean@k"] for p in prompts),
            "eval/pass@k": mean(p["pass@k"] for p in prompts),
            "eval/reward/mean": mean(s["reward"] for s in sampled),
            "eval/reward/greedy": mean(g["reward"] for g in greedy),
            "eval/length/mean": mean(s["length"] for s in sampled),
            "eval/length/greedy": mean(g["length"] for g in greedy),
            "eval/truncated": mean(s["finish_reason"] == "length" for s in sampled),
            "eval/failed_samples": sum(s["reward"] is None for s in greedy + sampled),
            "eval/prompts": len(prompts), "eval/samples": self.samples, "eval/k": self.k,
        }

    def _completions(self, sampler: Sampler, rows: list[tuple[int, int]], temperature: float,
                     cancelled: Callable[[], bool]) -> list[dict] | None:
        """Generate and score one completion per (record, sample number), batch_rows at a time."""
        stream = jax.random.fold_in(jax.random.key(self.seed), EVAL_KEY_STREAM)
        key_of = jax.vmap(lambda index, sample: jax.random.fold_in(jax.random.fold_in(stream, index), sample))
        out = []
        for start in range(0, len(rows), self.batch_rows):
            if cancelled():
                return None
            chunk = rows[start:start + self.batch_rows]
            records = [self.records[i] for i, _ in chunk]
            keys = key_of(jnp.asarray([r["dataset_index"] for r in records], jnp.uint32),
                          jnp.asarray([j for _, j in chunk], jnp.uint32))
            result = sampler.generate([[int(t) for t in r["prompt_ids"]] for r in records], keys,
                                      max_new_tokens=self.max_new_tokens, temperature=temperature)
            lengths = [int(n) for n in result.lengths]
            texts = [self.tokenizer.decode(result.tokens[i, :n]) for i, n in enumerate(lengths)]
            scored = self.rewards.score([r["row"] for r in records], texts, lengths)
            for error in scored.errors[:3]:
                logger.warning("eval reward: %s", error)
            deciding = scored.per_function[self.correct_reward] if self.correct_reward else \
                np.where(scored.failed, np.nan, scored.rewards)
            for i, text in enumerate(texts):
                out.append({"completion": text, "length": lengths[i], "finish_reason": result.finish_reasons[i],
                            "reward": None if scored.failed[i] else float(scored.rewards[i]),
                            "correct": bool(np.isfinite(deciding[i]) and deciding[i] >= self.correct_threshold)})
        return out


# ------------------------------------------------------------------------------------------ during training


class EvalDuringTraining:
    """Evaluations inside `grpo-jax train`: the learner thread requests one (step 0, every eval.every_steps,
    the end); the actor thread runs it as a side job with its current weights; the rows come back through
    finished() for the learner thread to write, keyed by the weight version evaluated (`step`) with the step
    that asked (`eval/requested_step`). A request that finds the weights of the last evaluation is skipped."""

    def __init__(self, evaluator: Evaluator, actor: Actor, sampler: Sampler):
        self.evaluator, self.actor, self.sampler = evaluator, actor, sampler
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._cancelled = threading.Event()
        self._last_version: int | None = None  # only the actor thread reads and writes it

    def request(self, step: int) -> None:
        with self._cond:
            self._pending += 1
        # Run with the weights of `step` at least: a request queued behind a running evaluation must not see the
        # weights that one measured (it would be skipped as a repeat, e.g. the evaluation after the last step).
        self.actor.submit_side_job(functools.partial(self._run, step), min_version=step)

    @property
    def pending(self) -> int:
        """Evaluations requested and not yet done (queued or running on the actor)."""
        with self._cond:
            return self._pending

    def finished(self) -> list[dict]:
        """The rows of the evaluations finished since the last call."""
        rows = []
        while True:
            try:
                rows.append(self._finished.get_nowait())
            except queue.Empty:
                return rows

    def wait(self, timeout: float) -> bool:
        """Wait until every requested evaluation has run (False if the time runs out or the actor stops)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending and self.actor.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return not self._pending

    def cancel(self) -> None:
        """Abandon the evaluation running (at its next generate call) and those queued."""
        self._cancelled.set()

    def _run(self, step: int, version: int) -> None:
        try:
            if self._cancelled.is_set() or version == self._last_version:
                return
            start = time.perf_counter()
            result = self.evaluator.evaluate(self.sampler, cancelled=self._cancelled.is_set)
            if result is None:
                return
            self._last_version = version
            row = {"step": version, "eval/requested_step": step, **result.summary,
                   "eval/seconds": time.perf_counter() - start}
            logger.info("eval of weight version %d: pass@1 %.3f, mean@k %.3f, pass@k %.3f (k=%d), reward %.3f, "
                        "%d prompts in %.1fs", version, row["eval/pass@1"], row["eval/mean@k"], row["eval/pass@k"],
                        row["eval/k"], row["eval/reward/mean"], row["eval/prompts"], row["eval/seconds"])
            self._finished.put(row)
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
