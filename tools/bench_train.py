"""Learner throughput and model FLOP utilisation (MFU) on the local device (meant for CPU).

Packed vs padded (the default, --mode packing): one step's sequences with long-tailed completion
lengths (log-normal quantiles, mean --mean-completion of --completion-bucket tokens; prompts mean --mean-prompt of
--prompt-bucket), trained by the real `Learner.step` as one sequence per row (pack_batch) and as packed rows
(pack_sequences, optim.packing; the row count rounded up to a size as the trainer does), the two timed
alternately in the same run. Prints the padding fraction of each layout, each one's trained (non-pad)
tokens/s, that the two first steps' losses agree, and a last line
`packed/padded: R x trained tokens/s (packed X, padded Y)`.

    python tools/bench_train.py                          # packed vs padded, 16 sequences, rows of 128 + 512
    python tools/bench_train.py --sequences 32 --mean-completion 200

--mode mfu instead measures the throughput and MFU of one batch of padded rows, as below.

--mode attention times one batch of long padded rows (--seq tokens; packed sequences inside a row attend alike)
trained with model.attention=blockwise (online softmax over --attention-block keys, a custom VJP: no [T, S]
scores kept) and with dense (the [T, S] scores whole), alternately in the same run; prints each compiled step's
temporaries, that the two first steps' losses agree, and a last line
`blockwise/dense: R x tokens/s (blockwise X, dense Y); temporaries A vs B`.

    python tools/bench_train.py --mode attention --seq 4096 --batch 1 --hidden 256 --intermediate 768 \
        --heads 4 --kv-heads 2

Runs the real `Learner.step` (jitted, donated, AdamW with global-norm clipping, GRPO loss with TIS
"tis", no KL, entropy metric on) on a synthetic batch of padded rows, and compares its model FLOP/s with
the peak FLOP/s of a large float32 matmul measured in the same run on the same machine. Prints both,
their ratio, and a last line `learner: X tokens/s, Y GFLOP/s, peak Z GFLOP/s, MFU W%`.

    python tools/bench_train.py --mode mfu      # default size below; ~1.4 s steps on 2 idle Zen 4 cores
    python tools/bench_train.py --mode mfu --breakdown  # also forward, forward+backward, optimizer timed apart
    python tools/bench_train.py --mode mfu --hidden 1024 --intermediate 2816 --heads 16 --batch 2 --seq 512
    python tools/bench_train.py --mode mfu --mini-batches 4  # 4 updates a step, old log-prob pass included
    python tools/bench_train.py --mode mfu --lora-rank 16  # LoRA (rank 16, alpha 32, every projection)

Default size: vocab 8192, hidden 768, MLP 2048, 4 layers, 12 query / 4 KV heads of 64, float32
(37.8M parameters, 31.5M of them in matmuls); batch 4 rows x 256 positions = 1024 tokens per step,
193 of them completions (prompt 64), one micro-batch: 193.6 model GFLOP per step.

Model FLOPs of one step, counted analytically from the config (T = positions the model runs per row,
i.e. the packed length minus one; S = positions per row that go through the LM head, the completion
length, since the learner scores completion tokens only (TrainBatch.completion_len; S = T when 0);
B = rows; E, H, KV, D, M, V, L as in ModelConfig):

    N_layers  = L * (E*H*D + 2*E*KV*D + H*D*E + 3*E*M)   projection and MLP weights
    N_head    = E*V                                      LM head (the embedding lookup is a gather: 0 FLOPs)
    dense     = 6 * (N_layers*B*T + N_head*B*S)          forward 2 FLOPs per weight per token, backward 4
                                                         (input and weight gradients)
    attention = 12 * L * B * T^2 * H * D                 forward QK^T and PV are 2*T^2*H*D each over the
                                                         full T x T square (what the model computes, causal
                                                         mask or not), backward twice the forward
    model FLOPs per step = dense + attention

With several updates a step (--mini-batches M, --epochs E) the step runs E passes of forward+backward over
the batch (each update on B / M rows) plus, before them, one forward pass over the whole batch for the
old log-probs (a third of the dense FLOPs and of the attention FLOPs above), which counts as model work:

    model FLOPs per step = E * (dense + attention) + (dense + attention) / 3    (when M * E > 1)

LoRA (--lora-rank R: adapters on q, k, v, o, gate, up, down, alpha 2R, over a frozen base): the base's
weights get no gradient, so forward+backward costs 4 FLOPs per base weight per token (forward 2, input
gradient 2) instead of 6, and the N_adapter = sum over adapted projections of R * (in + out) adapter
weights cost 6 each; in the formulas above, 6 * (N_layers*B*T + N_head*B*S) becomes
4 * (N_layers*B*T + N_head*B*S) + 6 * N_adapter*B*T (an old log-prob pass stays a forward: 2 per weight).
The tool also prints the learner's memory: bytes of the trained parameters, of the frozen ones and of
the optimizer state, and the compiled step's memory_analysis() (temporaries: activations, gradients).

Norms, RoPE, softmax, the loss and the optimizer are not counted (O(params) or O(B*T*(E+V)) each).
The XLA cost analysis of the compiled step (`.lower().compile().cost_analysis()["flops"]`) is
printed next to it as a cross-check; it counts that elementwise work too (1.01x at the default size).

Peak: a jitted N x N @ N x N float32 matmul (2*N^3 FLOPs, N = --peak-n, default 2048), timed (median
of --peak-repeats calls) right before each timed step, so that steps and peak see the same machine
state; the peak reported is the median of those, the MFU is median step FLOP/s over it. On a shared
machine other jobs take time slices from both, at different moments, so the tool also prints: the
load average (start and end); the median over steps of each step's MFU against its own peak; the
best step against the best peak; and an MFU from CPU time (step FLOPs per CPU-second of this process
over the matmul's), which time slices taken by other jobs do not change much.

Compile time: `lower().compile()` of the very function Learner.step calls, timed apart; the first
Learner.step call (printed too) reuses that executable. Neither is in the step figures.

XLA flags: --xla-flags (default below) is appended to XLA_FLAGS before jax is imported, in this
process only. The default, --xla_cpu_copy_insertion_use_region_analysis=true, lets XLA update the
donated Adam moments in place instead of copying them first (both moments of every parameter, 2 x
37.8M floats a step at the default size; about 3% of the step's CPU time). Pass --xla-flags= (empty)
for what the trainer gets; give flags as --xla-flags=--xla_...=... (with the `=`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

DEFAULT_XLA_FLAGS = "--xla_cpu_copy_insertion_use_region_analysis=true"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--vocab", type=int, default=8192)
    m.add_argument("--hidden", type=int, default=768)
    m.add_argument("--intermediate", type=int, default=2048)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=12)
    m.add_argument("--kv-heads", type=int, default=4)
    m.add_argument("--head-dim", type=int, default=0, help="0: hidden // heads")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    m.add_argument("--remat", action="store_true")
    b = p.add_argument_group("batch")
    b.add_argument("--batch", type=int, default=4, help="sequences per step")
    b.add_argument("--seq", type=int, default=256,
                   help="positions the model runs per row (packed length is seq + 1)")
    b.add_argument("--prompt-frac", type=float, default=0.25, help="share of the packed row that is prompt")
    b.add_argument("--micro", type=int, default=0, help="optim.micro_batch_size (0: whole mini-batch)")
    b.add_argument("--mini-batches", type=int, default=1, help="optim.mini_batches (updates per pass)")
    b.add_argument("--epochs", type=int, default=1, help="optim.epochs (passes over the batch per step)")
    b.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA adapters of this rank on every projection, alpha 2x rank (0: full fine-tuning)")
    b.add_argument("--ragged", action="store_true",
                   help="random prompt/completion lengths (padding is still computed; default: full rows)")
    k = p.add_argument_group("packing")
    k.add_argument("--attention-block", type=int, default=512, help="attention: model.attention_block")
    k.add_argument("--mode", default="packing", choices=["packing", "mfu", "attention"],
                   help="packing: packed vs padded rows on long-tailed lengths (default); mfu: throughput and MFU "
                        "of padded rows of the batch above")
    k.add_argument("--sequences", type=int, default=16, help="packing: sequences per step")
    k.add_argument("--prompt-bucket", type=int, default=128, help="packing: prompt bucket (tokens)")
    k.add_argument("--completion-bucket", type=int, default=512, help="packing: completion bucket (tokens)")
    k.add_argument("--mean-prompt", type=float, default=60.0, help="packing: mean prompt length (tokens)")
    k.add_argument("--mean-completion", type=float, default=120.0, help="packing: mean completion length (tokens)")
    r = p.add_argument_group("run")
    r.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    r.add_argument("--peak-n", type=int, default=2048, help="matmul size for the peak")
    r.add_argument("--peak-repeats", type=int, default=5, help="matmuls per peak measurement (median)")
    r.add_argument("--xla-flags", default=DEFAULT_XLA_FLAGS,
                   help=f"appended to XLA_FLAGS for this process (default {DEFAULT_XLA_FLAGS!r}; "
                        "--xla-flags= for none)")
    r.add_argument("--no-cost-analysis", action="store_true", help="skip the XLA cost-analysis cross-check")
    r.add_argument("--breakdown", action="store_true",
                   help="also time forward, forward(+entropy), forward+backward and the optimizer apart")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.xla_flags:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + ARGS.xla_flags).strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from grpo_jax.algorithm.batch import (  # noqa: E402
    pack_batch,
    pack_layout,
    pack_sequences,
    packed_row_sizes,
    packed_rows_for,
    padding_fraction,
    sequence_lengths,
)
from grpo_jax.algorithm.learner import Learner, OptimConfig, token_logprobs  # noqa: E402
from grpo_jax.algorithm.losses import LossConfig  # noqa: E402
from grpo_jax.model.lora import LoraConfig, init_adapters  # noqa: E402
from grpo_jax.model.transformer import ModelConfig, count_params, create_model  # noqa: E402


def model_flops(c: ModelConfig, batch: int, seq: int, scored: int = 0, epochs: int = 1,
                old_pass: bool = False, adapter_params: int = 0) -> dict[str, float]:
    """Analytic FLOPs of one step (see the module docstring): `epochs` forward+backward passes over the
    batch, plus a forward pass for the old log-probs when `old_pass`. `scored`: positions per row that go
    through the LM head (TrainBatch.completion_len; 0 = all `seq`). adapter_params > 0: LoRA, the base
    frozen (no weight gradients for it)."""
    e, h, kv, d, m, v, n_layers = (c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim,
                                   c.intermediate_size, c.vocab_size, c.num_layers)
    scored = scored or seq
    per_layer = e * h * d + 2 * e * kv * d + h * d * e + 3 * e * m
    n_body, n_head = n_layers * per_layer, e * v
    old = 1.0 if old_pass else 0.0
    weight = epochs * (4.0 if adapter_params else 6.0) + old * 2.0  # per frozen-or-trained base weight per token
    body = weight * n_body * batch * seq + (epochs * 6.0 + old * 2.0) * adapter_params * batch * seq
    head = weight * n_head * batch * scored
    attention = (epochs * 12.0 + old * 4.0) * n_layers * batch * seq**2 * h * d
    return {"n_matmul": n_body + n_head + adapter_params, "body": body, "head": head, "attention": attention,
            "total": body + head + attention}


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one blocking call."""
    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, time.process_time() - c0


def _median_time(fn, repeats: int, warmup: int = 1) -> tuple[float, float]:
    """Median wall and median CPU seconds of `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    walls, cpus = zip(*(_timed(fn) for _ in range(repeats)))
    return statistics.median(walls), statistics.median(cpus)


class PeakMatmul:
    """A jitted float32 n x n @ n x n matmul (2 n^3 FLOPs): () -> (FLOP/s, FLOP per CPU-second), each
    from the median of `repeats` calls."""

    def __init__(self, n: int, repeats: int):
        rng = np.random.default_rng(0)
        self.a = jnp.asarray(rng.standard_normal((n, n), np.float32))
        self.b = jnp.asarray(rng.standard_normal((n, n), np.float32))
        self.flops = 2.0 * n**3
        self.repeats = repeats
        self.matmul = jax.jit(jnp.matmul)

    def __call__(self) -> tuple[float, float]:
        wall, cpu = _median_time(lambda: self.matmul(self.a, self.b), self.repeats)
        return self.flops / wall, self.flops / cpu


def synthetic_batch(c: ModelConfig, batch: int, seq: int, prompt_frac: float, ragged: bool, seed: int):
    rng = np.random.default_rng(seed)
    length = seq + 1
    prompt_len = max(1, int(round(length * prompt_frac)))
    completion_len = length - prompt_len
    prompts, completions, behaviour = [], [], []
    for _ in range(batch):
        p_n = int(rng.integers(1, prompt_len + 1)) if ragged else prompt_len
        c_n = int(rng.integers(1, completion_len + 1)) if ragged else completion_len
        prompts.append(rng.integers(1, c.vocab_size, p_n).tolist())
        completions.append(rng.integers(1, c.vocab_size, c_n).tolist())
        # Near the log-prob of a uniform guess, so the TIS weights stay O(1) and the step is finite.
        behaviour.append(rng.normal(-np.log(c.vocab_size), 0.1, c_n))
    advantages = rng.standard_normal(batch).astype(np.float32)
    return pack_batch(prompts, completions, behaviour, advantages, pad_id=0, prompt_len=prompt_len,
                      completion_len=completion_len)


def long_tailed_sequences(c: ModelConfig, n: int, prompt_bucket: int, completion_bucket: int, mean_prompt: float,
                          mean_completion: float, seed: int):
    """n sequences (prompts, completions, behaviour log-probs, advantages) whose lengths follow log-normal laws
    with the given means (sigma 0.4 for prompts, 0.9 for completions: most answers short, a few long, as the
    token lengths of GSM8K answers are), cut to the buckets. The lengths are the laws' n quantiles in a random
    order, not draws, so that a step of a few sequences already has about the mean asked for."""
    from statistics import NormalDist

    rng = np.random.default_rng(seed)
    normal = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])

    def lengths(mean, sigma, bucket):
        quantiles = np.exp(np.log(mean) - sigma ** 2 / 2 + sigma * normal)
        return rng.permutation(np.clip(np.round(quantiles), 1, bucket).astype(int))

    prompt_lengths = lengths(mean_prompt, 0.4, prompt_bucket)
    completion_lengths = lengths(mean_completion, 0.9, completion_bucket)
    prompts = [rng.integers(1, c.vocab_size, k) for k in prompt_lengths]
    completions = [rng.integers(1, c.vocab_size, k) for k in completion_lengths]
    behaviour = [rng.normal(-np.log(c.vocab_size), 0.1, k) for k in completion_lengths]
    return prompts, completions, behaviour, rng.standard_normal(n).astype(np.float32)


def tokens_per_s_alternately(learners: dict[str, Learner], batches: dict, steps: int, tokens: int,
                             unit: str) -> dict[str, float]:
    """Each learner's step on its batch, `steps` times, the learners taking turns so that all see the same
    (shared, noisy) machine: prints each one's wall times and returns {NAME_tokens_per_s: tokens / median}."""
    times = {name: [] for name in learners}
    for _ in range(steps):
        for name, learner in learners.items():
            t0 = time.perf_counter()
            learner.step(batches[name])
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, walls in times.items():
        step_s = statistics.median(walls)
        out[f"{name}_tokens_per_s"] = tokens / step_s
        print(f"{name}: step wall times (s) " + ", ".join(f"{t:.3f}" for t in walls) + f"; median {step_s:.3f}: "
              f"{tokens / step_s:.0f} {unit}", flush=True)
    return out


def compare_packing(args, config: ModelConfig, loss_config: LossConfig, optim_config: OptimConfig) -> dict:
    """Packed vs padded learner throughput on the same long-tailed step (see the module docstring)."""
    sequences = long_tailed_sequences(config, args.sequences, args.prompt_bucket, args.completion_bucket,
                                      args.mean_prompt, args.mean_completion, args.seed)
    prompts, completions, behaviour, advantages = sequences
    length = args.prompt_bucket + args.completion_bucket
    padded = pack_batch(prompts, completions, behaviour, advantages, 0, args.prompt_bucket, args.completion_bucket)
    prompt_lengths, completion_lengths, _ = sequence_lengths(prompts, completions)
    layout = pack_layout(prompt_lengths, completion_lengths, length, args.completion_bucket, args.mini_batches)
    unit = args.mini_batches * (args.micro or 1)
    sizes = packed_row_sizes(-(-args.sequences // unit) * unit, unit, 8)  # as the trainer rounds (optim.packing)
    rows = packed_rows_for(layout.rows, sizes)
    packed = pack_sequences(prompts, completions, behaviour, advantages, 0, length, args.completion_bucket,
                            args.mini_batches, layout=layout, rows=rows)
    tokens = int((prompt_lengths + completion_lengths).sum())
    print(f"step: {args.sequences} sequences, prompts {prompt_lengths.mean():.0f} tokens on average (bucket "
          f"{args.prompt_bucket}), completions {completion_lengths.mean():.0f} on average, median "
          f"{np.median(completion_lengths):.0f}, longest {completion_lengths.max()} (bucket {args.completion_bucket}); "
          f"{tokens} trained tokens", flush=True)
    print(f"padding fraction: padded {padding_fraction(tokens, args.sequences, length):.3f} ({args.sequences} rows of "
          f"{length}), packed {padding_fraction(tokens, rows, length):.3f} ({rows} rows: {layout.rows} needed, "
          f"rounded up to one of {sizes})", flush=True)
    learners = {name: Learner(create_model(config, seed=args.seed), optim_config, loss_config)
                for name in ("padded", "packed")}
    batches = {"padded": padded, "packed": packed}
    first = {}
    for name, learner in learners.items():
        t0 = time.perf_counter()
        learner._step.lower(*learner.step_arguments(batches[name])).compile()
        compile_s = time.perf_counter() - t0
        first[name], _ = learner.step(batches[name])
        print(f"{name}: compiled in {compile_s:.1f} s; first step loss {first[name]['loss']:.6g}", flush=True)
    result = {"tokens": tokens, "rows": {"padded": args.sequences, "packed": rows},
              "padding_fraction": {"padded": padding_fraction(tokens, args.sequences, length),
                                   "packed": padding_fraction(tokens, rows, length)},
              "loss_difference": abs(first["packed"]["loss"] - first["padded"]["loss"])}
    result.update(tokens_per_s_alternately(learners, batches, args.steps, tokens, "trained tokens/s"))
    ratio = result["packed_tokens_per_s"] / result["padded_tokens_per_s"]
    result["ratio"] = ratio
    print(f"first steps' losses differ by {result['loss_difference']:.2g} (the same sequences, the same model)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    print(f"packed/padded: {ratio:.2f}x trained tokens/s (packed {result['packed_tokens_per_s']:.0f}, padded "
          f"{result['padded_tokens_per_s']:.0f})")
    return result


def compare_attention(args, config: ModelConfig, loss_config: LossConfig, optim_config: OptimConfig) -> dict:
    """Blockwise vs dense attention: learner throughput and temporaries on the same long rows (module docstring)."""
    batch = synthetic_batch(config, args.batch, args.seq, args.prompt_frac, args.ragged, args.seed)
    tokens = int(np.asarray(batch.input_mask).sum())  # real tokens, prompts and completions
    learners, temporaries, first = {}, {}, {}
    for impl in ("blockwise", "dense"):
        model_config = dataclasses.replace(config, attention=impl, attention_block=args.attention_block)
        learners[impl] = Learner(create_model(model_config, seed=args.seed), optim_config, loss_config)
        t0 = time.perf_counter()
        compiled = learners[impl].lowered_step(batch).compile()
        temporaries[impl] = compiled.memory_analysis().temp_size_in_bytes
        first[impl], _ = learners[impl].step(batch)
        print(f"{impl}: compiled in {time.perf_counter() - t0:.1f} s, temporaries {temporaries[impl] / 2**20:.0f} "
              f"MiB; first step loss {first[impl]['loss']:.6g}", flush=True)
    result = {"tokens": tokens, "temporaries": temporaries,
              "loss_difference": abs(first["blockwise"]["loss"] - first["dense"]["loss"])}
    result.update(tokens_per_s_alternately(learners, {impl: batch for impl in learners}, args.steps, tokens,
                                           "tokens/s"))
    result["ratio"] = result["blockwise_tokens_per_s"] / result["dense_tokens_per_s"]
    print(f"first steps' losses differ by {result['loss_difference']:.2g} (the same rows, the same model)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    print(f"blockwise/dense: {result['ratio']:.2f}x tokens/s (blockwise {result['blockwise_tokens_per_s']:.0f}, "
          f"dense {result['dense_tokens_per_s']:.0f}); temporaries {temporaries['blockwise'] / 2**20:.0f} MiB vs "
          f"{temporaries['dense'] / 2**20:.0f} MiB")
    return result


def learner_memory(learner: Learner, compiled) -> dict[str, int]:
    """Bytes of the trained parameters, the frozen ones (LoRA's base; 0 without), the optimizer state, and
    the compiled step's temporaries (activations, gradients, XLA scratch: memory_analysis().temp)."""
    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    out = {"params": nbytes(learner.params), "frozen": nbytes(learner.frozen), "opt_state": nbytes(learner.opt_state)}
    try:
        out["step_temp"] = compiled.memory_analysis().temp_size_in_bytes
    except Exception:  # noqa: BLE001 - not every backend implements it
        pass
    return out


def xla_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None
    flops = cost.get("flops")
    return float(flops) if flops is not None and flops > 0 else None


def breakdown(learner: Learner, batch, loss_config: LossConfig, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of the step's pieces, each jitted on its own, measured round-robin (so
    that a change in the machine's load hits all of them alike)."""
    import optax

    from grpo_jax.algorithm.losses import policy_loss
    from grpo_jax.model.transformer import positions_from_mask

    graphdef, params, opt = learner.graphdef, learner.params, learner.optimizer

    def hidden_only(params, batch):
        model = nnx.merge(graphdef, params)
        pos = positions_from_mask(batch.input_mask)
        return model.hidden_states(batch.tokens[:, :-1], pos[:, :-1], batch.input_mask[:, :-1])[0]

    # As make_train_step's micro_loss: the LM head runs on the scored (completion) positions only.
    last = getattr(batch, "completion_len", 0)
    scored = batch.scored if last else (lambda x: x)

    def fwd(params, batch, with_entropy):
        model = nnx.merge(graphdef, params)
        kwargs = {"last": last} if last else {}
        return token_logprobs(model, batch.tokens, batch.input_mask, with_entropy=with_entropy, **kwargs)

    def loss_fn(params, batch, with_entropy):
        logp, ent = fwd(params, batch, with_entropy)
        return policy_loss(logp, jax.lax.stop_gradient(logp), scored(batch.behaviour_logprobs), None,
                           batch.advantages, scored(batch.loss_mask), loss_config, entropies=ent)

    def apply(params, opt_state, grads):
        updates, new_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=2)
    grads = grad(params, batch, True)[1]
    pieces = {
        "forward: hidden states": (jax.jit(hidden_only), (params, batch)),
        "forward: logprobs": (jax.jit(fwd, static_argnums=2), (params, batch, False)),
        "forward: logprobs + entropy": (jax.jit(fwd, static_argnums=2), (params, batch, True)),
        "forward+backward: no entropy": (grad, (params, batch, False)),
        "forward+backward: + entropy": (grad, (params, batch, True)),
        "optimizer: clip + AdamW": (jax.jit(apply), (params, learner.opt_state, grads)),
    }
    for f, a in pieces.values():
        jax.block_until_ready(f(*a))
    times = {k: [] for k in pieces}
    for _ in range(repeats):
        for k, (f, a) in pieces.items():
            times[k].append(_timed(lambda: f(*a)))
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}


def main(args) -> dict:
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         head_dim=args.head_dim, dtype=args.dtype, remat=args.remat,
                         max_position_embeddings=max(4096, args.seq + 1))
    loss_config = LossConfig(off_policy="tis", kl_coef=0.0)
    optim_config = OptimConfig(lr=1e-5, weight_decay=0.01, micro_batch_size=args.micro,
                               mini_batches=args.mini_batches, epochs=args.epochs)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} x{jax.device_count()}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    try:
        print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()), f"({os.cpu_count()} CPUs)",
              flush=True)
    except OSError:
        pass

    if args.mode == "packing":
        return compare_packing(args, config, loss_config, optim_config)
    if args.mode == "attention":
        return compare_attention(args, config, loss_config, optim_config)
    measure_peak = PeakMatmul(args.peak_n, args.peak_repeats)
    print(f"peak: {args.peak_n}^3 float32 matmul {measure_peak()[0] / 1e9:.1f} GFLOP/s (first look)", flush=True)

    model = create_model(config, seed=args.seed)
    params_total = count_params(model)
    adapters = None
    if args.lora_rank:
        if args.breakdown:
            raise SystemExit("--breakdown times the full model's pieces; not with --lora-rank")
        adapters = init_adapters(config, LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank), seed=args.seed)
    learner = Learner(model, optim_config, loss_config, adapters=adapters)
    trained_params = count_params(adapters) if adapters is not None else params_total
    batch = synthetic_batch(config, args.batch, args.seq, args.prompt_frac, args.ragged, args.seed)
    updates = optim_config.updates_per_step
    flops = model_flops(config, args.batch, args.seq, getattr(batch, "completion_len", 0), epochs=args.epochs,
                        old_pass=updates > 1, adapter_params=trained_params if adapters is not None else 0)
    tokens = args.batch * args.seq
    print(f"model: vocab {config.vocab_size}, hidden {config.hidden_size}, mlp {config.intermediate_size}, "
          f"{config.num_layers} layers, {config.num_heads}/{config.num_kv_heads} heads x "
          f"{config.resolved_head_dim}, {config.dtype}; {params_total / 1e6:.2f}M params "
          f"({flops['n_matmul'] / 1e6:.2f}M in matmuls)", flush=True)
    print(f"batch: {args.batch} rows x {args.seq} positions = {tokens} tokens "
          f"({int(np.asarray(batch.loss_mask).sum())} trained), {updates} update(s) a step "
          f"({args.mini_batches} mini-batch(es) x {args.epochs} epoch(s)), micro-batch "
          f"{args.micro or args.batch // args.mini_batches}; "
          f"{getattr(batch, 'completion_len', 0) or args.seq} positions/row through the LM head; model FLOPs/step "
          f"{flops['total'] / 1e9:.2f} G (layers {flops['body'] / 1e9:.2f} G + LM head {flops['head'] / 1e9:.2f} G + "
          f"attention {flops['attention'] / 1e9:.2f} G)", flush=True)

    # Compile apart (lower + compile of the very function Learner.step calls), then the first real
    # call, which compiles again through jit's own cache unless the two share it.
    t0 = time.perf_counter()
    compiled = learner._step.lower(*learner.step_arguments(batch)).compile()
    compile_s = time.perf_counter() - t0
    xla = None if args.no_cost_analysis else xla_flops(compiled)
    memory = learner_memory(learner, compiled)
    del compiled
    print(f"learner memory: trained parameters {trained_params / 1e6:.2f}M, "
          + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in memory.items()), flush=True)
    t0 = time.perf_counter()
    first, _ = learner.step(batch)
    first_s = time.perf_counter() - t0
    assert np.isfinite(first["loss"]), first

    # Steps and peak measurements alternate, so that both see the same (shared, noisy) machine.
    times, cpus, peaks, peaks_cpu = [], [], [], []
    for _ in range(args.steps):
        peak_i, peak_cpu_i = measure_peak()
        peaks.append(peak_i)
        peaks_cpu.append(peak_cpu_i)
        c0, t0 = time.process_time(), time.perf_counter()
        metrics, _ = learner.step(batch)  # returns host floats: the step has finished
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    step_s = statistics.median(times)
    peak = statistics.median(peaks)
    achieved = flops["total"] / step_s
    mfu = achieved / peak
    paired = statistics.median(flops["total"] / t / p for t, p in zip(times, peaks))
    # FLOPs per CPU-second of the step over those of the matmul: what other jobs on a shared machine
    # take away (time slices) cancels out, what it leaves (the work per FLOP) stays.
    cpu_ratio = (flops["total"] / statistics.median(cpus)) / statistics.median(peaks_cpu)
    print(f"compile: {compile_s:.1f} s (lower+compile); first call {first_s:.1f} s "
          f"(its excess over a median step is any compilation jit did not share)", flush=True)
    print("step wall times (s): " + ", ".join(f"{t:.3f}" for t in times) + f"; median {step_s:.3f}, "
          f"min {min(times):.3f}")
    print("step CPU times (s):  " + ", ".join(f"{t:.3f}" for t in cpus) + f"; median {statistics.median(cpus):.3f}")
    print("peak (GFLOP/s):      " + ", ".join(f"{p / 1e9:.1f}" for p in peaks) + f"; median {peak / 1e9:.1f}, "
          f"max {max(peaks) / 1e9:.1f}")
    print(f"MFU of each step against the peak measured just before it: median {100 * paired:.1f}%")
    print(f"MFU by CPU time (step FLOP/CPU-s over matmul FLOP/CPU-s, load-insensitive): {100 * cpu_ratio:.1f}%")
    print(f"best step against best peak: {flops['total'] / min(times) / 1e9:.1f} GFLOP/s of "
          f"{max(peaks) / 1e9:.1f}, MFU {100 * flops['total'] / min(times) / max(peaks):.1f}%")
    if xla is not None and updates > 1:
        print("XLA cost analysis: not comparable with several updates (nested loops count their bodies once)")
    elif xla is not None:
        # The micro-batches run in a lax.scan (a while loop): the cost analysis counts its body once.
        trips = args.batch // args.micro if args.micro else 1
        xla *= trips
        print(f"XLA cost analysis: {xla / 1e9:.2f} GFLOP/step"
              + (f" (loop body x {trips} micro-batches)" if trips > 1 else "")
              + f" (analytic {flops['total'] / 1e9:.2f}, ratio {xla / flops['total']:.3f})")
    else:
        print("XLA cost analysis: unavailable")
    print(f"metrics: loss {metrics['loss']:.4g}, grad_norm {metrics['grad_norm']:.4g}, "
          f"entropy {metrics.get('entropy', float('nan')):.4g}")
    try:
        print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    except OSError:
        pass

    result = {"tokens_per_s": tokens / step_s, "gflops": achieved / 1e9, "peak_gflops": peak / 1e9,
              "mfu": mfu, "mfu_paired": paired, "mfu_cpu_time": cpu_ratio, "step_s": step_s,
              "step_cpu_s": statistics.median(cpus), "compile_s": compile_s, "first_call_s": first_s,
              "xla_gflop": None if xla is None else xla / 1e9, "model_gflop": flops["total"] / 1e9,
              "trained_params": trained_params, "memory_bytes": memory}
    if args.breakdown:
        print("breakdown (each piece jitted alone, on the whole batch; median wall s, median CPU s):")
        pieces = breakdown(learner, batch, loss_config, max(3, args.steps))
        for name, (wall, cpu) in pieces.items():
            print(f"  {name:34s} {wall:7.3f} {cpu:7.3f}")
        result["breakdown"] = pieces
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    print(f"learner: {tokens / step_s:.0f} tokens/s, {achieved / 1e9:.1f} GFLOP/s, "
          f"peak {peak / 1e9:.1f} GFLOP/s, MFU {100 * mfu:.1f}%")
    return result


if __name__ == "__main__":
    main(ARGS)
