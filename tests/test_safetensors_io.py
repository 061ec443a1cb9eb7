"""model.safetensors_io: the facade over the `safetensors` package. Every dtype round-trips; files in the layout
the hand-written writer used read the same; a bad file is one CheckpointError naming the file and the tensor;
a write is whole or not at all; a large file is read a tensor at a time."""

import json
import math
import os
import resource
import signal
import stat
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from grpo_jax.errors import CheckpointError
from grpo_jax.model.safetensors_io import DTYPES, SafetensorsFile, load_file, save_file


def _sample(dtype: np.dtype, shape=(2, 3)) -> np.ndarray:
    values = np.arange(math.prod(shape)).reshape(shape) % 5  # small integers: exact in every dtype
    return (values % 2 == 1) if dtype == np.bool_ else values.astype(dtype)


def _file(path, header: dict, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def _old_writer(tensors: dict, path) -> None:
    """The bytes grpo_jax's own writer produced before it went through the package: tensors in the caller's
    order (the package sorts them), `__metadata__` first, compact JSON padded with spaces to 8 bytes."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    names = {dtype: name for name, dtype in DTYPES.items()}
    for name, array in tensors.items():
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [len(data), len(data) + array.nbytes]}
        data += array.tobytes()
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


# ---- every dtype, both ways -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips(name, tmp_path):
    dtype = DTYPES[name]
    value, scalar = _sample(dtype), np.asarray(_sample(dtype, (1,))[0])
    save_file({"x": value, "scalar": scalar, "empty": np.zeros((0, 4), dtype)}, tmp_path / "ours.safetensors")
    back = SafetensorsFile(tmp_path / "ours.safetensors")
    assert back.tensors["x"].dtype == dtype and back.metadata == {"format": "pt"}
    for key, expected in {"x": value, "scalar": scalar}.items():
        got = back.get(key)
        assert got.dtype == dtype and got.shape == expected.shape and not got.flags.writeable
        assert got.tobytes() == expected.tobytes()  # bit for bit
    assert back.get("empty").shape == (0, 4)
    if not name.startswith("F8"):  # the package reads float8 only into torch
        np.testing.assert_array_equal(safetensors.numpy.load_file(tmp_path / "ours.safetensors")["x"], value)
    safetensors.numpy.save_file({"x": value}, tmp_path / "theirs.safetensors")  # the package's own writer
    assert load_file(tmp_path / "theirs.safetensors")["x"].tobytes() == value.tobytes()


def test_files_are_the_bytes_the_package_writes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"z.w": rng.standard_normal((4, 3)).astype(np.float32).T,  # not contiguous
               "a.w": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
               "big_endian": np.arange(3, dtype=">i4")}
    save_file(tensors, tmp_path / "ours.safetensors")
    written = (tmp_path / "ours.safetensors").read_bytes()
    contiguous = {k: np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")) for k, v in tensors.items()}
    safetensors.numpy.save_file(contiguous, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert written == (tmp_path / "ref.safetensors").read_bytes()
    save_file(tensors, tmp_path / "ours.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == written  # the same tensors, the same bytes
    # More metadata keys come back as written (the package writes them in no fixed order).
    save_file(tensors, tmp_path / "meta.safetensors", metadata={"step": "3", "base": "qwen"})
    assert SafetensorsFile(tmp_path / "meta.safetensors").metadata == {"format": "pt", "step": "3", "base": "qwen"}


def test_a_file_in_the_old_writers_layout_reads_the_same(tmp_path):
    tensors = {"model.layers.10.w": np.arange(6, dtype=np.float32).reshape(2, 3),
               "lm_head.weight": np.arange(4).astype(ml_dtypes.bfloat16),
               "model.layers.2.w": np.array(7, np.int64),
               "empty": np.zeros((0,), np.float16),
               "model.embed_tokens.weight": np.arange(5, dtype=np.uint8)}
    _old_writer(tensors, tmp_path / "old.safetensors")
    loaded = load_file(tmp_path / "old.safetensors")
    assert list(loaded) == list(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
        np.testing.assert_array_equal(loaded[name], value)


# ---- bad files --------------------------------------------------------------------------------------------

U8 = {"dtype": "U8", "shape": [2]}
BAD_FILES = {
    # name: (header, data, what the message must say)
    "truncated": ({"a": {**U8, "data_offsets": [0, 2]}, "b": {"dtype": "F32", "shape": [4], "data_offsets": [2, 18]}},
                  bytes(10), r"tensor 'b': data_offsets \[2, 18\] end at byte \d+, beyond the file size.*truncated"),
    "overlapping": ({"a": {**U8, "data_offsets": [0, 2]}, "b": {**U8, "data_offsets": [1, 3]}},
                    bytes(3), r"tensor 'b': data_offsets \[1, 3\] overlaps the end of 'a'"),
    "gap": ({"a": {**U8, "data_offsets": [0, 2]}, "b": {**U8, "data_offsets": [3, 5]}},
            bytes(5), r"tensor 'b': data_offsets \[3, 5\] leaves 1 unused bytes after the end of 'a'"),
    "trailing": ({"a": {**U8, "data_offsets": [0, 2]}}, bytes(5), r"3 bytes after tensor 'a' belong to no tensor"),
    "size_lies": ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(24),
                  r"tensor 'a': holds 20 bytes but shape \[2, 3\] of F32 needs 24"),
    "reversed_offsets": ({"a": {**U8, "data_offsets": [2, 0]}}, bytes(2), r"tensor 'a': bad data_offsets"),
    "unknown_dtype": ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8),
                      r"tensor 'a': unsupported dtype 'C64'"),
    "negative_shape": ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, bytes(1),
                       r"tensor 'a': bad shape \[-1\]"),
    "entry_not_a_tensor": ({"a": {"dtype": "U8"}}, b"", r"tensor 'a': header entry must have dtype, shape"),
    "metadata_not_strings": ({"__metadata__": {"step": 3}, "a": {**U8, "data_offsets": [0, 2]}}, bytes(2),
                             r"__metadata__ must map names to strings"),
    "header_not_an_object": ([1, 2], b"", r"header must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_header_is_one_error_naming_file_and_tensor(case, tmp_path):
    header, data, message = BAD_FILES[case]
    path = _file(tmp_path / f"{case}.safetensors", header, data)
    with pytest.raises(CheckpointError, match=message) as e:
        SafetensorsFile(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("content, message", [
    (b"", r"not a safetensors file \(0 bytes"),
    (b"PK\x03\x04" + bytes(60), r"beyond the file size 64 \(truncated or not a safetensors file\)"),  # torch zip
    (b"\x80\x02}q\x00(X\x04\x00\x00\x00", r"beyond the file size"),  # a pickle
    (b"version https://git-lfs.github.com/spec/v1\n", r"beyond the file size"),  # an LFS pointer, not the weights
    (struct.pack("<Q", 6) + b"\xff\xfe{}  ", r"header is not valid JSON"),
])
def test_a_file_that_is_not_safetensors(content, message, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as e:
        SafetensorsFile(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


def test_missing_file_and_tensor(tmp_path):
    with pytest.raises(CheckpointError, match=r"nothing\.safetensors: cannot read"):
        SafetensorsFile(tmp_path / "nothing.safetensors")
    save_file({"a": np.zeros(2)}, tmp_path / "one.safetensors")
    with pytest.raises(CheckpointError, match=r"one\.safetensors: no tensor named 'b'"):
        SafetensorsFile(tmp_path / "one.safetensors").get("b")


def test_unwritable_values_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"tensor 'c' has dtype complex128"):
        save_file({"c": np.zeros(2, np.complex128)}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"metadata 'step': 3"):
        save_file({"a": np.zeros(2)}, tmp_path / "x.safetensors", metadata={"step": 3})
    assert list(tmp_path.iterdir()) == []


# ---- writes: whole or not at all --------------------------------------------------------------------------


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": np.ones(4, np.float32)}, path)
    before = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))  # a disk that fills up mid-write
    try:
        with pytest.raises(OSError, match="model.safetensors"):
            save_file({"w": np.ones(1 << 18, np.float32)}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_written_file_gets_the_mode_any_new_file_gets(tmp_path):
    # The package itself writes mode 0600; a shared model directory must stay readable as before.
    (tmp_path / "plain").write_bytes(b"")
    save_file({"w": np.ones(2)}, tmp_path / "model.safetensors")
    save_file({"w": np.ones(3)}, tmp_path / "model.safetensors")  # over an existing file too
    mode = stat.S_IMODE(os.stat(tmp_path / "model.safetensors").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode)


# ---- memory: a tensor at a time ---------------------------------------------------------------------------

BIG = 32 << 20  # bytes of the large tensor


def _peak_traced(fn) -> int:
    """Peak bytes Python and numpy allocate while fn runs (mapped file pages are not allocations)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_large_files_are_read_and_written_a_tensor_at_a_time(tmp_path):
    path = tmp_path / "big.safetensors"
    tensors = {"big": np.ones(BIG // 4, np.float32), "small": np.ones(4, np.float32)}
    # Writing copies nothing of a contiguous tensor (safetensors < 0.8 copied every tensor into bytes).
    assert _peak_traced(lambda: save_file(tensors, path)) < BIG // 8
    tensors.clear()
    opened = []
    assert _peak_traced(lambda: opened.append(SafetensorsFile(path).get("small"))) < BIG // 8
    f = SafetensorsFile(path)
    peak = _peak_traced(lambda: float(f.get("big")[-1]))
    assert BIG <= peak < BIG + BIG // 8  # the one tensor asked for, once
