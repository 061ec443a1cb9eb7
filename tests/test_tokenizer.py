"""Tokenizer: byte-level round trips, special ids, chat templates rendered as transformers renders them, and
save/from_dir (also read back by transformers' AutoTokenizer)."""

import json

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.errors import CheckpointError
from grpo_jax.tokenizer import Tokenizer

transformers.logging.set_verbosity_error()

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? <b>&</b>"}]
ENDOFTEXT, IM_START, IM_END = 256, 257, 258

# Exercises what transformers' environment adds: trim_blocks/lstrip_blocks, loop controls, raise_exception,
# a tojson that does not HTML-escape, and bos/eos variables.
FANCY_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {%- endif %}
    {%- if loop.index0 > 5 %}{% break %}{% endif %}
    {% if message['role'] == 'system' %}
[SYS]{{ message['content'] | tojson }}
    {% else %}
<{{ message['role'] }}>{{ message['content'] }}{{ eos_token }}
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.byte_level()


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None)
def test_byte_level_round_trip(text):
    tok = Tokenizer.byte_level()
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    if not any(s in text for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")):  # hypothesis tries them
        assert ids == list(text.encode("utf-8"))  # ids are the UTF-8 bytes
        assert tok.decode(ids) == text


def test_special_ids(tok):
    assert tok.vocab_size == 259
    assert tok.encode("<|im_start|>hi<|im_end|>") == [IM_START, ord("h"), ord("i"), IM_END]
    assert tok.eos_ids == (IM_END, ENDOFTEXT) and tok.pad_id == ENDOFTEXT and tok.bos_id is None
    assert tok.decode([IM_START, 104, 105, IM_END]) == "hi"
    assert tok.decode([IM_START, 104, 105, IM_END], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    plain = Tokenizer.byte_level(extra_special_tokens=("<|endoftext|>",))
    assert plain.eos_ids == (ENDOFTEXT,) and plain.pad_id == ENDOFTEXT and plain.chat_template is None
    with pytest.raises(ValueError, match="no chat_template"):
        plain.apply_chat_template(MESSAGES)


def test_chatml_template(tok):
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2? <b>&</b><|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.apply_chat_template(MESSAGES) == expected
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n")


def _write_dir(tmp_path, tok, **config_updates):
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(config_updates)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_save_and_from_dir(tok, tmp_path):
    tok.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    text = "héllo 🤖 <|im_end|>\n\t x"
    assert again.encode(text) == tok.encode(text)
    assert again.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert (again.eos_ids, again.pad_id, again.bos_id, again.vocab_size) == \
        (tok.eos_ids, tok.pad_id, tok.bos_id, tok.vocab_size)
    assert again.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


def test_transformers_reads_saved_tokenizer(tok, tmp_path):
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Grüße, 世界! <|im_start|>x"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text), skip_special_tokens=True) == tok.decode(tok.encode(text))
    assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(MESSAGES)
    assert hf.eos_token_id == IM_END and hf.pad_token_id == ENDOFTEXT


def test_template_renders_like_transformers(tok, tmp_path):
    path = _write_dir(tmp_path, tok, chat_template=FANCY_TEMPLATE, bos_token="<|endoftext|>")
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for add in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == \
            hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
    assert '[SYS]"Be brief."' in ours.apply_chat_template(MESSAGES)
    assert ours.bos_id == ENDOFTEXT
    with pytest.raises(ValueError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_from_dir_variants(tok, tmp_path):
    # AddedToken dicts, a list of named templates, chat_template.jinja taking precedence, an int eos in config.json
    path = _write_dir(tmp_path, tok, eos_token={"content": "<|endoftext|>", "special": True},
                      pad_token=None, bos_token={"content": "<|im_start|>"},
                      chat_template=[{"name": "default", "template": "A{{ eos_token }}"},
                                     {"name": "tool_use", "template": "B"}])
    (path / "generation_config.json").unlink()
    (path / "config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    loaded = Tokenizer.from_dir(path)
    assert loaded.eos_ids == (ENDOFTEXT, IM_END) and loaded.pad_id == ENDOFTEXT and loaded.bos_id == IM_START
    assert loaded.apply_chat_template(MESSAGES) == "A<|endoftext|>"
    (path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(path).apply_chat_template(MESSAGES) == "J"
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_START, IM_END]}))
    assert Tokenizer.from_dir(path).eos_ids == (ENDOFTEXT, IM_START, IM_END)


def test_bad_tokenizer_dirs(tok, tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot load"):
        Tokenizer.from_dir(tmp_path)
    path = _write_dir(tmp_path / "a", tok, eos_token="<|nope|>")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: eos_token '<\|nope\|>' is not in"):
        Tokenizer.from_dir(path)
    path = _write_dir(tmp_path / "b", tok)
    (path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: cannot parse JSON"):
        Tokenizer.from_dir(path)
    path = _write_dir(tmp_path / "c", tok, chat_template="{% for %}")
    with pytest.raises(ValueError, match="syntax error"):
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)


def test_char_level_tokenizer_round_trips_and_saves(tmp_path):
    tok = Tokenizer.char_level("0123456789 +=:\nacdeprsvy")
    text = "reverse: 381=\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_ids == (tok.vocab_size - 1,) and tok.pad_id == tok.eos_ids[0]
    assert tok.decode(tok.encode("b")) == "<unk>"  # outside the alphabet: unk, not a crash
    tok.save(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode(text) == ids and loaded.eos_ids == tok.eos_ids
