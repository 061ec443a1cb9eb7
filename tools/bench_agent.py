"""Agent episodes: the same episodes through the agent endpoint (an agent on the OpenAI client, over loopback HTTP:
grpo_jax.envs.agent) and through the in-process environment, in one run.

Workload: `--rows` concurrent episodes of tools/bench_multiturn.py's scripted environment (the opening: `--opening`
random digits; every step answers with `--answer` more; `--turns` assistant turns at most), sampled by a random tiny
model through the compact chat format. The endpoint way plays each episode with
grpo_jax.envs.agent.environment_agent (the environment's reset, step and reward inside an agent that calls
`client.chat.completions.create` for every turn); the in-process way runs the environment itself. Both run the same
rows with the same keys (the checks print how many sampled tokens differ); both are warmed up first, then timed
`--repeats` times alternating, and the median is used.

Printed per way: seconds and sampled tokens/s; the last line is the endpoint's throughput over the in-process
path's.

    python tools/bench_agent.py [--rows 64] [--turns 5] [--opening 128] [--answer 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_multiturn import ScriptedEnv  # noqa: E402

from grpo_jax.data.tokenizer import Tokenizer  # noqa: E402
from grpo_jax.envs.agent import AgentEnvironment, environment_agent  # noqa: E402
from grpo_jax.envs.agent_endpoint import AgentEndpoint  # noqa: E402
from grpo_jax.envs.environment import EnvConfig  # noqa: E402
from grpo_jax.envs.render import make_renderer  # noqa: E402
from grpo_jax.model.transformer import ModelConfig, create_model  # noqa: E402
from grpo_jax.rollout.continuation import ContinuationEngine  # noqa: E402
from grpo_jax.rollout.episodes import EpisodeRunner  # noqa: E402
from grpo_jax.rollout.sampler import SamplerConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--opening", type=int, default=128)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=4.0)
    args = parser.parse_args()

    tokenizer = Tokenizer.synthetic_chat()
    renderer = make_renderer("compact", tokenizer)
    model = create_model(ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=2,
                                     num_heads=4, num_kv_heads=2, tie_embeddings=True,
                                     max_position_embeddings=4096), seed=0)
    max_new = 512
    sampler = SamplerConfig(temperature=args.temperature, max_new_tokens=max_new, max_prompt_len=args.opening + 16,
                            chunk_steps=16)
    context = args.opening + 16 + args.turns * (args.answer + 8) + max_new
    rows = [{"prompt": ""} for _ in range(args.rows)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), args.rows)))
    endpoint = AgentEndpoint(temperature=args.temperature)

    def scripted():
        return ScriptedEnv(args.opening, args.answer)

    agent = environment_agent(scripted)
    factories = {"in-process": scripted, "endpoint": lambda: AgentEnvironment(agent, endpoint)}
    runners = {}
    for name, factory in factories.items():
        env = EnvConfig(name="bench", max_turns=args.turns, max_total_tokens=context, step_timeout_s=60.0,
                        concurrency=args.rows)
        engine = ContinuationEngine(model, renderer.stop_ids, tokenizer.pad_id, sampler, rows=args.rows,
                                    context=context)
        runners[name] = EpisodeRunner(engine, renderer, env, factory, max_prompt_len=sampler.max_prompt_len,
                                      max_new_tokens=max_new)

    def run(name):
        start = time.perf_counter()
        results = runners[name].run(rows, list(range(args.rows)), keys)
        return time.perf_counter() - start, results

    episodes = {name: run(name)[1] for name in runners}  # warm-up: compiles every program
    for name, results in episodes.items():
        failed = [r.detail for r in results if r.failure is not None]
        assert not failed, f"{name}: {len(failed)} episodes failed, e.g. {failed[0]}"
    timings = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name in runners:
            timings[name].append(run(name)[0])
    sampled = {name: sum(sum(sum(s.loss_mask) for s in r.trajectory.segments) for r in results)
               for name, results in episodes.items()}
    turns = [r.turns for r in episodes["in-process"]]
    differ = sum(a != b for x, y in zip(episodes["in-process"], episodes["endpoint"])
                 for a, b in zip(x.trajectory.segments[-1].tokens, y.trajectory.segments[-1].tokens))
    print(f"{args.rows} concurrent episodes: turns mean {np.mean(turns):.2f} (max {max(turns)}), sampled tokens "
          f"{sampled['in-process']} in process, {sampled['endpoint']} through the endpoint; tokens that differ: "
          f"{differ}")
    medians = {}
    for name in runners:
        medians[name] = statistics.median(timings[name])
        print(f"{name:>10}: {medians[name]:7.2f} s  {sampled[name] / medians[name]:8.0f} sampled tokens/s")
    for runner in runners.values():
        runner.close()
    endpoint.close()
    ratio = (sampled["endpoint"] / medians["endpoint"]) / (sampled["in-process"] / medians["in-process"])
    print(f"endpoint vs in-process sampled tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
