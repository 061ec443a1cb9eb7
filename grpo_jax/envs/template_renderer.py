"""The template renderer: any checkpoint's own chat template (its Jinja, as the tokenizer ships it) as a Renderer,
for models no family renderer covers (Mistral, Phi, DeepSeek-R1 distills, SmolLM2's ChatML with its own default
system message, a fine-tune's template).

What a family renderer writes in Python, this one learns from the template on probe conversations when it is made:

- The end of an assistant turn: the first special token the template writes after an assistant message's text is
  the end-of-turn token the model samples (SmolLM2: <|im_end|>, Llama: <|eot_id|>, Mistral: </s>); the text it
  writes after that token before the next message, up to a special token, is the glue the model does not sample
  ("\\n" in ChatML). The tokenizer's other stop ids end the conversation. A template that writes no special token
  after a turn is refused: the model could not end a turn.
- Tools: `tool_format` template (the template writes the schemas, the calls of an assistant message and the
  results of `tool` messages itself, as Qwen's, Llama 3.1's and Hermes-style templates do) or folded (grpo_jax's
  form for a template without tools, as the gemma3 renderer's: Qwen's tool instructions in the system message,
  calls as <tool_call> blocks in the assistant's text, each run of tool results and user messages one user message
  of <tool_response> blocks). auto: template where a probe finds the template writing all three, else folded.
- Tool calls read back with a parser (`tool_parser`): hermes (Qwen's and Hermes' <tool_call>{json}</tool_call>),
  llama_json (one {"name", "parameters"} object alone in the turn, after <|python_tag|> or not), mistral
  ([TOOL_CALLS] then a JSON list of {"name", "arguments"}, or name[ARGS]{json} per call), none. auto: the one that
  reads back the call the template itself writes on a probe; an explicit parser that does not is refused, in one
  line naming what the template wrote.
- Every other option is a variable of the template (enable_thinking, ...).

The extension property is tested on the text the model sampled, not on a re-render of its turn: after an
environment step the history's render (the turns before the last with the generation prompt, the sampled text,
the end-of-turn token and the glue: what the ids held decode to) must be a prefix of the template's render of the
longer conversation, and the ids appended are those of the rest (they start after an end-of-turn special token,
where the tokenizer splits anyway). Where the template writes the sampled turn otherwise (it drops reasoning,
re-spaces a call's JSON, writes a turn unlike its own generation prompt), the trajectory starts a new segment
(CannotExtend), as with a family renderer.

A turn's text keeps its reasoning in the history message's content (the template decides what to keep of it);
AssistantTurn.reasoning and .content split it at </think> for the reader.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.render import (
    AssistantTurn,
    Renderer,
    calls_turn,
    folded_messages,
    json_call_turn,
    message_calls,
    read_call,
    tagged_turn,
)
from grpo_jax.envs.tools import ToolCall
from grpo_jax.errors import ConfigError
from grpo_jax.json_text import JSONTextError, loads_prefix

logger = logging.getLogger("grpo_jax.envs.template_renderer")

TOOL_FORMATS = ("auto", "template", "folded")
TOOL_PARSERS = ("auto", "hermes", "llama_json", "mistral", "none")
_MARK = "GRPOJAXPROBE"  # an assistant message's text on the probes: found where the template writes it
_PROBE_TOOL = {"type": "function", "function": {
    "name": "add_numbers", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
_PROBE_CALL = ToolCall(name="add_numbers", arguments={"a": 2, "b": 3})
_PROBE_RESULT = "GRPOJAXRESULT"


def mistral_turn(text: str, finish: str) -> AssistantTurn:
    """Mistral's calls: the content, then [TOOL_CALLS] and a JSON list of {"name", "arguments"} objects (or one
    object), or, in the newer form, [TOOL_CALLS]name[ARGS]{json} for each call."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return plain_turn(text, finish)
    content, calls, errors = text[:start], [], []
    bodies = text[start:].split("[TOOL_CALLS]")[1:]
    for number, body in enumerate(bodies, start=1):
        where, stripped = f"tool call {number}", body.strip()
        if stripped[:1] in ("[", "{"):  # a JSON list of calls (or one call)
            try:
                value, end = loads_prefix(stripped)
            except JSONTextError as e:
                errors.append(f"{where}: {e}")
                continue
            if stripped[end:].strip():
                errors.append(f"{where}: text after the calls' JSON: {stripped[end:].strip()[:80]!r}")
            bodies_of_calls = [json.dumps(item, ensure_ascii=False) for item in
                               (value if isinstance(value, list) else [value])]
        elif "[ARGS]" in body:  # name[ARGS]{json}, the name perhaps followed by [CALL_ID]id
            name, arguments = body.split("[ARGS]", 1)
            bodies_of_calls = ['{"name": ' + json.dumps(name.split("[CALL_ID]")[0].strip()) + ', "arguments": '
                               + arguments.strip() + "}"]
        else:
            errors.append(f"{where}: expected a JSON list of calls or name[ARGS]{{...}} after [TOOL_CALLS], got "
                          f"{stripped[:80]!r}")
            continue
        for call_body in bodies_of_calls:
            call, error = read_call(call_body, ("arguments", "parameters"), where)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
    return calls_turn(text, content, calls, "; ".join(errors) or None, finish)


def plain_turn(text: str, finish: str) -> AssistantTurn:
    return AssistantTurn(text=text, content=text, finish=finish, message={"role": "assistant", "content": text})


TURN_PARSERS = {"hermes": tagged_turn, "llama_json": json_call_turn, "mistral": mistral_turn, "none": plain_turn}


def _with_reasoning(turn: AssistantTurn) -> AssistantTurn:
    """The turn with its reasoning (the text before </think>) read out for the reader; the history message keeps
    the whole text, for the template to write as it does."""
    if "</think>" not in turn.content:
        return turn
    reasoning = turn.content.split("</think>")[0].split("<think>")[-1].strip("\n")
    return AssistantTurn(text=turn.text, content=turn.content.split("</think>")[-1].lstrip("\n"),
                         tool_calls=turn.tool_calls, parse_error=turn.parse_error, reasoning=reasoning,
                         finish=turn.finish, message=turn.message)


def _with_string_arguments(message: dict) -> dict:
    """The message with each tool call's arguments as a JSON string, for templates that write them as they are."""
    if not message.get("tool_calls"):
        return message
    def as_string(call):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("arguments"), dict)):
            return call  # (already a string, or a shape the template is left to judge)
        return {**call, "function": {**function, "arguments": json.dumps(function["arguments"], ensure_ascii=False)}}

    calls = [as_string(call) for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _system_into_first_user(messages: list[dict]) -> list[dict]:
    """The system message's text joined before the first user message's, for a template that refuses a system
    role (as Gemma's own templates fold it)."""
    system, rest = messages[0]["content"], list(messages[1:])
    first = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": system}, *rest]
    rest[first] = {**rest[first], "content": system + "\n\n" + rest[first]["content"]}
    return rest


class TemplateRenderer(Renderer):
    """A checkpoint's own chat template as a Renderer (module docstring)."""

    family = "template"

    def __init__(self, tokenizer: Tokenizer, *, tool_format: str = "auto", tool_parser: str = "auto", **variables):
        """tool_format: TOOL_FORMATS; tool_parser: TOOL_PARSERS; variables: the template's own variables."""
        if tokenizer.chat_template is None:
            raise ConfigError(f"renderer 'template': tokenizer {tokenizer.source} has no chat template (a "
                              "chat_template.jinja beside its tokenizer.json, or tokenizer_config.json's "
                              "chat_template); name a family renderer instead")
        for key, value, allowed in (("tool_format", tool_format, TOOL_FORMATS),
                                    ("tool_parser", tool_parser, TOOL_PARSERS)):
            if value not in allowed:
                raise ConfigError(f"renderer 'template': {key}={value!r}: allowed {', '.join(allowed)}")
        self.tokenizer, self.variables = tokenizer, dict(variables)
        self.folded = self.string_arguments = self.system_folded = False
        self.end_of_turn, self.glue = self._turn_end()
        eot_id = tokenizer.token_to_id(self.end_of_turn[0])
        self.end_of_text = tuple(dict.fromkeys(tokenizer.decode([i], skip_special_tokens=False)
                                               for i in tokenizer.eos_ids if i != eot_id))
        self.special_tokens = self.end_of_turn + self.end_of_text
        super().__init__(tokenizer)
        self.system_folded = self._refuses_system()
        self.folded, self.tool_parser = self._tool_form(tool_format, tool_parser)
        self._parse = TURN_PARSERS[self.tool_parser]
        self.extends = self._extends()

    def __repr__(self):
        return (f"TemplateRenderer(tool_format={'folded' if self.folded else 'template'}, "
                f"tool_parser={self.tool_parser}, end_of_turn={self.end_of_turn[0]!r}, glue={self.glue!r}, "
                f"extends={self.extends})")

    # ---- what the probes learn ---------------------------------------------------------------------------

    def _template(self, messages, tools=None, add_generation_prompt=False) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                      tools=tools, **self.variables)
        except ValueError as e:
            raise ConfigError(f"renderer 'template': the chat template of {self.tokenizer.source} fails on a probe "
                              f"conversation ({' '.join(str(e).split())[:200]})") from e

    def _turn_end(self) -> tuple[tuple[str], str]:
        """(end-of-turn token,), glue: from the renders of a turn that ends the conversation and of one a user
        message follows."""
        user = {"role": "user", "content": "Hello."}
        turn = {"role": "assistant", "content": _MARK}
        last = self._template([user, turn])
        followed = self._template([user, turn, {"role": "user", "content": "Go on."}])
        if _MARK not in last:
            raise ConfigError(f"renderer 'template': the chat template of {self.tokenizer.source} does not write an "
                              "assistant message's content")
        tail, next_tail = last.split(_MARK, 1)[1], followed.split(_MARK, 1)[1]
        specials = self.tokenizer.special_tokens

        def first_special(text: str, start: int = 0) -> tuple[int, str | None]:
            found = [(text.find(s, start), s) for s in specials if text.find(s, start) >= 0]
            return min(found, key=lambda f: (f[0], -len(f[1]))) if found else (len(text), None)

        at, token = first_special(next_tail)
        if token is None or next_tail[:at].strip():
            raise ConfigError(f"renderer 'template': the chat template of {self.tokenizer.source} writes no special "
                              f"token right after an assistant turn (it writes {next_tail[:40]!r}), so a sampled turn "
                              "cannot end; name a family renderer, or give the checkpoint a template that ends turns "
                              "with one")
        after, after_last = next_tail[at + len(token):], tail.split(token, 1)[1] if token in tail else ""
        glue = after[:first_special(after)[0]]
        common = 0
        while common < min(len(glue), len(after_last)) and glue[common] == after_last[common]:
            common += 1
        # The glue is what the template writes after the token both when the conversation ends there and when it
        # goes on (ChatML's "\n"); what it writes only before a next message belongs to that message.
        return (token,), glue[:common]

    def _extends(self) -> bool:
        """Whether a turn sampled after the generation prompt is written as the template writes an earlier turn,
        so that environment steps extend the sequence (a thinking template that opens <think> in its generation
        prompt and drops earlier reasoning does not: each step then starts a new segment)."""
        user = [{"role": "user", "content": "Hello."}]
        sampled = self.render(user, None, add_generation_prompt=True) + _MARK + self.end_of_turn[0] + self.glue
        followed = self.render([*user, {"role": "assistant", "content": _MARK}, {"role": "user", "content": "Go on."}],
                               None, add_generation_prompt=True)
        extends = followed.startswith(sampled)
        if not extends:
            logger.info("the chat template of %s writes an earlier assistant turn unlike the text sampled after its "
                        "generation prompt: every environment step starts a new segment", self.tokenizer.source)
        return extends

    def _refuses_system(self) -> bool:
        """Whether the template refuses a system message (Gemma's), whose text then joins the first user message."""
        try:
            self._template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}])
            return False
        except ConfigError:
            return True

    def _template_tool_gaps(self) -> list[str]:
        """What of a tool conversation the template does not write itself (schemas, an assistant's calls, a tool
        message's result); sets string_arguments where it writes calls only with their arguments as a JSON
        string (OpenAI's message format)."""
        user = [{"role": "user", "content": "Hello."}]
        result = {"role": "tool", "name": _PROBE_CALL.name, "content": _PROBE_RESULT}
        gaps = []
        try:
            if self._template(user, [_PROBE_TOOL]) == self._template(user):
                gaps.append("the tools' schemas")
        except ConfigError as e:
            return [f"the tools' schemas ({e})"]
        for string_arguments in (False, True):
            self.string_arguments = string_arguments
            call = self.template_conversation([{"role": "assistant", "content": "",
                                                "tool_calls": message_calls([_PROBE_CALL])}], None)[0][0]
            try:
                if _PROBE_CALL.name in self._template([*user, call], [_PROBE_TOOL]):
                    break
            except ConfigError:
                pass
        else:
            self.string_arguments = False
            return [*gaps, "an assistant message's tool calls"]
        try:
            if _PROBE_RESULT not in self._template([*user, call, result], [_PROBE_TOOL]):
                gaps.append("a tool message's result")
        except ConfigError as e:
            gaps.append(f"a tool message's result ({e})")
        return gaps

    def _probe_call_text(self) -> str:
        """The text of a tool call as the template writes it in an assistant turn."""
        user = [{"role": "user", "content": "Hello."}]
        prompt = self.render(user, [_PROBE_TOOL], add_generation_prompt=True)
        turn = self.render([*user, {"role": "assistant", "content": "", "tool_calls": message_calls([_PROBE_CALL])}],
                           [_PROBE_TOOL], add_generation_prompt=False)
        written = turn[len(prompt):] if turn.startswith(prompt) else turn
        return written.split(self.end_of_turn[0])[0]

    def _tool_form(self, tool_format: str, tool_parser: str) -> tuple[bool, str]:
        """(folded, parser): the template's own tool format where it writes every part and a parser reads back
        its call, else the folded form with hermes (module docstring); an explicit choice that cannot hold is
        refused in one line."""
        gaps = [] if tool_format == "folded" else self._template_tool_gaps()
        if not gaps:
            written = self._probe_call_text()

            def reads_back(name: str) -> bool:
                turn = TURN_PARSERS[name](written, "stop")
                return turn.parse_error is None and turn.tool_calls == (_PROBE_CALL,)

            candidates = ("hermes", "llama_json", "mistral") if tool_parser == "auto" else (tool_parser,)
            parser = next((name for name in candidates if reads_back(name)), None)
            if parser is not None:
                return False, parser
            if tool_parser != "auto":
                raise ConfigError(f"renderer 'template': tool_parser={tool_parser!r} does not read back the tool "
                                  f"call the chat template of {self.tokenizer.source} writes ({written[:120]!r}); use "
                                  "auto, or tool_format: folded")
            gaps = [f"a tool call that a parser reads back (it writes {written[:120]!r})"]
        if tool_format == "template":
            raise ConfigError(f"renderer 'template': tool_format='template', but the chat template of "
                              f"{self.tokenizer.source} does not write {'; '.join(gaps)}; use tool_format: folded "
                              "(or auto)")
        if tool_parser not in ("auto", "hermes"):
            raise ConfigError(f"renderer 'template': tool_parser={tool_parser!r}, but the tools are folded into the "
                              "conversation in Qwen's <tool_call> format (the template does not write "
                              f"{'; '.join(gaps)}): use hermes or auto")
        self.string_arguments = False  # (the folded form writes either)
        return True, "hermes"

    # ---- Renderer -------------------------------------------------------------------------------------------

    @property
    def template_variables(self) -> dict:
        return dict(self.variables)

    def template_conversation(self, messages, tools):
        if self.folded:
            messages, tools = folded_messages(messages, tools), None
        if self.string_arguments:
            messages = [_with_string_arguments(m) for m in messages]
        if self.system_folded and messages and messages[0]["role"] == "system":
            messages = _system_into_first_user(messages)
        return list(messages), tools

    def render(self, messages: Sequence[dict], tools, add_generation_prompt):
        messages, tools = self.template_conversation(messages, tools)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tools=tools, **self.variables)

    def render_as_sampled(self, history, tools, sampled: str | None = None):
        if sampled is None:
            return super().render_as_sampled(history, tools)
        return (self.render(history[:-1], tools, add_generation_prompt=True) + sampled + self.end_of_turn[0]
                + self.glue)

    def parse_text(self, text, finish):
        return _with_reasoning(self._parse(text, finish))
