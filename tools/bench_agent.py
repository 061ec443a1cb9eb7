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

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_multiturn import ScriptedEnv, parse_workload, workload  # noqa: E402

from grpo_jax.envs.agent import AgentEnvironment, environment_agent  # noqa: E402
from grpo_jax.envs.agent_endpoint import AgentEndpoint  # noqa: E402
from grpo_jax.envs.environment import EnvConfig  # noqa: E402


def main() -> None:
    args = parse_workload(__doc__, rows=64)
    work = workload(args)
    rows, keys = work.rows, work.keys
    endpoint = AgentEndpoint(temperature=args.temperature)

    def scripted():
        return ScriptedEnv(args.opening, args.answer)

    agent = environment_agent(scripted)
    factories = {"in-process": scripted, "endpoint": lambda: AgentEnvironment(agent, endpoint)}
    env = EnvConfig(name="bench", max_turns=args.turns, max_total_tokens=work.context, step_timeout_s=60.0,
                    concurrency=args.rows)
    runners = {name: work.runner(env, factory) for name, factory in factories.items()}

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
