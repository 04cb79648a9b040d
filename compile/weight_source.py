"""Where each weight of a loaded component lives: a byte range of one of its safetensors files,
or (where the loader changed it) the loaded tensor itself.

The compile loads a component with its library's `from_pretrained`, which maps safetensors files
lazily; `WeightSource.capture` records, for every state-dict tensor, the file range that holds the
same tensor, before the model's parameters become placeholders (compile/placeholders.py). The
archives are then written from the files one tensor at a time (compile/archive_writer.py), so
the compile never holds a component's weights in memory.

A file tensor stands for a loaded one only where its key names the same parameter (equal, or
one a dotted suffix of the other: transformers 5 drops CLIP's `text_model.` prefix), its shape is
the same, and its first and last values equal the loaded ones after the loader's dtype cast;
anything else (another layout converted by the loader, a .bin file, weights replaced after
loading) is kept as the loaded tensor, which is what the archive held before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sdiree.runtime.checkpoints.safetensors_file import checked_header

from .model_source import weight_files

# safetensors dtype names -> torch dtypes
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAMPLE = 64  # values compared at each end of a tensor


@dataclass(frozen=True)
class FileTensor:
    path: Path
    offset: int  # of the tensor's bytes in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read(self) -> torch.Tensor:
        """The tensor, read from the file (not mapped: its pages stay out of this process)."""
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        buf = bytearray(self.nbytes)
        with open(self.path, "rb", buffering=0) as f:
            view = memoryview(buf)
            done = 0
            while done < self.nbytes:
                n = os.preadv(f.fileno(), [view[done:]], self.offset + done)
                if n <= 0:
                    raise OSError(f"{self.path}: short read at {self.offset + done}")
                done += n
        return torch.frombuffer(buf, dtype=self.dtype).reshape(self.shape)


def read_header(path: Path) -> dict[str, FileTensor]:
    """{key: FileTensor} of one safetensors file, its header checked (UserError where it is
    damaged or the file is cut short)."""
    entries, _, data_start, _ = checked_header(path)
    return {
        key: FileTensor(
            path, data_start + e.begin, e.end - e.begin, _ST_DTYPES[e.dtype_name], e.shape
        )
        for key, e in entries.items()
        if e.dtype_name in _ST_DTYPES
    }


def _match_key(name: str, keys: dict[str, FileTensor]) -> FileTensor | None:
    if name in keys:
        return keys[name]
    found = [k for k in keys if k.endswith("." + name) or name.endswith("." + k)]
    return keys[found[0]] if len(found) == 1 else None


def _same_values(loaded: torch.Tensor, ft: FileTensor) -> bool:
    """loaded's first and last values equal the file tensor's, cast to loaded's dtype."""
    n = loaded.numel()
    if n == 0:
        return True
    k = min(_SAMPLE, n)
    item = ft.dtype.itemsize
    ends = []
    for start in (0, n - k):
        part = FileTensor(ft.path, ft.offset + start * item, k * item, ft.dtype, (k,))
        ends.append(part.read().to(loaded.dtype))
    flat = loaded.detach().reshape(-1)
    return torch.equal(flat[:k], ends[0]) and torch.equal(flat[n - k :], ends[1])


class WeightSource:
    """{state-dict name: FileTensor or loaded tensor} of one loaded component, and the dtype
    each tensor had as loaded (what the archive casts from)."""

    def __init__(self, tensors: dict[str, FileTensor | torch.Tensor], dtypes: dict):
        self.tensors = tensors
        self.dtypes = dtypes

    @classmethod
    def capture(cls, model: torch.nn.Module, folder: Path | None) -> WeightSource:
        """The source of every tensor of model's state dict: a file range of folder's
        safetensors files where it verifiably holds the tensor, else the tensor itself. folder
        None: every tensor is kept (weights replaced after loading)."""
        keys: dict[str, FileTensor] = {}
        files = weight_files(folder) if folder is not None else []
        for path in (p for p in files if p.suffix == ".safetensors"):
            keys.update(read_header(path))
        tensors: dict[str, FileTensor | torch.Tensor] = {}
        dtypes = {}
        for name, t in model.state_dict().items():
            dtypes[name] = t.dtype
            ft = _match_key(name, keys)
            usable = (
                ft is not None
                and ft.shape == tuple(t.shape)
                and (ft.dtype == t.dtype or (ft.dtype.is_floating_point and t.is_floating_point()))
                and _same_values(t, ft)
            )
            tensors[name] = ft if usable else t.detach()
        return cls(tensors, dtypes)

    def from_files(self) -> int:
        return sum(isinstance(v, FileTensor) for v in self.tensors.values())

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def file_range(self, name: str, dtype: torch.dtype) -> FileTensor | None:
        """The file range holding name's bytes as they go in an archive of dtype, if one does
        (no cast on the way)."""
        v = self.tensors[name]
        if isinstance(v, FileTensor) and v.dtype == self.dtypes[name] == dtype:
            return v
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """name's tensor as loaded (the loader's dtype), read now."""
        v = self.tensors[name]
        if isinstance(v, FileTensor):
            return v.read().to(self.dtypes[name])
        return v
