"""Reader and writer for the safetensors format, written directly with numpy (no torch, no safetensors lib).

Layout: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the raw
little-endian tensor bytes, offsets relative to the end of the header. Reading memory-maps the file, so a
tensor is a view into the page cache until the caller converts it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

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
# Real headers are kilobytes to a few MB; a huge value means a corrupt or non-safetensors file.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of the data
    end: int


class SafetensorsFile:
    """An opened, fully validated safetensors file. `get(name)` returns a read-only memory-mapped view."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tensors, self.metadata = read_header(self.path)
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        info = self.tensors[name]
        if self._mmap is None:
            # One map per file, shared by every tensor; np.memmap cannot map an empty file, but a valid
            # file always has at least its 8-byte length prefix.
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        count = math.prod(info.shape)
        flat = np.frombuffer(self._mmap, dtype=info.dtype.newbyteorder("<"), count=count, offset=info.begin)
        return flat.reshape(info.shape)


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
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _parse_entry(path, name, entry, data_start, size)
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


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a file, as memory-mapped read-only arrays."""
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.keys()}


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None):
    """Write tensors in the safetensors format (readable by the safetensors library and transformers).

    transformers refuses files whose metadata lacks format in (pt, tf, flax, mlx), so "pt" is the default.
    """
    path = os.fspath(path)
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    arrays, offset = [], 0
    for name, value in tensors.items():
        array = np.asarray(value)  # not ascontiguousarray: it turns a 0-d array into shape (1,)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in _NAMES:
            raise TypeError(f"{path}: tensor {name!r} has dtype {array.dtype}, not storable in safetensors")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    encoded += b" " * (-len(encoded) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in arrays:
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)  # never leave a half-written file under the real name
