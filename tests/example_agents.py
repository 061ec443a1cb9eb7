"""Agents for the tests that run them in a trainer of their own (a subprocess imports them as
`example_agents:NAME`, with tests/ on PYTHONPATH): nothing here imports the test suite."""

import functools

from grpo_jax.envs.agent import environment_agent
from grpo_jax.envs.synthetic import FetchCodeEnv

# configs/tiny_multiturn_cpu.yaml's fetch_code, played through the agent endpoint.
fetch_code_agent = environment_agent(functools.partial(FetchCodeEnv, code_digits=1, code_values=4,
                                                       number_alone=True, call_credit=0.1))
