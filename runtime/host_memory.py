"""Host heap settings: for the CPU drivers, freed memory stays in the heap for the next call;
for the compile driver, freed memory goes back to the system.

IREE's local-task device mallocs each call's transient buffers and frees them at the end of the
call. glibc serves blocks above its mmap threshold (32 MiB at most) with fresh mmaps and unmaps
them on free, so every call starts on new zeroed pages: an SD 1.5 UNet call at 512x512 took
~575k page faults (2.3 GB) and ~1.5 s of its ~29 s that way. With mmap off and trimming off,
glibc keeps freed blocks and the next call reuses them (0 faults after the first call; outputs
bit-identical; tools/PERFORMANCE.md). The price: the process keeps its peak heap until it
exits, which a generator that calls the UNet again and again would reach anyway.

Set SDIREE_HOST_HEAP=default to leave glibc's behaviour alone. `release_freed_heap` gives the
kept free pages back at the end of a phase whose working memory the next phase does not reuse
(runtime/residency.py, Session.release).

The compile driver wants the opposite (compile/driver.py): its stages (export, parameter
archives, encoder runs, layout learning) each allocate and free GBs once, and glibc's mmap
threshold rises (to 32 MiB at most) with each large block freed, so after the first one most
arrays came from the heap and each stage's freed high-water mark stayed resident, fragmented,
under the next. `map_large_blocks` pins the threshold (every block of 1 MiB or more its own
mapping, unmapped when freed) and the driver trims the heap after each stage: SD 1.5 bf16's
compile peaked at 2.09 GiB instead of 2.92-3.03 (compile/NOTES.md). The layout learning's
analysis, whose numpy temporaries are many and large, keeps its freed heap for itself
(`freed_heap_kept`; its encoder runs do not, their buffers are GBs).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os

# mallopt parameter numbers from glibc's malloc.h, and glibc's defaults of the two restored.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
LARGE_BLOCK = 1 << 20
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Tell glibc malloc to neither mmap nor trim; True once applied (False: not glibc, or opted out)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _applied = _keep_freed(mallopt)
    return _applied


def _keep_freed(mallopt) -> bool:
    """Neither mmap nor trim (a trim threshold of -1 turns trimming off, mallopt(3))."""
    return bool(mallopt(M_TRIM_THRESHOLD, -1)) and bool(mallopt(M_MMAP_MAX, 0))


def map_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Serve every block of threshold bytes or more from its own mapping, unmapped when freed,
    for the rest of the process (a pinned threshold no longer moves); True once applied."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold))


@contextlib.contextmanager
def freed_heap_kept():
    """Within: freed blocks stay in the heap for the next allocation (no mmap, no trim), as
    keep_freed_host_memory does for the runtime; after: large blocks are mapped again and the
    kept heap is released. For a compile stage of many large numpy temporaries (the layout
    learning: each one's fresh pages cost ~9 ns an int32 element here, more than the pass)."""
    mallopt = _mallopt()
    if mallopt is None or _applied:  # glibc's, opted out; or the runtime keeps it anyway
        yield bool(_applied)
        return
    applied = _keep_freed(mallopt)
    try:
        yield applied
    finally:
        mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        release_freed_heap()


def release_freed_heap() -> bool:
    """Return the heap's free pages to the OS once (glibc's malloc_trim); False elsewhere."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True


def _mallopt():
    """glibc's mallopt, or None where there is none or SDIREE_HOST_HEAP=default opts out."""
    if os.environ.get("SDIREE_HOST_HEAP", "") == "default":
        return None
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt


@functools.cache
def _libc(name: str):
    """The C library's function name, looked up once (find_library runs ldconfig); None where
    it has none (musl, macOS, Windows)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
