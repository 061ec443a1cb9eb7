"""Multi-turn rollout: the continuation engine (only the ids appended after each turn are prefilled) against
prefilling each turn's whole sequence again, on the same episodes, in one run.

Workload: `--rows` episodes of a scripted environment (the opening: `--opening` random digits; every environment
step answers with `--answer` more; an episode ends at `--turns` assistant turns, at a turn ending with end of text,
or at its context), sampled by a random tiny model through the compact chat format at a temperature that makes the
turns end after ~25 tokens on average. Both ways run the same rows with the same keys, so they sample the same
episodes (up to float noise: the checks print how many tokens differ); both are warmed up first (every program
compiled), then timed `--repeats` times alternating, and the median is used.

Printed per way: seconds, sampled tokens/s, prefilled tokens, extend calls; the last line is the speed-up of
continuing over prefilling again.

    python tools/bench_multiturn.py [--rows 32] [--turns 5] [--opening 128] [--answer 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax.data.tokenizer import Tokenizer  # noqa: E402
from grpo_jax.envs.environment import EnvConfig, Environment, StepResult  # noqa: E402
from grpo_jax.envs.render import Renderer, make_renderer  # noqa: E402
from grpo_jax.model.transformer import ModelConfig, create_model  # noqa: E402
from grpo_jax.rollout.continuation import ContinuationEngine  # noqa: E402
from grpo_jax.rollout.episodes import EpisodeRunner  # noqa: E402
from grpo_jax.rollout.sampler import SamplerConfig  # noqa: E402


class ScriptedEnv(Environment):
    """Answers every turn with `answer` digits; ends only by max_turns (or the model's end of text)."""

    def __init__(self, opening: int, answer: int):
        self.opening, self.answer = opening, answer

    async def reset(self, row, seed):
        self.rng = np.random.default_rng(seed)
        return [{"role": "user", "content": self._digits(self.opening)}]

    async def step(self, turn):
        return StepResult(messages=[{"role": "tool", "name": "read", "content": self._digits(self.answer)}])

    async def reward(self):
        return 0.0

    def _digits(self, n):
        return "".join(str(d) for d in self.rng.integers(0, 10, size=n))


MAX_NEW = 512


def parse_workload(doc: str, rows: int) -> argparse.Namespace:
    """The workload's command line (module docstring), `rows` episodes by default."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--opening", type=int, default=128)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=4.0)
    return parser.parse_args()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The benchmark's episodes: the tiny model and its sampler, `rows` openings and their keys."""

    tokenizer: Tokenizer
    renderer: Renderer
    model: object
    sampler: SamplerConfig
    context: int  # the tokens one sequence may hold: the opening, every turn and answer, and the sampled tokens
    rows: list[dict]
    keys: np.ndarray  # [rows, 2] uint32

    def runner(self, env: EnvConfig, factory, *, reprefill: bool = False) -> EpisodeRunner:
        """An EpisodeRunner of `factory`'s environments on a continuation engine of its own, one row an episode."""
        engine = ContinuationEngine(self.model, self.renderer.stop_ids, self.tokenizer.pad_id, self.sampler,
                                    rows=len(self.rows), context=self.context)
        return EpisodeRunner(engine, self.renderer, env, factory, max_prompt_len=self.sampler.max_prompt_len,
                             max_new_tokens=MAX_NEW, reprefill=reprefill)


def workload(args: argparse.Namespace) -> Workload:
    """The benchmark's episodes, as the command line sets them."""
    model = create_model(ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=2,
                                     num_heads=4, num_kv_heads=2, tie_embeddings=True,
                                     max_position_embeddings=4096), seed=0)
    sampler = SamplerConfig(temperature=args.temperature, max_new_tokens=MAX_NEW, max_prompt_len=args.opening + 16,
                            chunk_steps=16)
    tokenizer = Tokenizer.synthetic_chat()
    return Workload(tokenizer=tokenizer, renderer=make_renderer("compact", tokenizer), model=model, sampler=sampler,
                    context=args.opening + 16 + args.turns * (args.answer + 8) + MAX_NEW,
                    rows=[{"prompt": ""} for _ in range(args.rows)],
                    keys=np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), args.rows))))


def main() -> None:
    args = parse_workload(__doc__, rows=32)
    work = workload(args)
    rows, keys = work.rows, work.keys
    env = EnvConfig(name="bench", max_turns=args.turns, max_total_tokens=work.context, step_timeout_s=30.0)
    runners = {name: work.runner(env, lambda: ScriptedEnv(args.opening, args.answer), reprefill=reprefill)
               for name, reprefill in (("continue", False), ("prefill again", True))}

    def run(name):
        runner = runners[name]
        before = dict(runner.engine.stats)
        start = time.perf_counter()
        results = runner.run(rows, list(range(args.rows)), keys)
        seconds = time.perf_counter() - start
        stats = {k: runner.engine.stats[k] - before[k] for k in before}
        return seconds, results, stats

    episodes = {name: run(name)[1] for name in runners}  # warm-up: compiles every program
    timings = {name: [] for name in runners}
    stats = {}
    for _ in range(args.repeats):
        for name in runners:
            seconds, results, stats[name] = run(name)
            timings[name].append(seconds)
    sampled = sum(sum(sum(s.loss_mask) for s in r.trajectory.segments) for r in episodes["continue"])
    turns = [r.turns for r in episodes["continue"]]
    lengths = [len(r.trajectory.segments[-1].tokens) for r in episodes["continue"]]
    differ = sum(a != b for x, y in zip(episodes["continue"], episodes["prefill again"])
                 for a, b in zip(x.trajectory.segments[-1].tokens, y.trajectory.segments[-1].tokens))
    print(f"{args.rows} episodes: turns mean {np.mean(turns):.2f} (max {max(turns)}), final sequence length mean "
          f"{np.mean(lengths):.0f} (max {max(lengths)}), {sampled} sampled tokens; tokens that differ between the "
          f"two ways: {differ}")
    medians = {}
    for name in runners:
        medians[name] = statistics.median(timings[name])
        s = stats[name]
        print(f"{name:>14}: {medians[name]:7.2f} s  {sampled / medians[name]:8.0f} sampled tokens/s  prefilled "
              f"{s['extend_tokens']:7d} tokens in {s['extend_calls']} extend calls, {s['decode_steps']} decode steps")
    for runner in runners.values():
        runner.close()
    print(f"continuation vs prefilling again: {medians['prefill again'] / medians['continue']:.2f}x")


if __name__ == "__main__":
    main()
