"""Reader and writer for the safetensors format, through the `safetensors` package's numpy API.

Layout: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the raw
little-endian tensor bytes, offsets relative to the end of the header; the tensors cover the data exactly.

Reading: `SafetensorsFile` first checks the header itself (the package's own errors do not say which tensor
is wrong, nor that a file is truncated), so that a bad file is one `CheckpointError` naming the file and the
tensor; the package then memory-maps the file and checks it again. `get(name)` copies that one tensor out of
the map (the package's numpy API hands out copies, not views), so a multi-GB checkpoint is read a tensor at a
time, never whole, and memory holds the tensors the caller keeps. The package has no numpy type for float8
(numpy itself has none); those tensors are read with numpy from the offsets checked here.

Writing: `save_file` writes a temporary file beside the target through the package, fsyncs it, and renames
it over the target, so a crash or a full disk leaves the previous file or the new one, never half of one.
The package orders the tensors by dtype (widest first), then by name, in every file it writes
(transformers' too).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass

import ml_dtypes  # also registers the "bfloat16" numpy dtype name the package asks numpy for
import numpy as np
import safetensors
import safetensors.numpy

from grpo_jax.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The package writes these but reads them only into torch (it asks numpy for a float8 type numpy lacks).
_READ_WITH_NUMPY = {"F8_E4M3", "F8_E5M2"}
# The package's limit: real headers are kilobytes to a few MB; a huge value means a corrupt or
# non-safetensors file.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of the data
    end: int


class SafetensorsFile:
    """An opened, fully validated safetensors file. `get(name)` reads that one tensor, as a read-only array."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tensors, self.metadata = read_header(self.path)
        try:
            self._file = safetensors.safe_open(self.path, framework="np")
        except (safetensors.SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.path}: the safetensors library refuses the file: {_one_line(e)}") from e

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        info = self.tensors[name]
        try:
            if _NAMES[info.dtype] in _READ_WITH_NUMPY:
                count = math.prod(info.shape)
                array = np.fromfile(self.path, dtype=info.dtype, count=count, offset=info.begin).reshape(info.shape)
            else:
                array = self._file.get_tensor(name)
        except (safetensors.SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot read: {_one_line(e)}") from e
        # The array is this call's own copy; read-only all the same, as the file's data it stands for.
        array.flags.writeable = False
        return array


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a file's header without touching the tensor data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte "
                                      "header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: header length {header_len} is beyond the file size {size} "
                                      "(truncated or not a safetensors file)")
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: __metadata__ must map names to strings, got {metadata!r}")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _parse_entry(path, name, entry, data_start, size)
    _check_layout(path, tensors, data_start, size)
    return tensors, metadata


def _parse_entry(path: str, name: str, entry, data_start: int, size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise CheckpointError(f"{where}: header entry must have dtype, shape and data_offsets, got {entry!r}")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"{where}: unsupported dtype {entry['dtype']!r} (supported: {sorted(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: bad data_offsets {offsets!r}")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > size:
        raise CheckpointError(f"{where}: data_offsets {offsets} end at byte {end}, beyond the file size {size} "
                              "(the file is truncated)")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(f"{where}: holds {end - begin} bytes but shape {shape} of {entry['dtype']} "
                              f"needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_layout(path: str, tensors: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """The tensors tile the data: each starts where the one before it ends, and the last ends the file."""
    end, previous = data_start, None
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != end:
            where = f"the end of {previous!r}" if previous else "the end of the header"
            problem = "overlaps" if info.begin < end else f"leaves {info.begin - end} unused bytes after"
            raise CheckpointError(f"{path}: tensor {info.name!r}: data_offsets "
                                  f"{[info.begin - data_start, info.end - data_start]} {problem} {where} "
                                  "(the header's offsets are wrong)")
        end, previous = info.end, info.name if info.end > info.begin else previous
    if end != size:
        after = f"after tensor {previous!r}" if previous else "after the header"
        raise CheckpointError(f"{path}: {size - end} bytes {after} belong to no tensor "
                              "(the header's offsets are wrong, or this is not a safetensors file)")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a file, read into memory (as read-only arrays). A multi-GB file is better read through
    SafetensorsFile, a tensor at a time."""
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.keys()}


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None):
    """Write tensors in the safetensors format (readable by the safetensors library and transformers), whole
    or not at all: the previous file stays until the new one is complete and on disk.

    transformers refuses files whose metadata lacks format in (pt, tf, flax, mlx), so "pt" is the default.
    The same tensors give the same bytes, except that the package writes more than one metadata key in no
    fixed order (a hash map's).
    """
    path = os.fspath(path)
    metadata = {"format": "pt", **(metadata or {})}
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise TypeError(f"{path}: metadata {key!r}: {value!r}: safetensors metadata maps strings to strings")
    arrays = {name: _storable(path, name, value) for name, value in tensors.items()}
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a write cut short; created afresh below, so it gets a fresh mode
    try:
        with open(tmp, "xb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        try:
            safetensors.numpy.save_file(arrays, tmp, metadata=metadata)
        except safetensors.SafetensorError as e:
            raise OSError(f"{path}: cannot write: {_one_line(e)}") from e
        # The package writes through a private temporary file of its own (mode 0600); the file gets the mode
        # that open() gives any other file written here.
        os.chmod(tmp, mode)
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)  # never leave a half-written file under the real name
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync(os.path.dirname(path) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # the rename itself


def _storable(path: str, name: str, value) -> np.ndarray:
    """The array as the package writes it: C-contiguous (it writes the raw buffer), little-endian, a known dtype."""
    array = np.asarray(value)  # not ascontiguousarray: it turns a 0-d array into shape (1,)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.dtype not in _NAMES:
        raise TypeError(f"{path}: tensor {name!r} has dtype {array.dtype}, not storable in safetensors")
    return array


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
