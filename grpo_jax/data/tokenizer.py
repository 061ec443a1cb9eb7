"""Tokenizer: a Hugging Face `tokenizer.json` (via the `tokenizers` library) plus the special tokens and chat
template from `tokenizer_config.json`, without transformers.

Chat templates are rendered the way transformers renders them (sandboxed jinja2, trim_blocks, lstrip_blocks,
`raise_exception`, a non-HTML-escaping `tojson`), so prompts match what the checkpoint was trained on.

Prompts are encoded as transformers encodes them (encode_prompt): a rendered chat template as is (it writes its
own BOS; apply_chat_template(tokenize=True) adds nothing either), a plain prompt with the tokens that
tokenizer.json's post-processor puts before a text, as `tokenizer(text)` does: the BOS of Llama 3's
TemplateProcessing. (transformers' fast tokenizers follow the post-processor, not tokenizer_config.json's
add_bos_token.)

Text from outside (a dataset row's question, an environment's or a tool's message) cannot spell a special token:
transformers renders a chat template and encodes the text whole, so a question or a fetched page holding
`<|im_end|>\n<|im_start|>assistant\n` becomes those special tokens, a forged turn. Here the messages are guarded
first (`guard`): every special token's text in their strings is swapped for a placeholder (a random nonce, drawn per
render, so no text can spell one) and every lone surrogate for U+FFFD (which no tokenizer encodes); the template
renders; `encode_guarded` then takes the special tokens the template wrote from the tokenizer's own split of the
render, and encodes the text between them with the placeholders restored and special tokens read as text
(tokenizers' `encode_special_tokens`). `encode_chat` does all of it. A text with no special token's spelling (all
ordinary prompts) is encoded whole, exactly as before: the same ids as transformers. Only tokens marked special
count; added tokens that are not (Qwen's `<tool_call>` words) are matched in any text, as transformers matches them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import secrets
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from grpo_jax.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 saves the template here instead
GENERATION_CONFIG_FILE = "generation_config.json"

# ChatML, as Qwen uses; the tiny CPU models are trained with it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The synthetic_chat tokenizer's vocabulary (Tokenizer.synthetic_chat): the compact chat format's special tokens
# (end of text first: id 0 is eos and pad), every digit, whitespace and punctuation character, and the words the
# tiny environments' texts use (fetch_code, countdown_multiturn and their tool errors). Appending is safe; changing
# an entry's place changes the ids of a model trained with it.
SYNTHETIC_CHAT_SPECIALS = ("<|endoftext|>", "<|s|>", "<|u|>", "<|a|>", "<|t|>", "<|e|>", "<|c|>")
SYNTHETIC_CHAT_SYMBOLS = "0123456789 \n?,.:;=()'\"-_{}[]"
SYNTHETIC_CHAT_WORDS = ("code", "fetch", "lookup", "lookups", "key", "next", "left", "Error", "no", "unknown", "tool",
                        "tools", "call", "argument", "arguments", "its", "none", "the")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer and decoder use."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _token_content(value) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_list(value) -> list[int]:
    """eos_token_id in config.json / generation_config.json is null, an int or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when absent; unreadable or non-object content is a CheckpointError."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


GUARD_MAX_DEPTH = 200  # how deep guard() walks messages (a tool call's arguments are at most json_text.MAX_DEPTH)
_PLACEHOLDER_START, _PLACEHOLDER_END = "\ue000", "\ue001"  # private-use characters: kept by json.dumps and jinja


@dataclasses.dataclass(frozen=True)
class TextGuard:
    """What Tokenizer.guard swapped out of untrusted strings: each placeholder and the special token's text it
    stands for."""

    placeholders: dict[str, str]
    pattern: re.Pattern = dataclasses.field(repr=False)

    def restore(self, text: str) -> str:
        """`text` with each placeholder back as the special token's text it stands for."""
        return self.pattern.sub(lambda m: self.placeholders[m.group()], text)


def _compile_template(template: str) -> jinja2.Template:
    # Same environment as transformers' _compile_jinja_template (minus its generation-tracking extension).
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change prompts.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# What a lower bound on the token count may rely on (Tokenizer.min_tokens): pieces of the pipeline that keep every
# character of the text (a pre-tokenizer that drops whitespace, or an added token that swallows it, would let a long
# text be a few tokens).
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts")
_LOCAL_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace")


def _flatten(component: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer of tokenizer.json as the list of its parts (a Sequence's, in order)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        parts = component.get("normalizers", component.get("pretokenizers", []))
        return [leaf for part in parts for leaf in _flatten(part)]
    return [component]


def _max_token_bytes(spec: dict, normalize) -> int | None:
    """The most bytes of normalized text one token can stand for, when every byte of the text ends up in some
    token: a BPE over all 256 bytes (byte-level, or sentencepiece's byte_fallback) without subword affixes,
    pre-tokenizers that keep every character, normalizers that act on single characters (Replace: of one
    character) and added tokens that strip no whitespace. None when the tokenizer is not of that kind (then no
    bound is claimed). normalize: the tokenizer's normalizer (an added token that is matched before
    normalization still counts as its normalized content in a text normalized whole)."""
    model = spec.get("model") or {}
    if (model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict)
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    vocab: dict = model["vocab"]
    pre_tokenizers_ = _flatten(spec.get("pre_tokenizer"))
    for part in pre_tokenizers_:
        if part.get("type") not in _KEEPING_PRE_TOKENIZERS or part.get("behavior") == "Removed":
            return None
    if any(part["type"] == "ByteLevel" for part in pre_tokenizers_):
        covers_all_bytes = all(c in vocab for c in _bytes_to_unicode().values())
    else:
        covers_all_bytes = bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if not covers_all_bytes:
        return None
    for part in _flatten(spec.get("normalizer")):
        if part.get("type") not in _LOCAL_NORMALIZERS:
            return None
        if part["type"] == "Replace" and len((part.get("pattern") or {}).get("String") or "") != 1:
            return None  # a longer or regex pattern could match across an added token's edge
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    # A byte-level token's characters are bytes; counting their UTF-8 bytes (up to 2 each) only loosens the bound.
    sizes = [len(token.encode("utf-8")) for token in vocab]
    for token in added:
        content = token.get("content", "")
        sizes += [len(content.encode("utf-8")), len(normalize(content).encode("utf-8"))]
    return max(sizes)


class Tokenizer:
    """Encode/decode text, know the special ids, and render chat prompts."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 eos_token: str | None = None, bos_token: str | None = None, pad_token: str | None = None,
                 extra_eos_ids: tuple[int, ...] = (), pad_id: int | None = None, source: str = "<memory>"):
        """extra_eos_ids: more stop ids (from generation_config.json); pad_id: used when pad_token is None."""
        self._tok = tokenizer
        self.chat_template = chat_template
        self.eos_token, self.bos_token, self.pad_token = eos_token, bos_token, pad_token
        self.source = source
        self._template = None
        eos = [self._id_of(eos_token, "eos_token")] if eos_token is not None else []
        self._eos_ids = tuple(dict.fromkeys(eos + list(extra_eos_ids)))  # dedupe, keep order
        self._bos_id = self._id_of(bos_token, "bos_token") if bos_token is not None else None
        self._pad_id = self._id_of(pad_token, "pad_token") if pad_token is not None else pad_id
        self._prompt_prefix = self._leading_special_ids()

    def _leading_special_ids(self) -> tuple[int, ...]:
        """The ids transformers' tokenizer(text) puts before a text: those the post-processor puts before a
        single sequence (found on a probe text)."""
        if self._tok.post_processor is None:
            return ()
        for probe in ("a", "0", " ", "x"):
            encoding = self._tok.encode(probe, add_special_tokens=False)
            if encoding.ids:
                break
        else:
            return ()
        processed = self._tok.post_processor.process(encoding)
        prefix = []
        for token_id, special in zip(processed.ids, processed.special_tokens_mask):
            if not special:
                break
            prefix.append(token_id)
        return tuple(prefix)

    def _id_of(self, token: str, role: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{self.source}: {role} {token!r} is not in the vocabulary")
        return token_id

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, plus tokenizer_config.json / chat_template.jinja / generation_config.json /
        config.json when present (the layout transformers' save_pretrained writes)."""
        path = Path(path)
        tok_file = path / TOKENIZER_FILE
        if not tok_file.exists():
            raise CheckpointError(f"{tok_file}: not found (a tokenizer directory needs {TOKENIZER_FILE}; "
                                  "slow sentencepiece-only tokenizers are not supported)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises plain Exception for any parse problem
            raise CheckpointError(f"{tok_file}: cannot load tokenizer ({e})") from e

        config = read_json(path / TOKENIZER_CONFIG_FILE) or {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if (path / CHAT_TEMPLATE_FILE).exists():  # takes precedence, as in transformers
            template = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")

        # Stop ids: generation_config.json is what generate() uses; config.json when it is absent.
        extra_eos, pad_id = [], None
        for name in (GENERATION_CONFIG_FILE, "config.json"):
            data = read_json(path / name)
            if data is None:
                continue
            try:
                extra_eos = _eos_list(data.get("eos_token_id"))
            except ValueError as e:
                raise CheckpointError(f"{path / name}: {e}") from e
            pad_id = data.get("pad_token_id") if isinstance(data.get("pad_token_id"), int) else None
            break
        return cls(tok, chat_template=template,
                   eos_token=_token_content(config.get("eos_token")),
                   bos_token=_token_content(config.get("bos_token")),
                   pad_token=_token_content(config.get("pad_token")),
                   extra_eos_ids=tuple(extra_eos), pad_id=pad_id, source=str(path / TOKENIZER_CONFIG_FILE))

    @classmethod
    def byte_level(cls, extra_special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> Tokenizer:
        """A byte-level BPE tokenizer built locally: ids 0..255 are the bytes, then the special tokens.

        No merges, so every byte is one token: long sequences, but any text round-trips and no data or
        download is needed. Chat uses ChatML when <|im_start|>/<|im_end|> are among the specials; both
        <|im_end|> and <|endoftext|> stop generation (as with Qwen instruct models).
        """
        byte_chars = _bytes_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special_tokens])
        specials = set(extra_special_tokens)
        chat = {"<|im_start|>", "<|im_end|>"} <= specials
        eos = [t for t in ("<|im_end|>", "<|endoftext|>") if t in specials]
        pad = "<|endoftext|>" if "<|endoftext|>" in specials else None
        return cls(tok, chat_template=CHATML_TEMPLATE if chat else None,
                   eos_token=eos[0] if eos else None,
                   extra_eos_ids=tuple(tok.token_to_id(t) for t in eos), pad_token=pad, source="byte_level()")

    @classmethod
    def char_level(cls, alphabet: str, eos_token: str = "<|endoftext|>", unk_token: str = "<unk>") -> Tokenizer:
        """One token per character of `alphabet`, plus eos and unk, built locally.

        For the synthetic CPU tasks: a tiny model trained from scratch explores a vocabulary of ~30
        symbols far faster than 259 bytes, so its reward rises within minutes.
        """
        chars = list(dict.fromkeys(alphabet))
        vocab = {c: i for i, c in enumerate(chars)}
        vocab[unk_token] = len(vocab)
        tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
        tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(eos_token, special=True, normalized=False)])
        return cls(tok, eos_token=eos_token, pad_token=eos_token, source=f"char_level({alphabet!r})")

    @classmethod
    def word_level(cls, specials: tuple[str, ...], symbols: str, words: tuple[str, ...], eos_token: str,
                   unk_token: str = "<unk>", source: str = "word_level()") -> Tokenizer:
        """One token per special token, per character of `symbols` and per whole word of `words`, built locally;
        any other run of letters is `unk_token`. specials are added as special tokens (matched anywhere in a
        text); the pre-tokenizer cuts a text into special-looking tokens, runs of ASCII letters, single digits and
        single other characters, so a digit string is one token per digit. Decoding joins the tokens as they are,
        so a text made of known words, symbols and specials round-trips."""
        entries = [*specials, unk_token, *symbols, *words]
        if len(set(entries)) != len(entries):
            raise ValueError(f"word_level: a token appears twice among specials, symbols and words: {entries}")
        vocab = {token: i for i, token in enumerate(entries)}
        tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
        tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"<\|[a-z]+\|>|<unk>|[A-Za-z]+|[\s\S]"),
                                                 behavior="isolated")
        tok.decoder = decoders.Fuse()
        # <unk> special too: the text "<unk>" (a decoded unknown word) encodes back to its id
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*specials, unk_token)])
        return cls(tok, eos_token=eos_token, pad_token=eos_token, source=source)

    @classmethod
    def synthetic_chat(cls) -> Tokenizer:
        """The word-level tokenizer of the compact chat format (grpo_jax.envs.render, family `compact`) and the
        tiny built-in environments (`tokenizer: synthetic_chat`): < 64 tokens, so a 2-layer model trained from
        scratch samples a whole tool call as 3 tokens (`<|c|>fetch<|e|>`)."""
        return cls.word_level(SYNTHETIC_CHAT_SPECIALS, SYNTHETIC_CHAT_SYMBOLS, SYNTHETIC_CHAT_WORDS,
                              eos_token="<|endoftext|>", source="synthetic_chat")

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable by from_dir and transformers' AutoTokenizer).

        Stop ids beyond eos_token cannot be said in tokenizer_config.json, so they are merged into
        generation_config.json's eos_token_id, where from_dir and transformers' generate() read them.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,  # otherwise transformers rewrites " ." to "." on decode
            "eos_token": self.eos_token, "bos_token": self.bos_token, "pad_token": self.pad_token,
            "model_max_length": 1 << 30,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
        eos_token_id = [self._tok.token_to_id(self.eos_token)] if self.eos_token is not None else []
        if list(self._eos_ids) != eos_token_id:
            gen_file = path / GENERATION_CONFIG_FILE
            gen = read_json(gen_file) or {}
            gen["eos_token_id"] = list(self._eos_ids)
            gen_file.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    # ---- use ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. add_special_tokens defaults to False (unlike transformers): the ids of the text
        alone. Prompts go through encode_prompt."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def prompt_prefix(self) -> tuple[int, ...]:
        """The ids a plain prompt starts with (the BOS, for Llama 3); () when the post-processor adds none (Qwen)."""
        return self._prompt_prefix

    def encode_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """The ids of a prompt, as transformers gives them. chat: text is a rendered chat template, which writes
        its own BOS, so it is encoded as is (as apply_chat_template(tokenize=True) does). Plain: prompt_prefix,
        then the text (as tokenizer(text) does), unless the text already starts with it (a data.template that
        writes the BOS itself: one BOS, not two). Tokens a post-processor puts after a text (an EOS) are not
        added: a prompt is continued, not ended."""
        ids = self.encode(text)
        prefix = list(self._prompt_prefix)
        if chat or not prefix or ids[:len(prefix)] == prefix:
            return ids
        return prefix + ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) that costs no tokenization (one normalizer pass at most): the
        UTF-8 bytes of the normalized text over the most bytes one token can stand for. 0 for tokenizers whose
        pipeline may drop characters (see _max_token_bytes), for which no bound is claimed. What it is for:
        refusing a prompt that cannot fit before tokenizing all of it."""
        if not self._token_bytes_bound:
            return 0
        return math.ceil(len(self._normalize(text).encode("utf-8")) / self._token_bytes_bound)

    @functools.cached_property
    def _token_bytes_bound(self) -> int | None:
        # Computed when first needed: parsing a large tokenizer.json takes a moment.
        return _max_token_bytes(json.loads(self._tok.to_str()), self._normalize)

    def _normalize(self, text: str) -> str:
        normalizer = self._tok.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        if self._pad_id is not None:
            return self._pad_id
        if self._eos_ids:  # padding is masked out, so any id works; eos is the usual choice
            return self._eos_ids[0]
        raise ValueError(f"{self.source}: tokenizer has neither a pad token nor an eos token")

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- text from outside: special tokens read as text (module docstring) --------------------------

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every added token marked special, longest first (as the tokenizer matches them)."""
        added = self._tok.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}, key=lambda t: (-len(t), t)))

    @functools.cached_property
    def _special_ids(self) -> dict[int, str]:
        """id -> text of each special token."""
        return {self._tok.token_to_id(t): t for t in self.special_tokens}

    @functools.cached_property
    def _unsafe_text(self) -> re.Pattern:
        # A special token's spelling (longest first: the tokenizer's leftmost-longest match) or a lone surrogate.
        return re.compile("|".join([*map(re.escape, self.special_tokens), "[\ud800-\udfff]"]))

    @functools.cached_property
    def _text_tokenizer(self) -> tokenizers.Tokenizer:
        # A copy, not a flag flipped on the shared tokenizer: other threads encode prompts with it meanwhile.
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def guard(self, value):
        """(value, guard) for untrusted `value` (a str, or lists, tuples and dicts of strings and JSON scalars: chat
        messages, tool schemas): a copy whose strings, keys included, have each special token's text swapped for a
        placeholder and each lone surrogate for U+FFFD; guard is what encode_guarded and TextGuard.restore need, or
        None when no placeholder was needed. `value` itself is returned where nothing was replaced. ValueError for a
        value nested deeper than GUARD_MAX_DEPTH."""
        nonce = secrets.token_hex(8)
        placeholders: dict[str, str] = {}  # special token's text -> its placeholder

        def replace(match: re.Match) -> str:
            found = match.group()
            if len(found) == 1 and "\ud800" <= found <= "\udfff":
                return "\ufffd"
            if found not in placeholders:
                placeholders[found] = f"{_PLACEHOLDER_START}{nonce}{len(placeholders):x}{_PLACEHOLDER_END}"
            return placeholders[found]

        def walk(item, depth: int):
            if isinstance(item, str):
                return self._unsafe_text.sub(replace, item) if self._unsafe_text.search(item) else item
            if not isinstance(item, dict | list | tuple):
                return item
            if depth >= GUARD_MAX_DEPTH:
                raise ValueError(f"a message or tool schema nested more than {GUARD_MAX_DEPTH} deep")
            if isinstance(item, dict):
                pairs = [(walk(k, depth + 1), walk(v, depth + 1)) for k, v in item.items()]
                same = all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, item.items()))
                return item if same else dict(pairs)
            items = [walk(x, depth + 1) for x in item]
            return item if all(x is x0 for x, x0 in zip(items, item)) else type(item)(items)

        guarded = walk(value, 0)
        if not placeholders:
            return guarded, None
        restore = {p: text for text, p in placeholders.items()}
        return guarded, TextGuard(restore, re.compile("|".join(map(re.escape, restore))))

    def encode_guarded(self, text: str, guard: TextGuard | None) -> list[int]:
        """The ids of `text`, rendered from guarded messages: the special tokens it spells itself (the template's)
        as special tokens, the placeholders as the text they stand for, special tokens read as text there. With
        guard None, encode(text)."""
        if guard is None:
            return self.encode(text)
        ids, at = [], 0
        # The tokenizer's own split finds the template's special tokens (with any whitespace they strip).
        encoding = self._tok.encode(text, add_special_tokens=False)
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            # (a special id the model gives a word, as word_level's unknown word, is no special token of the text)
            if start >= at and self._special_ids.get(token_id) == text[start:end].strip():
                ids += self._encode_text(guard.restore(text[at:start]))
                ids.append(token_id)
                at = end
        return ids + self._encode_text(guard.restore(text[at:]))

    @functools.cached_property
    def _unk_id(self) -> int | None:
        unk = getattr(self._tok.model, "unk_token", None)
        return self._tok.token_to_id(unk) if unk else None

    def _encode_text(self, text: str) -> list[int]:
        ids = self._text_tokenizer.encode(text, add_special_tokens=False).ids if text else []
        if self._special_ids.keys().isdisjoint(ids):
            return ids
        # A vocabulary that holds the special tokens as words too (word_level's): their spelling is no word of the
        # text, so it is the unknown word, as any other word the vocabulary lacks.
        return [self._unk_id if i in self._special_ids and self._unk_id is not None else i for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render a conversation to the prompt string (not tokenized). tools: JSON schemas of the tools the model
        is offered, as transformers passes them (grpo_jax.envs.tools.Tool.schema). Extra kwargs reach the
        template."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: tokenizer has no chat_template (looked for 'chat_template' in "
                             f"{TOKENIZER_CONFIG_FILE} and for {CHAT_TEMPLATE_FILE}); use plain prompts instead")
        if self._template is None:
            try:
                self._template = _compile_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"{self.source}: chat_template has a syntax error: {e}") from e
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        variables = {k: v for k, v in specials.items() if v is not None}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **variables, **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.source}: chat_template failed: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError) as e:
            # A template's own expression failing on these messages ("a" + dict, a missing key): the same verdict.
            raise ValueError(f"{self.source}: chat_template failed: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **kwargs) -> tuple[str, list[int]]:
        """(text, ids) of a conversation rendered with the chat template: the text apply_chat_template gives, and
        ids in which only the template's own special tokens are special; a special token's spelling in the
        messages or the tools is encoded as text (module docstring). For a conversation that spells none, the ids
        are encode_prompt(text, chat=True)'s, as transformers' apply_chat_template(tokenize=True) gives them."""
        (messages, tools), guard = self.guard((messages, tools))
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if guard is None:
            return text, self.encode_prompt(text, chat=True)
        return guard.restore(text), self.encode_guarded(text, guard)


def load_tokenizer(name: str, model_path: str = "") -> Tokenizer:
    """The tokenizer a config names, for every command (train, init-model): "byte" (byte-level BPE),
    "synthetic" (char-level over the synthetic tasks' symbols), "synthetic_chat" (word-level, for the compact
    chat format of the tiny environments), or a directory holding tokenizer.json;
    "" means the tokenizer of model_path."""
    from grpo_jax.errors import ConfigError

    if name == "byte":
        return Tokenizer.byte_level()
    if name == "synthetic":
        from grpo_jax.data.tasks import SYNTHETIC_ALPHABET
        return Tokenizer.char_level(SYNTHETIC_ALPHABET)
    if name == "synthetic_chat":
        return Tokenizer.synthetic_chat()
    if not name and not model_path:
        raise ConfigError("tokenizer='': set tokenizer ('byte', 'synthetic', 'synthetic_chat' or a directory) when "
                          "no model_path is given")
    return Tokenizer.from_dir(name or model_path)
