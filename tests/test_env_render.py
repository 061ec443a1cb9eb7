"""Renderers against the models' own chat templates (Qwen2.5, Qwen3, Llama 3.1, Gemma 3): the opening prompt,
the sampled turns and the ids appended after each environment step concatenate to the ids of the template's
render of the whole conversation, with one tool call, several in one turn, a tool error, and random
conversations; Qwen3's template, which drops earlier reasoning, cannot be extended there; parsing never raises.
The compact family (grpo_jax's own format, no model's template) is checked against its own render: the same
concatenation, parse and render round trips, its parse errors.

Tokenizers are trained locally (test_tokenizer.train_byte_level_bpe: a merging byte-level BPE) with each
family's special tokens, and Qwen's tag words as added tokens that are not special, as in Qwen's vocabulary."""

import functools
import json

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from chat_templates import LLAMA31_TEMPLATE, QWEN3_TEMPLATE, QWEN25_TEMPLATE
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.render import RENDERERS, CannotExtend, make_renderer, tool_schemas
from grpo_jax.envs.tools import Tool
from grpo_jax.errors import ConfigError
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


def template_render(renderer, messages, tools, add_generation_prompt=True) -> str:
    """The conversation as the family's own chat template renders it (Gemma 3's has no tool format: it gets the
    conversation in grpo_jax's, from template_messages)."""
    schemas = tool_schemas(tools)
    kwargs = {}
    if renderer.family == "gemma3":
        messages, schemas = renderer.template_messages(messages, schemas), None
    if renderer.family == "qwen3" and not renderer.enable_thinking:
        kwargs["enable_thinking"] = False
    return renderer.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tools=schemas, **kwargs)


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
    if family == "gemma3":
        history, schemas = renderer.template_messages(history, schemas), None
    assert hf.apply_chat_template(history, tools=schemas, tokenize=False, add_generation_prompt=True) == \
        renderer.tokenizer.apply_chat_template(history, tools=schemas)


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


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_malformed_tool_calls_are_parse_errors_with_the_good_calls_kept(family):
    renderer = make_renderer(family, tokenizer(family))
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    cases = {
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}}\n</tool_call>": "tool call 1: invalid JSON",
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
        "tool call: invalid JSON")
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
    with pytest.raises(ConfigError, match=r"renderer 'mistral': allowed qwen2, qwen3, llama3, gemma3"):
        make_renderer("mistral", tokenizer("qwen2"))
    with pytest.raises(ConfigError, match="renderer 'qwen3'.*unexpected keyword argument 'thinking'"):
        make_renderer("qwen3", tokenizer("qwen3"), thinking=False)
    inner = train_byte_level_bpe(["<|endoftext|>", "<|im_start|>"])
    inner.add_special_tokens([AddedToken("<|im_end|>", special=True, rstrip=True)])  # eats the "\n" after it
    with pytest.raises(ConfigError, match=r"does not split '\\nx' from <\|im_end\|>"):
        make_renderer("qwen2", Tokenizer(inner))
    assert set(RENDERERS) == {*FAMILIES, "compact"}  # compact has no model's template to compare with (below)


def test_environment_messages_must_be_user_or_tool_and_the_history_must_end_with_the_turn():
    renderer = make_renderer("qwen2", tokenizer("qwen2"))
    history = OPENING + [{"role": "assistant", "content": "Hi"}]
    with pytest.raises(ValueError, match=r"new_messages\[0\]: role='assistant': allowed user, tool"):
        renderer.append_ids(history, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"new_messages\[0\]: content must be a str, got int"):
        renderer.append_ids(history, [{"role": "tool", "content": 5}])
    with pytest.raises(ValueError, match="history must end with the assistant turn"):
        renderer.append_ids(OPENING, [{"role": "user", "content": "x"}])


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
        '<|c|>add a="1': "tool call 1: argument a: invalid JSON",
        "<|c|>add a=1 a=2": "tool call 1: argument a given twice",
        '<|c|>add a="1"b': "tool call 1: argument a: a space must follow its value",
        "<|c|>add a = 1": "tool call 1: expected ` k=v` at ' a = 1'",
        "<|c|>add a=1<|c|>divide b=[1,": "tool call 2: argument b: invalid JSON",
    }
    for text, error in cases.items():
        turn = COMPACT.parse(COMPACT.tokenizer.encode(text) + list(COMPACT.end_of_turn_ids))
        assert turn.parse_error is not None and turn.parse_error.startswith(error), (text, turn.parse_error)
        assert [c.name for c in turn.tool_calls] == (["add"] if text.startswith("<|c|>add a=1<|c|>") else [])
    turn = COMPACT.parse(COMPACT.tokenizer.encode("I add.<|c|>add a=1") + [COMPACT.end_of_text_ids[0]])
    assert (turn.content, turn.tool_calls[0].arguments, turn.finish) == ("I add.", {"a": 1}, "eos")
    assert COMPACT.parse(COMPACT.tokenizer.encode("1.25")).finish == "length"
