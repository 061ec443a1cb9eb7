"""Decode throughput: grpo_jax's generator vs transformers' generate on the same random Qwen2 model.

Workload: batch 64, 64-token prompts, exactly 128 new tokens each (no eos stop), temperature 1, float32.
`--engine continuous` (the default, as in the trainer) runs grpo_jax's continuous Engine with 64 slots (the
64 prompts fill them once; each decode chunk is a device call); `--engine static` the static Sampler.
A random transformers Qwen2ForCausalLM is saved with save_pretrained and loaded through grpo_jax.model.hf, so
both sides run identical weights (checked: max |logit difference| is printed). Compilation / first-call
warm-up is timed separately; the two generators then alternate `--repeats` times (so background load hits
both alike) and the median of each is reported.

    python tools/bench_sampler.py [--engine continuous|static] [--repeats 3] [--threads 2] [--streams 2] [--realtime]

On a machine shared with other work, --realtime (root only) runs this process, and the threads it
starts, under SCHED_FIFO so that background load does not decide the result (both sides alike).
"""

from __future__ import annotations

import argparse
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
from grpo_jax.rollout.engine import make_generator  # noqa: E402
from grpo_jax.rollout.sampler import SamplerConfig  # noqa: E402

BATCH, PROMPT, NEW, VOCAB = 64, 64, 128, 32000


def build_models(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, torch_dtype="float32")
    hf_model = transformers.Qwen2ForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        ours, _ = load_hf_model(tmp)
    # Same weights on both sides: compare logits on one sequence.
    ids = np.random.default_rng(seed).integers(0, VOCAB, (1, 32))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ours(jax.numpy.asarray(ids))[0])
    return hf_model, ours, float(np.abs(got - ref).max())


def time_ours(sampler, prompts: list[list[int]], seed: int) -> float:
    start = time.perf_counter()
    res = sampler.generate(prompts, seed, max_new_tokens=NEW, temperature=1.0)
    elapsed = time.perf_counter() - start
    assert res.tokens.shape == (BATCH, NEW) and (res.lengths == NEW).all()
    return elapsed


def time_hf(hf_model, input_ids: torch.Tensor, seed: int) -> float:
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=NEW, max_new_tokens=NEW,
                                pad_token_id=0, eos_token_id=VOCAB - 1)
    elapsed = time.perf_counter() - start
    assert out.shape == (BATCH, PROMPT + NEW)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams", type=int, default=SamplerConfig.decode_streams,
                        help="SamplerConfig.decode_streams")
    parser.add_argument("--realtime", action="store_true", help="SCHED_FIFO priority (needs root)")
    parser.add_argument("--engine", choices=("continuous", "static"), default="continuous",
                        help="SamplerConfig.engine: the generator measured")
    args = parser.parse_args()
    if args.realtime:  # before jax and torch start their thread pools, which inherit the policy
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(5))
    torch.set_num_threads(args.threads)
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} CPUs, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"engine={args.engine}, decode_streams={args.streams}, realtime={args.realtime}; load average before: "
          f"{os.getloadavg()[0]:.2f}")

    hf_model, ours, diff = build_models(args.seed)
    print(f"weights shared: max |logits(ours) - logits(transformers)| = {diff:.2e}")
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, VOCAB, (BATCH, PROMPT))
    input_ids = torch.tensor(prompts)
    # No eos stop: eos_ids=() on our side, min_new_tokens=max_new_tokens on theirs.
    sampler = make_generator(ours, eos_ids=(), pad_id=0, slots=BATCH,
                             config=SamplerConfig(max_new_tokens=NEW, max_prompt_len=PROMPT, min_prompt_bucket=PROMPT,
                                                  decode_streams=args.streams, engine=args.engine))
    prompt_lists = prompts.tolist()

    warm_ours = time_ours(sampler, prompt_lists, args.seed)
    warm_hf = time_hf(hf_model, input_ids, args.seed)
    print(f"warm-up (first call, includes compilation): ours {warm_ours:.2f} s, transformers {warm_hf:.2f} s")

    ours_t, hf_t = [], []
    for r in range(args.repeats):
        ours_t.append(time_ours(sampler, prompt_lists, args.seed + 1 + r))
        hf_t.append(time_hf(hf_model, input_ids, args.seed + 1 + r))
        print(f"  repeat {r}: ours {ours_t[-1]:.3f} s, transformers {hf_t[-1]:.3f} s")
    tokens = BATCH * NEW
    ours_tps, hf_tps = tokens / statistics.median(ours_t), tokens / statistics.median(hf_t)
    print(f"load average after: {os.getloadavg()[0]:.2f} (other processes on these cores slow both sides)")
    print(f"ours:         {ours_tps:8.0f} tokens/s (median of {args.repeats}; best {tokens / min(ours_t):.0f})")
    print(f"transformers: {hf_tps:8.0f} tokens/s (median of {args.repeats}; best {tokens / min(hf_t):.0f})")
    print(f"ratio:        {ours_tps / hf_tps:8.2f}x")
    print(f"compilations: {sampler.num_compilations}")


if __name__ == "__main__":
    main()
