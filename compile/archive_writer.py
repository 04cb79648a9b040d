"""Write an .irpa parameter archive one tensor at a time, never holding all of them.

iree's archive builder (`ParameterIndex.create_archive_file`, what iree-turbine's
ParameterArchiveBuilder calls) copies each entry from wherever the index says it is. Entries
that are byte ranges of a file are read from it without mapping it, so a tensor already in a
safetensors file in the archive's dtype is indexed where it lies, and every other tensor (cast,
computed, or only in memory) is made one at a time and appended to a scratch file beside the
archive, removed afterwards. The archive is byte for byte what ParameterArchiveBuilder writes
for the same tensors in the same order (tests/compile/test_archive_writer.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from sdiree.runtime.fileutil import temp_path_for

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


def write_archive(entries: Iterable[ArchiveEntry], path: Path) -> int:
    """Write the archive of entries to path; returns how many entries."""
    import iree.runtime as rt

    path = Path(path)
    scratch = temp_path_for(path.with_name(path.name + ".scratch"))  # stale ones are removed
    index = rt.ParameterIndex()
    handles: dict[Path, tuple[int, object]] = {}
    fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        scratch_handle = rt.FileHandle.wrap_fd(fd)
        end = 0
        count = 0
        for e in entries:
            meta = metadata(e.dtype, e.shape)
            if isinstance(e.source, FileTensor):
                if e.source.path not in handles:
                    src_fd = os.open(e.source.path, os.O_RDONLY)
                    handles[e.source.path] = (src_fd, rt.FileHandle.wrap_fd(src_fd))
                handle = handles[e.source.path][1]
                index.add_from_file_handle(e.name, handle, e.source.nbytes, e.source.offset, meta)
            else:
                t = e.source()
                if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                    raise ValueError(
                        f"{e.name}: made {t.dtype} {tuple(t.shape)}, expected {e.dtype} {e.shape}"
                    )
                data = _tensor_bytes(t)
                del t
                written = 0
                while written < len(data):
                    written += os.pwrite(fd, data[written:], end + written)
                index.add_from_file_handle(e.name, scratch_handle, len(data), end, meta)
                end += len(data)
                del data
            count += 1
        index.create_archive_file(str(path))
        return count
    finally:
        del index
        os.close(fd)
        for src_fd, _ in handles.values():
            os.close(src_fd)
        scratch.unlink(missing_ok=True)
