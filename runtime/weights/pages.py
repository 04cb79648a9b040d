"""Encoded archives that store each distinct page once, served as the original entries.

The cpu target's encoded archive holds one packed copy of every weight per matmul size that
uses it (the UNet's `denoise_cfg` at batch 2 and `denoise` at batch 1), and the copies are
byte-identical: half of SD 1.5's 11.5 GB. iree's encoder writes them all as one entry
(`parameter0`) that the module reads at fixed offsets, so entries cannot be aliased in the
archive's index; pages can. A *paged* archive is an ordinary .irpa whose one data entry
(`sdiree.pages`) holds the distinct 4 KiB pages, page-aligned in the file, and whose metadata
lists each original entry as runs of pages (virtual offset, length, offset in the store). At
load every original entry becomes one reserved address range with each run mapped read-only
from the file at its place, so a page shared by two copies is one page of page cache, and the
module sees the original bytes. Every shared run is compared byte for byte before it is
written as shared (the page hashes only propose candidates).
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fileutil import atomic_path
from . import irpa_writer

PAGES_KEY = "sdiree.pages"
META_PREFIX = "SDIREE_PAGES:"
PAGE = 4096
FORMAT_VERSION = 1
_CHUNK_PAGES = 16384  # 64 MiB read at a time


@dataclass(frozen=True)
class PagedStats:
    entries: int
    bytes_in: int  # data bytes of the source archive
    bytes_out: int  # distinct page bytes stored
    shared_runs: int


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Pages:
    """The pages of a source archive's data entries, numbered globally in entry order, read
    from its file descriptor: a mapping of the SD 1.5-size UNet's 11.5 GB raw encoder output
    kept every page read in the process's RSS."""

    def __init__(self, fd: int, entries: list[tuple[str, int, int]]):
        self.fd = fd
        self.entries = entries  # (key, file offset, length)
        counts = [_round_up(length, PAGE) // PAGE for _, _, length in entries]
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.entry_of = np.repeat(np.arange(len(entries)), counts)
        self.total = int(self.first[-1])

    def read(self, g0: int, count: int) -> np.ndarray:
        """count pages from global page g0, zero-padded past each entry's end."""
        out = np.zeros(count * PAGE, np.uint8)
        done = 0
        while done < count:
            g = g0 + done
            i = int(self.entry_of[g])
            local = g - int(self.first[i])
            take = min(count - done, int(self.first[i + 1]) - g)
            _, off, length = self.entries[i]
            n = min(take * PAGE, length - local * PAGE)
            _pread(self.fd, out[done * PAGE : done * PAGE + n], off + local * PAGE)
            done += take
        return out


def _page_hashes(pages: _Pages, i: int, weights: np.ndarray) -> np.ndarray:
    """One 64-bit hash per page of entry i of pages (the last page zero-padded)."""
    count = int(pages.first[i + 1] - pages.first[i])
    out = np.empty(count, np.uint64)
    for p0 in range(0, count, _CHUNK_PAGES):
        p1 = min(count, p0 + _CHUNK_PAGES)
        words = pages.read(int(pages.first[i]) + p0, p1 - p0).view(np.uint64)
        out[p0:p1] = words.reshape(p1 - p0, PAGE // 8) @ weights  # wraps modulo 2**64
    return out


def _pread(fd: int, into: np.ndarray, offset: int) -> None:
    """Fill the uint8 array `into` from the file at offset."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [memoryview(into[done:])], offset + done)
        if got <= 0:
            raise OSError(f"short read at {offset + done}")
        done += got


def _segments(starts: np.ndarray) -> list[tuple[int, int]]:
    """(first index, count) of the segments that each True of starts begins (starts[0] True)."""
    brk = np.flatnonzero(starts)
    ends = np.append(brk[1:], len(starts))
    return [(int(a), int(b - a)) for a, b in zip(brk, ends, strict=True)]


def _true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first index, count) of the maximal runs of True in mask."""
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return [(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def write_paged(src: Path, out: Path, only_if_shared: bool = False) -> PagedStats | None:
    """Write src (an .irpa) as a paged archive at out (atomically); with only_if_shared,
    nothing (None) when no page of it repeats."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(src))
    data_entries, splats = [], []
    for key, e in index.items():
        if e.is_splat:
            splats.append((key, bytes(e.splat_pattern), int(e.length), bytes(e.metadata or b"")))
        else:
            data_entries.append((key, int(e.file_storage[1]), int(e.length)))
    del index  # its mapping of src: the pages are read, not mapped (_Pages)
    fd = os.open(src, os.O_RDONLY)
    try:
        return _write_paged(_Pages(fd, data_entries), splats, out, only_if_shared)
    finally:
        os.close(fd)


def _write_paged(pages: _Pages, splats: list, out: Path, only_if_shared: bool):
    data_entries = pages.entries
    weights = np.random.default_rng(0x5D1EE).integers(1, 2**63, PAGE // 8, dtype=np.uint64)
    weights |= np.uint64(1)
    hashes = np.concatenate(
        [_page_hashes(pages, i, weights) for i in range(len(data_entries))]
        or [np.zeros(0, np.uint64)]
    )
    g = np.arange(pages.total)
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    source = first[inverse.reshape(-1)]  # the first page with the same hash
    shared = source != g
    # Candidate shared runs: consecutive pages of one entry whose sources are consecutive.
    follows = np.zeros(pages.total, bool)
    follows[1:] = (
        shared[1:]
        & shared[:-1]
        & (source[1:] == source[:-1] + 1)
        & (pages.entry_of[1:] == pages.entry_of[:-1])
    )
    tails = dict(_true_runs(follows))  # a shared run's pages after its first
    for a in np.flatnonzero(shared & ~follows).tolist():
        n = 1 + tails.get(a + 1, 0)
        if not _same(pages, a, int(source[a]), n):
            shared[a : a + n] = False  # a hash collision: stored as its own pages
    if only_if_shared and not shared.any():
        return None
    slot = np.cumsum(~shared) - 1  # store page of each distinct page, in order
    store = np.where(shared, slot[source], slot)
    n_store = int((~shared).sum())
    layout: dict[str, dict] = {}
    shared_runs = 0
    for i, (key, _, length) in enumerate(data_entries):
        g0, g1 = int(pages.first[i]), int(pages.first[i + 1])
        s = store[g0:g1]
        starts = np.ones(g1 - g0, bool)
        starts[1:] = s[1:] != s[:-1] + 1
        runs = []
        for a, n in _segments(starts):
            virt = a * PAGE
            runs.append([virt, min(n * PAGE, length - virt), int(s[a]) * PAGE])
            shared_runs += bool(shared[g0 + a])
        layout[key] = {"length": length, "runs": runs}
    meta = META_PREFIX + json.dumps(
        {"version": FORMAT_VERSION, "page": PAGE, "entries": layout}, separators=(",", ":")
    )
    store_bytes = n_store * PAGE
    plan = [
        irpa_writer.Entry(key, length, smeta, pattern) for key, pattern, length, smeta in splats
    ]
    plan.append(irpa_writer.Entry(PAGES_KEY, store_bytes + PAGE, meta.encode()))
    # written through a descriptor, not a writable mapping (dirty mapped pages are RSS)
    with atomic_path(out) as tmp, irpa_writer.created(tmp, plan) as (target, offsets):
        start = _round_up(offsets[PAGES_KEY], PAGE)
        for a, n in _true_runs(~shared):
            for c in range(0, n, _CHUNK_PAGES):
                take = min(_CHUNK_PAGES, n - c)
                irpa_writer.pwrite_all(
                    target, pages.read(a + c, take), start + int(slot[a + c]) * PAGE
                )
        os.fsync(target)
    return PagedStats(len(data_entries), sum(x[2] for x in data_entries), store_bytes, shared_runs)


def _same(pages: _Pages, a: int, b: int, n: int) -> bool:
    """Whether the n pages from global page a equal the n pages from b, byte for byte."""
    for c in range(0, n, _CHUNK_PAGES):
        take = min(_CHUNK_PAGES, n - c)
        if not np.array_equal(pages.read(a + c, take), pages.read(b + c, take)):
            return False
    return True


# -- loading ----------------------------------------------------------------------------------
def paged_layout(index) -> dict | None:
    """The layout a paged archive's index records, or None for an ordinary archive."""
    for key, e in index.items():
        if key == PAGES_KEY:
            text = bytes(e.metadata).decode()
            if not text.startswith(META_PREFIX):
                raise ValueError(f"{PAGES_KEY} entry without its layout")
            layout = json.loads(text[len(META_PREFIX) :])
            if layout.get("version") != FORMAT_VERSION:
                raise ValueError(f"paged archive format {layout.get('version')!r} is not known")
            return layout
    return None


def raw_size(path: Path) -> int:
    """Bytes of the data entries of the archive at path as the encoder writes them: a paged
    archive's original entries, not its distinct pages."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(path))
    paged = paged_layout(index)
    if paged is not None:
        return sum(int(e["length"]) for e in paged["entries"].values())
    return sum(int(e.length) for _, e in index.items() if not e.is_splat)


def load_archive(index, path: Path) -> None:
    """Add the entries of the archive at path to index: an ordinary archive as iree loads it,
    a paged one as its original entries, each over its pages mapped from the file."""
    import iree.runtime as rt

    probe = rt.ParameterIndex()
    probe.load(str(path))
    layout = paged_layout(probe)
    if layout is None:
        index.load(str(path))
        return
    store = None
    for key, e in probe.items():
        if key == PAGES_KEY:
            store = int(e.file_storage[1])
        elif e.is_splat:
            index.add_splat(key, np.frombuffer(bytes(e.splat_pattern), np.uint8).copy(), e.length)
    start = _round_up(store, int(layout["page"]))
    for key, entry in layout["entries"].items():
        view = _assemble(Path(path), start, int(entry["length"]), entry["runs"], layout["page"])
        index.add_buffer(key, view)


def entry_views(path: Path, private: bool = False, write: bool = False) -> dict[str, np.ndarray]:
    """{key: uint8 view} of every data entry of the archive at path (ordinary or paged), as
    the module reads it; with private, copy-on-write views (see _assemble); with write,
    views that write to the file (a page shared by two places is written through both)."""
    import iree.runtime as rt

    probe = rt.ParameterIndex()
    probe.load(str(path))
    layout = paged_layout(probe)
    items = dict(probe.items())
    if layout is None:
        mode = "c" if private else "r+" if write else "r"
        out = {}
        for key, e in items.items():
            if not e.is_splat:
                off, n = int(e.file_storage[1]), int(e.length)
                out[key] = np.memmap(path, np.uint8, mode=mode, offset=off, shape=(n,))
        return out
    start = _round_up(int(items[PAGES_KEY].file_storage[1]), int(layout["page"]))
    return {
        key: _assemble(
            Path(path), start, int(e["length"]), e["runs"], layout["page"], private, write
        )
        for key, e in layout["entries"].items()
    }


def zeroed_like(path: Path, out: Path) -> bool:
    """Write at out an archive with the entries of the paged archive at path, all zero, laid
    out as path's (a page shared there is shared here). False (nothing written) when path
    is not paged."""
    import iree.runtime as rt

    probe = rt.ParameterIndex()
    probe.load(str(path))
    if paged_layout(probe) is None:
        return False
    irpa_writer.create(out, [
        irpa_writer.Entry(key, int(e.length), bytes(e.metadata or b""),
                          bytes(e.splat_pattern) if e.is_splat else None)
        for key, e in probe.items()
    ])  # fmt: skip
    return True


def splat_entries(path: Path) -> list[tuple[str, bytes, int]]:
    """(key, pattern, length) of the splat entries of the archive at path."""
    import iree.runtime as rt

    probe = rt.ParameterIndex()
    probe.load(str(path))
    return [(k, bytes(e.splat_pattern), int(e.length)) for k, e in probe.items() if e.is_splat]


class _Region:
    """An address range whose pages are mapped from a file run by run; unmapped when freed."""

    def __init__(self, libc, size: int):
        self.libc, self.size = libc, size
        prot_none, flags = 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        addr = libc.mmap(None, size, prot_none, flags, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "could not reserve address space")
        self.addr = addr

    def map(self, fd: int, at: int, length: int, offset: int, private: bool, write: bool):
        flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | _MAP_FIXED
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if private or write else 0)
        got = self.libc.mmap(self.addr + at, length, prot, flags, fd, offset)
        if got != self.addr + at:
            raise OSError(ctypes.get_errno(), "could not map a page run")

    def __del__(self):
        if getattr(self, "addr", None):
            self.libc.munmap(self.addr, self.size)
            self.addr = None


_MAP_FIXED = 0x10  # Linux and macOS
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


@functools.cache  # one handle: release_pages runs for every region a reader passes
def _libc():
    """libc's mmap/munmap where this system can map file pages at fixed places, else None."""
    if os.name != "posix" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def _assemble(
    path: Path,
    start: int,
    length: int,
    runs: list,
    page: int,
    private: bool = False,
    write: bool = False,
) -> np.ndarray:
    """A uint8 view of one original entry: its runs mapped from the store at their places, or
    (where pages cannot be mapped so) copied into memory. Read-only, or with private a
    copy-on-write view: writing a page copies it, the file never changes."""
    libc = _libc() if page % mmap.PAGESIZE == 0 and start % mmap.PAGESIZE == 0 else None
    size = max(page, _round_up(length, page))
    if libc is None:
        if write:
            raise OSError("this system cannot map a paged archive for writing")
        out = np.empty(length, np.uint8)
        src = np.memmap(path, np.uint8, mode="r")
        for virt, n, at in runs:
            out[virt : virt + n] = src[start + at : start + at + n]
        out.flags.writeable = private
        return out
    region = _Region(libc, size)
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        for virt, n, at in runs:
            region.map(fd, virt, _round_up(n, page), start + at, private, write)
    finally:
        os.close(fd)  # the mappings keep the file
    buf = (ctypes.c_uint8 * length).from_address(region.addr)
    buf._region = region  # freed (and unmapped) with the last view of it
    view = np.frombuffer(buf, np.uint8)
    view.flags.writeable = private or write
    return view


_MADV_DONTNEED = 4  # Linux


def mapped_from_file(view: np.ndarray) -> bool:
    """Whether view's bytes are a file mapping (np.memmap, or a paged entry's mapped runs),
    not memory of its own: only then can release_pages drop them without losing data."""
    while view is not None:
        if isinstance(view, np.memmap) or getattr(view, "_region", None) is not None:
            return True
        view = getattr(view, "base", None)
    return False


def release_pages(view: np.ndarray, start: int = 0, end: int | None = None) -> None:
    """Drop from this process the whole pages of bytes [start, end) of view, a read-only file
    mapping (mapped_from_file): they stay in the page cache and are read back if touched again.
    A one-pass reader of a many-GB mapping so keeps only what it is reading in its RSS. Does
    nothing for views of memory (that would zero them) or where madvise is unavailable."""
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux") or not mapped_from_file(view):
        return
    end = view.nbytes if end is None else min(end, view.nbytes)
    base = view.ctypes.data
    a = _round_up(base + max(start, 0), mmap.PAGESIZE)
    b = (base + end) // mmap.PAGESIZE * mmap.PAGESIZE
    if b > a:
        libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)


def store_encoded(raw: Path, out: Path) -> PagedStats | None:
    """Keep an encoder's output raw at out: paged when some of its pages repeat (the raw file
    is then left for the caller to remove), else moved there as it is (None)."""
    stats = write_paged(raw, out, only_if_shared=True)
    if stats is None:
        os.replace(raw, out)
    return stats
