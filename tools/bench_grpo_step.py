"""One synchronous GRPO step end to end on CPU, on the sampler benchmark's Qwen2 shape.

    python tools/bench_grpo_step.py [--repeats 5]

Workload: random Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 768, vocab 32000, float32);
8 prompts of 64 tokens x 4 generations, exactly 32 new tokens; rewards, group advantages; a learner
update with KL to a frozen reference (coefficient 0.04) and AdamW. Prints the median step time and its
parts (rollout, the reference log-probs alone, the update which includes the reference pass).
For scale: Tunix's GRPO learner took 4.1-4.9 s per step for this on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.algorithm.advantages import group_advantages  # noqa: E402
from grpo_jax.algorithm.batch import pack_batch  # noqa: E402
from grpo_jax.algorithm.learner import Learner, OptimConfig, token_logprobs  # noqa: E402
from grpo_jax.algorithm.losses import LossConfig  # noqa: E402
from grpo_jax.model.transformer import ModelConfig, create_model  # noqa: E402
from grpo_jax.rollout.sampler import Sampler, SamplerConfig  # noqa: E402

MODEL = ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                    num_kv_heads=2, qkv_bias=True, tie_embeddings=False)
PROMPTS, GENERATIONS, PROMPT_LEN, NEW_TOKENS = 8, 4, 64, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, MODEL.vocab_size, PROMPT_LEN)) for _ in range(PROMPTS)]
    rows = [p for p in prompts for _ in range(GENERATIONS)]
    # No stop token: every completion is exactly NEW_TOKENS long, as the workload says.
    sampler = Sampler(create_model(MODEL, seed=0), eos_ids=(), pad_id=0,
                      config=SamplerConfig(max_new_tokens=NEW_TOKENS, max_prompt_len=PROMPT_LEN,
                                           min_prompt_bucket=PROMPT_LEN))
    learner = Learner(create_model(MODEL, seed=0), OptimConfig(lr=1e-5), LossConfig(kl_coef=0.04, kl_estimator="k3"),
                      reference_model=create_model(MODEL, seed=0))
    ref_graphdef = nnx.graphdef(create_model(MODEL, seed=0))
    ref_logprobs = jax.jit(lambda params, tokens, mask: token_logprobs(nnx.merge(ref_graphdef, params), tokens, mask,
                                                                      last=NEW_TOKENS)[0])

    def one_step(step: int) -> dict:
        t0 = time.perf_counter()
        keys = jax.random.split(jax.random.key(step), len(rows))
        result = sampler.generate(rows, keys)
        t1 = time.perf_counter()
        # A cheap stand-in reward with real spread inside each group.
        rewards = np.array([(tokens[:n] % 2 == 0).mean() for tokens, n in zip(result.tokens, result.lengths)])
        advantages, _ = group_advantages(rewards.reshape(PROMPTS, GENERATIONS))
        completions = [list(t[:n]) for t, n in zip(result.tokens, result.lengths)]
        logprobs = [lp[:n] for lp, n in zip(result.logprobs, result.lengths)]
        batch = pack_batch(rows, completions, logprobs, np.asarray(advantages).reshape(-1), 0, PROMPT_LEN, NEW_TOKENS)
        t2 = time.perf_counter()
        learner.step(batch)  # blocks on the metrics, so the update is finished
        t3 = time.perf_counter()
        sampler.update_params(learner.params)
        jax.block_until_ready(ref_logprobs(learner.ref_params, batch.tokens, batch.input_mask))
        t4 = time.perf_counter()
        return {"rollout": t1 - t0, "prepare": t2 - t1, "update": t3 - t2, "reference": t4 - t3,
                "step": t3 - t0}

    start = time.perf_counter()
    one_step(0)
    print(f"warm-up (compilation) step: {time.perf_counter() - start:.1f}s")
    runs = [one_step(i + 1) for i in range(args.repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"workload: {PROMPTS} prompts x {GENERATIONS} generations, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new "
          f"tokens, vocab {MODEL.vocab_size}, KL coef 0.04 to a reference, AdamW; {jax.device_count()} device(s)")
    print(f"median of {args.repeats}: step {median['step']:.2f}s = rollout {median['rollout']:.2f}s + rewards/packing "
          f"{median['prepare']:.2f}s + update {median['update']:.2f}s (of which the reference log-probs alone take "
          f"{median['reference']:.2f}s)")
    print(f"vs Tunix 4.1-4.9 s/step on the same workload: {4.1 / median['step']:.1f}x-{4.9 / median['step']:.1f}x "
          "faster; target <= 1.5 s")


if __name__ == "__main__":
    main()
