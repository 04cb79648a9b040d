"""What an IREE parameter archive (.irpa) holds: each tensor's name, dtype, shape and bytes.

sdiree's archives are written by iree-turbine, which stores each tensor's dtype and shape in the
entry's metadata (`PYTORCH:{"dtype": ..., "shape": [...]}`); the bytes are read through a
read-only memory map, never copied. A compiled cpu artifact may keep only part of an archive;
the keys it dropped stay listed here (`recovered`), read back from the encoded archives
(weights/recover.py) when asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .recover import read_sidecar

# torch dtype names (as iree-turbine records them) -> numpy dtypes
_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a torch dtype name; bfloat16 through ml_dtypes (iree's dependency)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DTYPES[name])


@dataclass(frozen=True)
class Entry:
    key: str
    offset: int  # in the archive file
    length: int  # bytes
    dtype: np.dtype | None  # None: no (readable) metadata
    shape: tuple[int, ...] | None
    splat: bytes | None = None  # the repeated pattern of a splat entry (no file bytes)
    recovered: bool = False  # not in the file: read back from the encoded archives


class Archive:
    """The entries of one .irpa file, and read-only views of their tensors."""

    def __init__(self, path: Path):
        import iree.runtime as rt

        self.path = Path(path)
        self.index = rt.ParameterIndex()
        self.index.load(str(self.path))
        self.entries: dict[str, Entry] = {}
        self._raw: dict[str, object] = {}
        for key, e in self.index.items():
            self._raw[key] = e
            dtype, shape = _parse_metadata(e.metadata)
            if e.is_splat:
                entry = Entry(key, 0, e.length, dtype, shape, bytes(e.splat_pattern))
            else:
                entry = Entry(key, int(e.file_storage[1]), int(e.length), dtype, shape)
            self.entries[key] = entry
        self._map: np.memmap | None = None
        self._recoverer = None
        pruned = read_sidecar(self.path)
        if pruned is not None:
            keys, self._recoverer = pruned
            for key, (shape, dtype) in keys.items():
                if key not in self.entries:
                    d = numpy_dtype(dtype)
                    n = int(np.prod(shape, dtype=np.int64)) * d.itemsize
                    self.entries[key] = Entry(key, -1, n, d, shape, recovered=True)

    def raw(self, key: str):
        """The ParameterIndexEntry of key (its file handle is this archive's mapping); only
        for keys the file holds (not `recovered`)."""
        return self._raw[key]

    def read_back(self, key: str, shape, dtype) -> np.ndarray | None:
        """key (listed or not: a derived weight) read back from the encoded archives of a
        pruned archive's sidecar, exactly as they hold it; None where none holds it."""
        if self._recoverer is None:
            return None
        try:
            return self._recoverer.array(key, tuple(shape), np.dtype(dtype))
        except KeyError:
            return None

    def array(self, key: str) -> np.ndarray:
        """The tensor as a read-only array over the file (no copy; a `recovered` one is read
        back into memory)."""
        e = self.entries[key]
        if e.dtype is None or e.shape is None:
            raise ValueError(f"{self.path.name}: {key} has no dtype/shape metadata")
        if e.recovered:
            w = self._recoverer.array(key, e.shape, e.dtype)
            w.flags.writeable = False
            return w
        if e.splat is not None:
            one = np.frombuffer(e.splat, e.dtype)
            return np.broadcast_to(one[0], e.shape)
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        return self._map[e.offset : e.offset + e.length].view(e.dtype).reshape(e.shape)


def _parse_metadata(meta: bytes | None) -> tuple[np.dtype | None, tuple[int, ...] | None]:
    if not meta:
        return None, None
    text = bytes(meta).decode("utf-8", "replace")
    if not text.startswith("PYTORCH:"):
        return None, None
    try:
        d = json.loads(text[len("PYTORCH:") :])
        return numpy_dtype(d["dtype"]), tuple(int(x) for x in d["shape"])
    except (ValueError, KeyError, TypeError):
        return None, None
