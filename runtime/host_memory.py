"""Host heap setting for the CPU drivers: freed memory stays in the heap for the next call.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameter numbers from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Tell glibc malloc to neither mmap nor trim; True once applied (False: not glibc, or opted out)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("SDIREE_HOST_HEAP", "") == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to set
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # A trim threshold of -1 turns trimming off (mallopt(3)).
    _applied = bool(mallopt(M_TRIM_THRESHOLD, -1)) and bool(mallopt(M_MMAP_MAX, 0))
    return _applied


def release_freed_heap() -> bool:
    """Return the heap's free pages to the OS once (glibc's malloc_trim); False elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
