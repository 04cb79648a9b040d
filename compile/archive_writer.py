"""Write an .irpa parameter archive one tensor at a time, never holding all of them.

The archive is laid out first (runtime/weights/irpa_writer.py) and each tensor written at its
place: a tensor already in a safetensors file in the archive's dtype is copied from its byte
range there (in the kernel, never mapped), and every other one (cast, computed, or only in
memory) is made one at a time and written. Nothing is written twice: before, the made tensors
went to a scratch file that iree's writer then copied whole (8 s of the SD 1.5 UNet's 29 s
derived-weights stage, and twice their size on disk meanwhile). The archive is byte for byte
what ParameterArchiveBuilder writes for the same tensors in the same order
(tests/compile/test_streamed_params.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from sdiree.runtime.fileutil import atomic_path
from sdiree.runtime.weights import irpa_writer

from .weight_source import FileTensor


@dataclass(frozen=True)
class ArchiveEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    # a file range holding the bytes as they are stored, or what makes the tensor when needed
    source: FileTensor | Callable[[], torch.Tensor]


def metadata(dtype: torch.dtype, shape) -> str:
    """The entry metadata iree-turbine writes (dtype and shape), for a tensor of dtype, shape."""
    from iree.turbine.aot.params import _make_tensor_metadata

    return _make_tensor_metadata(torch.empty(tuple(shape), dtype=dtype, device="meta"))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """t's bytes in row-major order, as ParameterArchiveBuilder.add_tensor stores them."""
    if t.dim() == 0:
        return memoryview(t.detach().reshape(1).contiguous().numpy().tobytes())
    return memoryview(t.detach().flatten().contiguous().view(torch.uint8).numpy())


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def write_archive(entries: Iterable[ArchiveEntry], path: Path) -> int:
    """Write the archive of entries to path (through a temp path); returns how many entries."""
    entries = list(entries)
    lengths = [
        e.source.nbytes if isinstance(e.source, FileTensor) else _nbytes(e.dtype, e.shape)
        for e in entries
    ]
    plan = [
        irpa_writer.Entry(e.name, n, metadata(e.dtype, e.shape).encode())
        for e, n in zip(entries, lengths, strict=True)
    ]
    sources: dict[Path, int] = {}
    with atomic_path(Path(path)) as tmp, irpa_writer.created(tmp, plan) as (fd, offsets):
        try:
            for e, n in zip(entries, lengths, strict=True):
                if isinstance(e.source, FileTensor):
                    if e.source.path not in sources:
                        sources[e.source.path] = os.open(e.source.path, os.O_RDONLY)
                    src = sources[e.source.path]
                    irpa_writer.copy_range(src, e.source.offset, fd, offsets[e.name], n)
                    continue
                t = e.source()
                if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                    raise ValueError(
                        f"{e.name}: made {t.dtype} {tuple(t.shape)}, expected {e.dtype} {e.shape}"
                    )
                data = _tensor_bytes(t)
                del t
                irpa_writer.pwrite_all(fd, data, offsets[e.name])
                del data
        finally:
            for src in sources.values():
                os.close(src)
    return len(entries)
