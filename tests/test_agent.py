"""Agent episodes (grpo_jax.envs.agent, grpo_jax.envs.agent_endpoint): agent code written only against the real
`openai` client, over loopback, trained token-exactly.

With a scripted engine (each row "samples" the turns it is given): a calculator agent's calls become one segment
per episode whose sampled ids and log-probs are those every response carried (non-streaming and SSE streaming),
its tool results appended after them; an agent that rewrites its history starts a new segment; the reward comes
from run() or from /rl/reward. Every failure fails its episode with its reason, never the batch: an agent that
raises, hangs, never calls the model, returns no reward, drops its connection before the response is written,
calls again after its episode ended. Requests the endpoint refuses are one-line 4xx errors naming the field. With
the real continuation engine on a tiny model: each response's log-probs are a full forward pass's."""

import asyncio
import importlib.util
import json
import pathlib
import urllib.parse

import aiohttp
import jax
import numpy as np
import pytest

from conftest import jitted_token_logprobs
from example_agents import fetch_code_agent
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.agent import AgentEnvironment, check_agent
from grpo_jax.envs.agent_endpoint import AgentEndpoint
from grpo_jax.envs.environment import EnvConfig
from grpo_jax.envs.render import make_renderer
from grpo_jax.errors import ConfigError
from grpo_jax.model.transformer import ModelConfig, create_model
from grpo_jax.rollout.continuation import ContinuationEngine
from grpo_jax.rollout.episodes import EpisodeRunner
from grpo_jax.rollout.sampler import SamplerConfig
from test_episodes import ScriptedEngine

REPO = pathlib.Path(__file__).resolve().parents[1]

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.byte_level()  # ChatML; its template has no tools: the template renderer folds them


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return make_renderer("template", tokenizer)


@pytest.fixture
def endpoint():
    server = AgentEndpoint()
    yield server
    server.close()


def turn_ids(renderer, text, end="eot"):
    stop = renderer.end_of_turn_ids[0] if end == "eot" else renderer.end_of_text_ids[0]
    return renderer.tokenizer.encode(text) + [stop]


def scripted_runner(renderer, endpoint, agent, scripts, **env):
    config = EnvConfig(agent="test_agent:calculator", **{"max_turns": 4, "step_timeout_s": 5.0,
                                                          "max_total_tokens": 4096, **env})
    return EpisodeRunner(ScriptedEngine(scripts), renderer, config, lambda: AgentEnvironment(agent, endpoint),
                         max_prompt_len=2048, max_new_tokens=1024)


async def request(method, url, key, **kwargs) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one HTTP request with the episode's key."""
    async with aiohttp.ClientSession() as http, http.request(
            method, url, headers={"Authorization": f"Bearer {key}"}, **kwargs) as answer:
        text = await answer.text()
        try:
            return answer.status, json.loads(text)
        except json.JSONDecodeError:
            return answer.status, text


def run_batch(runner, n):
    rows = [{"id": i, "question": f"What is 2 + 3? ({i})"} for i in range(n)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), n)))
    try:
        return runner.run(rows, list(range(n)), keys)
    finally:
        runner.close()


SEEN: dict = {}  # row id -> what each response carried: (prompt ids, token ids, log-probs, versions)


def carried(choice, body) -> tuple:
    extra = choice.model_extra
    return (tuple(body["prompt_token_ids"]), tuple(extra["token_ids"]), tuple(extra["token_logprobs"]),
            tuple(extra["weight_versions"]))


async def calculator(row, client, stream=False):
    """An agent as users write them: the OpenAI client, a tool loop, the reward from the final answer."""
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": row["question"]}]
    seen = SEEN.setdefault(row["id"], [])
    while True:
        if stream:
            content, calls, record = "", {}, None
            async for chunk in await client.chat.completions.create(model="grpo-jax", messages=messages,
                                                                    tools=TOOLS, stream=True):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    calls[call.index] = {"id": call.id, "type": "function",
                                         "function": {"name": call.function.name,
                                                      "arguments": call.function.arguments}}
                if chunk.choices[0].finish_reason is not None:
                    record = carried(chunk.choices[0], chunk.model_extra)
            seen.append(record)
            message = {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())}
                                                                    if calls else {})}
        else:
            response = await client.chat.completions.create(model="grpo-jax", messages=messages, tools=TOOLS)
            seen.append(carried(response.choices[0], response.model_extra))
            message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return 1.0 if "5" in message["content"] else 0.0
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": str(arguments["a"] + arguments["b"])})


async def streaming_calculator(row, client):
    return await calculator(row, client, stream=True)


@pytest.mark.parametrize("agent", [calculator, streaming_calculator])
def test_an_openai_client_agent_trains_the_engines_own_ids(renderer, endpoint, agent):
    SEEN.clear()
    scripts = [[turn_ids(renderer, "I add.\n" + CALL), turn_ids(renderer, "2 + 3 = 5.")]] * 4
    results = run_batch(scripted_runner(renderer, endpoint, agent, scripts), 4)
    assert [r.failure for r in results] == [None] * 4, [r.detail for r in results]
    assert [r.reward for r in results] == [1.0] * 4 and all(r.turns == 2 for r in results)
    for i, result in enumerate(results):
        (segment,) = result.trajectory.segments
        tokens, mask = np.array(segment.tokens), np.array(segment.loss_mask, bool)
        responses = SEEN[i]
        assert len(responses) == 2
        # Each response carried its prompt (the sequence so far) and the turn exactly as the segment holds them.
        at = 0
        for prompt_ids, ids, logprobs, versions in responses:
            at = len(prompt_ids)
            assert tuple(tokens[:at]) == prompt_ids and tuple(tokens[at:at + len(ids)]) == ids
            assert mask[at:at + len(ids)].all() and not mask[:at][~np.isin(np.arange(at), np.flatnonzero(mask))].any()
            assert tuple(np.array(segment.behaviour_logprobs)[at:at + len(ids)]) == logprobs
            assert tuple(np.array(segment.weight_versions)[at:at + len(ids)]) == versions
        assert mask.sum() == sum(len(r[1]) for r in responses)
        text = renderer.tokenizer.decode(segment.tokens, skip_special_tokens=False)
        assert "<tool_response>\n5\n</tool_response>" in text  # the tool's result, after the sampled call


async def rewriting(row, client):
    """An agent that keeps only its last exchange: its second call does not extend the first."""
    first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                                 tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    await client.chat.completions.create(model="m", tools=TOOLS, messages=[
        {"role": "user", "content": "Summary: you called add(2, 3)."},
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}])
    return 1.0


async def posting(row, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    status, _ = await request("POST", str(client.base_url).replace("/v1/", "/rl/reward"), client.api_key,
                              json={"reward": 0.25})
    assert status == 200
    return None


def test_a_rewritten_history_starts_a_new_segment_and_a_posted_reward_counts(renderer, endpoint):
    scripts = [[turn_ids(renderer, CALL), turn_ids(renderer, "5.")]] * 2
    (result, _) = run_batch(scripted_runner(renderer, endpoint, rewriting, scripts), 2)
    assert result.failure is None and len(result.trajectory.segments) == 2, result.detail
    assert "anew" in result.trajectory.cuts[0]
    second = renderer.tokenizer.decode(result.trajectory.segments[1].tokens, skip_special_tokens=False)
    assert "Summary: you called add(2, 3)." in second
    results = run_batch(scripted_runner(renderer, endpoint, posting, [[turn_ids(renderer, "Hello.")]] * 2), 2)
    assert [r.reward for r in results] == [0.25, 0.25], [r.detail for r in results]


TOKEN_CALLS: dict = {}  # row id -> the ids each token call sent, and what came back


def token_agent(tokenizer):
    async def run(row, client):
        """The token route: the agent holds ids itself; its second prompt extends the first with the turn and a
        result of its own, its third starts over."""
        calls = TOKEN_CALLS.setdefault(row["id"], [])
        prompt = tokenizer.encode("<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n")
        for step in range(3):
            response = await client.completions.create(model="grpo-jax", prompt=prompt, max_tokens=256)
            ids = response.choices[0].model_extra["token_ids"]
            calls.append((list(prompt), ids, response.choices[0].text))
            if step == 0:
                prompt = prompt + ids + tokenizer.encode("\n<|im_start|>user\nResult: 5<|im_end|>\n"
                                                         "<|im_start|>assistant\n")
            else:
                prompt = tokenizer.encode("<|im_start|>user\nStart over: 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
        return 1.0

    return run


def test_the_token_route_extends_a_sequence_by_its_ids_and_starts_over_where_they_differ(renderer, endpoint):
    TOKEN_CALLS.clear()
    tok = renderer.tokenizer
    scripts = [[turn_ids(renderer, CALL), turn_ids(renderer, "5."), turn_ids(renderer, "Five.")]] * 2
    results = run_batch(scripted_runner(renderer, endpoint, token_agent(tok), scripts), 2)
    assert [r.failure for r in results] == [None, None], [r.detail for r in results]
    for i, result in enumerate(results):
        first, second = result.trajectory.segments
        (p0, ids0, text0), (p1, ids1, _), (p2, ids2, _) = TOKEN_CALLS[i]
        assert text0 == CALL and ids0 == scripts[0][0]  # the text decoded, its stop id left out
        # The second prompt extended the first: one segment holds both turns, the agent's ids as it sent them.
        assert list(first.tokens) == p1 + ids1
        assert [t for t, m in zip(first.tokens, first.loss_mask) if m] == ids0 + ids1
        assert list(second.tokens) == p2 + ids2 and "does not start with the ids" in result.trajectory.cuts[0]
    # Ids outside the vocabulary fail the episode in one line; text is refused by the route.
    loop = asyncio.new_event_loop()
    session = endpoint.open_session(loop)
    status, answer = asyncio.run(request("POST", session.base_url + "/completions", session.key,
                                         json={"prompt": "Add 2 and 3."}))
    assert status == 400 and "a non-empty list of token ids" in answer["error"]["message"]
    loop.close()

    async def out_of_vocabulary(row, client):
        await client.completions.create(model="grpo-jax", prompt=[tok.vocab_size + 5], max_tokens=4)

    (result,) = run_batch(scripted_runner(renderer, endpoint, out_of_vocabulary, scripts[:1]), 1)
    assert result.failure == "env_error" and "is not in the tokenizer's vocabulary" in result.detail, result.detail


FINISHES: list = []


async def capped(row, client):
    """Asks for at most 5 tokens, then asks again with the cut reply in its history."""
    messages = [{"role": "user", "content": "Hi."}]
    response = await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    choice = response.choices[0]
    FINISHES.append((choice.finish_reason, len(choice.model_extra["token_ids"])))
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "Go on."}]
    response = await client.chat.completions.create(model="m", messages=messages)
    FINISHES.append((response.choices[0].finish_reason, len(response.choices[0].model_extra["token_ids"])))
    return 1.0


def test_a_turn_cut_at_the_calls_max_tokens_goes_on_in_a_new_segment(renderer, endpoint):
    FINISHES.clear()
    script = [turn_ids(renderer, "Hello there."), turn_ids(renderer, "More.")]
    results = run_batch(scripted_runner(renderer, endpoint, capped, [script] * 2), 2)
    assert [(r.failure, r.reward, r.trajectory.truncated, r.turns) for r in results] == [(None, 1.0, False, 2)] * 2
    assert sorted(FINISHES) == [("length", 5)] * 2 + [("stop", len(script[1]))] * 2  # two episodes at once
    for result in results:
        first, second = result.trajectory.segments
        assert sum(first.loss_mask) == 5 and sum(second.loss_mask) == len(script[1])
        assert result.trajectory.cuts == ["the last turn was cut at its caller's token limit, without an end-of-turn "
                                          "id"]


async def capped_at_the_end(row, client):
    """Asks for more tokens than the sequence has room for: the cut is the run's, and the episode ends."""
    import openai

    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}], max_tokens=4000)
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    except openai.ConflictError:
        return 0.0
    return 1.0


def test_a_turn_cut_at_the_sequences_limit_ends_the_episode_truncated(renderer, endpoint):
    script = [turn_ids(renderer, "Hello there, a long reply. " * 4)]
    results = run_batch(scripted_runner(renderer, endpoint, capped_at_the_end, [script] * 2, max_total_tokens=40), 2)
    assert [(r.failure, r.reward, r.trajectory.truncated) for r in results] == [(None, 0.0, True)] * 2, \
        [r.detail for r in results]


async def raising(row, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    raise KeyError("the agent broke")


async def silent(row, client):
    return 1.0


async def hanging(row, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    await asyncio.sleep(60)


async def no_reward(row, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])


async def dropping(row, client):
    """Sends a whole request, then closes its connection before the answer comes."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi."}]}).encode()
    url = urllib.parse.urlsplit(str(client.base_url))
    _, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(f"POST {url.path}chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                 "Content-Type: application/json\r\n"
                 f"Authorization: Bearer {client.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()
    await asyncio.sleep(3)
    return 1.0


async def after_the_end(row, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."},
                                                               {"role": "assistant", "content": "Bye."},
                                                               {"role": "user", "content": "Wait."}])
    return 1.0


async def told_the_end(row, client):
    """Catches the 409 of a call after its episode ended, and returns the reward of what it has."""
    import openai

    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "More?"}])
    except openai.ConflictError as e:
        assert "the episode has ended" in str(e)
        return 0.5
    return 0.0


def test_an_agent_told_its_episode_ended_may_return_its_reward(renderer, endpoint):
    """The model ended the conversation (an end-of-text id): the episode is trained as it stands."""
    results = run_batch(scripted_runner(renderer, endpoint, told_the_end,
                                        [[turn_ids(renderer, "Bye.", end="eos")]] * 2), 2)
    assert [(r.failure, r.reward, r.turns) for r in results] == [(None, 0.5, 1)] * 2, [r.detail for r in results]


@pytest.mark.parametrize("agent, scripts, reason, detail", [
    (raising, None, "env_error", "the agent's run() raised KeyError: 'the agent broke'"),
    (silent, None, "env_error", "returned without calling the model"),
    (hanging, None, "env_timeout", "step_timeout_s"),
    (no_reward, None, "env_error", "returned None and posted no reward"),
    (dropping, None, "env_error", "connection closed before its response was written"),
    # The model ends the conversation (an end-of-text id): the agent's next call is told (409), and raises.
    (after_the_end, "eos", "env_error", "the agent's run() raised ConflictError"),
])
def test_every_agent_failure_fails_its_episode_with_its_reason(renderer, endpoint, agent, scripts, reason, detail):
    turns = [turn_ids(renderer, "Bye.", end="eos")] if scripts == "eos" else [turn_ids(renderer, "Hi there.")] * 2
    results = run_batch(scripted_runner(renderer, endpoint, agent, [turns] * 2, step_timeout_s=1.0), 2)
    for result in results:
        assert result.failure == reason and detail in result.detail, (result.failure, result.detail)


def test_refused_requests_are_one_line_errors_naming_the_field(endpoint):
    loop = asyncio.new_event_loop()
    session = endpoint.open_session(loop)
    url = session.base_url + "/chat/completions"
    hi = [{"role": "user", "content": "Hi."}]
    cases = [
        ({"messages": hi, "n": 2}, session.key, 400, "n=2: 1 in a training episode"),
        ({"messages": hi, "temperature": 0.3}, session.key, 400, "temperature=0.3: the learner trains at the "
                                                                  "sampler's"),
        ({"messages": hi, "stop": ["\n"]}, session.key, 400, "stop=['\\n']"),
        ({"messages": hi, "max_tokens": 0}, session.key, 400, "max_tokens=0: an integer >= 1"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, session.key, 400, "only text parts"),
        ({"messages": []}, session.key, 400, "messages: a non-empty list"),
        ({"messages": hi}, "sk-wrong", 401, "the API key is not this episode's"),
    ]
    for body, key, status, message in cases:
        got, answer = asyncio.run(request("POST", url, key, json=body))
        assert got == status and message in answer["error"]["message"] and "\n" not in answer["error"]["message"], (
            answer)
    assert asyncio.run(request("POST", url.replace(session.id, "0" * 16), session.key, json={"messages": hi}))[0] == 404
    assert asyncio.run(request("POST", url, session.key, data=b"{"))[0] == 400
    status, models = asyncio.run(request("GET", session.base_url + "/models", session.key))
    assert status == 200 and [m["id"] for m in models["data"]] == ["grpo-jax"]
    endpoint.end_session(session)
    assert asyncio.run(request("POST", url, session.key, json={"messages": hi}))[0] == 410 and session.late_calls == 1
    loop.close()


def test_an_agent_must_be_an_async_function_of_row_and_client():
    async def three(row, client, extra):
        return 0.0

    with pytest.raises(ConfigError, match="is not an async function"):
        check_agent(lambda row, client: 0.0)
    with pytest.raises(ConfigError, match=r"cannot be called as run\(row, client\)"):
        check_agent(three)
    assert check_agent(calculator) is calculator
    problems = EnvConfig(name="fetch_code", agent="test_agent:calculator").validate()
    assert problems and "set one" in problems[0]
    assert "no module named nowhere" in EnvConfig(agent="nowhere:run").validate()[0]


def test_on_the_continuation_engine_each_response_carries_a_full_forward_passs_logprobs(renderer, endpoint):
    """A tiny random model samples the turns: every response's token log-probs equal the learner's forward pass
    over the episode's segment."""
    SEEN.clear()
    tok = renderer.tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_embeddings=True, max_position_embeddings=1024)
    model = create_model(cfg, seed=0)
    sampler = SamplerConfig(max_new_tokens=48, max_prompt_len=768, chunk_steps=8)
    engine = ContinuationEngine(model, renderer.stop_ids, tok.pad_id, sampler, rows=4, context=1024)
    config = EnvConfig(agent="test_agent:calculator", max_turns=2, step_timeout_s=10.0, max_total_tokens=1024)
    runner = EpisodeRunner(engine, renderer, config, lambda: AgentEnvironment(calculator, endpoint),
                           max_prompt_len=768, max_new_tokens=48)
    results = run_batch(runner, 4)
    assert all(r.failure is None for r in results), [r.detail for r in results]
    for i, result in enumerate(results):
        (segment,) = result.trajectory.segments
        tokens = np.array(segment.tokens)[None]
        full = np.asarray(jitted_token_logprobs(model, tokens, np.ones(tokens.shape, bool))[0])[0]
        for prompt_ids, ids, logprobs, _ in SEEN[i]:
            at = len(prompt_ids)
            np.testing.assert_allclose(logprobs, full[at - 1:at - 1 + len(ids)], atol=2e-4)


def test_grpo_jax_train_with_an_agent_trains_and_audits_clean(tmp_path):
    """grpo_jax.train(config, agent=run) on configs/tiny_multiturn_cpu.yaml: fetch_code's episodes played by an
    agent through the endpoint; two steps train, and the ledger accounts for every prompt."""
    import grpo_jax
    from grpo_jax.cli import main
    from test_multiturn_training import CONFIG

    history = grpo_jax.train(CONFIG, agent=fetch_code_agent, run_dir=tmp_path / "run", overrides=[
        "trainer.max_steps=2", "grpo.prompts_per_step=4", "grpo.max_staleness=0", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.save_final_model=false", "checkpoint.every_steps=0"])
    assert len(history) == 2 and history[-1]["env/turns"] >= 1
    assert history[-1]["rollout/agent_calls"] > 0 and history[-1]["rollout/agent_undelivered"] == 0
    assert {k: v for k, v in history[-1].items() if k.startswith("env/failed_")} == {
        "env/failed_env_error": 0, "env/failed_env_timeout": 0, "env/failed_context_limit": 0}
    assert main(["audit", str(tmp_path / "run")]) == 0


def test_the_example_gsm8k_agent_asks_again_for_a_missing_answer_line_and_scores_the_reply(renderer, endpoint):
    """examples/gsm8k_agent.py (configs/smollm2_gsm8k_agent_cpu.yaml's agent), run against scripted turns."""
    spec = importlib.util.spec_from_file_location("gsm8k_agent", REPO / "examples" / "gsm8k_agent.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert check_agent(example.run) is example.run
    scripts = [[turn_ids(renderer, "2 + 3 = 5.\n#### 5")],
               [turn_ids(renderer, "It is five."), turn_ids(renderer, "#### 4")]]
    runner = scripted_runner(renderer, endpoint, example.run, scripts)
    rows = [{"id": i, "question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"} for i in range(2)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 2)))
    try:
        results = runner.run(rows, [0, 1], keys)
    finally:
        runner.close()
    assert [(r.failure, r.turns, r.reward) for r in results] == [(None, 1, 2.0), (None, 2, 1.0)], \
        [r.detail for r in results]
    assert example.final_number("so\n#### 1,234\n") == "1234" and example.final_number("#### five") is None
