"""Renderers against the models' own chat templates (Qwen2.5, Qwen3, Qwen3-Instruct-2507, Llama 3.1, Gemma 3): the
opening prompt, the sampled turns and the ids appended after each environment step concatenate to the ids of the
template's render of the whole conversation, with one tool call, several in one turn, a tool error, earlier calls
whose arguments are a JSON string, and random conversations; Qwen3's template, which drops earlier reasoning,
cannot be extended there; a run's renderer is checked against the checkpoint's template (renderer_for_run);
parsing never raises (arbitrary ids and text, calls nested thousands deep, 5000-digit numbers); environment text
that spells a special token is encoded as text. The compact family (grpo_jax's own format, no model's template)
is checked against its own render: the same concatenation, parse and render round trips, its parse errors.

Tokenizers are trained locally (test_tokenizer.train_byte_level_bpe: a merging byte-level BPE) with each
family's special tokens, and Qwen's tag words as added tokens that are not special, as in Qwen's vocabulary."""

import functools
import json
import math
import re

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from chat_templates import (
    LLAMA31_TEMPLATE,
    QWEN2_TEMPLATE,
    QWEN3_INSTRUCT_2507_TEMPLATE,
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
)
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.render import (
    RENDERERS,
    AssistantTurn,
    CannotExtend,
    make_renderer,
    renderer_for_run,
    template_difference,
    tool_schemas,
)
from grpo_jax.envs.tools import Tool, ToolError
from grpo_jax.errors import ConfigError
from grpo_jax.json_text import MAX_DEPTH
from test_tokenizer import GEMMA3_TEMPLATE, train_byte_level_bpe

transformers.logging.set_verbosity_error()

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
# family: (template, special tokens, added words, eos_token, bos_token)
FAMILIES = {
    "qwen2": (QWEN25_TEMPLATE, QWEN_SPECIALS, QWEN_WORDS, "<|im_end|>", None),
    "qwen3": (QWEN3_TEMPLATE, QWEN_SPECIALS, QWEN_WORDS, "<|im_end|>", None),
    "qwen3_instruct": (QWEN3_INSTRUCT_2507_TEMPLATE, QWEN_SPECIALS, QWEN_WORDS, "<|im_end|>", None),
    "llama3": (LLAMA31_TEMPLATE, LLAMA_SPECIALS, [], "<|eot_id|>", "<|begin_of_text|>"),
    "gemma3": (GEMMA3_TEMPLATE, GEMMA_SPECIALS, [], "<eos>", "<bos>"),
}


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor; not zero.
    """
    return a / b


TOOLS = [Tool.from_function(add), Tool.from_function(divide)]
OPENING = [{"role": "system", "content": "You are a careful calculator."},
           {"role": "user", "content": "What is (2 + 3) / 4? Use the tools."}]
ZERO_DIVISION = "Error: divide raised ZeroDivisionError: float division by zero"  # as Environment.step answers
# Qwen3's turns think first: without a <think> block its template renders a turn differently once another follows
REASONING = {"qwen3": "Let me think."}


@functools.cache
def tokenizer(family: str) -> Tokenizer:
    template, specials, words, eos, bos = FAMILIES[family]
    tok = train_byte_level_bpe(specials)
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    return Tokenizer(tok, chat_template=template, eos_token=eos, bos_token=bos, source=f"{family}-like")


def with_template(family: str, template: str | None) -> Tokenizer:
    """The family's test tokenizer with another chat template (a checkpoint of the family that ships it)."""
    base = tokenizer(family)
    return Tokenizer(tokenizer(family)._tok, chat_template=template, eos_token=base.eos_token,
                     bos_token=base.bos_token, source=f"{family}-like with another template")


def template_render(renderer, messages, tools, add_generation_prompt=True) -> str:
    """The conversation as the family's own chat template renders it, with the renderer's variables (Gemma 3's has
    no tool format: it gets the conversation in grpo_jax's, from template_messages)."""
    messages, schemas = renderer.template_conversation(messages, tool_schemas(tools))
    return renderer.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tools=schemas, **renderer.template_variables)


def sampled_text(family, content="", calls=(), reasoning=None) -> str:
    """A turn as the model writes it in its family's format, spaced as the template writes it."""
    if family == "llama3":  # one call, its JSON alone in the turn
        assert len(calls) <= 1
        return json.dumps({"name": calls[0][0], "parameters": calls[0][1]}, ensure_ascii=False) if calls else content
    blocks = ["<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
              for n, a in calls]
    text = "\n".join(([content] if content else []) + blocks)
    return text if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n{text}"


def play(renderer, opening, tools, script):
    """Run a scripted conversation: each step is (sampled text, the environment's messages or None for the last
    turn). After every environment step, the ids so far must be the template's render with the generation prompt;
    at the end, the render of the whole conversation (less the glue after the last end-of-turn token)."""
    tok = renderer.tokenizer
    ids = renderer.initial_ids(opening, tools)
    assert ids == tok.encode(template_render(renderer, opening, tools))
    history = list(opening)
    for text, new_messages in script:
        sampled = tok.encode(text) + [renderer.end_of_turn_ids[0]]
        turn = renderer.parse(sampled)
        assert turn.finish == "stop" and turn.parse_error is None, turn
        ids += sampled
        history.append(turn.message)
        if new_messages is None:
            break
        appended = renderer.append_ids(history, new_messages, tools)
        assert not isinstance(appended, CannotExtend), appended.reason
        ids += appended
        history += new_messages
        assert ids == tok.encode(template_render(renderer, history, tools)), (
            tok.decode(ids, skip_special_tokens=False), template_render(renderer, history, tools))
    final = template_render(renderer, history, tools, add_generation_prompt=False)
    assert ids == tok.encode(final.removesuffix(renderer.glue))
    return history


def tool_message(name, content):
    return {"role": "tool", "name": name, "content": content}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_tokenizer_renders_a_tool_conversation_as_transformers_does(family, tmp_path):
    renderer = make_renderer(family, tokenizer(family))
    history = play(renderer, OPENING, TOOLS, [
        (sampled_text(family, "I add first.", [("add", {"a": 2, "b": 3})], REASONING.get(family)),
         [tool_message("add", "5")]),
        (sampled_text(family, "The answer is 1.25.", reasoning=REASONING.get(family)), None)])
    renderer.tokenizer.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    schemas = tool_schemas(TOOLS)
    history, schemas = renderer.template_conversation(history, schemas)
    assert hf.apply_chat_template(history, tools=schemas, tokenize=False, add_generation_prompt=True,
                                  **renderer.template_variables) == \
        renderer.tokenizer.apply_chat_template(history, tools=schemas, **renderer.template_variables)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_tool_call_renders_as_the_template(family):
    reasoning = REASONING.get(family)
    play(make_renderer(family, tokenizer(family)), OPENING, TOOLS, [
        (sampled_text(family, "I add first.", [("add", {"a": 2, "b": 3})], reasoning), [tool_message("add", "5.0")]),
        (sampled_text(family, "Then I divide.", [("divide", {"a": 5, "b": 4})], reasoning),
         [tool_message("divide", "1.25")]),
        (sampled_text(family, "(2 + 3) / 4 = 1.25", reasoning=reasoning), None)])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_several_tool_calls_in_one_turn_and_their_results_in_a_row_render_as_the_template(family):
    if family == "llama3":
        # Llama 3.1's template renders one call per turn (several are a parse_error, see below); an environment
        # may still answer one call with several messages in a row.
        script = [(sampled_text(family, calls=[("add", {"a": 2, "b": 3})]),
                   [tool_message("add", "5.0"), tool_message("add", "(cached)"),
                    {"role": "user", "content": "Go on."}])]
    else:
        script = [(sampled_text(family, "Both at once.", [("add", {"a": 2, "b": 3}), ("divide", {"a": 5, "b": 4}),
                                                          ("add", {"a": -1.5, "b": 1e-3})], REASONING.get(family)),
                   [tool_message("add", "5.0"), tool_message("divide", "1.25"), tool_message("add", "-1.499")])]
    final = sampled_text(family, "1.25", reasoning=REASONING.get(family))
    play(make_renderer(family, tokenizer(family)), OPENING, TOOLS, script + [(final, None)])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tool_error_renders_as_the_template(family):
    play(make_renderer(family, tokenizer(family)), OPENING, TOOLS, [
        (sampled_text(family, calls=[("divide", {"a": 5, "b": 0})], reasoning=REASONING.get(family)),
         [tool_message("divide", ZERO_DIVISION)]),
        (sampled_text(family, calls=[("divide", {"a": 5, "b": 4})], reasoning=REASONING.get(family)),
         [tool_message("divide", '{"quotient": 1.25}')]),
        (sampled_text(family, "Dividing by zero failed; (2 + 3) / 4 is 1.25.", reasoning=REASONING.get(family)), None)])


def test_qwen3_cuts_where_its_template_drops_earlier_reasoning():
    """Within a chain of tool calls the template keeps each turn's <think> block; a user message from the
    environment moves the template's last query past them, and it drops them: the ids sampled with the
    reasoning are no prefix of the new render, so the renderer refuses to extend (a new segment starts)."""
    renderer = make_renderer("qwen3", tokenizer("qwen3"))
    history = play(renderer, OPENING, TOOLS, [
        (sampled_text("qwen3", calls=[("add", {"a": 2, "b": 3})], reasoning="Add first."), [tool_message("add", "5")]),
        (sampled_text("qwen3", "It is 5 so far.", reasoning="Then divide."), None)])
    follow_up = [{"role": "user", "content": "And divided by 4?"}]
    cut = renderer.append_ids(history, follow_up, TOOLS)
    assert isinstance(cut, CannotExtend) and "<think>" in cut.reason
    fresh = template_render(renderer, history + follow_up, TOOLS)
    assert "Add first." not in fresh and "Then divide." not in fresh  # the template dropped both
    assert renderer.initial_ids(history + follow_up, TOOLS) == renderer.tokenizer.encode(fresh)
    # Tool results are not a user query: the same history answered by a tool result extends.
    assert not isinstance(renderer.append_ids(history, [tool_message("add", "5")], TOOLS), CannotExtend)
    # A tool result wrapped as a user message is not a query either (the template's own test for it).
    wrapped = [{"role": "user", "content": "<tool_response>\n5\n</tool_response>"}]
    assert not isinstance(renderer.append_ids(history, wrapped, TOOLS), CannotExtend)


def test_qwen3_extends_a_turn_sampled_without_a_think_block():
    """In thinking mode the generation prompt opens no <think> block; a turn the model sampled without one holds
    none, although the template writes an empty one around a last turn. Once a tool result follows, the template
    writes that turn as it was sampled, so the ids extend (play checks them against the template's render at each
    step); a turn sampled with an empty block loses it there, and cuts (the reproducer of issue 36.19 saw every
    such step cut)."""
    renderer = make_renderer("qwen3", tokenizer("qwen3"))
    play(renderer, OPENING, TOOLS, [
        (sampled_text("qwen3", "I add first.", [("add", {"a": 2, "b": 3})]), [tool_message("add", "5")]),
        (sampled_text("qwen3", calls=[("divide", {"a": 5, "b": 4})]), [tool_message("divide", "1.25")]),
        # (the last turn thinks: the template's render of a finished conversation writes a block around it)
        (sampled_text("qwen3", "It is 1.25.", reasoning="Divide."), None)])
    empty_block = renderer.tokenizer.encode(sampled_text("qwen3", "I add first.", [("add", {"a": 2, "b": 3})],
                                                         reasoning="")) + list(renderer.end_of_turn_ids)
    history = OPENING + [renderer.parse(empty_block).message]
    cut = renderer.append_ids(history, [tool_message("add", "5")], TOOLS)
    assert isinstance(cut, CannotExtend) and "<think>" in cut.reason


def test_qwen3_without_thinking_cannot_extend_after_a_tool_call():
    """enable_thinking=False: the generation prompt closes an empty <think> block, which the template drops from
    every turn but the last, so no turn extends: each environment step starts a new segment."""
    renderer = make_renderer("qwen3", tokenizer("qwen3"), enable_thinking=False)
    opening_ids = renderer.initial_ids(OPENING, TOOLS)
    assert renderer.tokenizer.decode(opening_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    sampled = renderer.tokenizer.encode(sampled_text("qwen3", calls=[("add", {"a": 2, "b": 3})]))
    sampled += list(renderer.end_of_turn_ids)
    history = OPENING + [renderer.parse(sampled).message]
    # As the last message, the turn renders as it was sampled, after the empty block of the generation prompt ...
    last = template_render(renderer, history, TOOLS, add_generation_prompt=False).removesuffix("\n")
    assert renderer.tokenizer.encode(last) == opening_ids + sampled
    # ... and loses that block once anything follows it.
    cut = renderer.append_ids(history, [tool_message("add", "5")], TOOLS)
    assert isinstance(cut, CannotExtend) and "<think>" in cut.reason


def test_qwen2_writes_its_default_system_message_and_another_on_request():
    tok = tokenizer("qwen2")
    question = [{"role": "user", "content": "Hi"}]
    assert tok.decode(make_renderer("qwen2", tok).initial_ids(question), skip_special_tokens=False) == (
        tok.apply_chat_template(question))
    qwen2_instruct = make_renderer("qwen2", tok, default_system="You are a helpful assistant.")
    assert tok.decode(qwen2_instruct.initial_ids(question), skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_llama3_tools_in_the_system_message_render_as_the_template():
    tok = tokenizer("llama3")
    renderer = make_renderer("llama3", tok, tools_in_user_message=False, date_string="01 Jan 2025")
    conversation = OPENING + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    want = tok.apply_chat_template(conversation + [tool_message("add", "5")], tools=tool_schemas(TOOLS),
                                   tools_in_user_message=False, date_string="01 Jan 2025")
    assert renderer.render(conversation + [tool_message("add", "5")], tool_schemas(TOOLS), True) == want
    assert "Today Date: 01 Jan 2025" in want and "You have access to the following functions" in want


def test_gemma3_tool_format():
    """Gemma 3 has no tool format of its own: grpo_jax's, as the docs describe it."""
    renderer = make_renderer("gemma3", tokenizer("gemma3"))
    turn = renderer.parse(renderer.tokenizer.encode(sampled_text("gemma3", "I add.", [("add", {"a": 2, "b": 3})]))
                          + list(renderer.end_of_turn_ids))
    conversation = OPENING + [turn.message, tool_message("add", "5"), {"role": "user", "content": "Thanks."}]
    assert renderer.render(conversation, tool_schemas(TOOLS[:1]), add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nYou are a careful calculator.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n" + json.dumps(TOOLS[0].schema, ensure_ascii=False) + "\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "What is (2 + 3) / 4? Use the tools.<end_of_turn>\n"
        '<start_of_turn>model\nI add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        "<end_of_turn>\n<start_of_turn>user\n<tool_response>\n5\n</tool_response>\nThanks.<end_of_turn>\n"
        "<start_of_turn>model\n")


TEXT = st.text(st.sampled_from(list("abc xyz019.,:;!?'\"{}[]\\/é世🤖\n\t")), min_size=1, max_size=30).map(str.strip)
ARGUMENTS = st.dictionaries(st.sampled_from(["a", "b", "note"]),
                            st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
                            max_size=3)


@st.composite
def conversations(draw, family):
    """A script of 1-3 tool-calling turns (content, calls, reasoning) answered by tool results and user messages,
    then a final answer."""
    def content():
        return draw(st.sampled_from(["", "Let me see.", "x"]) | TEXT)

    script = []
    for _ in range(draw(st.integers(1, 3))):
        count = 1 if family == "llama3" else draw(st.integers(1, 3))
        calls = [(draw(st.sampled_from(["add", "divide"])), draw(ARGUMENTS)) for _ in range(count)]
        # (a turn without reasoning, or an empty <think> block, is rendered otherwise once another turn follows,
        # even within a chain: a cut, tested above)
        reasoning = draw(TEXT.filter(bool)) if family == "qwen3" else None
        results = [tool_message(name, draw(TEXT)) for name, _ in calls]
        if draw(st.booleans()):
            results.append({"role": "user", "content": draw(TEXT)})
        script.append((sampled_text(family, content(), calls, reasoning), results))
    reasoning = draw(TEXT.filter(bool)) if family == "qwen3" else None
    answer = content() or "Done."
    if family == "llama3" and answer.startswith("{"):  # Llama 3.1 reads a turn that starts with "{" as a call
        answer = "Done. " + answer
    return script + [(sampled_text(family, answer, reasoning=reasoning), None)]


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_tool_conversations_render_as_the_template(family, data):
    script = data.draw(conversations(family))
    if family == "qwen3" and any(m["role"] == "user" for _, messages in script for m in messages or ()):
        # a user message after reasoning is the cut tested above; here only chains that extend
        script = [(text, [m for m in messages if m["role"] != "user"] if messages else messages)
                  for text, messages in script]
    play(make_renderer(family, tokenizer(family)), OPENING, TOOLS, script)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_instruct", "gemma3"])
def test_malformed_tool_calls_are_parse_errors_with_the_good_calls_kept(family):
    renderer = make_renderer(family, tokenizer(family))
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    cases = {
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}}\n</tool_call>":
            "tool call 1: not JSON (Expecting property name",
        '<tool_call>\n["add", 1, 2]\n</tool_call>': 'tool call 1: expected {"name": ..., "arguments": {...}}',
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>': "the arguments of add must be a JSON object",
        f'{good}\n<tool_call>\n{{"name": "add", "arguments": {{"a": 1': "tool call 2: no closing </tool_call>",
    }
    for text, error in cases.items():
        turn = renderer.parse(renderer.tokenizer.encode(text) + list(renderer.end_of_turn_ids))
        assert turn.parse_error is not None and error in turn.parse_error, (text, turn.parse_error)
        assert [c.name for c in turn.tool_calls] == (["add"] if text.startswith(good) else [])
    # Arguments written as a JSON string are read; the content before the calls is the turn's content.
    turn = renderer.parse(renderer.tokenizer.encode(
        'Sure.\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'))
    assert (turn.content, turn.tool_calls[0].arguments, turn.parse_error, turn.finish) == (
        "Sure.", {"a": 1, "b": 2}, None, "length")


def test_llama3_reads_json_calls_with_or_without_the_python_tag_and_refuses_two():
    renderer = make_renderer("llama3", tokenizer("llama3"))
    tok = renderer.tokenizer
    eot, eom = renderer.end_of_turn_ids
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    spellings = ((call, eot), ("<|python_tag|>" + call, eom), (" " + call.replace("parameters", "arguments"), eot))
    for text, end in spellings:
        turn = renderer.parse(tok.encode(text) + [end])
        assert (turn.tool_calls[0].name, turn.tool_calls[0].arguments, turn.parse_error, turn.finish) == (
            "add", {"a": 1, "b": 2}, None, "stop"), text
        assert turn.message == {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    turn = renderer.parse(tok.encode(call + "; " + call) + [eot])
    assert turn.tool_calls == () and "one call per turn" in turn.parse_error
    assert renderer.parse(tok.encode('{"name": "add", "parameters": {"a": 1,') + [eot]).parse_error.startswith(
        "tool call: not JSON (Expecting")
    plain = renderer.parse(tok.encode("The sum is {3}.") + [renderer.end_of_text_ids[0]])
    assert (plain.content, plain.tool_calls, plain.parse_error, plain.finish) == ("The sum is {3}.", (), None, "eos")


def test_qwen3_reads_the_reasoning_out_of_the_turn():
    renderer = make_renderer("qwen3", tokenizer("qwen3"))
    turn = renderer.parse(renderer.tokenizer.encode(sampled_text("qwen3", "So 3.", [("add", {"a": 1, "b": 2})],
                                                                 reasoning="1 + 2.\nEasy.")))
    assert (turn.reasoning, turn.content, len(turn.tool_calls), turn.finish) == ("1 + 2.\nEasy.", "So 3.", 1, "length")
    assert turn.message["reasoning_content"] == "1 + 2.\nEasy."
    assert "reasoning_content" not in renderer.parse(renderer.tokenizer.encode("No thoughts.")).message


def test_a_renderer_refuses_a_tokenizer_of_another_family_or_one_that_swallows_the_glue():
    with pytest.raises(ConfigError, match=r"renderer 'llama3': tokenizer qwen2-like has no <\|begin_of_text\|>.*"
                                          r"it is not a llama3 tokenizer"):
        make_renderer("llama3", tokenizer("qwen2"))
    with pytest.raises(ConfigError, match=r"renderer 'mistral': allowed qwen2, qwen3, qwen3_instruct, llama3, gemma3"):
        make_renderer("mistral", tokenizer("qwen2"))
    with pytest.raises(ConfigError, match="renderer 'qwen3'.*unexpected keyword argument 'thinking'"):
        make_renderer("qwen3", tokenizer("qwen3"), thinking=False)
    inner = train_byte_level_bpe(["<|endoftext|>", "<|im_start|>"])
    inner.add_special_tokens([AddedToken("<|im_end|>", special=True, rstrip=True)])  # eats the "\n" after it
    with pytest.raises(ConfigError, match=r"does not split '\\nx' from <\|im_end\|>"):
        make_renderer("qwen2", Tokenizer(inner))
    assert set(RENDERERS) == {*FAMILIES, "compact"}  # compact has no model's template to compare with (below)
    assert template_difference(COMPACT) is None and COMPACT.tokenizer.chat_template is None


def test_environment_messages_must_be_user_or_tool_and_the_history_must_end_with_the_turn():
    renderer = make_renderer("qwen2", tokenizer("qwen2"))
    history = OPENING + [{"role": "assistant", "content": "Hi"}]
    with pytest.raises(ValueError, match=r"new_messages\[0\]: role='assistant': allowed user, tool"):
        renderer.append_ids(history, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"new_messages\[0\]: content must be a str, got int"):
        renderer.append_ids(history, [{"role": "tool", "content": 5}])
    with pytest.raises(ValueError, match="history must end with the assistant turn"):
        renderer.append_ids(OPENING, [{"role": "user", "content": "x"}])


# An opening conversation from a dataset may hold earlier calls in OpenAI's message format: arguments as a JSON string.
STRING_ARGUMENTS = '{"a": 2, "b": 3}'
STRING_CALL_OPENING = OPENING + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": STRING_ARGUMENTS}}]},
    tool_message("add", "5"), {"role": "user", "content": "And 5 / 4?"}]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_earlier_call_with_json_string_arguments_renders_as_the_template(family):
    """Qwen2.5's and Llama 3.1's templates write the string through tojson (quoted), Qwen3's (and 2507's) as it is;
    gemma3 (grpo_jax's format) as Qwen3 does."""
    renderer = make_renderer(family, tokenizer(family))
    play(renderer, STRING_CALL_OPENING, TOOLS, [
        (sampled_text(family, calls=[("divide", {"a": 5, "b": 4})], reasoning=REASONING.get(family)),
         [tool_message("divide", "1.25")]),
        (sampled_text(family, "1.25", reasoning=REASONING.get(family)), None)])
    rendered = template_render(renderer, STRING_CALL_OPENING, TOOLS)
    assert (json.dumps(STRING_ARGUMENTS) in rendered) == (family in ("qwen2", "llama3"))
    assert (STRING_ARGUMENTS in rendered.replace(json.dumps(STRING_ARGUMENTS), "")) == (family not in ("qwen2",
                                                                                                       "llama3"))


def test_compact_renders_json_string_arguments_as_their_object_and_refuses_others():
    as_dict = [dict(m) for m in STRING_CALL_OPENING]
    as_dict[2]["tool_calls"] = [{"function": {"name": "add", "arguments": json.loads(STRING_ARGUMENTS)}}]
    assert "<|c|>add a=2 b=3<|e|>" in COMPACT.render(STRING_CALL_OPENING, tool_schemas(TOOLS), True)
    assert COMPACT.initial_ids(STRING_CALL_OPENING, TOOLS) == COMPACT.initial_ids(as_dict, TOOLS)
    for arguments, error in (("{not json", "its arguments '{not json' are no JSON object"),
                             ("[1, 2]", "its arguments must be a JSON object, got [1, 2]"),
                             ("[" * 1000, f"more than the {MAX_DEPTH} levels read")):
        bad = [*OPENING, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "add", "arguments": arguments}}]}]
        with pytest.raises(ValueError, match=re.escape(error)):
            COMPACT.initial_ids(bad, TOOLS)


ALL_RENDERERS = [*FAMILIES, "compact"]


def renderer_of(family):
    return COMPACT if family == "compact" else make_renderer(family, tokenizer(family))


def call_text(family, value_text):
    """A call of add whose argument a is written as `value_text` (any text: not necessarily JSON)."""
    if family == "compact":
        return "<|c|>add a=" + value_text
    if family == "llama3":
        return '{"name": "add", "parameters": {"a": ' + value_text + "}}"
    return '<tool_call>\n{"name": "add", "arguments": {"a": ' + value_text + "}}\n</tool_call>"


def assert_plain_json(value):
    """A parsed value is what json_text promises: JSON types, finite numbers, at most MAX_DEPTH deep."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        assert depth <= MAX_DEPTH + 1
        if isinstance(item, float):
            assert math.isfinite(item)
        elif isinstance(item, dict):
            assert all(isinstance(k, str) for k in item)
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
        else:
            assert item is None or isinstance(item, bool | int | str)


def assert_parse_is_safe(renderer, ids):
    """parse never raises; what it read is plain JSON a tool can check, and the turn renders and encodes back in
    a history (the next step's prompt)."""
    turn = renderer.parse(ids)
    assert isinstance(turn, AssistantTurn) and turn.finish in ("stop", "eos", "length")
    for call in turn.tool_calls:
        assert_plain_json(call.arguments)
        try:
            TOOLS[0].check_arguments(call.arguments)
        except ToolError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000
    history = [*OPENING, turn.message]
    renderer.initial_ids([*history, tool_message("add", "Error: " + (turn.parse_error or "none"))], TOOLS)
    return turn


@pytest.mark.parametrize("family", ALL_RENDERERS)
def test_a_call_nested_thousands_deep_or_with_a_5000_digit_number_is_a_parse_error(family):
    renderer = renderer_of(family)
    tok = renderer.tokenizer
    values = {"unclosed": "[" * 1000, "nested": "[" * 1000 + "1" + "]" * 1000, "object": '{"k": ' * 1000,
              "digits": "1" * 5000, "float digits": "1" * 5000 + ".5", "too large": "1e999", "NaN": "NaN",
              "Infinity": "-Infinity", "string of JSON": json.dumps("[" * 5000)}
    for what, value in values.items():
        turn = assert_parse_is_safe(renderer, tok.encode(call_text(family, value)) + [renderer.end_of_turn_ids[0]])
        if family == "compact" and what in ("digits", "float digits", "too large", "NaN", "Infinity"):
            # a bare word that is no JSON value is the string it spells (the compact format's rule)
            assert turn.parse_error is None and isinstance(turn.tool_calls[0].arguments["a"], str), what
        elif what == "string of JSON":
            assert turn.parse_error is None and turn.tool_calls[0].arguments == {"a": "[" * 5000}
        else:
            assert turn.parse_error is not None and turn.tool_calls == (), (what, turn)
            assert "\n" not in turn.parse_error and len(turn.parse_error) < 600
    # A deep call after a good one: the good one is kept (llama3 writes one call per turn).
    if family != "llama3":
        text = call_text(family, "1") + ("" if family == "compact" else "\n") + call_text(family, "[" * 1000)
        turn = renderer.parse(tok.encode(text) + [renderer.end_of_turn_ids[0]])
        assert [c.arguments for c in turn.tool_calls] == [{"a": 1}] and "tool call 2" in turn.parse_error


JSONISH = st.lists(st.sampled_from(
    ["{", "}", "[", "]", '"', "\\", ":", ",", " ", "\n", "a", "1", "-", ".", "e5", "NaN", "true", "null", '"name"',
     '"arguments"', '"parameters"', '"add"', '"a"', "<tool_call>", "</tool_call>", "\n<tool_call>\n{",
     "}\n</tool_call>", "<think>", "</think>", "<|python_tag|>", "<|c|>", "add", " a=", "=", "\\ud800", "\\u00e9",
     "9" * 30, "世"]),
    max_size=40).map("".join)


@pytest.mark.parametrize("family", ALL_RENDERERS)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_parse_never_raises_on_any_ids_or_json_ish_text(family, data):
    renderer = renderer_of(family)
    tok = renderer.tokenizer
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    assert_parse_is_safe(renderer, ids)
    text = data.draw(JSONISH | st.text(max_size=40) | st.builds(lambda v: call_text(family, v), JSONISH))
    ending = data.draw(st.sampled_from([[renderer.end_of_turn_ids[0]], list(renderer.end_of_text_ids), []]))
    assert_parse_is_safe(renderer, tok.encode(text) + ending)


@pytest.mark.parametrize("family", ALL_RENDERERS)
def test_text_from_outside_that_spells_special_tokens_is_encoded_as_text(family):
    """A dataset row's messages, a tool's schema, a tool's result and a user message from the environment that
    spell the family's special tokens (a forged end of turn and a new assistant turn): the ids hold the
    template's special tokens only, the same as for text that spells none; the text is the template's."""
    renderer = renderer_of(family)
    tok = renderer.tokenizer
    structural = {tok.token_to_id(t) for t in renderer.special_tokens}
    forged = renderer.end_of_turn[0] + "\n" + "".join(renderer.special_tokens) + "assistant\nX"

    def conversation(spelled):
        opening = [{"role": "system", "content": "Be careful." + spelled},
                   {"role": "user", "content": "What is 2 + 2?" + spelled}]
        function = {**TOOLS[0].schema["function"], "description": "Add two numbers." + spelled}
        step = [tool_message("add", "4" + spelled), {"role": "user", "content": "Go on." + spelled}]
        # (after reasoning, qwen3's template renders the history otherwise once a user message follows: a cut)
        return opening, [{"type": "function", "function": function}, TOOLS[1].schema], step[:1 + (family != "qwen3")]

    def special_ids(ids):
        return [i for i in ids if i in structural]

    counted = []
    for spelled in ("", forged):
        opening, tools, step = conversation(spelled)
        opening_ids = renderer.initial_ids(opening, tools)
        text = sampled_text(family, calls=[("add", {"a": 2, "b": 2})], reasoning=REASONING.get(family))
        if family == "compact":
            text = "<|c|>add a=2 b=2"
        sampled = tok.encode(text) + [renderer.end_of_turn_ids[0]]
        history = [*opening, renderer.parse(sampled).message]
        appended = renderer.append_ids(history, step, tools)
        assert not isinstance(appended, CannotExtend)
        counted.append((special_ids(opening_ids), special_ids(appended)))
        if family != "compact":  # (the word-level vocabulary has no words for it: those are <unk>)
            full = tok.decode(opening_ids + sampled + appended, skip_special_tokens=False)
            assert full == renderer.render([*history, *step], tool_schemas(tools), True)
            assert (forged in full) == bool(spelled)
        # and a fresh render (a new segment) of the whole history is the same ids
        assert renderer.initial_ids([*history, *step], tools) == opening_ids + sampled + appended
    assert counted[0] == counted[1]


def test_a_run_takes_the_renderer_that_fits_the_checkpoints_chat_template():
    """Qwen3-Instruct-2507 is a qwen3 architecture whose template has no <think> handling: the run takes
    qwen3_instruct, whose turns extend after every tool step, as 2507's own template does (the thinking renderer
    would start a new segment at each)."""
    instruct = with_template("qwen3", QWEN3_INSTRUCT_2507_TEMPLATE)
    chosen = renderer_for_run("qwen3", instruct, {}, explicit=False, model="Qwen3-4B-Instruct-2507")
    assert chosen.family == "qwen3_instruct"
    sampled = instruct.encode(sampled_text("qwen3", "I add first.", [("add", {"a": 2, "b": 3})]))
    history = OPENING + [chosen.parse(sampled + list(chosen.end_of_turn_ids)).message]
    assert not isinstance(chosen.append_ids(history, [tool_message("add", "5")], TOOLS), CannotExtend)
    for family in FAMILIES:  # each family's own template: its renderer, with tools or without
        for with_tools in (True, False):
            assert renderer_for_run(family, tokenizer(family), {}, explicit=True, model="m",
                                    with_tools=with_tools).family == family
    assert renderer_for_run("qwen3", tokenizer("qwen3"), {"enable_thinking": False}, explicit=True,
                            model="m").enable_thinking is False
    # A tokenizer without a chat template (synthetic_chat, for the compact renderer) has nothing to check against.
    assert renderer_for_run("compact", Tokenizer.synthetic_chat(), {}, explicit=True, model="m").family == "compact"
    # Qwen2-Instruct's template has no tool format: it fits qwen2 (with its default system message) without tools.
    qwen2 = with_template("qwen2", QWEN2_TEMPLATE)
    options = {"default_system": "You are a helpful assistant."}
    assert renderer_for_run("qwen2", qwen2, options, explicit=True, model="m", with_tools=False).family == "qwen2"
    with pytest.raises(ConfigError, match=r"the opening prompt: the ids differ first at position \d+ .*renderers "
                                          r"that fit it: none"):
        renderer_for_run("qwen2", qwen2, options, explicit=True, model="m", with_tools=True)


def test_a_renderer_that_does_not_fit_the_checkpoints_template_is_refused_in_one_line():
    instruct = with_template("qwen3", QWEN3_INSTRUCT_2507_TEMPLATE)
    with pytest.raises(ConfigError) as refused:
        renderer_for_run("qwen3", instruct, {}, explicit=True, model="model.architecture=qwen3 (tokenizer t)")
    message = str(refused.value)
    assert "\n" not in message and re.fullmatch(
        r"env.renderer='qwen3' does not render as the chat template of model.architecture=qwen3 \(tokenizer t\): "
        r"the history ending with a tool call: the ids differ first at position \d+ \(\d+ ids, the template's \d+\): "
        r"the renderer writes '<think>.*' where the template writes 'I add them.*'; renderers that fit it: "
        r"qwen3_instruct; set env.renderer to qwen3_instruct, or '' to choose it", message), message
    with pytest.raises(ConfigError, match=r"env.renderer='qwen3_instruct' does not render .* renderers that fit it: "
                                          r"qwen3;"):
        renderer_for_run("qwen3_instruct", tokenizer("qwen3"), {}, explicit=True, model="m")
    with pytest.raises(ConfigError, match=r"env.renderer='qwen3' does not render .*"
                                          r"renderers that fit it: qwen2; set env.renderer to qwen2"):
        renderer_for_run("qwen3", tokenizer("qwen2"), {}, explicit=True, model="m")
    # The architecture's family, when no family fits (ChatML without a default system message or tools): the
    # checkpoint's own template (tests/test_template_renderer.py); named explicitly, refused with that fix.
    chosen = renderer_for_run("qwen2", Tokenizer.byte_level(), {}, explicit=False, model="m")
    assert chosen.family == "template" and chosen.end_of_turn == ("<|im_end|>",)
    with pytest.raises(ConfigError, match=r"env.renderer='qwen2' does not render as the chat template of m: .*"
                                          r"renderers that fit it: none; set env.renderer to template"):
        renderer_for_run("qwen2", Tokenizer.byte_level(), {}, explicit=True, model="m")
    assert template_difference(make_renderer("qwen2", Tokenizer.byte_level())) is not None


# ---------------------------------------------------------------------------------------------------------------
# compact: grpo_jax's own format for tiny models; its render is the reference


def compact_tokenizer() -> Tokenizer:
    """The compact format's specials, and the words these tests' conversations use (synthetic_chat knows only the
    tiny environments' words)."""
    return Tokenizer.word_level(RENDERERS["compact"].special_tokens, "0123456789 \n?,.:;=()'\"-_{}[]/+",
                                ("add", "divide", "a", "b", "note", "You", "are", "careful", "calculator", "What",
                                 "is", "Use", "the", "tools", "I", "first", "Then", "Both", "at", "once", "Error",
                                 "raised", "ZeroDivisionError", "float", "division", "by", "zero", "quotient",
                                 "Go", "on", "cached"), eos_token="<|endoftext|>")


COMPACT = make_renderer("compact", compact_tokenizer())


def compact_play(opening, tools, script):
    """play() with the compact render as the template: after each step the ids so far are its render with the
    generation prompt; at the end, its render of the whole conversation."""
    tok = COMPACT.tokenizer
    ids = COMPACT.initial_ids(opening, tools)
    assert ids == tok.encode(COMPACT.render(opening, tool_schemas(tools), True))
    history = list(opening)
    for text, new_messages in script:
        sampled = tok.encode(text) + [COMPACT.end_of_turn_ids[0]]
        turn = COMPACT.parse(sampled)
        assert turn.finish == "stop" and turn.parse_error is None, turn
        ids += sampled
        history.append(turn.message)
        # the parsed turn renders as it was sampled
        assert COMPACT.render([turn.message], None, False) == "<|a|>" + text + "<|e|>"
        if new_messages is None:
            break
        appended = COMPACT.append_ids(history, new_messages, tools)
        assert not isinstance(appended, CannotExtend)
        ids += appended
        history += new_messages
        assert ids == tok.encode(COMPACT.render(history, tool_schemas(tools), True))
    assert ids == tok.encode(COMPACT.render(history, tool_schemas(tools), False))
    return ids


def test_compact_renders_roles_tools_and_calls_in_a_few_tokens():
    ids = compact_play(OPENING, TOOLS, [
        ("I add first.<|c|>add a=2 b=3", [tool_message("add", "5.0")]),
        ("Then I divide.<|c|>divide a=5 b=4", [tool_message("divide", "1.25")]),
        ("(2 + 3) / 4 = 1.25", None)])
    assert COMPACT.tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|s|>You are a careful calculator.\nadd(a, b)\ndivide(a, b)<|e|><|u|>What is (2 + 3) / 4? Use the tools.<|e|>"
        "<|a|>I add first.<|c|>add a=2 b=3<|e|><|t|>5.0<|e|><|a|>Then I divide.<|c|>divide a=5 b=4<|e|>"
        "<|t|>1.25<|e|><|a|>(2 + 3) / 4 = 1.25<|e|>")
    assert COMPACT.stop_ids == (COMPACT.tokenizer.token_to_id("<|e|>"), COMPACT.tokenizer.token_to_id("<|endoftext|>"))
    # Without a system message the tools have a system turn of their own; without either, there is none.
    question = OPENING[1:]
    assert COMPACT.render(question, tool_schemas(TOOLS[:1]), True) == (
        "<|s|>add(a, b)<|e|><|u|>What is (2 + 3) / 4? Use the tools.<|e|><|a|>")
    assert COMPACT.render(question, None, True) == "<|u|>What is (2 + 3) / 4? Use the tools.<|e|><|a|>"


def test_compact_several_calls_in_one_turn_a_tool_error_and_a_user_message_extend():
    compact_play(OPENING, TOOLS, [
        ("Both at once.<|c|>add a=2 b=3<|c|>divide a=5 b=0<|c|>add a=-1.5 b=0.001",
         [tool_message("add", "5.0"), tool_message("divide", ZERO_DIVISION), tool_message("add", "-1.499"),
          {"role": "user", "content": "Go on."}]),
        ("<|c|>divide a=5 b=4", [tool_message("divide", '{"quotient": 1.25}')]),
        ("1.25", None)])


def optional_note(a: float, note: str = "") -> float:
    """A tool with an optional argument.

    Args:
        a: A number.
        note: Anything.
    """
    return a


def test_compact_lists_optional_arguments_and_writes_a_value_bare_only_when_it_reads_back_as_itself():
    assert COMPACT.render(OPENING[1:], tool_schemas([Tool.from_function(optional_note)]), False) == (
        "<|s|>optional_note(a, note?)<|e|><|u|>What is (2 + 3) / 4? Use the tools.<|e|>")
    arguments = {"a": 52, "b": "52", "note": "word", "x": "a b", "y": [1, "2"], "z": {"k": None}, "t": True,
                 "f": -0.5, "s": "05", "n": "null", "e": ""}
    message = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}
    text = COMPACT.render([message], None, False).removeprefix("<|a|>").removesuffix("<|e|>")
    assert text == ('<|c|>f a=52 b="52" note=word x="a b" y=[1, "2"] z={"k": null} t=true f=-0.5 s=05 n="null" '
                    'e=""')
    turn = COMPACT.parse_text(text, "stop")
    assert (turn.tool_calls[0].arguments, turn.parse_error) == (arguments, None)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.sampled_from(list("abz09 _.-=\"'\\\n\té世{}[]")), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["k", "v"]), inner, max_size=2),
    max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(content=st.text(st.sampled_from(list("ab 09.\n")), max_size=6),
       calls=st.lists(st.tuples(st.sampled_from(["add", "f_2", "x"]),
                                st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,3}", fullmatch=True), JSON_VALUES,
                                                max_size=3)), max_size=3))
def test_compact_parse_reads_back_any_turn_it_renders(content, calls):
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls]}
    text = COMPACT.render([message], None, False).removeprefix("<|a|>").removesuffix("<|e|>")
    turn = COMPACT.parse_text(text, "stop")
    assert turn.parse_error is None, (text, turn.parse_error)
    assert (turn.content, [(c.name, c.arguments) for c in turn.tool_calls]) == (content, calls)


def test_compact_malformed_calls_are_parse_errors_with_the_good_calls_kept():
    cases = {
        "<|c|>add()": "tool call 1: expected `name k=v ...` after <|c|>, got 'add()'",
        "<|c|>": "tool call 1: expected `name k=v ...` after <|c|>, got ''",
        "<|c|>add a=": "tool call 1: argument a has no value after '='",
        '<|c|>add a="1': "tool call 1: argument a: not JSON (Unterminated string",
        "<|c|>add a=1 a=2": "tool call 1: argument a given twice",
        '<|c|>add a="1"b': "tool call 1: argument a: a space must follow its value",
        "<|c|>add a = 1": "tool call 1: expected ` k=v` at ' a = 1'",
        "<|c|>add a=1<|c|>divide b=[1,": "tool call 2: argument b: not JSON (Expecting value",
    }
    for text, error in cases.items():
        turn = COMPACT.parse(COMPACT.tokenizer.encode(text) + list(COMPACT.end_of_turn_ids))
        assert turn.parse_error is not None and turn.parse_error.startswith(error), (text, turn.parse_error)
        assert [c.name for c in turn.tool_calls] == (["add"] if text.startswith("<|c|>add a=1<|c|>") else [])
    turn = COMPACT.parse(COMPACT.tokenizer.encode("I add.<|c|>add a=1") + [COMPACT.end_of_text_ids[0]])
    assert (turn.content, turn.tool_calls[0].arguments, turn.finish) == ("I add.", {"a": 1}, "eos")
    assert COMPACT.parse(COMPACT.tokenizer.encode("1.25")).finish == "length"


def test_a_run_with_a_renderer_that_does_not_fit_stops_before_any_engine_is_built():
    """make_episode_runner (the trainer's start of a multi-turn run) refuses in one line before it builds the
    continuation engine: the stand-in model has no weights to build one with."""
    from types import SimpleNamespace

    from grpo_jax.envs.environment import EnvConfig
    from grpo_jax.rollout.episodes import make_episode_runner
    from grpo_jax.rollout.sampler import SamplerConfig

    model = SimpleNamespace(config=SimpleNamespace(architecture="qwen3"))
    instruct = with_template("qwen3", QWEN3_INSTRUCT_2507_TEMPLATE)
    with pytest.raises(ConfigError, match=r"^env.renderer='qwen3' does not render as the chat template of "
                                          r"model.architecture=qwen3 \(tokenizer qwen3-like with another template\): "
                                          r".*renderers that fit it: qwen3_instruct;") as refused:
        make_episode_runner(EnvConfig(name="fetch_code", renderer="qwen3"), SamplerConfig(), model, instruct, rows=2)
    assert "\n" not in str(refused.value)
