"""The prompt data pipeline: GSM8K through Grain, exact resume, bad rows, the other sources, sharding."""

import dataclasses
import importlib.util
import json
import pathlib
import types

import pytest

from grpo_jax import json_text
from grpo_jax.config_io import ConfigError, load_config
from grpo_jax.data import pipeline as data
from grpo_jax.data.collector import Collector
from grpo_jax.data.pipeline import DataConfig, DataError, dataset_fingerprint, make_data_iterator
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.state.checkpoint import with_checksum

TEMPLATE = "Question: {question}\nAnswer:"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.byte_level()


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir):
    return {split: [json.loads(line) for line in (gsm8k_dir / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "test")}


def _take(it, n):
    return [next(it) for _ in range(n)]


def _keys(records):
    return [(r["epoch"], r["dataset_index"]) for r in records]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load_prepare_tfds():
    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "prepare_tfds.py"
    spec = importlib.util.spec_from_file_location("prepare_tfds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_records_carry_index_epoch_row_and_prompt(gsm8k_dir, gsm8k_rows, tok):
    config = DataConfig(path=str(gsm8k_dir), split="train", template=TEMPLATE)
    it = make_data_iterator(config, tok)
    assert it.rows == len(gsm8k_rows["train"]) == 7473
    for r in _take(it, 50):
        assert set(r) == {"dataset_index", "epoch", "row", "prompt_text", "prompt_ids"}
        assert r["epoch"] == 0
        row = gsm8k_rows["train"][r["dataset_index"]]
        assert r["row"] == row
        assert r["prompt_text"] == f"Question: {row['question']}\nAnswer:"
        assert list(r["prompt_ids"]) == tok.encode(r["prompt_text"])
    # A file path works as well as directory + split; without a template the prompt is the field itself.
    it = make_data_iterator(DataConfig(path=str(gsm8k_dir / "test.jsonl"), shuffle=False), tok)
    r = next(it)
    assert (r["dataset_index"], r["prompt_text"]) == (0, gsm8k_rows["test"][0]["question"])


def test_epochs_are_seeded_permutations(gsm8k_dir, tok):
    config = DataConfig(path=str(gsm8k_dir), split="test", shuffle_seed=7)
    n = 1319
    stream = _take(make_data_iterator(config, tok), 3 * n)
    epochs = [[r["dataset_index"] for r in stream[e * n:(e + 1) * n]] for e in range(3)]
    assert [r["epoch"] for r in stream] == [i // n for i in range(3 * n)]
    for order in epochs:
        assert sorted(order) == list(range(n))  # each epoch visits every row exactly once
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
    # Deterministic from shuffle_seed; another seed is another order; no shuffle is the file order.
    assert _keys(_take(make_data_iterator(config, tok), n)) == _keys(stream[:n])
    other = _take(make_data_iterator(dataclasses.replace(config, shuffle_seed=8), tok), n)
    assert [r["dataset_index"] for r in other] != epochs[0]
    plain = _take(make_data_iterator(dataclasses.replace(config, shuffle=False), tok), n + 2)
    assert _keys(plain) == [(i // n, i % n) for i in range(n + 2)]


def test_finite_epochs_end_the_stream(gsm8k_dir, tok):
    it = make_data_iterator(DataConfig(path=str(gsm8k_dir), split="test", num_epochs=2), tok)
    records = list(it)
    assert len(records) == 2 * 1319 and records[-1]["epoch"] == 1


@pytest.mark.parametrize("stop", [5, 1319 - 3, 1319, 2 * 1319 + 4])  # mid-epoch, before/at/after a boundary
def test_state_resumes_exactly(gsm8k_dir, tok, stop):
    config = DataConfig(path=str(gsm8k_dir), split="test", template=TEMPLATE, shuffle_seed=3)
    it = make_data_iterator(config, tok)
    _take(it, stop)
    state = json.loads(json.dumps(it.get_state()))  # JSON-serialisable, survives a round trip
    assert state["worker_count"] == 0 and state["grain"] == {"next_index": stop}
    expected = _take(it, 20)

    resumed = make_data_iterator(config, tok)
    resumed.set_state(state)
    got = _take(resumed, 20)
    assert _keys(got) == _keys(expected)
    assert [list(r["prompt_ids"]) for r in got] == [list(r["prompt_ids"]) for r in expected]
    assert got[-1]["epoch"] == (stop + 19) // 1319


def test_state_refuses_other_dataset_worker_count_and_shard(gsm8k_dir, tok):
    config = DataConfig(path=str(gsm8k_dir), split="test")
    it = make_data_iterator(config, tok)
    next(it)
    state = it.get_state()
    with pytest.raises(DataError, match="another dataset"):
        make_data_iterator(dataclasses.replace(config, template=TEMPLATE), tok).set_state(state)
    with pytest.raises(DataError, match="worker_count=2.*worker_count=0"):
        make_data_iterator(config, tok).set_state({**state, "worker_count": 2})
    with pytest.raises(DataError, match="shard 0 of 1"):
        make_data_iterator(config, tok, shard_index=1, shard_count=2).set_state(state)
    with pytest.raises(DataError, match="version-1 state"):
        make_data_iterator(config, tok).set_state({"next_index": 3})


def test_malformed_rows_become_bad_row_records(tmp_path, tok):
    lines = [
        json.dumps({"question": "What is 2+2?", "answer": "4"}),
        json.dumps({"question": "No answer here"}),
        json.dumps({"question": "   ", "answer": "1"}),
        json.dumps({"question": "x" * 300, "answer": "1"}),
        '{"question": "broken", "answer": ',
        "",  # blank lines are skipped, not rows
        json.dumps([1, 2, 3]),
        json.dumps({"question": 5, "answer": "5"}),
        json.dumps({"question": "Last one", "answer": "9"}),  # no trailing newline
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    config = DataConfig(path=str(path), shuffle=False, num_epochs=2, max_prompt_len=100)
    records = list(make_data_iterator(config, tok))
    assert len(records) == 2 * 8  # every row, both epochs: nothing is filtered out
    first = records[:8]
    assert [r["dataset_index"] for r in first] == list(range(8))
    assert [r.get("bad_row") for r in first] == [None, "missing_field", "empty_prompt", "prompt_too_long",
                                                 "bad_json", "not_an_object", "bad_field_type", None]
    for r in first:
        if "bad_row" in r:
            assert set(r) == {"dataset_index", "epoch", "bad_row", "detail"} and r["detail"]
            assert r["bad_row"] in data.BAD_ROW_REASONS
    assert "'answer'" in first[1]["detail"] and "300 tokens" in first[3]["detail"]
    assert "line 5" in first[4]["detail"]  # the file's line number, blank lines counted
    assert first[7]["prompt_text"] == "Last one"
    assert [r.get("bad_row") for r in records[8:]] == [r.get("bad_row") for r in first]


def _row_with_meta(i: int, meta: str) -> str:
    return json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)})[:-1] + f', "meta": {meta}}}'


# Valid JSON that json.loads cannot read (RecursionError; ValueError over sys.get_int_max_str_digits), and rows that
# pass the read at its bounds: nested MAX_DEPTH deep (the row's own object is level 1), and NaN (which pandas writes).
DEEP_ROWS = {
    1: ("[" * 2000 + "]" * 2000, "nested 2001 deep, more than the 100 levels read"),
    3: ("1" * 5000, "an integer longer than the 4300 digits read"),
    4: ("[" * 100 + "]" * 100, "nested 101 deep, more than the 100 levels read"),
    6: ("[" * 99 + "7" + "]" * 99, None),
    7: ("NaN", None),
}


def test_rows_nested_too_deep_or_with_too_long_an_integer_are_bad_rows_and_the_stream_resumes(tmp_path, tok):
    # Each pass of a bad row through the pipeline, the collector and a checkpoint, and a resume past the next ones.
    lines = [_row_with_meta(i, DEEP_ROWS[i % 8][0]) if i % 8 in DEEP_ROWS else _row_with_meta(i, "0")
             for i in range(24)]
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = DataConfig(path=str(path), shuffle=False, num_epochs=1, max_prompt_len=100)

    def account(prompts):
        """Drop the bad rows as the actor does, train the rest; (dataset_index, detail) of the drops."""
        drops = []
        for p in prompts:
            if p.bad_row:
                collector.mark_dropped(p.ordinal, "bad_row", f"{p.bad_row}: {p.record['detail']}")
                drops.append((p.dataset_index, p.record["detail"]))
            else:
                collector.mark_finished(p.ordinal)
                collector.mark_trained([p.ordinal])
        return drops

    def expected(indices):
        return [(i, f"deep.jsonl line {i + 1}: {DEEP_ROWS[i % 8][1]}") for i in indices
                if i % 8 in DEEP_ROWS and DEEP_ROWS[i % 8][1]]

    collector = Collector(make_data_iterator(config, tok), handout_size=4)
    first = collector.handout() + collector.handout()
    assert account(first) == expected(range(8))
    good = {p.dataset_index: p.record["row"] for p in first if not p.bad_row}
    assert good[7]["meta"] == "NaN" and good[6]["meta"] == json.loads(DEEP_ROWS[6][0])  # kept, as plain JSON
    # What a checkpoint writes (the buffer's rows, the collector's state) writes and reads back.
    assert with_checksum({"rows": list(good.values())})["rows"] == list(good.values())
    state = json.loads(json.dumps(collector.checkpoint_state([])))

    collector = Collector.restore(make_data_iterator(config, tok), state, handout_size=4)
    rest = [p for handout in iter(collector.handout, []) for p in handout]
    assert [p.dataset_index for p in rest] == list(range(8, 24))
    assert account(rest) == expected(range(8, 24))
    assert collector.is_drained()
    # Evaluation reads held-out rows through the same source: the deep row is one of its bad rows too.
    source = data.JsonlSource(path)
    with pytest.raises(data.BadRow, match="bad_json: deep.jsonl line 2: nested 2001 deep"):
        source[1]


def test_json_value_refuses_a_row_nested_deeper_than_it_reads():
    # Parquet and TFDS rows are Python values already: json_value, which walks them, bounds their depth itself.
    deep = 0
    for _ in range(json_text.MAX_DEPTH):
        deep = [deep]
    assert data.json_value({"meta": deep[0]}) == {"meta": deep[0]}
    with pytest.raises(data.BadRow, match=r"unsupported_value: row\['meta'\]\[0\]\[0\].* is nested more than 100 "
                                             r"deep"):
        data.json_value({"meta": deep})
    for _ in range(2000):
        deep = (deep,)
    with pytest.raises(data.BadRow, match="nested more than 100 deep"):
        data.json_value(deep)


def test_jsonl_index_across_read_chunks(tmp_path, monkeypatch, gsm8k_rows):
    # Large files are indexed chunk by chunk; a tiny chunk puts line boundaries at every chunk edge.
    monkeypatch.setattr(data.JsonlSource, "_CHUNK", 7)
    rows = gsm8k_rows["test"][:40]
    source = data.JsonlSource(_write_jsonl(tmp_path / "t.jsonl", rows))
    assert len(source) == 40 and [source[i] for i in range(40)] == rows


def test_parquet_source_equals_jsonl(tmp_path, gsm8k_rows, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gsm8k_rows["test"][:200]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=64)
    base = DataConfig(path=str(tmp_path), template=TEMPLATE, shuffle_seed=1)
    a = _take(make_data_iterator(base, tok), 450)
    b = _take(make_data_iterator(dataclasses.replace(base, source="parquet"), tok), 450)
    assert _keys(a) == _keys(b)
    assert [r["row"] for r in a] == [r["row"] for r in b]
    assert [list(r["prompt_ids"]) for r in a] == [list(r["prompt_ids"]) for r in b]


def test_tfds_prepared_subset_reads_back(tmp_path, gsm8k_dir, gsm8k_rows, tok):
    prepare = _load_prepare_tfds()
    target = prepare.prepare_jsonl_as_tfds(gsm8k_dir, "gsm8k_small", tmp_path / "tfds", splits=["train"],
                                           max_rows=50)
    assert (target / "dataset_info.json").exists()
    assert list(target.glob("gsm8k_small-train.array_record-*"))
    with pytest.raises(ValueError, match="already prepared"):
        prepare.prepare_jsonl_as_tfds(gsm8k_dir, "gsm8k_small", tmp_path / "tfds", splits=["train"], max_rows=50)

    _write_jsonl(tmp_path / "train.jsonl", gsm8k_rows["train"][:50])
    jsonl = DataConfig(path=str(tmp_path / "train.jsonl"), template=TEMPLATE, shuffle_seed=5)
    tfds_config = dataclasses.replace(jsonl, source="tfds", path="", tfds_name="gsm8k_small",
                                      tfds_data_dir=str(tmp_path / "tfds"))
    a = _take(make_data_iterator(jsonl, tok), 120)
    b_it = make_data_iterator(tfds_config, tok)
    b = _take(b_it, 120)
    assert b_it.rows == 50
    assert _keys(a) == _keys(b)  # TFDS keeps the JSONL order (disable_shuffling), so indices agree
    assert [r["row"] for r in b] == [r["row"] for r in a]  # text comes back as str, not bytes
    assert [r["prompt_text"] for r in b] == [r["prompt_text"] for r in a]

    state = b_it.get_state()
    resumed = make_data_iterator(tfds_config, tok)
    resumed.set_state(json.loads(json.dumps(state)))
    assert _keys(_take(resumed, 10)) == _keys(_take(b_it, 10))
    # A record over data.max_row_bytes (its serialized size) is refused before it is decoded.
    limited = _take(make_data_iterator(dataclasses.replace(tfds_config, max_row_bytes=400), tok), 50)
    refused = [r for r in limited if r.get("bad_row") == "row_too_large"]
    assert 0 < len(refused) < 50 and all(r["detail"].endswith("bytes > data.max_row_bytes=400") for r in refused)
    assert [r["row"] for r in limited if "row" in r] == [r["row"] for r in b[:50] if r["dataset_index"] not in
                                                         {x["dataset_index"] for x in refused}]
    with pytest.raises(DataError, match="Unknown split 'test'"):
        make_data_iterator(dataclasses.replace(tfds_config, split="test"), tok)
    with pytest.raises(DataError, match="'nope' not found"):
        make_data_iterator(dataclasses.replace(tfds_config, tfds_name="nope"), tok)


def test_chat_format_uses_chat_template(gsm8k_dir, gsm8k_rows, tok):
    config = DataConfig(path=str(gsm8k_dir), split="test", prompt_format="chat",
                        system_prompt="Think step by step.")
    r = next(make_data_iterator(config, tok))
    question = gsm8k_rows["test"][r["dataset_index"]]["question"]
    expected = tok.apply_chat_template([{"role": "system", "content": "Think step by step."},
                                        {"role": "user", "content": question}], add_generation_prompt=True)
    assert r["prompt_text"] == expected
    assert r["prompt_text"].startswith("<|im_start|>system\n")
    assert r["prompt_text"].endswith("<|im_start|>assistant\n")
    assert list(r["prompt_ids"]) == tok.encode(expected)
    assert tok.token_to_id("<|im_start|>") in list(r["prompt_ids"])  # the special token, not its bytes
    # The template builds the user message.
    r = next(make_data_iterator(dataclasses.replace(config, system_prompt="", template=TEMPLATE), tok))
    question = gsm8k_rows["test"][r["dataset_index"]]["question"]
    assert r["prompt_text"] == (f"<|im_start|>user\nQuestion: {question}\nAnswer:<|im_end|>\n"
                                "<|im_start|>assistant\n")
    no_chat = Tokenizer.byte_level(extra_special_tokens=("<|endoftext|>",))
    with pytest.raises(DataError, match="no chat template"):
        make_data_iterator(config, no_chat)


def test_chat_template_kwargs_reach_the_template_and_the_fingerprint(gsm8k_dir, tok, tmp_path):
    from test_tokenizer import THINKING_TEMPLATE

    tok.save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": THINKING_TEMPLATE}))
    thinking = Tokenizer.from_dir(tmp_path)
    config = DataConfig(path=str(gsm8k_dir), split="test", prompt_format="chat")
    answer_at_once = dataclasses.replace(config, chat_template_kwargs={"enable_thinking": False})
    first, direct = next(make_data_iterator(config, thinking)), next(make_data_iterator(answer_at_once, thinking))
    assert first["dataset_index"] == direct["dataset_index"]
    assert first["prompt_text"].endswith("<|im_start|>assistant\n")
    assert direct["prompt_text"] == first["prompt_text"] + "<think>\n\n</think>\n\n"
    assert list(direct["prompt_ids"]) == thinking.encode(direct["prompt_text"])
    # Other prompts, another stream: a checkpoint saved with one refuses to resume with the other.
    assert dataset_fingerprint(answer_at_once, thinking) != dataset_fingerprint(config, thinking)
    problems = DataConfig(path=str(gsm8k_dir), chat_template_kwargs={"enable_thinking": False, "messages": [],
                                                                     "two words": 1}).validate()
    assert problems == ["chat_template_kwargs: allowed only with prompt_format=chat",
                        "chat_template_kwargs.messages: set by grpo_jax itself (reserved: messages, "
                        "add_generation_prompt, tools, documents, bos_token, eos_token, pad_token)",
                        "chat_template_kwargs.two words: must be a template variable name"], problems


def test_sharding_splits_the_stream_disjointly(gsm8k_dir, tok):
    config = DataConfig(path=str(gsm8k_dir), split="test", shuffle_seed=2, num_epochs=1)
    whole = list(make_data_iterator(config, tok))
    shards = [list(make_data_iterator(config, tok, shard_index=k, shard_count=3)) for k in range(3)]
    assert [len(s) for s in shards] == [440, 440, 439]  # 1319 = 3 * 439 + 2
    for k, shard in enumerate(shards):
        assert _keys(shard) == _keys(whole[k::3])  # global element i goes to shard i % 3, global indices kept
    indices = [r["dataset_index"] for s in shards for r in s]
    assert sorted(indices) == list(range(1319))
    with pytest.raises(DataError, match="shard_index=3"):
        make_data_iterator(config, tok, shard_index=3, shard_count=3)


def test_worker_processes_give_the_same_stream_and_resume(gsm8k_dir, tok):
    config = DataConfig(path=str(gsm8k_dir), split="test", template=TEMPLATE, worker_count=2)
    tok.apply_chat_template([{"role": "user", "content": "x"}])  # a compiled template must not break pickling
    expected = _take(make_data_iterator(dataclasses.replace(config, worker_count=0), tok), 30)
    it = make_data_iterator(config, tok)
    try:
        first = _take(it, 13)
        state = json.loads(json.dumps(it.get_state()))
        rest = _take(it, 17)
        assert _keys(first + rest) == _keys(expected)
        resumed = make_data_iterator(config, tok)
        try:
            resumed.set_state(state)
            assert _keys(_take(resumed, 17)) == _keys(rest)
        finally:
            resumed.close()
        with pytest.raises(DataError, match="worker_count=2"):
            make_data_iterator(dataclasses.replace(config, worker_count=0), tok).set_state(state)
    finally:
        it.close()


def test_synthetic_source(tok):
    config = DataConfig(source="synthetic", prompt_field="prompt", synthetic_task="add", synthetic_size=10,
                        shuffle=False)
    records = _take(make_data_iterator(config, tok), 11)
    assert records[0]["prompt_text"].startswith("add: ") and records[0]["prompt_text"].endswith("=")
    assert (records[10]["epoch"], records[10]["dataset_index"]) == (1, 0)


def test_fingerprint_tracks_data_template_and_tokenizer(tmp_path, gsm8k_dir, tok):
    config = DataConfig(path=str(gsm8k_dir), split="test")
    fp = dataset_fingerprint(config, tok)
    assert fp == dataset_fingerprint(config, Tokenizer.byte_level())  # stable
    assert fp == make_data_iterator(config, tok).fingerprint
    # The same file under another directory is the same dataset.
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "test.jsonl").write_bytes((gsm8k_dir / "test.jsonl").read_bytes())
    assert dataset_fingerprint(dataclasses.replace(config, path=str(tmp_path / "copy")), tok) == fp
    different = [
        dataset_fingerprint(dataclasses.replace(config, split="train"), tok),
        dataset_fingerprint(dataclasses.replace(config, template=TEMPLATE), tok),
        dataset_fingerprint(dataclasses.replace(config, prompt_format="chat"), tok),
        dataset_fingerprint(dataclasses.replace(config, shuffle_seed=1), tok),
        dataset_fingerprint(dataclasses.replace(config, max_prompt_len=512), tok),
        dataset_fingerprint(config, Tokenizer.byte_level(extra_special_tokens=("<|endoftext|>", "<|x|>"))),
    ]
    rows = (gsm8k_dir / "test.jsonl").read_text().splitlines()
    (tmp_path / "copy" / "test.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    different.append(dataset_fingerprint(dataclasses.replace(config, path=str(tmp_path / "copy")), tok))
    assert len(set(different + [fp])) == len(different) + 1
    # worker_count and num_epochs do not change the elements of the stream.
    assert dataset_fingerprint(dataclasses.replace(config, worker_count=3, num_epochs=2), tok) == fp


def test_clear_errors(tmp_path, gsm8k_dir, tok):
    with pytest.raises(DataError, match="nowhere.jsonl: no such file"):
        make_data_iterator(DataConfig(path=str(tmp_path / "nowhere.jsonl")), tok)
    with pytest.raises(DataError, match=r"validation\.jsonl: not found.*test, train"):
        make_data_iterator(DataConfig(path=str(gsm8k_dir), split="validation"), tok)
    with pytest.raises(DataError, match="template field 'problem' is not a field.*'question', 'answer'"):
        make_data_iterator(DataConfig(path=str(gsm8k_dir), split="test", template="Q: {problem}"), tok)
    with pytest.raises(DataError, match="prompt_field 'prompt' is not a field"):
        make_data_iterator(DataConfig(path=str(gsm8k_dir), split="test", prompt_field="prompt"), tok)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl: the dataset has no rows"):
        make_data_iterator(DataConfig(path=str(tmp_path / "empty.jsonl")), tok)
    (tmp_path / "train.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="train.parquet: cannot read as Parquet"):
        make_data_iterator(DataConfig(source="parquet", path=str(tmp_path)), tok)
    with pytest.raises(DataError, match="positional"):
        make_data_iterator(DataConfig(path=str(gsm8k_dir), template="Q: {}"), tok)


def test_config_validation():
    assert DataConfig(path="x").validate() == []
    problems = DataConfig(source="tfds", split="", prompt_format="plain", system_prompt="s", shuffle_seed=2**32,
                          num_epochs=-1, max_prompt_len=0, worker_count=-1).validate()
    assert len(problems) == 7
    assert any(p.startswith("tfds_name=''") for p in problems)
    assert DataConfig(source="synthetic").validate() == [
        "prompt_field='question': synthetic rows have the fields prompt, answer, task (set prompt_field=prompt)"]
    with pytest.raises(ConfigError, match=r"source='csv': allowed values"):
        load_config(DataConfig, None, ["source=csv", "path=x"])
    with pytest.raises(ConfigError, match="invalid config: path=''"):
        load_config(DataConfig, None, [])
    assert load_config(DataConfig, None, ["path=a.jsonl", "num_epochs=2"]).num_epochs == 2


# ---- size limits: a huge row is refused by its size, unread (issue 20 item 6) ---------------------------------


class SpyTokenizer(Tokenizer):
    """The byte-level tokenizer, recording the length of every text it tokenizes."""

    def __init__(self):
        base = Tokenizer.byte_level()
        super().__init__(base._tok, chat_template=base.chat_template, eos_token=base.eos_token,
                         pad_token=base.pad_token, extra_eos_ids=base.eos_ids, source="spy")
        self.encoded_lengths = []

    def encode(self, text, add_special_tokens=False):
        self.encoded_lengths.append(len(text))
        return super().encode(text, add_special_tokens)


def test_a_row_over_max_row_bytes_is_a_bad_row_that_is_never_read(tmp_path, monkeypatch):
    big = json.dumps({"question": "x" * (3 << 20), "answer": "1"})
    lines = [json.dumps({"question": "What is 2+2?", "answer": "4"}), big,
             json.dumps({"question": "Last one", "answer": "9"})]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    read_rows = []
    raw = data.JsonlSource.raw
    monkeypatch.setattr(data.JsonlSource, "raw", lambda self, i: read_rows.append(i) or raw(self, i))
    tok = SpyTokenizer()
    config = DataConfig(path=str(path), shuffle=False, num_epochs=1, max_prompt_len=100)
    it = make_data_iterator(config, tok)
    read_rows.clear()  # start-up hashes the first and last rows for the fingerprint
    records = list(it)
    assert [r.get("bad_row") for r in records] == [None, "row_too_large", None]
    assert records[1]["detail"] == f"{len(big) + 1} bytes > data.max_row_bytes=1048576"  # the line with its newline
    assert 1 not in read_rows and max(tok.encoded_lengths) < 100  # neither read nor tokenized
    assert config.row_bytes_limit() == 1 << 20  # the default: max(1 MiB, 256 bytes * max_prompt_len)
    # An explicit limit; Parquet measures a row by its values' bytes in the table, without copying them.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "q" * n, "answer": "a"} for n in (10, 500, 20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    records = list(make_data_iterator(DataConfig(source="parquet", path=str(tmp_path), shuffle=False, num_epochs=1,
                                                 max_row_bytes=400), tok))
    assert [r.get("bad_row") for r in records] == [None, "row_too_large", None]
    assert records[1]["detail"].endswith("bytes > data.max_row_bytes=400")
    assert DataConfig(path="x", max_row_bytes=-1).validate() == [
        "max_row_bytes=-1: must be >= 0 (0: max(1 MiB, 256 * max_prompt_len))"]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tmp_path):
    rows = [{"question": "x" * 300_000, "answer": "1"},  # under the 1 MiB row limit, far over 100 tokens
            {"question": "y" * 150, "answer": "2"},  # over 100 characters, but not provably over 100 tokens
            {"question": "z" * 50, "answer": "3"}]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    tok = SpyTokenizer()
    records = list(make_data_iterator(DataConfig(path=str(path), shuffle=False, num_epochs=1, max_prompt_len=100),
                                      tok))
    assert [r.get("bad_row") for r in records] == ["prompt_too_long", "prompt_too_long", None]
    # The byte-level tokenizer's tokens stand for at most 13 bytes (<|endoftext|>): 300000 / 13 -> 23077.
    assert records[0]["detail"] == "at least 23077 tokens (300000 characters) > data.max_prompt_len=100"
    assert records[1]["detail"] == "150 tokens > data.max_prompt_len=100"  # tokenized, counted exactly
    assert 300_000 not in tok.encoded_lengths and 150 in tok.encoded_lengths


# ---- a dataset edited between runs (issue 20 item 8) -------------------------------------------------------------


def _edit_in_place(path, old: bytes, new: bytes):
    """Replace bytes of one middle row with as many others: the file keeps its size."""
    content = path.read_bytes()
    assert len(old) == len(new) and content.count(old) == 1
    path.write_bytes(content.replace(old, new))
    assert path.stat().st_size == len(content)


def test_a_dataset_edited_in_the_middle_is_another_dataset(tmp_path, gsm8k_rows, tok):
    rows = gsm8k_rows["test"][:100]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    config = DataConfig(path=str(path), template=TEMPLATE)
    it = make_data_iterator(config, tok)
    next(it)
    state = it.get_state()
    _edit_in_place(path, json.dumps(rows[50]).encode(), json.dumps({**rows[50], "answer": rows[50]["answer"]
                                                                    .replace("#### ", "####_")}).encode())
    edited = make_data_iterator(config, tok)
    assert [json.loads(line) for line in path.read_text().splitlines()[::99]] == rows[::99]  # first, last rows
    assert edited.rows == it.rows and edited.fingerprint != it.fingerprint
    with pytest.raises(DataError, match="another dataset"):
        edited.set_state(state)
    assert state["fingerprint"].startswith(data.FINGERPRINT_PREFIX)
    # Parquet: the file's bytes are hashed too.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", compression="none")
    parquet = dataclasses.replace(config, source="parquet", path=str(tmp_path))
    before = dataset_fingerprint(parquet, tok)
    question = rows[50]["question"].encode()
    _edit_in_place(tmp_path / "train.parquet", question, question.upper())
    table = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert table[::99] == rows[::99] and table[50] != rows[50]
    assert dataset_fingerprint(parquet, tok) != before


# ---- the BOS of a plain prompt, the same in training, evaluation and generate (issue 20 item 17) ------------------


def test_plain_prompts_start_with_the_bos_in_training_evaluation_and_generate(tmp_path, gsm8k_rows, monkeypatch):
    import transformers

    from grpo_jax import cli
    from grpo_jax.model import hf as hf_io
    from grpo_jax.rollout import sampler
    from grpo_jax.run.config import Config
    from grpo_jax.run.evaluation import held_out_records
    from test_tokenizer import BOT, write_llama3_like

    path = write_llama3_like(tmp_path / "llama3")
    tok, reference = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    bos = tok.token_to_id(BOT)
    _write_jsonl(tmp_path / "train.jsonl", gsm8k_rows["train"][:20])
    _write_jsonl(tmp_path / "test.jsonl", gsm8k_rows["test"][:5])
    config = DataConfig(path=str(tmp_path), template=TEMPLATE, max_prompt_len=512)
    for r in _take(make_data_iterator(config, tok), 10):
        assert list(r["prompt_ids"]) == reference(r["prompt_text"])["input_ids"] and r["prompt_ids"][0] == bos
    # Chat: the template's own BOS, once.
    for r in _take(make_data_iterator(dataclasses.replace(config, prompt_format="chat"), tok), 10):
        assert r["prompt_text"].startswith(BOT) and list(r["prompt_ids"]).count(bos) == 1
    # A template that writes the BOS: one, not two.
    r = next(make_data_iterator(dataclasses.replace(config, template=BOT + TEMPLATE), tok))
    assert list(r["prompt_ids"]).count(bos) == 1 and r["prompt_ids"][0] == bos
    # Evaluation encodes its held-out prompts the same way.
    run_config = load_config(
        Config,
        pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml",
        [
            "data.source=jsonl",
            f"data.path={tmp_path}",
            f"data.template={json.dumps(TEMPLATE)}",
            "data.prompt_field=question",
            "data.max_prompt_len=512",
            "sampler.max_prompt_len=512",
            "eval.split=test",
            f"tokenizer={path}",
        ],
    )
    for r in held_out_records(run_config, tok):
        assert list(r["prompt_ids"]) == reference(r["prompt_text"])["input_ids"] and r["prompt_ids"][0] == bos
    # So does `grpo-jax generate` (its sampler replaced by one that records the prompts it is given).
    given = []

    class RecordingSampler:
        def __init__(self, *args, **kwargs):
            pass

        def generate(self, prompts, keys):
            given.extend(prompts)
            raise KeyboardInterrupt

    stub = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=tok.vocab_size))  # for --top-k's check
    monkeypatch.setattr(hf_io, "load_hf_model", lambda *args, **kwargs: (stub, tok))
    monkeypatch.setattr(sampler, "Sampler", RecordingSampler)
    (tmp_path / "prompts.txt").write_text("What is 2+2?\n")
    for chat in ([], ["--chat"]):
        given.clear()
        with pytest.raises(KeyboardInterrupt):
            cli.cmd_generate(cli.build_parser().parse_args(
                ["generate", "--model", str(path), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens",
                 "4"] + chat))
        text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]) if chat else "What is 2+2?"
        assert given == [tok.encode_prompt(text, chat=bool(chat))] and given[0][0] == bos
        assert given[0].count(bos) == 1
