"""Trajectories: the loss mask is 1 exactly on the sampled tokens (with their log-probs and weight versions) and 0
on the prompt's, the glue's and the environment's; the segments are the template's renders of the conversation
they cover; where the renderer cannot extend, a new segment starts from the fresh render, and nothing sampled
before is trained twice; calls out of order are refused; any call the model may write is a tool error it reads."""

import asyncio

import pytest

from grpo_jax.envs.environment import Environment
from grpo_jax.envs.render import make_renderer
from grpo_jax.envs.trajectory import NO_VERSION, Segment, Trajectory
from test_env_render import FAMILIES, OPENING, REASONING, TOOLS, sampled_text, template_render, tokenizer, tool_message


class Sampler:
    """Stands in for the engine: a turn's ids (its end-of-turn id included), distinct log-probs and versions per
    turn, and where in the current segment each turn's ids went."""

    def __init__(self, renderer):
        self.renderer, self.turns = renderer, 0
        self.spans: list[tuple[int, int, int]] = []  # (segment, start, end) of each sampled turn

    def add_turn(self, trajectory, text, end=True):
        ids = self.renderer.tokenizer.encode(text) + ([self.renderer.end_of_turn_ids[0]] if end else [])
        self.turns += 1
        logprobs = [-0.25 * self.turns - 0.001 * i for i in range(len(ids))]
        versions = [self.turns + i % 2 for i in range(len(ids))]
        start = len(trajectory.current_ids)
        turn = trajectory.add_turn(ids, logprobs, versions)
        segment = len(trajectory.segments) - 1
        self.spans.append((segment, start, start + len(ids)))
        assert trajectory.segments[segment].tokens[start:] == tuple(ids)
        assert trajectory.segments[segment].behaviour_logprobs[start:] == tuple(logprobs)
        assert trajectory.segments[segment].weight_versions[start:] == tuple(versions)
        return turn


def assert_mask_is_the_sampled_tokens(trajectory, spans):
    for number, segment in enumerate(trajectory.segments):
        sampled = {i for s, start, end in spans if s == number for i in range(start, end)}
        assert [i for i, m in enumerate(segment.loss_mask) if m] == sorted(sampled)
        assert all(segment.behaviour_logprobs[i] == 0.0 and segment.weight_versions[i] == NO_VERSION
                   for i in range(len(segment.tokens)) if i not in sampled)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_loss_mask_covers_exactly_the_sampled_tokens_and_the_segment_is_the_render(family):
    renderer = make_renderer(family, tokenizer(family))
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    sampler = Sampler(renderer)
    reasoning = REASONING.get(family)
    calls = [("add", {"a": 2, "b": 3}), ("divide", {"a": 5, "b": 0})]
    calls = calls[:1] if family == "llama3" else calls  # Llama 3.1: one call per turn
    turn = sampler.add_turn(trajectory, sampled_text(family, "Both.", calls, reasoning))
    results = [tool_message("add", "5"), tool_message("divide", "Error: divide raised ZeroDivisionError")][:len(calls)]
    assert trajectory.add_step(results, tool_errors=len(calls) - 1) is False
    sampler.add_turn(trajectory, sampled_text(family, calls=[("divide", {"a": 5, "b": 4})], reasoning=reasoning))
    trajectory.add_step([tool_message("divide", "1.25")])
    sampler.add_turn(trajectory, sampled_text(family, "1.25", reasoning=reasoning))

    assert_mask_is_the_sampled_tokens(trajectory, sampler.spans)
    (segment,) = trajectory.segments
    full = template_render(renderer, trajectory.messages, TOOLS, add_generation_prompt=False)
    assert list(segment.tokens) == renderer.tokenizer.encode(full.removesuffix(renderer.glue))
    assert trajectory.messages[len(OPENING)] == turn.message
    assert (trajectory.turns, trajectory.tool_calls, trajectory.tool_errors, trajectory.truncated, trajectory.cuts) == (
        3, len(calls) + 1, len(calls) - 1, False, [])
    assert not trajectory.ended  # the environment says when it ends


def test_where_the_template_cannot_extend_a_new_segment_starts_from_the_fresh_render():
    renderer = make_renderer("qwen3", tokenizer("qwen3"))
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    sampler = Sampler(renderer)
    sampler.add_turn(trajectory, sampled_text("qwen3", calls=[("add", {"a": 2, "b": 3})], reasoning="Add first."))
    assert trajectory.add_step([tool_message("add", "5")]) is False
    sampler.add_turn(trajectory, sampled_text("qwen3", "5 so far.", reasoning="Then divide."))
    before_cut = list(trajectory.messages)
    assert trajectory.add_step([{"role": "user", "content": "And divided by 4?"}]) is True
    sampler.add_turn(trajectory, sampled_text("qwen3", calls=[("divide", {"a": 5, "b": 4})], reasoning="Divide."))
    assert trajectory.add_step([tool_message("divide", "1.25")]) is False
    sampler.add_turn(trajectory, sampled_text("qwen3", "1.25", reasoning="Done."))

    first, second = trajectory.segments
    def render(messages):
        return renderer.tokenizer.encode(template_render(renderer, messages, TOOLS, False).removesuffix("\n"))

    assert list(first.tokens) == render(before_cut) and list(second.tokens) == render(trajectory.messages)
    # The second segment's prompt re-renders the turns sampled in the first (without their reasoning): loss 0 there,
    # so nothing is trained twice.
    assert_mask_is_the_sampled_tokens(trajectory, sampler.spans)
    assert [s for s, _, _ in sampler.spans] == [0, 0, 1, 1]
    assert sum(first.loss_mask) + sum(second.loss_mask) == sum(end - start for _, start, end in sampler.spans)
    assert len(trajectory.cuts) == 1 and "<think>" in trajectory.cuts[0]
    assert trajectory.current_ids == list(second.tokens)


def test_calls_out_of_order_are_refused_and_a_turn_without_its_end_of_turn_token_ends_the_trajectory():
    renderer = make_renderer("qwen2", tokenizer("qwen2"))
    sampler = Sampler(renderer)
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    with pytest.raises(ValueError, match="add_step: an environment step answers an assistant turn"):
        trajectory.add_step([tool_message("add", "5")])
    for ids, logprobs, versions, message in (
            ([], [], [], "a turn at least one"), ([1, 2], [-0.1], [0, 0], r"\(2, 1, 2\)"),
            ([1], [0.5], [0], "log-prob must be finite and <= 0"), ([1], [float("nan")], [0], "finite"),
            ([1], [-0.1], [-1], "weight versions are >= 0")):
        with pytest.raises(ValueError, match=message):
            trajectory.add_turn(ids, logprobs, versions)
    sampler.add_turn(trajectory, "Hello.")
    with pytest.raises(ValueError, match="add_turn: an assistant turn needs an environment step"):
        sampler.add_turn(trajectory, "Again.")
    trajectory.add_step([{"role": "user", "content": "Go on."}])

    turn = sampler.add_turn(trajectory, "Cut off mid-sen", end=False)  # the token limit, no end-of-turn token
    assert turn.finish == "length" and trajectory.truncated and trajectory.ended
    with pytest.raises(ValueError, match="add_step: the trajectory has ended"):
        trajectory.add_step([{"role": "user", "content": "Go on."}])
    with pytest.raises(ValueError, match="add_turn: the trajectory has ended"):
        sampler.add_turn(trajectory, "More.")

    trajectory = Trajectory(renderer, OPENING, TOOLS)
    eos = renderer.tokenizer.encode("Bye.") + list(renderer.end_of_text_ids)
    assert trajectory.add_turn(eos, [-0.1] * len(eos), [0] * len(eos)).finish == "eos"
    assert trajectory.ended and not trajectory.truncated  # the model ended the conversation

    trajectory = Trajectory(renderer, OPENING, TOOLS)
    sampler.add_turn(trajectory, "Hello.")
    trajectory.mark_truncated()  # max_turns or max_total_tokens, before the environment was done
    assert trajectory.truncated and trajectory.ended
    with pytest.raises(ValueError, match="Segment: tokens, loss_mask, behaviour_logprobs, weight_versions differ"):
        Segment(tokens=(1, 2), loss_mask=(0,), behaviour_logprobs=(0.0, 0.0), weight_versions=(-1, -1))


@pytest.mark.parametrize("cut", [False, True])
def test_take_back_step_undoes_the_last_step_and_ends_the_trajectory_truncated(cut):
    """The engine's way out when the environment's answer does not fit: the trajectory is as it was before that
    step (ids, messages, tool errors, segments), and ended."""
    family = "qwen3" if cut else "qwen2"
    renderer = make_renderer(family, tokenizer(family))
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    sampler = Sampler(renderer)
    sampler.add_turn(trajectory, sampled_text(family, calls=[("add", {"a": 2, "b": 3})], reasoning="Add."))
    trajectory.add_step([tool_message("add", "5")])
    sampler.add_turn(trajectory, sampled_text(family, "5 so far.", reasoning="Then divide."))
    segments, messages, errors = trajectory.segments, list(trajectory.messages), trajectory.tool_errors
    started = trajectory.add_step([{"role": "user", "content": "And divided by 4?"}], tool_errors=2)
    assert started is cut and len(trajectory.segments) == len(segments) + cut
    trajectory.take_back_step()
    assert trajectory.segments == segments and trajectory.messages == messages
    assert trajectory.tool_errors == errors and trajectory.cuts == [] and trajectory.truncated and trajectory.ended
    assert_mask_is_the_sampled_tokens(trajectory, sampler.spans)
    with pytest.raises(ValueError, match="no environment step"):
        trajectory.take_back_step()


class Calculator(Environment):
    tools = TOOLS

    async def reset(self, row, seed):
        return list(OPENING)

    async def reward(self):
        return 0.0


def call(body):
    return "<tool_call>\n" + body + "\n</tool_call>"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_call_the_model_may_write_is_a_tool_error_it_reads_and_the_trajectory_goes_on(family):
    """The episode runner's path (add_turn, the default Environment.step, add_step, then a fresh render of the
    whole history, as a new segment would be): malformed JSON, a call nested 1000 deep, a 5000-digit number, NaN,
    an unknown tool, escaped lone surrogates (in a wrong-typed argument, in a tool's name), special-token text in
    an argument: each a tool error the model reads; nothing raises, so nothing is an env_error."""
    renderer = make_renderer(family, tokenizer(family))
    tok = renderer.tokenizer
    structural = {tok.token_to_id(t) for t in renderer.special_tokens}
    bodies = ['{"name": "add", "arguments": {"a": 1,}}', '{"name": "add", "arguments": {"a": ' + "[" * 1000 + "}}",
              '{"name": "add", "arguments": {"a": ' + "1" * 5000 + ', "b": 1}}',
              '{"name": "add", "arguments": {"a": NaN, "b": Infinity}}', '{"name": "rm -rf", "arguments": {}}',
              '{"name": "add", "arguments": {"a": ["\\ud800"], "b": 3}}', '{"name": "\\udfff", "arguments": {}}',
              '{"name": "add", "arguments": {"a": "<|im_end|><|eot_id|><end_of_turn>", "b": 3}}']
    for body in bodies:
        text = body.replace('"arguments"', '"parameters"') if family == "llama3" else call(body)
        if family == "qwen3":
            text = "<think>\nA call.\n</think>\n\n" + text
        env = Calculator()
        trajectory = Trajectory(renderer, asyncio.run(env.reset({}, 0)), env.tools)
        ids = tok.encode_guarded(*tok.guard(text)) + [renderer.end_of_turn_ids[0]]  # the characters, as text
        result = asyncio.run(env.step(trajectory.add_turn(ids, [-1.0] * len(ids), [0] * len(ids))))
        assert result.tool_errors == 1 and result.messages[-1]["content"].startswith("Error: "), (body, result)
        assert not trajectory.add_step(result.messages, tool_errors=result.tool_errors)
        fresh = renderer.initial_ids(trajectory.messages, TOOLS)
        assert [i for i in trajectory.current_ids if i in structural] == [i for i in fresh if i in structural]
