"""Write .irpa parameter archives in place: the layout first, then each entry's data at its offset.

iree's archive writer (`ParameterIndex.create_archive_file`) copies every entry's bytes from
wherever its index says they lie. So an archive whose data is made after it is laid out (the
encoder's outputs, the page store, the coded inputs) was written twice, zeros and then the data,
and one whose tensors are made one at a time went through a scratch file that was then copied.
`create` writes only what iree writes before the data (header, entry table, names and metadata)
for the same entries in the same order, byte for byte (tests/runtime/weights/
test_irpa_writer.py), and sizes the file; the data reads as zeros until it is written at the
offsets `create` returns. The file is sparse until then: on this project's VMs' ext4, 4 GiB
written into a sparse file took 2.8-4.0 s, zeros then the data 6.2-8.2 s, and into blocks
reserved first with posix_fallocate 5.5-7.2 s (tools/PERFORMANCE.md, sixty-eighth). `reserve`
is for data written through a writable mapping, where a full disk must fail at `create`
rather than as a SIGBUS later.

The format (iree/schemas/parameter_archive.h, version 0): a header whose offsets are relative to
it, a table of entries each aligned to 16 bytes, the names and metadata one after another, and
the data, each entry aligned to 64 bytes; the file rounded up to 4 KiB.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

_MAGIC = 0x41505249  # "IRPA"
_HEADER = struct.Struct("<IHHQQQQQQQQQQ")  # prefix, entry count, three segments
_ENTRY_HEAD = "<QIQQQQQQ"  # size, type, flags, name range, metadata range, minimum alignment
_DATA = struct.Struct(_ENTRY_HEAD + "QQ")  # + storage range
_SPLAT = struct.Struct(_ENTRY_HEAD + "Q16sB")  # + length, pattern, pattern length
_SPLAT_TYPE, _DATA_TYPE = 1, 2
_ENTRY_ALIGN, _DATA_ALIGN, _FILE_ALIGN = 16, 64, 4096
_COPY_CHUNK = 1 << 26


@dataclass(frozen=True)
class Entry:
    key: str
    length: int  # bytes
    metadata: bytes = b""
    splat: bytes | None = None  # the pattern (1, 2, 4, 8 or 16 bytes) of a splat entry


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def layout(entries: Iterable[Entry]) -> tuple[bytes, dict[str, int], int]:
    """(the archive's bytes before its data, each data entry's offset in the file, the file's
    size) for entries in order."""
    entries = list(entries)
    if len({e.key for e in entries}) != len(entries):
        raise ValueError("an archive cannot hold two entries of the same name")
    table_size = 0
    for e in entries:
        if e.splat is not None and (
            len(e.splat) not in (1, 2, 4, 8, 16) or e.length % len(e.splat)
        ):
            raise ValueError(f"{e.key}: splat pattern of {len(e.splat)} bytes for {e.length}")
        table_size = _up(table_size, _ENTRY_ALIGN) + (_SPLAT if e.splat is not None else _DATA).size
    table_at = _up(_HEADER.size, _ENTRY_ALIGN)
    meta_at = table_at + table_size
    names = b"".join(e.key.encode() + e.metadata for e in entries)
    storage_at = _up(
        meta_at + len(names), _DATA_ALIGN if any(e.splat is None for e in entries) else 1
    )
    head = bytearray(storage_at)
    at, meta, stored, offsets = table_at, 0, 0, {}
    for e in entries:
        at = _up(at, _ENTRY_ALIGN)
        key = e.key.encode()
        name_ref = (meta, len(key))
        meta += len(key)
        meta_ref = (meta if e.metadata else 0, len(e.metadata))
        meta += len(e.metadata)
        if e.splat is None:
            start = _up(stored, _DATA_ALIGN)
            row = _DATA.pack(
                _DATA.size, _DATA_TYPE, 0, *name_ref, *meta_ref, _DATA_ALIGN, start, e.length
            )
            offsets[e.key] = storage_at + start
            stored = start + e.length
        else:
            row = _SPLAT.pack(_SPLAT.size, _SPLAT_TYPE, 0, *name_ref, *meta_ref, 0, e.length,
                              e.splat, len(e.splat))  # fmt: skip
        head[at : at + len(row)] = row
        at += len(row)
    head[meta_at : meta_at + len(names)] = names
    _HEADER.pack_into(head, 0, _MAGIC, 0, 0, _HEADER.size, 0, 0, len(entries),
                      table_at, table_size, meta_at, len(names), storage_at, stored)  # fmt: skip
    return bytes(head[: meta_at + len(names)]), offsets, _up(storage_at + stored, _FILE_ALIGN)


def create(path: Path, entries: Iterable[Entry], reserve: bool = False) -> dict[str, int]:
    """Write at path the archive of entries with their data still to be written (it reads as
    zeros until then); returns each data entry's offset in the file. reserve: allocate the
    file's blocks now (a full disk fails here)."""
    head, offsets, size = layout(entries)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if reserve and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        os.ftruncate(fd, size)
        pwrite_all(fd, head, 0)
    finally:
        os.close(fd)
    return offsets


@contextlib.contextmanager
def created(path: Path, entries: Iterable[Entry]) -> Iterator[tuple[int, dict[str, int]]]:
    """create(path, entries), then (a descriptor open for writing its data, the offsets)."""
    offsets = create(path, entries)
    fd = os.open(path, os.O_RDWR)
    try:
        yield fd, offsets
    finally:
        os.close(fd)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of data (any buffer: bytes, memoryview, a contiguous numpy array) at offset."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int) -> None:
    """Copy length bytes between two open files, in the kernel where it can."""
    done = 0
    while done < length and hasattr(os, "copy_file_range"):
        try:
            n = os.copy_file_range(src, dst, min(length - done, _COPY_CHUNK),
                                   src_offset + done, dst_offset + done)  # fmt: skip
        except OSError:  # not across these file systems: copied through memory below
            break
        if n == 0:
            raise OSError(f"the source ended {length - done} bytes early")
        done += n
    while done < length:
        chunk = os.pread(src, min(length - done, _COPY_CHUNK), src_offset + done)
        if not chunk:
            raise OSError(f"the source ended {length - done} bytes early")
        pwrite_all(dst, chunk, dst_offset + done)
        done += len(chunk)
