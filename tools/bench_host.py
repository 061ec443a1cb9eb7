"""Host work per learner step, and the replay buffer's host memory per buffered group.

The GSM8K shape by default: 64 groups x 8 samples = 512 sequences of up to 1,024 tokens (prompts up to
512, completions up to 512, random lengths). Timed per step, median of --repeats:

  actor:   the sampler's [rows, N] outputs cut into 64 Groups (arrays per completion) and put into the
           ReplayBuffer (what the actor thread does per handout);
  learner: ReplayBuffer.take, then group_rows + pack_batch into the learner's [512, 1024] TrainBatch
           (NumPy, then one transfer of each array to the device).

For comparison, the same learner-side work as it was written before (a Python list of ints per token,
a row loop in pack_batch) is timed in the same run, and the ratio printed. Memory: tracemalloc's net
allocation while 64 groups are built and buffered, per group, against the raw bytes of their arrays.

    python tools/bench_host.py                        # last line: host work per step and memory per group
    python tools/bench_host.py --projected-step-s 2.5 # also: host work as a share of a projected device step

The projected device step comes from `grpo-jax compile` (its roofline estimate for the GSM8K config on a
TPU slice); host work runs on the host while the device works, but the learner thread does the learner
side between steps, so that share is what it adds to each step if nothing overlaps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from grpo_jax.algorithm.batch import pack_batch
from grpo_jax.algorithm.learner import TrainBatch
from grpo_jax.run.trainer import group_rows  # noqa: E402
from grpo_jax.state.replay_buffer import Group, ReplayBuffer  # noqa: E402


def sampler_outputs(rng, groups: int, g: int, prompt_len: int, new_tokens: int):
    """What one handout's generation returns: prompts, and [rows, new_tokens] tokens/log-probs with lengths."""
    prompts = [rng.integers(1, 32000, rng.integers(prompt_len // 4, prompt_len + 1)).astype(np.int32)
               for _ in range(groups)]
    rows = groups * g
    tokens = rng.integers(1, 32000, (rows, new_tokens)).astype(np.int32)
    logprobs = rng.normal(-2.0, 1.0, (rows, new_tokens)).astype(np.float32)
    lengths = rng.integers(1, new_tokens + 1, rows).astype(np.int32)
    return prompts, tokens, logprobs, lengths


def build_groups(prompts, tokens, logprobs, lengths, g: int, version: int, first_ordinal: int) -> list[Group]:
    """As the actor builds them (grpo_jax.rollout.actor.Actor._process): one array per completion."""
    out = []
    for i, prompt in enumerate(prompts):
        rows = range(i * g, (i + 1) * g)
        out.append(Group(
            ordinal=first_ordinal + i, prompt={"prompt_ids": prompt, "dataset_index": i, "epoch": 0, "row": {}},
            completions=[tokens[j, :lengths[j]].astype(np.int32) for j in rows],
            behaviour_logprobs=[logprobs[j, :lengths[j]].astype(np.float32) for j in rows],
            rewards=np.zeros(g, np.float32), weight_version=version,
            advantages=np.linspace(-1, 1, g, dtype=np.float32), valid=np.ones(g, bool)))
    return out


def old_group_rows(groups, group_size):
    """The learner batch as it was assembled before: Python ints per token."""
    prompts, completions, logprobs, advantages = [], [], [], []
    for group in groups:
        ids = [int(t) for t in group.prompt["prompt_ids"]]
        for j in range(group_size):
            prompts.append(ids)
            completions.append([int(t) for t in group.completions[j]])
            logprobs.append(np.asarray(group.behaviour_logprobs[j]))
            advantages.append(float(group.advantages[j]))
    return prompts, completions, logprobs, np.asarray(advantages, np.float32)


def old_pack_batch(prompts, completions, behaviour_logprobs, advantages, pad_id, prompt_len, completion_len):
    size, length = len(prompts), prompt_len + completion_len
    tokens = np.full((size, length), pad_id, np.int32)
    input_mask = np.zeros((size, length), bool)
    loss_mask = np.zeros((size, length - 1), np.float32)
    behaviour = np.zeros((size, length - 1), np.float32)
    for i, (prompt, completion, logp) in enumerate(zip(prompts, completions, behaviour_logprobs)):
        start = prompt_len - len(prompt)
        tokens[i, start:prompt_len] = prompt
        tokens[i, prompt_len:prompt_len + len(completion)] = completion
        input_mask[i, start:prompt_len + len(completion)] = True
        loss_mask[i, prompt_len - 1:prompt_len - 1 + len(completion)] = 1.0
        behaviour[i, prompt_len - 1:prompt_len - 1 + len(completion)] = np.asarray(logp)[:len(completion)]
    return TrainBatch(tokens=jnp.asarray(tokens), input_mask=jnp.asarray(input_mask),
                      loss_mask=jnp.asarray(loss_mask), advantages=jnp.asarray(advantages, jnp.float32),
                      behaviour_logprobs=jnp.asarray(behaviour), completion_len=completion_len)


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--projected-step-s", type=float, default=0.0,
                   help="a projected device step time (from grpo-jax compile) to compare with")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    g, n = args.group_size, args.groups
    outputs = [sampler_outputs(rng, n, g, args.prompt_len, args.new_tokens) for _ in range(args.repeats + 1)]

    actor_s, learner_s, old_s = [], [], []
    for r, (prompts, tokens, logprobs, lengths) in enumerate(outputs):
        buffer = ReplayBuffer(capacity=2 * n, max_staleness=1, prompts_per_step=n)
        start = time.perf_counter()
        groups = build_groups(prompts, tokens, logprobs, lengths, g, version=0, first_ordinal=r * n)
        buffer.reserve(n, 0)
        for group in groups:
            buffer.put(group)
        actor = time.perf_counter() - start

        def learner_side(pack=pack_batch, rows=group_rows):
            taken = buffer.take(n, current_version=0)
            batch = pack(*rows(taken.groups, g)[:4], 0, args.prompt_len, args.new_tokens)  # no masks: no env
            buffer.put_back(taken.groups, 0)  # the same groups for the next timing
            return batch

        learner = timed(learner_side)
        old = timed(lambda: learner_side(old_pack_batch, old_group_rows))
        if r:  # the first round warms up allocators and jnp transfers
            actor_s.append(actor)
            learner_s.append(learner)
            old_s.append(old)
        np.testing.assert_array_equal(np.asarray(learner_side().tokens),
                                      np.asarray(learner_side(old_pack_batch, old_group_rows).tokens))

    prompts, tokens, logprobs, lengths = outputs[0]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    buffer = ReplayBuffer(capacity=n, max_staleness=1, prompts_per_step=n)
    buffer.reserve(n, 0)
    for group in build_groups(prompts, tokens, logprobs, lengths, g, version=0, first_ordinal=0):
        buffer.put(group)
    used = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    raw = int(lengths.sum()) * (4 + 4) + sum(len(prompt) * 4 for prompt in prompts)  # int32 ids, float32 log-probs
    actor, learner, old = (statistics.median(x) for x in (actor_s, learner_s, old_s))
    rows, width = n * g, args.prompt_len + args.new_tokens
    print(f"{rows} sequences x {width} tokens ({int(lengths.sum())} completion tokens); median of {args.repeats}")
    print(f"actor side (groups + buffer put):        {actor * 1e3:8.1f} ms per step")
    print(f"learner side (take + rows + pack + put): {learner * 1e3:8.1f} ms per step "
          f"(before: {old * 1e3:.1f} ms, {old / learner:.1f}x)")
    print(f"replay buffer: {used / n / 1e3:.1f} kB per buffered group (its arrays: {raw / n / 1e3:.1f} kB)")
    host = actor + learner
    line = f"host work {host * 1e3:.1f} ms per step; {used / n / 1e3:.1f} kB per buffered group"
    if args.projected_step_s:
        line += f"; {100 * host / args.projected_step_s:.2f}% of a projected {args.projected_step_s:.3f} s step"
    print(line)
    return {"actor_s": actor, "learner_s": learner, "old_learner_s": old, "bytes_per_group": used / n}


if __name__ == "__main__":
    main()
