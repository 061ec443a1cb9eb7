"""Renderers: a conversation's token ids for one model family, as the family's chat template writes them.

Token-in/token-out: the ids the sampler produced are the ids the learner trains, never decoded and encoded
again. The environment speaks messages; turning its messages into ids is the renderer's job:

- `initial_ids(messages, tools)`: the opening prompt, tool schemas included, ending with the generation prompt.
- `parse(assistant_ids)`: the sampled turn as an AssistantTurn (content, tool calls, reasoning, and the turn
  as a chat message for the history). It never raises, whatever the ids: a malformed tool call is `parse_error`.
  Every JSON read of sampled text goes through grpo_jax.json_text (at most json_text.MAX_DEPTH deep, no integer
  past Python's digit limit, no NaN, Infinity or 1e999), so what a call holds can be walked, checked and echoed.
- `append_ids(history, new_messages, tools)`: the ids that follow the sampled turn: the end-of-turn glue the
  model did not sample (the "\\n" after Qwen's <|im_end|>), the environment's messages as the template writes
  them (several tool results in a row included), and the next generation prompt. Or CannotExtend when the
  template renders the history differently once the new messages follow (Qwen3 drops the reasoning of turns
  before the last user message): that is not faked; the trajectory starts a new segment there (prime-rl's way).
- `stop_ids`: the ids that end an assistant turn (`end_of_turn_ids`, after which the conversation can go on, and
  the end-of-text ids, after which it cannot).

How: each family's `render` is its chat template written in Python; the tests render the same conversations
with the real templates (Tokenizer.apply_chat_template, tools included) and require the same ids.
`template_conversation` and `template_variables` give the conversation and the variables as the model's own
template takes them, and a run's renderer is checked against the checkpoint's template on a probe conversation
(`renderer_for_run`, `template_difference`): env.renderer='' takes the family renderer that fits it, else the
`template` renderer (grpo_jax.envs.template_renderer: the checkpoint's own Jinja template, what it needs learned
from probes); an explicit one that does not fit is refused in one line naming where the ids differ.

Text from outside is text: initial_ids and append_ids guard every message's strings and the tool schemas
(Tokenizer.guard), so a special token's spelling in them (a tool result spelling `<|im_end|>`) is encoded as text
and only the template's own structural tokens are special; where nothing spells one, the ids are the whole
render's, as transformers encodes it.

`append_ids` renders the history without and with the new messages and returns the ids of the difference when
the first render is a prefix of the second. The difference starts right after an end-of-turn special token,
where the tokenizer splits the text anyway, so its ids are those the whole render has there (checked on a
probe when the renderer is made: a tokenizer whose end-of-turn token swallows the text after it is refused).

Families (`RENDERERS`):
- qwen2: Qwen2.5's template (Qwen2's, with `default_system="You are a helpful assistant."`): tools listed in
  the system message, calls as <tool_call>{"name", "arguments"}</tool_call> in the assistant turn (arguments
  given as a JSON string written through tojson, quoted, as the template writes them), results as
  <tool_response> blocks in one user turn.
- qwen3: Qwen3's template: the same tool format, and <think> reasoning that the template keeps only for the
  turns after the last user message: a user message from the environment after reasoning cannot extend; with
  `enable_thinking=False` (the generation prompt closes an empty <think> block, which the template drops from
  earlier turns) no turn extends. Arguments given as a JSON string are written as they are.
- qwen3_instruct: Qwen3-Instruct-2507's template: Qwen3's without <think> handling (a turn's text is written and
  read as it is, the generation prompt opens no block), so every step extends.
- llama3: Llama 3.1's template (its custom tools): tools as JSON in the first user message (or the system
  message, `tools_in_user_message=False`), one call per turn as {"name", "parameters"} JSON alone in the turn
  (after <|python_tag|> or not), results in `ipython` turns as JSON strings (the template writes a string
  result through tojson). A turn of several calls is a parse_error: the template renders one call per turn.
  Built-in tools (brave_search, wolfram_alpha, code_interpreter) are not rendered.
- gemma3: Gemma 3's template has no tool format, so this one is grpo_jax's: the system message followed by
  Qwen's tool instructions folded into the first user turn (as the template folds a system message), calls
  as Qwen's <tool_call> blocks in the model turn, and the environment's messages of one step merged into one
  user turn (the template needs user and model turns to alternate): each tool result as a <tool_response>
  block, each user message as it is, joined by "\\n". `folded_messages` gives the conversation in that form,
  as Gemma's own template takes it. Arguments given as a JSON string are written as they are (Qwen3's rule).
- compact: grpo_jax's own short format, for tiny models trained from scratch with the word-level tokenizer
  `synthetic_chat` (Tokenizer.synthetic_chat), where a whole tool call is a few tokens. Each message is its role
  token, its content and <|e|>: <|s|> system, <|u|> user, <|a|> assistant, <|t|> tool (the result only; results
  follow in call order). The tools are listed in a system turn, one `name(arg, opt?)` line each after the system
  message's content ("?": optional; no schemas), the turn written when there are tools or a system message. A
  call is `<|c|>name k=v k=v` in the assistant turn, after its content: a value is written bare when it reads
  back as itself (a number, true/false/null, a string of letters, digits and `_.-` that is not JSON, e.g.
  `word` or `05`), else as JSON (`"52"`, `"a b"`, `[1, 2]`); `k=52` is the number. Generation prompt <|a|>;
  nothing after <|e|> (glue ""); <|endoftext|> ends the conversation. Every step extends.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import re
import weakref
from collections.abc import Sequence

from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.envs.tools import Tool, ToolCall
from grpo_jax.errors import ConfigError
from grpo_jax.json_text import JSONTextError, loads, loads_prefix

logger = logging.getLogger("grpo_jax.envs.render")

ENVIRONMENT_ROLES = ("user", "tool")  # what an environment step may say
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA31_DATE = "26 Jul 2024"  # Llama 3.1's template's date when none is given

# Qwen's tool instructions (Qwen2.5 and Qwen3 write the same words; Gemma 3 gets them too).
_QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_LLAMA_TOOLS_FORMAT = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                       'its value}.Do not use variables.\n\n')
_LLAMA_SYSTEM_TOOLS = ("You have access to the following functions. To call a function, please respond with JSON for "
                       "a function call." + _LLAMA_TOOLS_FORMAT)
_LLAMA_USER_TOOLS = ("Given the following functions, please respond with a JSON for a function call with its proper "
                     "arguments that best answers the given prompt.\n\n" + _LLAMA_TOOLS_FORMAT)


def _tojson(value, indent: int | None = None) -> str:
    # The templates' tojson (grpo_jax.data.tokenizer, as transformers'): not ASCII-escaped, Python's separators.
    return json.dumps(value, ensure_ascii=False, indent=indent)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssistantTurn:
    """One sampled assistant turn, parsed. `message` is the turn as a chat message for the history (the form
    the family's template takes: content, tool_calls, reasoning_content)."""

    text: str  # the sampled text, its stop token left out
    content: str  # the text for the reader: before the tool calls, after the reasoning
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str | None = None  # why a tool call could not be read (the calls that could are in tool_calls)
    reasoning: str | None = None  # the <think> block's text (qwen3); None when the turn has none
    # "stop": ended with an end-of-turn token (the conversation can go on); "eos": with the end-of-text token (the
    # model ended the conversation); "length": with no stop token (cut off by the token limit)
    finish: str
    message: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class CannotExtend:
    """append_ids' answer when the template renders the history differently once the new messages follow: the
    ids so far are not a prefix of the template's render, so the trajectory starts a new segment."""

    reason: str


def tool_schemas(tools: Sequence[Tool | dict] | None) -> list[dict] | None:
    """Tools as chat templates take them: their schemas, or None for none (an empty list included)."""
    if not tools:
        return None
    return [t.schema if isinstance(t, Tool) else t for t in tools]


def check_messages(messages: Sequence[dict], where: str, roles: Sequence[str] | None = None) -> None:
    """ValueError unless every message is a dict with a str role (one of `roles`, when given) and str content."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}[{i}]: a message is a dict {{'role': ..., 'content': ...}}, got "
                             f"{type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or (roles is not None and role not in roles):
            allowed = ", ".join(roles) if roles is not None else "a string"
            raise ValueError(f"{where}[{i}]: role={role!r}: allowed {allowed}")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}]: content must be a str, got {type(content).__name__}")


def _calls(message: dict) -> list[tuple[str, dict | str]]:
    """(name, arguments) of each tool call of a message; a call is {"function": {...}} or flat, as templates allow.
    ValueError for a call of another shape (a history from reset() may hold anything)."""
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), dict | str)):
            raise ValueError(f"a tool call is {{'function': {{'name': str, 'arguments': dict or JSON str}}}}, got "
                             f"{str(call)[:120]}")
        out.append((function["name"], function["arguments"]))
    return out


def message_calls(calls: Sequence[ToolCall]) -> list[dict]:
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _qwen_call_text(name: str, arguments, strings_as_they_are: bool) -> str:
    # Arguments given as a JSON string (the OpenAI message format): Qwen3's template writes the string as it is,
    # Qwen2.5's through tojson (a quoted JSON string) like any other value.
    as_is = strings_as_they_are and isinstance(arguments, str)
    arguments_text = arguments if as_is else _tojson(arguments)
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments_text + "}\n</tool_call>"


def _qwen_tools_text(tools: list[dict]) -> str:
    return _QWEN_TOOLS_HEAD + "".join("\n" + _tojson(t) for t in tools) + _QWEN_TOOLS_TAIL


def read_call(body: str, arguments_keys: tuple[str, ...], where: str) -> tuple[ToolCall | None, str | None]:
    """A call's JSON object {"name": str, <arguments key>: object} as a ToolCall, or why it is not one."""
    try:
        value = loads(body.strip())
    except JSONTextError as e:
        return None, f"{where}: {e}"
    shape = '{"name": ..., "' + arguments_keys[0] + '": {...}}'
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None, f"{where}: expected {shape}, got {body.strip()[:200]}"
    key = next((k for k in arguments_keys if k in value), None)
    arguments = value.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = loads(arguments)
        except JSONTextError:
            pass
    if not isinstance(arguments, dict):
        return None, f"{where}: the arguments of {value['name']} must be a JSON object, got {_tojson(arguments)[:200]}"
    return ToolCall(name=value["name"], arguments=arguments), None


def _parse_tagged_calls(text: str) -> tuple[str, list[ToolCall], str | None]:
    """Qwen's format: content, then <tool_call>\\n{json}\\n</tool_call> blocks. The content is the text before the
    first block, less the one newline the template writes between them; text after the last block is ignored."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, [], None
    content = text[:start].removesuffix("\n")
    calls, errors = [], []
    for number, chunk in enumerate(text[start:].split("<tool_call>")[1:], start=1):
        if "</tool_call>" not in chunk:
            errors.append(f"tool call {number}: no closing </tool_call>")
            continue
        call, error = read_call(chunk.split("</tool_call>")[0], ("arguments", "parameters"), f"tool call {number}")
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    return content, calls, "; ".join(errors) or None


class Renderer(abc.ABC):
    """A model family's chat format (module docstring). Subclasses give the family's tokens and `render` (its
    chat template in Python) and `parse_text`."""

    family: str
    special_tokens: tuple[str, ...]  # every special token the format writes
    end_of_turn: tuple[str, ...]  # tokens that end a turn the conversation goes on after; [0] is the template's
    end_of_text: tuple[str, ...]  # stop tokens after which the conversation cannot go on
    glue: str  # what the template writes after the end-of-turn token, which the model does not sample

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        missing = [t for t in self.special_tokens if tokenizer.token_to_id(t) is None]
        if missing:
            raise ConfigError(f"renderer {self.family!r}: tokenizer {tokenizer.source} has no {', '.join(missing)}: "
                              f"it is not a {self.family} tokenizer; use the renderer of the model's family "
                              f"({', '.join(RENDERERS)})")
        self.end_of_turn_ids = tuple(tokenizer.token_to_id(t) for t in self.end_of_turn)
        self.end_of_text_ids = tuple(tokenizer.token_to_id(t) for t in self.end_of_text)
        probe = self.glue + "x"
        if tokenizer.encode(self.end_of_turn[0] + probe) != [self.end_of_turn_ids[0], *tokenizer.encode(probe)]:
            raise ConfigError(f"renderer {self.family!r}: tokenizer {tokenizer.source} does not split {probe!r} from "
                              f"{self.end_of_turn[0]} (an added token that strips the text after it?), so the ids "
                              "after a turn cannot be encoded on their own")

    def __repr__(self):
        return repr(self.family)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.end_of_turn_ids + self.end_of_text_ids

    @property
    def thinks(self) -> bool:
        """Whether the model writes a reasoning block before each turn (what the probe's turns hold)."""
        return False

    @property
    def template_variables(self) -> dict:
        """The chat template's variables this renderer's options stand for (passed when rendering with it)."""
        return {}

    def template_conversation(self, messages: Sequence[dict], tools: list[dict] | None) -> tuple[list, list | None]:
        """The conversation and tool schemas as the model's own chat template takes them (what template_difference
        renders): as they are, unless the template has no tool format (gemma3)."""
        return list(messages), tools

    @abc.abstractmethod
    def render(self, messages: Sequence[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The conversation as the family's chat template renders it (tools: schemas, or None)."""

    def render_as_sampled(self, history: Sequence[dict], tools: list[dict] | None, sampled: str | None = None) -> str:
        """`history`, whose last turn the model sampled, as the ids it holds: the render of the turns before
        it with the generation prompt, then that turn. For most templates the render of the whole history.
        sampled: that turn's text as sampled (AssistantTurn.text), which a family renderer's parse and render give
        back, so it renders the turn from its message; the template renderer writes the text itself."""
        return self.render(history, tools, add_generation_prompt=False)

    @abc.abstractmethod
    def parse_text(self, text: str, finish: str) -> AssistantTurn:
        """A sampled turn's text (its stop token left out) as an AssistantTurn."""

    def initial_ids(self, messages: Sequence[dict], tools: Sequence[Tool | dict] | None = None) -> list[int]:
        """The ids of the opening conversation with the tools' schemas, ending with the generation prompt."""
        check_messages(messages, "messages")
        if not messages:
            raise ValueError("messages=[]: a conversation needs at least one message")
        # Every message's text and the schemas are text: a special token's spelling there is no special token.
        (messages, schemas), guard = self.tokenizer.guard((list(messages), tool_schemas(tools)))
        return self.tokenizer.encode_guarded(self.render(messages, schemas, add_generation_prompt=True), guard)

    def parse(self, assistant_ids: Sequence[int]) -> AssistantTurn:
        """The sampled ids of one assistant turn (ending with the stop id, when one was sampled) as an
        AssistantTurn."""
        ids = [int(i) for i in assistant_ids]
        finish = "length"
        if ids and ids[-1] in self.end_of_turn_ids:
            finish, ids = "stop", ids[:-1]
        elif ids and ids[-1] in self.end_of_text_ids:
            finish, ids = "eos", ids[:-1]
        return self.parse_text(self.tokenizer.decode(ids, skip_special_tokens=False), finish)

    def append_ids(self, history: Sequence[dict], new_messages: Sequence[dict],
                   tools: Sequence[Tool | dict] | None = None, sampled: str | None = None) -> list[int] | CannotExtend:
        """The ids that follow the last (sampled) assistant turn of `history` once the environment said
        `new_messages`: end-of-turn glue, the messages, the next generation prompt. CannotExtend when the
        template then renders the history differently. sampled: the last turn's text as sampled
        (render_as_sampled)."""
        check_messages(history, "history")
        check_messages(new_messages, "new_messages", ENVIRONMENT_ROLES)
        if not history or history[-1]["role"] != "assistant":
            raise ValueError("history must end with the assistant turn the new messages answer")
        # One guard for both renders: their placeholders are the same, so the prefix test holds as without them.
        (history, new_messages, schemas, sampled), guard = self.tokenizer.guard(
            (list(history), list(new_messages), tool_schemas(tools), sampled))
        restore = guard.restore if guard is not None else (lambda text: text)
        before = self.render_as_sampled(history, schemas, sampled)
        after = self.render([*history, *new_messages], schemas, add_generation_prompt=True)
        if not before.endswith(self.end_of_turn[0] + self.glue):
            raise ValueError(f"{self.family}: the history's render does not end with {self.end_of_turn[0]!r} + "
                             f"{self.glue!r}: {restore(before[-80:])!r}")
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(after))
            at = before.rfind("\n", 0, at) + 1  # from the start of the line that differs
            return CannotExtend(reason=f"{self.family}'s chat template renders the history differently once these "
                                       f"messages follow: from character {at}, {restore(before[at:at + 60])!r} "
                                       f"becomes {restore(after[at:at + 60])!r}")
        return self.tokenizer.encode_guarded(after[len(before) - len(self.glue):], guard)


class Qwen2Renderer(Renderer):
    """Qwen2.5's chat template (module docstring)."""

    family = "qwen2"
    special_tokens = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    end_of_turn = ("<|im_end|>",)
    end_of_text = ("<|endoftext|>",)
    glue = "\n"

    def __init__(self, tokenizer: Tokenizer, *, default_system: str = QWEN25_DEFAULT_SYSTEM):
        """default_system: the system message the template writes when the conversation has none (Qwen2.5's;
        Qwen2's is "You are a helpful assistant.")."""
        super().__init__(tokenizer)
        self.default_system = default_system

    def render(self, messages, tools, add_generation_prompt):
        has_system = bool(messages) and messages[0]["role"] == "system"
        system = messages[0]["content"] if has_system else self.default_system
        out = ["<|im_start|>system\n" + system]
        if tools:
            out.append("\n\n" + _qwen_tools_text(tools))
        out.append("<|im_end|>\n")
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            calls = _calls(message)
            if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not calls):
                out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            elif role == "assistant":
                out.append("<|im_start|>assistant" + ("\n" + content if content else ""))
                out.extend("\n" + _qwen_call_text(name, arguments, False) for name, arguments in calls)
                out.append("<|im_end|>\n")
            elif role == "tool":
                out.append(_qwen_tool_response(messages, i))
            elif not (role == "system" and i == 0):  # (the first system message is written above)
                raise ValueError(f"messages[{i}]: role={role!r}: {self.family} renders system, user, assistant, tool")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def parse_text(self, text, finish):
        return tagged_turn(text, finish)


def calls_turn(text: str, content: str, calls: Sequence[ToolCall], parse_error: str | None,
               finish: str) -> AssistantTurn:
    """The AssistantTurn of a parsed turn: its content and calls, with the history message they make."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = message_calls(calls)
    return AssistantTurn(text=text, content=content, tool_calls=tuple(calls), parse_error=parse_error, finish=finish,
                         message=message)


def tagged_turn(text: str, finish: str) -> AssistantTurn:
    """An assistant turn whose calls are <tool_call> blocks (Qwen's format; Gemma 3's here)."""
    content, calls, error = _parse_tagged_calls(text)
    return calls_turn(text, content, calls, error, finish)


def _qwen_tool_response(messages: Sequence[dict], i: int) -> str:
    # Consecutive tool results share one user turn.
    first = i == 0 or messages[i - 1]["role"] != "tool"
    last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
    return (("<|im_start|>user" if first else "") + "\n<tool_response>\n" + messages[i]["content"]
            + "\n</tool_response>" + ("<|im_end|>\n" if last else ""))


class Qwen3Renderer(Renderer):
    """Qwen3's chat template (module docstring)."""

    family = "qwen3"
    special_tokens = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    end_of_turn = ("<|im_end|>",)
    end_of_text = ("<|endoftext|>",)
    glue = "\n"
    thinking_template = True  # the template reads <think> blocks out of turns and drops earlier ones

    def __init__(self, tokenizer: Tokenizer, *, enable_thinking: bool = True):
        """enable_thinking=False: the template's variable of that name; the generation prompt closes an empty
        thinking block, so the model answers at once."""
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking

    @property
    def thinks(self) -> bool:
        return self.thinking_template and self.enable_thinking

    @property
    def template_variables(self) -> dict:
        return {"enable_thinking": self.enable_thinking} if self.thinking_template else {}

    def render_as_sampled(self, history, tools, sampled=None):
        # The template writes its last turn with a <think> block, empty when the turn has no reasoning, but the
        # generation prompt of thinking mode writes none: a turn sampled without one holds no such block.
        if self.thinks and "reasoning_content" not in history[-1] and "</think>" not in history[-1]["content"]:
            return self.render(history, tools, add_generation_prompt=False, last_sampled_unthinking=True)
        return self.render(history, tools, add_generation_prompt=False)

    def render(self, messages, tools, add_generation_prompt, last_sampled_unthinking=False):
        has_system = bool(messages) and messages[0]["role"] == "system"
        out = []
        if tools:
            out.append("<|im_start|>system\n" + (messages[0]["content"] + "\n\n" if has_system else "")
                       + _qwen_tools_text(tools) + "<|im_end|>\n")
        elif has_system:
            out.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
        # The last user message that is not tool responses: assistant turns before it lose their reasoning.
        last_query = next((i for i in reversed(range(len(messages))) if messages[i]["role"] == "user"
                           and not (messages[i]["content"].startswith("<tool_response>")
                                    and messages[i]["content"].endswith("</tool_response>"))), len(messages) - 1)
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "user" or (role == "system" and i > 0):
                out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            elif role == "assistant":
                reasoning = message.get("reasoning_content") if self.thinking_template else ""
                if reasoning is None:
                    reasoning = ""
                    if "</think>" in content:
                        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                        content = content.split("</think>")[-1].lstrip("\n")
                last = i == len(messages) - 1 and not last_sampled_unthinking
                if self.thinking_template and i > last_query and (last or reasoning):
                    out.append("<|im_start|>assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                               + content.lstrip("\n"))
                else:
                    out.append("<|im_start|>assistant\n" + content)
                for j, (name, arguments) in enumerate(_calls(message)):
                    if j > 0 or content:
                        out.append("\n")
                    out.append(_qwen_call_text(name, arguments, True))
                out.append("<|im_end|>\n")
            elif role == "tool":
                out.append(_qwen_tool_response(messages, i))
            elif not (role == "system" and i == 0):  # (the first system message is written above)
                raise ValueError(f"messages[{i}]: role={role!r}: {self.family} renders system, user, assistant, tool")
        if add_generation_prompt:
            closed = self.thinking_template and not self.enable_thinking
            out.append("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if closed else ""))
        return "".join(out)

    def parse_text(self, text, finish):
        if not self.thinking_template:  # the template writes a turn's text as it is, </think> or not
            return tagged_turn(text, finish)
        reasoning, answer = None, text
        if "</think>" in text:  # as the template reads a turn's reasoning out of its content
            reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            answer = text.split("</think>")[-1].lstrip("\n")
        content, calls, error = _parse_tagged_calls(answer)
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = message_calls(calls)
        return AssistantTurn(text=text, content=content, tool_calls=tuple(calls), parse_error=error,
                             reasoning=reasoning, finish=finish, message=message)


class Qwen3InstructRenderer(Qwen3Renderer):
    """Qwen3-Instruct-2507's chat template (module docstring)."""

    family = "qwen3_instruct"
    thinking_template = False

    def __init__(self, tokenizer: Tokenizer):
        Renderer.__init__(self, tokenizer)
        self.enable_thinking = False


class Llama3Renderer(Renderer):
    """Llama 3.1's chat template with custom tools (module docstring)."""

    family = "llama3"
    special_tokens = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                      "<|end_of_text|>", "<|python_tag|>")
    end_of_turn = ("<|eot_id|>", "<|eom_id|>")
    end_of_text = ("<|end_of_text|>",)
    glue = ""

    def __init__(self, tokenizer: Tokenizer, *, date_string: str = LLAMA31_DATE, tools_in_user_message: bool = True):
        """date_string and tools_in_user_message: the template's variables of those names."""
        super().__init__(tokenizer)
        self.date_string, self.tools_in_user_message = date_string, tools_in_user_message

    @property
    def template_variables(self) -> dict:
        return {"date_string": self.date_string, "tools_in_user_message": self.tools_in_user_message}

    def render(self, messages, tools, add_generation_prompt):
        messages = list(messages)
        system = ""
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"].strip(), messages[1:]
        out = ["<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"]
        if tools is not None:
            out.append("Environment: ipython\n")
        out.append(f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n")
        tool_list = "".join(_tojson(t, indent=4) + "\n\n" for t in tools or ())
        if tools is not None and not self.tools_in_user_message:
            out.append(_LLAMA_SYSTEM_TOOLS + tool_list)
        out.append(system + "<|eot_id|>")
        if tools is not None and self.tools_in_user_message:
            if not messages:
                raise ValueError("llama3: the tools go into the first user message, and there is none")
            first, messages = messages[0]["content"].strip(), messages[1:]
            out.append("<|start_header_id|>user<|end_header_id|>\n\n" + _LLAMA_USER_TOOLS + tool_list + first
                       + "<|eot_id|>")
        for message in messages:
            role = message["role"]
            if not (role in ("tool", "ipython") or "tool_calls" in message):
                out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{message['content'].strip()}<|eot_id|>")
            elif "tool_calls" in message:
                calls = _calls(message)
                if len(calls) != 1:
                    raise ValueError("llama3: Llama 3.1's template renders one tool call per assistant message, "
                                     f"this one has {len(calls)}")
                (name, arguments), = calls
                out.append('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + name
                           + '", "parameters": ' + _tojson(arguments) + "}<|eot_id|>")
            else:
                # The template writes a string result through tojson too (a str is iterable in jinja): quoted.
                out.append("<|start_header_id|>ipython<|end_header_id|>\n\n" + _tojson(message["content"])
                           + "<|eot_id|>")
        if add_generation_prompt:
            out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(out)

    def parse_text(self, text, finish):
        return json_call_turn(text, finish)


def json_call_turn(text: str, finish: str) -> AssistantTurn:
    """Llama 3.1's calls: one {"name", "parameters"} JSON object alone in the turn, after <|python_tag|> or
    not (a turn of text otherwise)."""
    body = text.removeprefix("<|python_tag|>")
    plain = {"role": "assistant", "content": text}
    if body == text and not body.lstrip().startswith("{"):
        return AssistantTurn(text=text, content=text, finish=finish, message=plain)
    # After <|python_tag|>, or JSON from the first character: the model meant a call.
    try:
        _, end = loads_prefix(body.strip())
    except JSONTextError as e:
        return AssistantTurn(text=text, content=text, parse_error=f"tool call: {e}",
                             finish=finish, message=plain)
    if body.strip()[end:].strip():
        return AssistantTurn(text=text, content=text, finish=finish, message=plain,
                             parse_error="tool call: text after the call's JSON object; Llama 3.1's template "
                                         "writes one call per turn, alone")
    call, error = read_call(body, ("parameters", "arguments"), "tool call")
    if call is None:
        return AssistantTurn(text=text, content=text, parse_error=error, finish=finish, message=plain)
    message = {"role": "assistant", "content": "", "tool_calls": message_calls([call])}
    return AssistantTurn(text=text, content="", tool_calls=(call,), finish=finish, message=message)


def folded_messages(messages: Sequence[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation in grpo_jax's folded tool form, for a chat template without tools (Gemma 3's, and the
    template renderer's for such templates): a system message, then user and assistant messages of plain text
    (alternating where the environment says one thing per step): Qwen's tool instructions joined to the system
    message, tool calls written into the assistant's text as <tool_call> blocks, each run of tool and user messages
    merged into one user message (a result as a <tool_response> block, the pieces joined by "\\n")."""
    out, rest = [], list(messages)
    system = []
    if rest and rest[0]["role"] == "system":
        system.append(rest.pop(0)["content"])
    if tools:
        system.append(_qwen_tools_text(tools))
    if system:
        out.append({"role": "system", "content": "\n\n".join(system)})
    merging = False  # the last message of `out` is a user message that more user/tool messages join
    for i, message in enumerate(rest):
        role, content = message["role"], message["content"]
        if role == "assistant":
            calls = [_qwen_call_text(name, arguments, True) for name, arguments in _calls(message)]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
            merging = False
        elif role in ("user", "tool"):
            piece = content if role == "user" else "<tool_response>\n" + content + "\n</tool_response>"
            if merging:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + piece}
            else:
                out.append({"role": "user", "content": piece})
            merging = True
        else:
            raise ValueError(f"messages[{i}]: role={role!r}: the folded form takes a first system message, then "
                             "user, assistant and tool messages")
    return out


class Gemma3Renderer(Renderer):
    """Gemma 3's chat template, with grpo_jax's tool format (module docstring)."""

    family = "gemma3"
    special_tokens = ("<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>")
    end_of_turn = ("<end_of_turn>",)
    end_of_text = ("<eos>",)
    glue = "\n"

    def template_conversation(self, messages, tools):
        return folded_messages(messages, tools), None

    def render(self, messages, tools, add_generation_prompt):
        turns = folded_messages(messages, tools)
        prefix = ""
        if turns and turns[0]["role"] == "system":
            prefix, turns = turns[0]["content"] + "\n\n", turns[1:]
        out = ["<bos>"]
        for i, message in enumerate(turns):
            if (message["role"] == "user") != (i % 2 == 0):
                raise ValueError("gemma3: conversation roles must alternate user/assistant/user/assistant/...")
            role = "model" if message["role"] == "assistant" else message["role"]
            out.append(f"<start_of_turn>{role}\n" + (prefix if i == 0 else "") + message["content"].strip()
                       + "<end_of_turn>\n")
        if add_generation_prompt:
            out.append("<start_of_turn>model\n")
        return "".join(out)

    def parse_text(self, text, finish):
        return tagged_turn(text, finish)


_COMPACT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COMPACT_ARGUMENT = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)=")
_COMPACT_BARE = re.compile(r"[A-Za-z0-9_.\-]+")


def _json_or_none(text: str):
    """(value,) when `text` is one JSON value alone (json_text's: not NaN, Infinity or 1e999), else None."""
    try:
        return (loads(text),)
    except JSONTextError:
        return None


def _compact_value(value) -> str:
    # Bare when reading it back gives the value again (a number, or a word that is no JSON), else JSON.
    if isinstance(value, str):
        bare = _COMPACT_BARE.fullmatch(value) is not None and _json_or_none(value) is None
        return value if bare else _tojson(value)
    return _tojson(value)


def _compact_call_text(name: str, arguments) -> str:
    if isinstance(arguments, str):  # arguments given as a JSON string, as some histories hold them
        try:
            arguments = loads(arguments)
        except JSONTextError as e:
            raise ValueError(f"tool call {name}: its arguments {arguments[:80]!r} are no JSON object ({e})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call {name}: its arguments must be a JSON object, got {_tojson(arguments)[:80]}")
    return "<|c|>" + " ".join([name, *(f"{k}={_compact_value(v)}" for k, v in arguments.items())])


def _read_compact_call(body: str, where: str) -> tuple[ToolCall | None, str | None]:
    """`name k=v k=v` as a ToolCall, or why it is not one."""
    body = body.strip()
    name = _COMPACT_NAME.match(body)
    if name is None or (name.end() < len(body) and not body[name.end()].isspace()):
        return None, f"{where}: expected `name k=v ...` after <|c|>, got {body[:200]!r}"
    arguments, at = {}, name.end()
    while at < len(body):
        key = _COMPACT_ARGUMENT.match(body, at)
        if key is None:
            return None, f"{where}: expected ` k=v` at {body[at:at + 40]!r} (a value with spaces is JSON: k=\"a b\")"
        at = key.end()
        rest = body[at:]
        if rest[:1] in ('"', "{", "["):
            try:
                value, length = loads_prefix(rest)
            except JSONTextError as e:
                return None, f"{where}: argument {key.group(1)}: {e}"
        else:
            length = len(rest.split(None, 1)[0]) if rest.strip() else 0
            if rest[:1].isspace() or not length:
                return None, f"{where}: argument {key.group(1)} has no value after '='"
            parsed = _json_or_none(rest[:length])
            value = parsed[0] if parsed is not None else rest[:length]
        if rest[length:length + 1] and not rest[length].isspace():
            return None, f"{where}: argument {key.group(1)}: a space must follow its value, got {rest[:40]!r}"
        if key.group(1) in arguments:
            return None, f"{where}: argument {key.group(1)} given twice"
        arguments[key.group(1)] = value
        at += length
    return ToolCall(name=name.group(), arguments=arguments), None


def _compact_tools_text(tools: list[dict]) -> str:
    lines = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters") or {}
        required = parameters.get("required") or ()
        names = [p if p in required else p + "?" for p in parameters.get("properties") or {}]
        lines.append(f"{function['name']}({', '.join(names)})")
    return "\n".join(lines)


class CompactRenderer(Renderer):
    """grpo_jax's compact format for tiny models and the synthetic_chat tokenizer (module docstring)."""

    family = "compact"
    special_tokens = ("<|s|>", "<|u|>", "<|a|>", "<|t|>", "<|e|>", "<|c|>", "<|endoftext|>")
    end_of_turn = ("<|e|>",)
    end_of_text = ("<|endoftext|>",)
    glue = ""
    role_tokens = {"system": "<|s|>", "user": "<|u|>", "assistant": "<|a|>", "tool": "<|t|>"}

    def render(self, messages, tools, add_generation_prompt):
        messages = list(messages)
        system = []
        if messages and messages[0]["role"] == "system":
            system.append(messages.pop(0)["content"])
        if tools:
            system.append(_compact_tools_text(tools))
        out = ["<|s|>" + "\n".join(part for part in system if part) + "<|e|>"] if system else []
        for i, message in enumerate(messages):
            role = message["role"]
            if role not in self.role_tokens:
                raise ValueError(f"messages[{i}]: role={role!r}: {self.family} renders system, user, assistant, tool")
            calls = "".join(_compact_call_text(name, arguments) for name, arguments in _calls(message))
            out.append(self.role_tokens[role] + message["content"] + calls + "<|e|>")
        if add_generation_prompt:
            out.append("<|a|>")
        return "".join(out)

    def parse_text(self, text, finish):
        content, *bodies = text.split("<|c|>")
        calls, errors = [], []
        for number, body in enumerate(bodies, start=1):
            call, error = _read_compact_call(body, f"tool call {number}")
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        return calls_turn(text, content, calls, "; ".join(errors) or None, finish)


RENDERERS: dict[str, type[Renderer]] = {
    "qwen2": Qwen2Renderer, "qwen3": Qwen3Renderer, "qwen3_instruct": Qwen3InstructRenderer, "llama3": Llama3Renderer,
    "gemma3": Gemma3Renderer, "compact": CompactRenderer}


# ---- the renderer a checkpoint needs: checked against its own chat template ----------------------------------

_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number", "description": "The first number."},
                                                    "b": {"type": "number", "description": "The second number."}},
                   "required": ["a", "b"]}}}]


def _probe(renderer: Renderer, with_tools: bool) -> list[tuple[str, list[dict], list[dict] | None, bool]]:
    """(what, messages, tools, add_generation_prompt) of the probe: an opening with tools, a turn calling one, its
    result, an answer (each step a render of its own, so that whether the longer history extends the shorter is
    tested too); a conversation without system message or tools; an opening holding an earlier call whose
    arguments are a JSON string (OpenAI's message format). A thinking renderer's turns carry reasoning. Without
    tools (an environment that offers none): the same steps with a plain turn answered by a user message."""
    def turn(content, calls=(), reasoning="I add the numbers."):
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": "add", "arguments": a}} for a in calls]
        if renderer.thinks:
            message["reasoning_content"] = reasoning
        return message

    opening = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
    question = [{"role": "user", "content": "Hello, who are you?"}]
    no_tools = [("a prompt without system message or tools", question, None, True),
                ("an answer without tools", [*question, turn("I am a calculator.")], None, False)]
    if not with_tools:
        step, answer = turn("2 + 3 = 5."), {"role": "user", "content": "And 5 + 1?"}
        return [("the opening prompt", opening, None, True),
                ("the history ending with an answer", [*opening, step], None, False),
                ("the prompt after a user's reply", [*opening, step, answer], None, True),
                ("the whole conversation", [*opening, step, answer, turn("5 + 1 = 6.")], None, False), *no_tools]
    call, result = turn("I add them.", [{"a": 2, "b": 3}]), {"role": "tool", "name": "add", "content": "5"}
    earlier = [*opening, turn("", ['{"a": 2, "b": 3}']), result, {"role": "user", "content": "And 5 + 1?"}]
    return [("the opening prompt", opening, _PROBE_TOOLS, True),
            ("the history ending with a tool call", [*opening, call], _PROBE_TOOLS, False),
            ("the prompt after the tool's result", [*opening, call, result], _PROBE_TOOLS, True),
            ("the whole conversation", [*opening, call, result, turn("2 + 3 = 5.")], _PROBE_TOOLS, False),
            *no_tools,
            ("an opening with an earlier call whose arguments are a JSON string", earlier, _PROBE_TOOLS, True)]


def _first_difference(tokenizer: Tokenizer, ours: list[int], theirs: list[int]) -> tuple[int, str, str]:
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def near(ids):
        text = tokenizer.decode(ids[at:at + 12], skip_special_tokens=False)
        return repr(text[:50]) if ids[at:] else "the end"

    return at, near(ours), near(theirs)


_DIFFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {renderer key: difference}


def template_difference(renderer: Renderer, with_tools: bool = True) -> str | None:
    """Where the renderer's ids first differ from those of its tokenizer's own chat template on the probe
    conversation (_probe; with_tools=False: one without tools), in one line; None when they agree everywhere, also
    on whether the environment's answer extends the history, or when the tokenizer has no chat template to compare
    with (the synthetic tokenizers)."""
    tokenizer = renderer.tokenizer
    if tokenizer.chat_template is None:
        return None
    key = (type(renderer), repr(sorted((k, v) for k, v in vars(renderer).items() if k != "tokenizer")), with_tools)
    known = _DIFFERENCES.setdefault(tokenizer, {})
    if key not in known:
        known[key] = _template_difference(renderer, with_tools)
    return known[key]


def _template_difference(renderer: Renderer, with_tools: bool) -> str | None:
    tokenizer = renderer.tokenizer
    probe, texts = _probe(renderer, with_tools), []
    for what, messages, tools, generation_prompt in probe:
        template_messages, template_tools = renderer.template_conversation(messages, tools)
        try:
            theirs = tokenizer.apply_chat_template(template_messages, add_generation_prompt=generation_prompt,
                                                   tools=template_tools, **renderer.template_variables)
        except ValueError as e:
            return f"{what}: the chat template fails on it ({' '.join(str(e).split())[:200]})"
        ours = renderer.render(messages, tools, generation_prompt)
        texts.append(theirs)
        if ours != theirs:
            our_ids, their_ids = tokenizer.encode(ours), tokenizer.encode(theirs)
            at, near_ours, near_theirs = _first_difference(tokenizer, our_ids, their_ids)
            return (f"{what}: the ids differ first at position {at} ({len(our_ids)} ids, the template's "
                    f"{len(their_ids)}): the renderer writes {near_ours} where the template writes {near_theirs}")
    # probe[1] is the history ending with a turn, probe[2] that history and the environment's answer
    template_extends = texts[2].startswith(texts[1])
    history = probe[1][1]
    extends = not isinstance(renderer.append_ids(history, probe[2][1][len(history):], probe[2][2]), CannotExtend)
    if extends != template_extends:
        return (f"after the environment's answer the renderer {'extends' if extends else 'starts a new segment'} "
                f"where the template {'extends' if template_extends else 'renders the history differently'}")
    return None


TEMPLATE = "template"  # the renderer of a checkpoint's own chat template (envs.template_renderer)
RENDERER_NAMES = (*RENDERERS, TEMPLATE)  # what env.renderer may name


def _construct(name: str, tokenizer: Tokenizer, options: dict) -> Renderer:
    if name == TEMPLATE:
        from grpo_jax.envs.template_renderer import TemplateRenderer  # (it builds on this module)
        cls = TemplateRenderer
    elif name in RENDERERS:
        cls = RENDERERS[name]
    else:
        raise ConfigError(f"renderer {name!r}: allowed {', '.join(RENDERER_NAMES)}")
    try:
        return cls(tokenizer, **options)
    except TypeError as e:
        raise ConfigError(f"renderer {name!r}: {e}") from e


def fitting_renderers(tokenizer: Tokenizer, with_tools: bool = True) -> list[Renderer]:
    """The family renderers (RENDERERS order, default options) that render the probe as the tokenizer's chat
    template does; [] without a template."""
    fitting = []
    for name in RENDERERS:
        try:
            candidate = _construct(name, tokenizer, {})
        except ConfigError:  # not this family's tokens
            continue
        if tokenizer.chat_template is not None and template_difference(candidate, with_tools) is None:
            fitting.append(candidate)
    return fitting


def make_renderer(family: str, tokenizer: Tokenizer, **options) -> Renderer:
    """The renderer of a model family (RENDERER_NAMES: a family's, or `template`), with its options (e.g.
    enable_thinking for qwen3), as it is: a run's renderer is chosen and checked against the checkpoint's chat
    template by renderer_for_run."""
    return _construct(family, tokenizer, options)


def renderer_for_run(family: str, tokenizer: Tokenizer, options: dict, *, explicit: bool, model: str,
                     with_tools: bool = True) -> Renderer:
    """The renderer a run uses, checked against the checkpoint's own chat template on a probe conversation
    (template_difference; with_tools=False for an environment that offers no tools) before anything runs, and
    logged. family: env.renderer when `explicit`, else the model architecture's (`template` for an architecture
    without a family); model: what names the checkpoint in a message. An explicit family renderer that does not
    fit is refused (ConfigError naming where the ids differ and the renderers that fit); otherwise the first family
    renderer that fits is chosen, else the template renderer (the checkpoint's own template, envs.template_renderer).
    A tokenizer without a chat template (the synthetic ones, for `compact`) is not checked."""
    if family == TEMPLATE:
        renderer = _construct(family, tokenizer, options)
        logger.info("multi-turn renderer: the chat template of %s (%r)", model, renderer)
        return renderer
    try:
        renderer = _construct(family, tokenizer, options)
        difference = template_difference(renderer, with_tools)
    except ConfigError:  # not this family's tokens
        if explicit or tokenizer.chat_template is None:
            raise
        difference = f"its tokenizer is not a {family} tokenizer (it lacks {family}'s special tokens)"
    if difference is None:
        logger.info("multi-turn renderer: %s, %s", family, "which renders a probe conversation as the chat template "
                    f"of {model} does" if tokenizer.chat_template is not None else f"({model} has no chat template)")
        return renderer
    fitting = [r.family for r in fitting_renderers(tokenizer, with_tools)]
    setting = f"env.renderer={family!r}" if explicit else f"env.renderer='' (the model's family: {family})"
    if explicit:
        fix = (f"set env.renderer to {' or '.join(fitting)}, or '' to choose it" if fitting else
               "set env.renderer to template (the checkpoint's own chat template), or '' to choose it")
        raise ConfigError(f"{setting} does not render as the chat template of {model}: {difference}; renderers that "
                          f"fit it: {', '.join(fitting) or 'none'}; {fix}")
    renderer = _construct(fitting[0], tokenizer, {}) if fitting else _construct(TEMPLATE, tokenizer, options)
    logger.warning("%s does not render as the chat template of %s (%s); using renderer %r, which does", setting,
                   model, difference, renderer)
    return renderer
