"""Read and write .safetensors files with numpy alone: memory-mapped, read-only, checked.

The format: an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype", "shape",
"data_offsets": [begin, end]}, optional "__metadata__": {str: str}}), then the data, offsets
relative to its start. Every entry is checked against the file before any tensor is handed
out (dtype known, shape and byte length agreeing, inside the file, no two overlapping), so a
truncated download or a foreign file is one UserError naming the file and what is wrong. The
tensors are views of one read-only memory map of the file: nothing is copied or read until used.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import UserError

# safetensors' largest header (its own reader refuses more): a bound before reading N bytes.
MAX_HEADER = 100 * 1024 * 1024
REDOWNLOAD = "re-download it"


def _ml(name: str) -> np.dtype:
    import ml_dtypes  # iree-base-runtime's dependency: bfloat16 and float8 for numpy

    return np.dtype(getattr(ml_dtypes, name))


# safetensors dtype names -> numpy dtypes (little-endian, as the format stores them)
_NUMPY = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
DTYPE_NAMES = tuple(_NUMPY) + tuple(_ML_DTYPES)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (KeyError for an unknown one)."""
    if name in _ML_DTYPES:
        return _ml(_ML_DTYPES[name])
    return np.dtype(_NUMPY[name])


def safetensors_dtype(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype (ValueError for one the format has not)."""
    dtype = np.dtype(dtype)
    for name in DTYPE_NAMES:
        if numpy_dtype(name) == dtype.newbyteorder("<"):
            return name
    raise ValueError(f"safetensors has no dtype for numpy {dtype}")


def _bad(path: Path, problem: str) -> UserError:
    return UserError(f"{path} {problem}; {REDOWNLOAD}")


def read_header(path: Path) -> tuple[dict, int, int]:
    """The parsed JSON header, the data section's offset and the file size; UserError when the
    file is not a well-formed safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, f"is truncated ({size} bytes; a safetensors file has at least 8)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise UserError(
                f"{path} is not a safetensors file (its first 8 bytes give a header of {n} "
                "bytes); is it a checkpoint?"
            )
        if 8 + n > size:
            raise _bad(path, f"is truncated (header says {8 + n} bytes at least, file has {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _bad(path, f"has a damaged header (not JSON: {why})") from None
    if not isinstance(header, dict):
        raise _bad(path, "has a damaged header (not a JSON object)")
    return header, 8 + n, size


class Entry(NamedTuple):
    """One tensor of a safetensors header, checked: its numpy dtype, shape and byte span in the
    data section, and the format's name of its dtype."""

    dtype: np.dtype
    shape: tuple
    begin: int
    end: int
    dtype_name: str


def _check_entry(path: Path, name: str, entry) -> Entry:
    if not isinstance(entry, dict):
        raise _bad(path, f"has a damaged header (entry {name!r} is not an object)")
    dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype_name not in DTYPE_NAMES:
        raise UserError(
            f"{path}: tensor {name!r} has dtype {dtype_name!r}, which sdiree does not read "
            f"({', '.join(DTYPE_NAMES)})"
        )
    ok_shape = isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    )
    ok_offsets = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not ok_shape or not ok_offsets:
        raise _bad(path, f"has a damaged header (tensor {name!r}: shape {shape}, {offsets})")
    dtype = numpy_dtype(dtype_name)
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise _bad(
            path,
            f"has a damaged header (tensor {name!r}: {dtype_name} {shape} needs "
            f"{math.prod(shape) * dtype.itemsize} bytes, its offsets span {end - begin})",
        )
    return Entry(dtype, tuple(shape), begin, end, dtype_name)


def checked_header(path: Path) -> tuple[dict[str, Entry], dict[str, str], int, int]:
    """({name: Entry}, the header's __metadata__, the data section's offset, the file size) of a
    safetensors file, every entry checked against the file; nothing but the header is read."""
    path = Path(path)
    header, data_start, size = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(path, "has a damaged header (__metadata__ is not a map of strings)")
    data_size = size - data_start
    entries = {name: _check_entry(path, name, e) for name, e in header.items()}
    needed = max((e.end for e in entries.values()), default=0)
    if needed > data_size:
        raise _bad(path, f"is truncated (header says {data_start + needed} bytes, file has {size})")
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise _bad(path, f"has a damaged header (tensors {a!r} and {b!r} overlap)")
    return entries, dict(metadata), data_start, size


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: read-only array view of the file}, the header's __metadata__) of a safetensors
    file, every entry checked first."""
    entries, metadata, data_start, size = checked_header(path)
    data_size = size - data_start
    tensors: dict[str, np.ndarray] = {}
    if data_size > 0:
        buf = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,))
    else:
        buf = np.zeros(0, dtype=np.uint8)
    for name, (dtype, shape, begin, end, _) in entries.items():
        if end == begin:
            arr = np.zeros(shape, dtype=dtype)
            arr.flags.writeable = False
        else:
            arr = buf[begin:end].view(dtype).reshape(shape)
        tensors[name] = arr
    return tensors, metadata


def write_safetensors(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write tensors (in the mapping's order) as a safetensors file at path, one tensor at a
    time: no copy of the whole set is made. The caller makes the write atomic."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, t in tensors.items():
        t = np.asarray(t)
        nbytes = t.size * t.dtype.itemsize
        header[name] = {
            "dtype": safetensors_dtype(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        arrays.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in arrays:
            if t.dtype.byteorder == ">":
                t = t.astype(t.dtype.newbyteorder("<"))
            f.write(np.ascontiguousarray(t).reshape(-1).view(np.uint8).data)
