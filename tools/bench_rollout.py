"""Rollout throughput on a long-tailed workload: the continuous engine (ring and paged KV) vs the static sampler vs
transformers.

Workload (GRPO-like): 64 prompts of 64 tokens x 8 samples = 512 completions of up to 512 new tokens, temperature
1, float32, on the random Qwen2 shape of tools/bench_sampler.py. The model is made so that an end-of-sequence
token has a set probability at every step (--eos-prob, default 0.008): completion lengths are then geometric
and capped, so most rows stop early and a few run to the limit (the length distribution is printed). Both
sides run identical weights (a transformers model saved with save_pretrained and loaded through grpo_jax.model.hf).

Measured, in one run, as tokens of finished completions per second of wall time:
  (a) grpo_jax's static Sampler: one generate call over all 512 rows (each of its decode_streams batches runs
      until its longest row ends);
  (b) grpo_jax's continuous Engine: the 64 prompts submitted as groups of 8 (one prefill per prompt), slots
      refilled between decode chunks;
  (b') the same engine with paged KV (sampler.kv_cache=paged, --page-size) at the same slots (equal concurrency),
      its pool as large as the rings (nothing waits for a page): tokens/s, and its peak KV bytes in use against
      the rings' bytes;
  (c) transformers' generate: one call over all 512 rows (num_return_sequences=8), stopping at eos.
Each is warmed up (ours: one full call, which compiles; transformers: a short call), then timed `--repeats`
times, alternating, and the median is used.

    python tools/bench_rollout.py [--repeats 1] [--slots 128] [--chunk-steps 16] [--page-size 16] [--threads 2]
                                  [--skip-hf]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from grpo_jax.model.hf import load_hf_model  # noqa: E402
from grpo_jax.rollout.engine import Engine  # noqa: E402
from grpo_jax.rollout.sampler import Sampler, SamplerConfig  # noqa: E402

PROMPTS, SAMPLES, PROMPT_LEN, MAX_NEW, VOCAB = 64, 8, 64, 512, 32000
EOS = VOCAB - 1
CONSTANT_DIM = 0  # the hidden dimension that carries a constant, through which the eos logit is set


def build_models(seed: int, eos_prob: float):
    """A random Qwen2 whose eos token has probability ~eos_prob at every step, in transformers and grpo_jax.

    A random model's next-token distribution is near uniform over 32k tokens, so eos would (almost) never come.
    Every embedding row gets the same value in one dimension: the residual stream is dominated by it, so after
    the final RMSNorm that dimension is nearly the same for every context. The eos row of the LM head reads
    only that dimension, which makes the eos logit a near-constant b, and b is calibrated on random contexts."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, torch_dtype="float32")
    hf_model = transformers.Qwen2ForCausalLM(cfg).eval()
    ids = torch.tensor(np.random.default_rng(seed).integers(0, VOCAB - 1, (16, 96)))
    with torch.no_grad():
        hf_model.model.embed_tokens.weight[:, CONSTANT_DIM] = 1.0
        head = hf_model.lm_head.weight
        head[EOS] = 0.0
        hidden = hf_model.model(ids).last_hidden_state[:, PROMPT_LEN - 1:]  # final-normed, as the LM head sees it
        level = float(hidden[..., CONSTANT_DIM].mean())
        bias = 0.0
        for _ in range(4):
            head[EOS, CONSTANT_DIM] = bias / level
            p = torch.softmax(hf_model.lm_head(hidden), -1)[..., EOS].mean().item()
            bias += float(np.log(eos_prob / p))
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        ours, _ = load_hf_model(tmp)
    with torch.no_grad():
        ref = hf_model(ids[:1, :32]).logits.numpy()
    got = np.asarray(ours(jax.numpy.asarray(ids[:1, :32].numpy()))[0])
    return hf_model, ours, float(np.abs(got - ref).max()), p


def run_static(sampler: Sampler, prompts: list[list[int]], keys) -> tuple[float, np.ndarray]:
    rows = [p for p in prompts for _ in range(SAMPLES)]
    start = time.perf_counter()
    res = sampler.generate(rows, keys)
    return time.perf_counter() - start, res.lengths


def run_engine(engine: Engine, prompts: list[list[int]], keys) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(p, keys[i * SAMPLES:(i + 1) * SAMPLES], tag=i)
    lengths = np.zeros(len(prompts) * SAMPLES, np.int32)
    while engine.busy:
        for group in engine.step():
            lengths[group.tag * SAMPLES:(group.tag + 1) * SAMPLES] = [len(t) for t in group.tokens]
    return time.perf_counter() - start, lengths


def run_hf(hf_model, prompts: np.ndarray, seed: int, max_new: int = MAX_NEW) -> tuple[float, np.ndarray]:
    torch.manual_seed(seed)
    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                num_return_sequences=SAMPLES, pad_token_id=0, eos_token_id=EOS)
    elapsed = time.perf_counter() - start
    completion = out[:, PROMPT_LEN:].numpy()
    hit = completion == EOS
    lengths = np.where(hit.any(1), hit.argmax(1) + 1, completion.shape[1])
    return elapsed, lengths


def describe(lengths: np.ndarray) -> str:
    q = np.percentile(lengths, [10, 50, 90, 99])
    return (f"mean {lengths.mean():.0f}, p10/p50/p90/p99 {q[0]:.0f}/{q[1]:.0f}/{q[2]:.0f}/{q[3]:.0f}, "
            f"at the limit {(lengths >= MAX_NEW).sum()} of {len(lengths)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos-prob", type=float, default=0.008)
    parser.add_argument("--slots", type=int, default=128, help="the engine's slots (SamplerConfig.slots)")
    parser.add_argument("--chunk-steps", type=int, default=SamplerConfig.chunk_steps)
    parser.add_argument("--streams", type=int, default=SamplerConfig.decode_streams)
    parser.add_argument("--page-size", type=int, default=SamplerConfig.page_size, help="the paged engine's")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out (it is the slowest by far)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} CPUs, slots={args.slots}, chunk_steps={args.chunk_steps}, "
          f"decode_streams={args.streams}; load average before: {os.getloadavg()[0]:.2f}")
    hf_model, ours, diff, p = build_models(args.seed, args.eos_prob)
    print(f"weights shared: max |logits(ours) - logits(transformers)| = {diff:.2e}; P(eos) per step {p:.4f}")
    config = SamplerConfig(max_new_tokens=MAX_NEW, max_prompt_len=PROMPT_LEN, min_prompt_bucket=PROMPT_LEN,
                           decode_streams=args.streams, slots=args.slots, chunk_steps=args.chunk_steps)
    sampler = Sampler(ours, eos_ids=(EOS,), pad_id=0, config=config)
    engine = Engine(ours, eos_ids=(EOS,), pad_id=0, config=config)
    paged = Engine(ours, eos_ids=(EOS,), pad_id=0,
                   config=dataclasses.replace(config, kv_cache="paged", page_size=args.page_size))
    prompts = np.random.default_rng(args.seed).integers(0, VOCAB - 1, (PROMPTS, PROMPT_LEN))
    prompt_lists = prompts.tolist()

    def keys(r):
        return jax.random.split(jax.random.key(args.seed + r), PROMPTS * SAMPLES)

    sides = {"static": lambda r: run_static(sampler, prompt_lists, keys(r)),
             "engine": lambda r: run_engine(engine, prompt_lists, keys(r)),
             "paged": lambda r: run_engine(paged, prompt_lists, keys(r))}
    if not args.skip_hf:
        sides["transformers"] = lambda r: run_hf(hf_model, prompts, args.seed + r)
    # Warm-up: ours compile their programs on a full first call; transformers compiles nothing, so a short call
    # (8 prompts, 16 tokens) warms it instead of a second full run.
    warm = {name: run(0)[0] for name, run in sides.items() if name != "transformers"}
    if "transformers" in sides:
        warm["transformers (short)"] = run_hf(hf_model, prompts[:8], args.seed, max_new=16)[0]
    print("warm-up (first call, includes compilation): " + ", ".join(f"{k} {v:.1f} s" for k, v in warm.items()))
    before = engine.metrics()  # the timed runs' own figures: the engine's totals count the warm-up too
    times = {name: [] for name in sides}
    tokens = {name: [] for name in sides}
    for r in range(args.repeats):
        for name, run in sides.items():
            seconds, lengths = run(1 + r)
            times[name].append(seconds)
            tokens[name].append(int(lengths.sum()))
            print(f"  repeat {r} {name:>12}: {seconds:6.1f} s, {lengths.sum() / seconds:6.0f} tokens/s; lengths "
                  f"{describe(lengths)} (load average {os.getloadavg()[0]:.2f})")
    tps = {name: statistics.median(t / s for t, s in zip(tokens[name], times[name])) for name in sides}
    for name in sides:
        print(f"{name:>12}: {tps[name]:6.0f} tokens/s of finished completions (median of {args.repeats})")
    stats = engine.stats
    after = engine.metrics()
    prefilled = (after["engine/prefill_tokens"] - before["engine/prefill_tokens"]) // args.repeats
    saved = (after["engine/prefill_tokens_saved"] - before["engine/prefill_tokens_saved"]) // args.repeats
    print(f"engine: slot occupancy {stats['live_slot_steps'] / stats['slot_steps']:.2f} (warm-up included), "
          f"per run {prefilled} prompt tokens prefilled / {saved} saved by sharing (a prefill per sample: "
          f"{PROMPTS * SAMPLES * PROMPT_LEN}), {engine.num_compilations} compiled programs; load average after: "
          f"{os.getloadavg()[0]:.2f}")
    layers, heads, dim = ours.config.num_layers, engine.cache_heads, ours.config.resolved_head_dim
    position_bytes = layers * 2 * heads * dim * 4  # keys and values of one position in every layer, float32
    ring_bytes = engine.num_slots * engine.ring * position_bytes
    paged_peak = paged.metrics()["engine/kv_pages_peak"] * paged.num_banks * args.page_size * position_bytes
    print(f"KV bytes: rings {ring_bytes / 2**20:.1f} MiB; paged peak in use {paged_peak / 2**20:.1f} MiB (pages of "
          f"{args.page_size}, the most any bank held, times {paged.num_banks} banks), "
          f"{ring_bytes / paged_peak:.2f}x less; paged put back {paged.metrics()['engine/samples_put_back']} samples")
    line = (f"engine/static: {tps['engine'] / tps['static']:.2f}x, "
            f"paged/ring engine: {tps['paged'] / tps['engine']:.2f}x")
    if "transformers" in tps:
        line += f", engine/transformers: {tps['engine'] / tps['transformers']:.2f}x"
    print(line)


if __name__ == "__main__":
    main()
