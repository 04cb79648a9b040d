"""Archive entries a device imports as they are: page-aligned host copies.

iree's parameter provider offers an entry's host memory to the device's allocator before it
allocates one of its own: a driver that can use host memory as it is (the cpu HAL; a Vulkan
driver with VK_EXT_external_memory_host, when pointer and size are aligned to its import
alignment, 4 KiB on lavapipe) then keeps no copy. sdiree's archives place entries at 64 bytes,
which a Vulkan driver does not import, so a Vulkan device gets every parameter in memory its
HAL allocates from its pools; on lavapipe at SD 1.5 size a call overwrites that memory
(compile/NOTES.md, "Whose memory the lavapipe call overwrites"). On a CPU Vulkan device the
session adds each entry as a page-aligned, page-padded copy instead: imported, and no more
memory than the pool's copy it replaces.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from .pages import load_archive, paged_layout


def add_importable(index, path: Path, keep: list) -> dict[str, tuple[mmap.mmap, int, int]]:
    """Add the entries of the archive at path to index, each data entry as a copy in its own
    page-aligned memory of a whole number of pages (appended to keep, which must outlive the
    index); a paged archive is added as load_archive does (its entries are page-aligned maps).
    Returns {key: (copy, offset of the entry in the file, length)} of the copies made."""
    import iree.runtime as rt

    probe = rt.ParameterIndex()
    probe.load(str(path))
    if paged_layout(probe) is not None:
        load_archive(index, path)
        return {}
    page = mmap.PAGESIZE
    private = (
        {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    )
    copies = {}
    with open(path, "rb") as f:
        for key, e in probe.items():
            if e.is_splat:
                pattern = np.frombuffer(bytes(e.splat_pattern), np.uint8).copy()
                index.add_splat(key, pattern, e.length)
                continue
            offset, length = int(e.file_storage[1]), int(e.length)
            copy = mmap.mmap(-1, max(page, -(-length // page) * page), **private)
            f.seek(offset)
            if f.readinto(memoryview(copy)[:length]) != length:
                raise OSError(f"{path} ends inside its entry {key}")
            index.add_buffer(key, copy)
            keep.append(copy)
            copies[key] = (copy, offset, length)
    return copies
