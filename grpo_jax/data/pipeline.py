"""Prompt data: a random-access source (JSONL, Parquet, TFDS array_record, synthetic) fed through Grain.

The stream is a pure function of the element number, which is what makes exact resume possible:

    global element i  ->  epoch = i // N,  dataset_index = perm_epoch[i % N]      (N = rows in the source)

perm_epoch is Grain's index shuffle seeded with (shuffle_seed + epoch): a different permutation each epoch,
the same one on every run; without shuffle it is the identity. num_epochs=0 repeats forever. (Grain derives
the epoch seed by addition, so seed s in epoch 1 is seed s+1 in epoch 0: compare runs, not seeds.)

Sharding (one shard per JAX process): element i of the global stream goes to shard i % shard_count, so
shard k sees global elements k, k + S, k + 2S, ... and every record keeps its global dataset_index/epoch.
With a finite num_epochs the shards can differ in length by one element.

Every element yields exactly one record; nothing is filtered inside the pipeline (the collector stamps an
ordinal on each element and the actor records malformed ones as `drop` events with reason `bad_row`):

    {"dataset_index", "epoch", "row", "prompt_text", "prompt_ids"}                  a usable prompt
    {"dataset_index", "epoch", "bad_row": <reason in BAD_ROW_REASONS>, "detail"}   a malformed row

`row` holds plain JSON values only (json_value: datetimes become ISO strings, Decimals strings, bytes text
or base64, ...), converted as the row is read, so that a checkpoint holding it can always be written. It is
nested at most json_text.MAX_DEPTH deep, so that nothing walking it later (a template, a reward's copy, a
checkpoint) can exhaust the stack: a JSONL row nested deeper, or holding an integer longer than Python converts,
is `bad_json` (read by json_text, which never raises anything else), a Parquet or TFDS value `unsupported_value`.

prompt_text is the template (plain) or the tokenizer's chat template (chat) applied to the row; prompt_ids
(np.int32) is tokenizer.encode_prompt(prompt_text), as transformers encodes it: a plain prompt starts with the
BOS when the tokenizer puts one before a text (Llama 3), a chat template writes its own.

Size limits, checked before the work they bound: a row over data.max_row_bytes (its bytes in the file or table,
known without reading it: the JSONL line index, the Arrow slice, the TFDS record) is a bad row
`row_too_large`, never parsed or tokenized; a prompt text the tokenizer provably cannot encode in the prompt
limit (Tokenizer.min_tokens) is `prompt_too_long` before it is tokenized.

Iterator state (DataIterator.get_state) is a JSON-serialisable dict:

    {"version": 1, "fingerprint": str, "worker_count": int, "shard_index": int, "shard_count": int,
     "grain": <Grain's own iterator state, e.g. {"next_index": 12}>}

set_state refuses a state from another dataset/tokenizer/prompt format, shard layout or worker count
(Grain cannot restore its multiprocess state under a different number of workers).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime
import decimal
import hashlib
import json
import math
import os
import string
import threading
import uuid
from pathlib import Path
from typing import Any, Literal

import grain
import numpy as np

from grpo_jax import json_text
from grpo_jax.config_io import config_key
from grpo_jax.data.tasks import TASKS, make_synthetic_dataset
from grpo_jax.errors import DataError

SOURCES = ("jsonl", "parquet", "tfds", "synthetic")
PROMPT_FORMATS = ("plain", "chat")
# The chat template's variables grpo_jax sets (Tokenizer.apply_chat_template): not data.chat_template_kwargs'.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
                               "pad_token")
BAD_ROW_REASONS = ("bad_json", "not_an_object", "missing_field", "bad_field_type", "template_error",
                   "empty_prompt", "prompt_too_long", "unsupported_value", "row_too_large")
STATE_VERSION = 1
FINGERPRINT_PREFIX = "data-v2-"  # v2: a JSONL or Parquet file counts with its whole content (a hash), not its size

# data.max_row_bytes=0 means max(MIN_ROW_BYTES_LIMIT, ROW_BYTES_PER_PROMPT_TOKEN * data.max_prompt_len): room for
# a prompt that fits (a token is rarely over 16 bytes of text, a JSON escape takes at most 6 bytes a character)
# and an answer and other fields as long again, with margin; a row many times that holds no prompt that fits.
ROW_BYTES_PER_PROMPT_TOKEN = 256
MIN_ROW_BYTES_LIMIT = 1 << 20

# Threads that read + tokenize ahead in the consuming process. Small: the trainer needs a few prompts per
# step, and more threads only compete with the host side of JAX for the GIL.
_READ_THREADS = 2
_PREFETCH_BUFFER = 64


class BadRow(Exception):
    """One malformed row (`reason` from BAD_ROW_REASONS, `detail` one line): a source's [i] or RowReader's
    prompt_text raises it; the stream makes it a bad_row record and goes on."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: Literal["jsonl", "parquet", "tfds", "synthetic"] = config_key("jsonl", "Where the prompts come from.")
    path: str = config_key("", "jsonl/parquet: a file, or a directory holding {split}.jsonl / {split}.parquet.")
    split: str = config_key("train", "The split read: jsonl/parquet {split} files in a directory, a TFDS split.")
    tfds_name: str = config_key("", "tfds: a prepared dataset (see tools/prepare_tfds.py).")
    tfds_data_dir: str = config_key("", "tfds: the directory holding it; '' = TFDS's default directory.")
    prompt_field: str = config_key("question", "The record field holding the prompt.")
    answer_field: str = config_key("answer", "The record field holding the answer rewards compare to; '': none "
                                             "(the rows of an environment, or rewards that need no answer).")
    prompt_format: Literal["plain", "chat"] = config_key("plain", "plain: the prompt text as is; chat: a user "
                                                                  "message in the tokenizer's chat template.")
    template: str = config_key("", "A Python format string over the record's fields, e.g. "
                                   "'Question: {question}\\nAnswer:'. Empty: the prompt_field as is. With chat it "
                                   "builds the user message.")
    system_prompt: str = config_key("", "chat only: the system message.")
    chat_template_kwargs: dict = config_key(help="chat only: more variables for the chat template, as transformers' "
                                                 "apply_chat_template(**kwargs) passes them, e.g. {enable_thinking: "
                                                 "false} for Qwen3's template (no thinking block; true or absent: "
                                                 "thinking).", default_factory=dict)
    synthetic_task: str = config_key("copy", f"synthetic: the task ({', '.join(TASKS)}).")
    synthetic_size: int = config_key(1000, "synthetic: rows generated.")
    synthetic_min_digits: int = config_key(1, "synthetic: the fewest digits of an operand.")
    synthetic_max_digits: int = config_key(4, "synthetic: the most digits of an operand.")
    seed: int = config_key(0, "Seed of the synthetic rows.")
    shuffle: bool = config_key(True, "Shuffle the rows (each epoch in its own order).")
    shuffle_seed: int = config_key(0, "Seed of the shuffle (each epoch shuffles with shuffle_seed + epoch).")
    num_epochs: int = config_key(0, "Passes over the data; 0 = repeat forever.")
    max_prompt_len: int = config_key(1024, "Tokens; longer prompts become bad_row prompt_too_long.")
    max_row_bytes: int = config_key(0, "Bytes of one row (a JSONL line, a Parquet or TFDS record); larger rows "
                                       "become bad_row row_too_large unread. 0: max(1 MiB, 256 * max_prompt_len).")
    worker_count: int = config_key(0, "Grain worker processes; 0 = read in threads of the calling process.")

    def validate(self) -> list[str]:
        problems = []
        if self.source not in SOURCES:
            problems.append(f"source={self.source!r}: allowed {', '.join(SOURCES)}")
        if self.source in ("jsonl", "parquet") and not self.path:
            problems.append(f"path='': source={self.source} needs a file, or a directory holding "
                            f"{{split}}.{self.source}")
        if self.source in ("jsonl", "parquet", "tfds") and not self.split:
            problems.append("split='': must name a split, e.g. train")
        if self.source == "tfds" and not self.tfds_name:
            problems.append("tfds_name='': source=tfds needs the dataset name (see tools/prepare_tfds.py)")
        if self.source == "synthetic":
            if self.synthetic_task not in TASKS:
                problems.append(f"synthetic_task={self.synthetic_task!r}: allowed {', '.join(TASKS)}")
            if self.synthetic_size < 1:
                problems.append(f"synthetic_size={self.synthetic_size}: must be >= 1")
            if not 1 <= self.synthetic_min_digits <= self.synthetic_max_digits:
                problems.append(f"synthetic_min_digits={self.synthetic_min_digits}, synthetic_max_digits="
                                f"{self.synthetic_max_digits}: need 1 <= min <= max")
            if self.prompt_field not in ("prompt", "answer", "task"):
                problems.append(f"prompt_field={self.prompt_field!r}: synthetic rows have the fields prompt, "
                                "answer, task (set prompt_field=prompt)")
        if not self.prompt_field:
            problems.append("prompt_field='': must name the record field holding the prompt")
        if self.prompt_format not in PROMPT_FORMATS:
            problems.append(f"prompt_format={self.prompt_format!r}: allowed {', '.join(PROMPT_FORMATS)}")
        if self.system_prompt and self.prompt_format != "chat":
            problems.append("system_prompt: allowed only with prompt_format=chat")
        if self.chat_template_kwargs and self.prompt_format != "chat":
            problems.append("chat_template_kwargs: allowed only with prompt_format=chat")
        for name in self.chat_template_kwargs:
            if not isinstance(name, str) or not name.isidentifier():
                problems.append(f"chat_template_kwargs.{name}: must be a template variable name")
            elif name in RESERVED_TEMPLATE_VARIABLES:
                problems.append(f"chat_template_kwargs.{name}: set by grpo_jax itself (reserved: "
                                f"{', '.join(RESERVED_TEMPLATE_VARIABLES)})")
        if self.template:
            try:
                _template_fields(self.template)
            except ValueError as e:
                problems.append(f"template={self.template!r}: {e}")
        if self.seed < 0:
            problems.append(f"seed={self.seed}: must be >= 0")
        if not 0 <= self.shuffle_seed < 2**32:  # Grain's index shuffle takes a 32-bit seed
            problems.append(f"shuffle_seed={self.shuffle_seed}: allowed 0 <= shuffle_seed < 2**32")
        if self.num_epochs < 0:
            problems.append(f"num_epochs={self.num_epochs}: must be >= 0 (0 = repeat forever)")
        if self.max_prompt_len < 1:
            problems.append(f"max_prompt_len={self.max_prompt_len}: must be >= 1")
        if self.max_row_bytes < 0:
            problems.append(f"max_row_bytes={self.max_row_bytes}: must be >= 0 (0: max(1 MiB, 256 * max_prompt_len))")
        if self.worker_count < 0:
            problems.append(f"worker_count={self.worker_count}: must be >= 0")
        return problems

    def row_bytes_limit(self) -> int:
        """max_row_bytes, or its default when 0."""
        return self.max_row_bytes or max(MIN_ROW_BYTES_LIMIT, ROW_BYTES_PER_PROMPT_TOKEN * self.max_prompt_len)


def _template_fields(template: str) -> list[str]:
    """Names of the record fields a format string uses ("{a[0]}" and "{a.b}" use field a)."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        name = field.split(".", 1)[0].split("[", 1)[0]
        if name == "" or name.isdigit():
            raise ValueError("use named fields such as {question}, not positional ones such as {} or {0}")
        names.append(name)
    return list(dict.fromkeys(names))


# ---- sources: len(), [i] -> the raw record (or BadRow), raw(i) -> bytes for fingerprints ---------------
# A source refuses a row over its max_row_bytes (0: no limit) in [i], from the row's size alone.


def _row_too_large(size: int, limit: int) -> BadRow:
    return BadRow("row_too_large", f"{size} bytes > data.max_row_bytes={limit}")


class JsonlSource:
    """One JSON object per line. Line offsets are indexed once (numpy, chunked: fine for large files), and the
    content hashed in the same pass; rows are read lazily with pread, which is thread-safe without a shared file
    position. Blank lines are skipped (a trailing newline is not a row)."""

    _CHUNK = 1 << 24

    def __init__(self, path: str | os.PathLike, max_row_bytes: int = 0):
        self.path, self.max_row_bytes = Path(path), max_row_bytes
        bounds, size, last = [np.zeros(1, np.int64)], 0, b"\n"
        content_hash = hashlib.sha256()
        try:
            with open(self.path, "rb") as f:
                while chunk := f.read(self._CHUNK):
                    content_hash.update(chunk)
                    newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n"))
                    bounds.append(newlines.astype(np.int64) + size + 1)
                    size, last = size + len(chunk), chunk[-1:]
        except OSError as e:
            raise DataError(f"{self.path}: cannot read ({e.strerror or e})") from e
        bounds = np.concatenate(bounds)
        if bounds[-1] != size:  # the last line has no newline
            bounds = np.append(bounds, size)
        content = np.diff(bounds) - 1  # line length without its newline
        if last != b"\n":
            content[-1] += 1
        self._bounds = bounds
        self._lines = np.flatnonzero(content > 0)  # row -> line number (0-based)
        self.size = size
        self.sha256 = content_hash.hexdigest()
        self._fd = None
        self._lock = threading.Lock()

    def __getstate__(self):  # the fd is per process: worker processes reopen the file
        state = dict(self.__dict__)
        state["_fd"], state["_lock"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lines)

    def _span(self, i: int) -> tuple[int, int]:
        line = int(self._lines[i])
        return int(self._bounds[line]), int(self._bounds[line + 1])

    def raw(self, i: int) -> bytes:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
        start, end = self._span(i)
        return os.pread(self._fd, end - start, start)

    def __getitem__(self, i: int) -> Any:
        start, end = self._span(i)
        if 0 < self.max_row_bytes < end - start:
            raise _row_too_large(end - start, self.max_row_bytes)
        raw = self.raw(i)
        where = f"{self.path.name} line {int(self._lines[i]) + 1}"
        encoding = json.detect_encoding(raw)  # as json.loads reads bytes: a UTF-8 byte-order mark is no error
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as e:
            raise BadRow("bad_json", f"{where}: not {encoding} text ({e.reason} at byte {e.start})") from None
        try:
            # Bounded: a row nested thousands deep, or a 5000-digit integer, is a bad row, not an exception that
            # stops the run on every resume; and every later walk of the row (json_value, a checkpoint, a reward's
            # copy) stays far from the recursion limit. NaN stays readable: pandas writes it (json_value names it).
            return json_text.loads(text, max_depth=json_text.MAX_DEPTH, allow_nan=True)
        except json_text.JSONTextError as e:
            raise BadRow("bad_json", f"{where}: {e}") from None

    def identity(self) -> dict:
        # The file name, size and content, not its directory: the same data under another mount still resumes.
        return {"kind": "jsonl", "file": self.path.name, "bytes": self.size, "sha256": self.sha256}

    def __del__(self, _close=os.close):  # bound now: at interpreter exit the module's `os` may be gone
        if getattr(self, "_fd", None) is not None:
            _close(self._fd)


class ParquetSource:
    """A Parquet file read through pyarrow. The table is loaded once per process (memory-mapped; columnar, so
    compact) because shuffled access touches every row group; a row is a one-row slice of it."""

    def __init__(self, path: str | os.PathLike, max_row_bytes: int = 0):
        import pyarrow.parquet as pq

        self.path, self.max_row_bytes = Path(path), max_row_bytes
        try:
            parquet = pq.ParquetFile(self.path)
            # Read once here, so the table is then mapped from the page cache.
            with open(self.path, "rb") as f:
                self.sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError) for a non-parquet file
            raise DataError(f"{self.path}: cannot read as Parquet ({e})") from e
        self._rows = parquet.metadata.num_rows
        self._schema = str(parquet.schema_arrow)
        self.size = self.path.stat().st_size
        self._table = None
        self._lock = threading.Lock()

    def __getstate__(self):  # worker processes map the file themselves
        state = dict(self.__dict__)
        state["_table"], state["_lock"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _get_table(self):
        if self._table is None:
            import pyarrow.parquet as pq

            with self._lock:
                if self._table is None:
                    self._table = pq.read_table(self.path, memory_map=True)
        return self._table

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, i: int) -> Any:
        row = self._get_table().slice(int(i), 1)
        if 0 < self.max_row_bytes < row.nbytes:  # the bytes of the row's values, counted without copying them
            raise _row_too_large(row.nbytes, self.max_row_bytes)
        return row.to_pylist()[0]

    def raw(self, i: int) -> bytes:
        return _canonical(self._get_table().slice(int(i), 1).to_pylist()[0])

    def identity(self) -> dict:
        return {"kind": "parquet", "file": self.path.name, "bytes": self.size, "schema": self._schema,
                "sha256": self.sha256}


def _plain(value: Any) -> Any:
    """TFDS decodes to numpy: text as bytes, numbers as numpy scalars. Make them plain Python values."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class TfdsSource:
    """A prepared TFDS dataset in the array_record format, read through tfds.data_source (no TensorFlow).
    Identified by name, split, version and size, not content: TFDS writes a prepared version once
    (tools/prepare_tfds.py refuses to overwrite one)."""

    def __init__(self, name: str, split: str, data_dir: str = "", max_row_bytes: int = 0):
        import tensorflow_datasets as tfds  # slow import; only when this source is used

        self.name, self.split, self.data_dir, self.max_row_bytes = name, split, data_dir, max_row_bytes
        where = f"data_dir {data_dir}" if data_dir else "TFDS's default data_dir"
        try:
            self._ds = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
        except tfds.core.registered.DatasetNotFoundError:
            # TFDS's own message lists the whole catalog; this one says what to do.
            raise DataError(f"tfds dataset {name!r} not found in {where} (prepare it with "
                            "tools/prepare_tfds.py)") from None
        except Exception as e:  # TFDS raises ValueError/AssertionError/FileNotFoundError, by case
            raise DataError(f"tfds dataset {name!r} split {split!r} in {where}: {str(e)[:500]}") from e
        info = self._ds.dataset_info
        self._identity = {"kind": "tfds", "name": name, "split": split, "version": str(info.version),
                          "bytes": int(info.splits[split].num_bytes)}

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i: int) -> Any:
        # The serialized record first: its size decides before it is decoded (tfds's DataSource.__getitem__ is
        # these two steps).
        record = self._ds.data_source[int(i)]
        if 0 < self.max_row_bytes < len(record):
            raise _row_too_large(len(record), self.max_row_bytes)
        return _plain(self._ds._deserialize(record))

    def raw(self, i: int) -> bytes:
        return _canonical(_plain(self._ds[int(i)]))

    def identity(self) -> dict:
        return dict(self._identity)


class SyntheticSource:
    """tasks.make_synthetic_dataset rows, generated in memory (deterministic from task/size/seed/digits)."""

    def __init__(self, task: str, size: int, seed: int, min_digits: int, max_digits: int):
        self._rows = make_synthetic_dataset(task, size, seed, min_digits, max_digits)
        self._identity = {"kind": "synthetic", "task": task, "size": size, "seed": seed,
                          "digits": [min_digits, max_digits]}

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> Any:
        return dict(self._rows[i])  # a copy: consumers may mutate records

    def raw(self, i: int) -> bytes:
        return _canonical(self._rows[i])

    def identity(self) -> dict:
        return dict(self._identity)


def json_value(value: Any, where: str = "row", depth: int = 0) -> Any:
    """`value` as plain JSON values, faithfully where JSON allows (docs/data-and-rewards.md lists the forms):
    datetime, date, time -> ISO 8601 strings; timedelta -> seconds; Decimal, UUID -> their exact strings;
    bytes -> the text if they are UTF-8, else base64; NaN and infinities -> "NaN", "Infinity", "-Infinity"
    (float() reads all of these back); numpy scalars and arrays -> Python numbers and lists; tuples ->
    lists; mapping keys -> strings. Any other type, or containers nested deeper than json_text.MAX_DEPTH (the
    row's own object is level 1, as a JSONL row is read), makes the row bad (unsupported_value). `depth`: the
    containers around `value`."""
    if isinstance(value, np.datetime64):
        return str(np.datetime_as_string(value))
    if isinstance(value, np.timedelta64):
        return json_value(float(value / np.timedelta64(1, "s")), where, depth)
    if isinstance(value, np.generic):  # np.float64 is a float and np.str_ a str: make them plain first
        return json_value(value.item(), where, depth)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value)
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, (dict, list, tuple)) and depth >= json_text.MAX_DEPTH:
        shown = where if len(where) <= 60 else where[:60] + "..."
        raise BadRow("unsupported_value", f"{shown} is nested more than {json_text.MAX_DEPTH} deep")
    if isinstance(value, dict):
        return {str(k): json_value(v, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, np.ndarray):
        return json_value(value[()] if value.ndim == 0 else list(value), where, depth)
    raise BadRow("unsupported_value", f"{where} is a {type(value).__name__}, which has no JSON form")


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr).encode("utf-8")


def source_file(config: DataConfig) -> Path:
    """The file a jsonl or parquet source reads: data.path, or its split's file when data.path is a directory
    (DataError naming the splits there when it has none)."""
    path = Path(config.path)
    if path.is_dir():
        path = path / f"{config.split}.{config.source}"
        if not path.is_file():
            have = sorted(p.stem for p in path.parent.glob(f"*.{config.source}"))
            raise DataError(f"{path}: not found (split {config.split!r}; {config.source} splits in "
                            f"{path.parent}: {', '.join(have) or 'none'})")
    elif not path.is_file():
        raise DataError(f"{path}: no such file or directory (data.path)")
    return path


def open_source(config: DataConfig):
    """The random-access source config names. Raises DataError for a missing file/split or no rows."""
    problems = config.validate()
    if problems:
        raise DataError("invalid data config: " + "; ".join(problems))
    if config.source == "jsonl":
        source = JsonlSource(source_file(config), config.row_bytes_limit())
    elif config.source == "parquet":
        source = ParquetSource(source_file(config), config.row_bytes_limit())
    elif config.source == "tfds":
        source = TfdsSource(config.tfds_name, config.split, config.tfds_data_dir, config.row_bytes_limit())
    else:  # rows of a few dozen bytes
        source = SyntheticSource(config.synthetic_task, config.synthetic_size, config.seed,
                                 config.synthetic_min_digits, config.synthetic_max_digits)
    if len(source) == 0:
        raise DataError(f"{_describe(config)}: the dataset has no rows")
    return source


def _describe(config: DataConfig) -> str:
    if config.source in ("jsonl", "parquet"):
        return f"{config.path} (split {config.split})" if Path(config.path).is_dir() else config.path
    if config.source == "tfds":
        return f"tfds {config.tfds_name}:{config.split}"
    return f"synthetic {config.synthetic_task}"


def check_fields(config: DataConfig, source) -> None:
    """Refuse up front a field name no row has (else every row would come out bad_row). Checked against the
    first row that is a JSON object; rows missing a field later become bad_row missing_field."""
    for i in range(min(len(source), 100)):
        try:
            row = source[i]
        except BadRow:
            continue
        if isinstance(row, dict):
            break
    else:
        raise DataError(f"{_describe(config)}: none of the first rows is a JSON object")
    wanted = [("prompt_field", config.prompt_field)] + ([("answer_field", config.answer_field)]
                                                        if config.answer_field else [])
    if config.template:
        wanted += [("template field", name) for name in _template_fields(config.template)]
    for what, name in wanted:
        if name not in row:
            raise DataError(f"{_describe(config)}: {what} {name!r} is not a field of the records (row {i} has "
                            f"{', '.join(map(repr, row)) or 'no fields'})")


# ---- records ------------------------------------------------------------------------------------------


def _picklable(tokenizer):
    """A shallow copy without the compiled jinja template, which cannot be pickled (worker processes
    recompile it on first use)."""
    tokenizer = copy.copy(tokenizer)
    if getattr(tokenizer, "_template", None) is not None:
        tokenizer._template = None
    return tokenizer


class RowReader:
    """(epoch, dataset_index) -> a prompt record, or a bad_row record for a malformed row: the training stream's
    map, and how readers outside it (held-out evaluation) read rows as training does. prompt_text(row): the row's
    prompt text (BadRow for a malformed row).

    A prompt longer than data.max_prompt_len, or than sampler_max_prompt_len (what the sampler can take; 0:
    no such limit), is a bad row: it could never be sampled. A text longer than the limit in characters is
    first checked against the tokenizer's lower bound on its tokens, so one that cannot fit is not tokenized."""

    def __init__(self, source, config: DataConfig, tokenizer, sampler_max_prompt_len: int = 0):
        self.source, self.config, self.tokenizer = source, config, tokenizer
        self.limit, self.limit_key = config.max_prompt_len, "data.max_prompt_len"
        if 0 < sampler_max_prompt_len < config.max_prompt_len:
            self.limit, self.limit_key = sampler_max_prompt_len, "sampler.max_prompt_len"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["tokenizer"] = _picklable(self.tokenizer)
        return state

    def __call__(self, item: tuple[int, int]) -> dict:
        epoch, index = int(item[0]), int(item[1])
        record = {"dataset_index": index, "epoch": epoch}
        try:
            row = json_value(self.source[index])
            text = self.prompt_text(row)
            chat = self.config.prompt_format == "chat"
            if len(text) > self.limit:  # a shorter text is quick to tokenize
                at_least = self.tokenizer.min_tokens(text) + (0 if chat else len(self.tokenizer.prompt_prefix))
                if at_least > self.limit:
                    raise BadRow("prompt_too_long", f"at least {at_least} tokens ({len(text)} characters) > "
                                                       f"{self.limit_key}={self.limit}")
            ids = self.tokenizer.encode_prompt(text, chat=chat)
            if len(ids) > self.limit:
                raise BadRow("prompt_too_long", f"{len(ids)} tokens > {self.limit_key}={self.limit}")
        except BadRow as e:
            return {**record, "bad_row": e.reason, "detail": e.detail}
        return {**record, "row": row, "prompt_text": text, "prompt_ids": np.asarray(ids, np.int32)}

    def prompt_text(self, row: Any) -> str:
        c = self.config
        if not isinstance(row, dict):
            raise BadRow("not_an_object", f"expected a JSON object, got {type(row).__name__}")
        for field in (c.prompt_field, c.answer_field):
            if field and field not in row:
                raise BadRow("missing_field", f"no field {field!r}")
        prompt = row[c.prompt_field]
        if not isinstance(prompt, str):
            raise BadRow("bad_field_type", f"{c.prompt_field!r} is {type(prompt).__name__}, expected a string")
        if not prompt.strip():
            raise BadRow("empty_prompt", f"{c.prompt_field!r} is empty")
        if c.template:
            try:
                prompt = c.template.format(**row)
            except KeyError as e:
                raise BadRow("missing_field", f"no field {e.args[0]!r} (used by the template)") from None
            except (ValueError, TypeError, IndexError, AttributeError) as e:
                raise BadRow("template_error", f"template failed: {e}") from None
        if c.prompt_format == "plain":
            return prompt
        messages = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **c.chat_template_kwargs)


def _tokenizer_hash(tokenizer) -> str:
    # The whole tokenizer.json (vocab, merges, normalizer, added tokens) plus what the Tokenizer adds on top.
    # Tokenizer has no public serialisation accessor, hence _tok.
    h = hashlib.sha256(tokenizer._tok.to_str().encode("utf-8"))
    h.update(_canonical([tokenizer.chat_template, tokenizer.eos_token, tokenizer.bos_token,
                         tokenizer.pad_token, list(tokenizer.eos_ids), list(tokenizer.prompt_prefix)]))
    return h.hexdigest()


def _fingerprint(config: DataConfig, source, tokenizer) -> str:
    n = len(source)
    parts = {
        "version": STATE_VERSION,
        "source": source.identity(),
        "rows": n,
        "first": hashlib.sha256(source.raw(0)).hexdigest(),
        "last": hashlib.sha256(source.raw(n - 1)).hexdigest(),
        # What turns a row into prompt ids, and the order of the stream (num_epochs and worker_count are
        # not here: the stream's elements do not depend on them).
        "prompt": [config.prompt_field, config.answer_field, config.prompt_format, config.template,
                   config.system_prompt, config.max_prompt_len,
                   # only when set, so that the fingerprints of checkpoints saved before it existed still match
                   *([config.chat_template_kwargs] if config.chat_template_kwargs else [])],
        "order": [config.shuffle, config.shuffle_seed],
        "tokenizer": _tokenizer_hash(tokenizer),
    }
    return FINGERPRINT_PREFIX + hashlib.sha256(_canonical(parts)).hexdigest()[:32]


def dataset_fingerprint(config: DataConfig, tokenizer) -> str:
    """A string that changes with the data (source identity: a JSONL or Parquet file's content hash; size,
    first/last rows, row count), the prompt format (fields, template, system prompt, max length), the shuffle
    order and the tokenizer. Stored with a checkpoint so a resume against different data refuses to start.
    data.max_row_bytes is not in it: like the sampler's prompt limit it changes which rows are bad, not the
    positions of the stream."""
    return _fingerprint(config, open_source(config), tokenizer)


# ---- the pipeline -------------------------------------------------------------------------------------


class _EpochOf:
    """Grain map_with_index: global element i -> (epoch, dataset_index). A class, so workers can pickle it."""

    def __init__(self, rows: int):
        self.rows = rows

    def __call__(self, i: int, dataset_index: int) -> tuple[int, int]:
        return i // self.rows, int(dataset_index)


class DataIterator:
    """Iterates records; get_state/set_state checkpoint it exactly (see the module docstring)."""

    def __init__(self, it, *, fingerprint: str, rows: int, worker_count: int, shard_index: int, shard_count: int):
        self._it = it
        self.fingerprint, self.rows = fingerprint, rows
        self.worker_count, self.shard_index, self.shard_count = worker_count, shard_index, shard_count

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict:
        return next(self._it)

    def get_state(self) -> dict:
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint, "worker_count": self.worker_count,
                "shard_index": self.shard_index, "shard_count": self.shard_count,
                "grain": self._it.get_state()}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "grain" not in state:
            raise DataError(f"data iterator state: not a version-{STATE_VERSION} state from "
                            "DataIterator.get_state")
        if state["fingerprint"] != self.fingerprint:
            raise DataError(f"data iterator state is for another dataset, tokenizer or prompt format "
                            f"(fingerprint {state['fingerprint']}, this pipeline {self.fingerprint})")
        if state["worker_count"] != self.worker_count:
            raise DataError(f"data iterator state was saved with worker_count={state['worker_count']}, this "
                            f"pipeline has worker_count={self.worker_count}: Grain cannot restore its state "
                            f"under another worker count (set data.worker_count={state['worker_count']})")
        if (state["shard_index"], state["shard_count"]) != (self.shard_index, self.shard_count):
            raise DataError(f"data iterator state is for shard {state['shard_index']} of {state['shard_count']}, "
                            f"this pipeline reads shard {self.shard_index} of {self.shard_count}")
        self._it.set_state(state["grain"])

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def make_data_iterator(config: DataConfig, tokenizer, shard_index: int = 0, shard_count: int = 1,
                       sampler_max_prompt_len: int = 0) -> DataIterator:
    """The record stream of shard `shard_index` of `shard_count` (usually jax.process_index()/process_count()).
    sampler_max_prompt_len: the sampler's prompt limit, when it is below data.max_prompt_len (longer prompts
    become bad rows; it does not change the fingerprint: the stream's positions stay the same)."""
    if not 0 <= shard_index < shard_count:
        raise DataError(f"shard_index={shard_index}, shard_count={shard_count}: "
                        "need 0 <= shard_index < shard_count")
    source = open_source(config)
    check_fields(config, source)
    if config.prompt_format == "chat" and tokenizer.chat_template is None:
        raise DataError(f"prompt_format=chat: tokenizer {tokenizer.source} has no chat template")
    rows = len(source)

    ds = grain.MapDataset.range(rows)
    if config.shuffle:
        ds = ds.shuffle(seed=config.shuffle_seed)  # Grain reseeds it with shuffle_seed + epoch per epoch
    ds = ds.repeat(config.num_epochs or None)  # None: forever (length sys.maxsize)
    ds = ds.map_with_index(_EpochOf(rows))
    ds = ds[shard_index::shard_count]
    ds = ds.map(RowReader(source, config, tokenizer, sampler_max_prompt_len))
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS, prefetch_buffer_size=_PREFETCH_BUFFER))
    if config.worker_count > 0:
        # Grain 0.2.18's mp_prefetch reads an absl flag and fails with UnparsedFlagAccessError outside
        # absl.app.run; with nothing parsed, the defaults are what it would get anyway.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.worker_count))
    return DataIterator(iter(it_ds), fingerprint=_fingerprint(config, source, tokenizer), rows=rows,
                        worker_count=config.worker_count, shard_index=shard_index, shard_count=shard_count)
