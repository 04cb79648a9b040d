"""Give back what a finished pipeline phase holds resident: its weights' mapped file pages.

On the cpu driver a module's parameters are read in place from memory-mapped archives, and every
page a call touched stays in the process's RSS while the mapping lives: after one SD 1.5-size
image at 512x512 that was the text encoder's 0.3 GB, the UNet's 5.5 GB and the VAE decoder's
0.7 GB at once, with the VAE's 1.7 GB of working memory on top (8.6 GB). The phases of a run
use one module each, so the pages of a module whose phase is over can go: `release_mapped`
drops a file's pages from this process's page tables (madvise MADV_DONTNEED over each read-only
mapping of it). Nothing is lost: the page cache keeps the pages (until the kernel needs the
memory), and the next call that reads them faults them back in (minor faults), bytes unchanged.
Writable mappings are left alone (a private copy-on-write page would be lost).

Linux only (/proc/self/maps); elsewhere, or with SDIREE_PHASE_MEMORY=keep, nothing is released.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

MADV_DONTNEED = 4  # Linux
KEEP_ENV = "SDIREE_PHASE_MEMORY"  # "keep": release nothing between phases


def enabled() -> bool:
    return os.environ.get(KEEP_ENV, "") != "keep"


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """(device major, minor, inode) of a file as /proc/self/maps names it; None if gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def mapped_ranges(
    identities: Iterable[tuple[int, int, int]], maps: str = "/proc/self/maps"
) -> list[tuple[int, int]]:
    """(start, end) of every read-only mapping of one of the files (by identity)."""
    wanted = set(identities)
    out = []
    try:
        with open(maps) as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or "w" in parts[1]:
            continue
        major, _, minor = parts[3].partition(":")
        try:
            ident = (int(major, 16), int(minor, 16), int(parts[4]))
        except ValueError:
            continue
        if ident in wanted and ident[2] != 0:
            start, _, end = parts[0].partition("-")
            out.append((int(start, 16), int(end, 16)))
    return out


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def release_mapped_files(paths: Iterable[Path]) -> int:
    """release_mapped for the files at paths."""
    return release_mapped(i for i in map(file_identity, paths) if i is not None)


def release_mapped(identities: Iterable[tuple[int, int, int]]) -> int:
    """Drop the pages of the files (by file_identity) from this process's RSS (see the module
    docstring); the bytes of address space advised (0 where nothing could be)."""
    identities = set(identities)
    if not identities or not enabled() or not os.path.exists("/proc/self/maps"):
        return 0
    ranges = mapped_ranges(identities)
    madvise = _madvise() if ranges else None
    if madvise is None:
        return 0
    done = 0
    for start, end in ranges:
        if madvise(start, end - start, MADV_DONTNEED) == 0:
            done += end - start
    return done


def resident_bytes(identities: Iterable[tuple[int, int, int]], smaps="/proc/self/smaps") -> int:
    """Bytes of the files' mappings (by file_identity, all of them) in this process's RSS
    now; 0 where /proc is not there."""
    wanted, total, counting = set(identities), 0, False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    major, _, minor = head[3].partition(":") if len(head) > 4 else ("", "", "")
                    try:
                        ident = (int(major, 16), int(minor, 16), int(head[4]))
                    except (ValueError, IndexError):
                        ident = None
                    counting = ident in wanted
                elif counting and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except OSError:
        return 0
    return total
