"""A small PNG encoder (zlib + struct + numpy): 8-bit gray, RGB or RGBA with text chunks.

The runtime writes one kind of file, an 8-bit image with a "parameters" text chunk, so it does
not need Pillow (21 MB installed). Rows are filtered as libpng does by default: every one of the
five PNG filters is tried and the row keeps the one whose bytes, read as signed, sum smallest in
absolute value. Filters read the unfiltered bytes only, so all rows are filtered at once.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping

import numpy as np

__all__ = ["encode_png", "text_chunk"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPES = {1: 0, 3: 2, 4: 6}  # channels -> PNG color type (gray, RGB, RGBA)


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(data, zlib.crc32(kind))
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def text_chunk(keyword: str, text: str) -> bytes:
    """A tEXt chunk when `text` is latin-1, else an uncompressed iTXt (UTF-8) one.

    The keyword is 1-79 printable latin-1 characters without leading, trailing or double
    spaces (PNG spec 11.3.4.2); neither may hold a NUL character (ValueError).
    """
    try:
        key = keyword.encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(f"PNG text keyword {keyword!r} is not latin-1") from None
    if not 1 <= len(key) <= 79 or keyword != keyword.strip() or "  " in keyword:
        raise ValueError(f"PNG text keyword {keyword!r} must be 1-79 characters, single-spaced")
    if not all(32 <= b <= 126 or b >= 161 for b in key):
        raise ValueError(f"PNG text keyword {keyword!r} holds a non-printable character")
    if "\0" in text:
        raise ValueError("PNG text cannot hold a NUL character")
    try:
        return _chunk(b"tEXt", key + b"\0" + text.encode("latin-1"))
    except UnicodeEncodeError:
        # keyword, compression flag 0, method 0, empty language tag, empty translated keyword
        return _chunk(b"iTXt", key + b"\0\0\0\0\0" + text.encode("utf-8"))


def _filtered_rows(pixels: np.ndarray) -> bytes:
    """Each row prefixed by its filter type byte, the filter chosen per row (see module doc)."""
    h, w = pixels.shape[:2]
    bpp = 1 if pixels.ndim == 2 else pixels.shape[2]
    x = pixels.reshape(h, w * bpp).astype(np.int16)
    a = np.zeros_like(x)  # the byte one pixel to the left
    a[:, bpp:] = x[:, :-bpp]
    b = np.zeros_like(x)  # the byte above
    b[1:] = x[:-1]
    c = np.zeros_like(x)  # the byte above and to the left
    c[1:, bpp:] = x[:-1, :-bpp]
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
    candidates = np.stack([x, x - a, x - b, x - (a + b) // 2, x - paeth]).astype(np.uint8)
    cost = np.abs(candidates.view(np.int8).astype(np.int32)).sum(axis=2)
    best = cost.argmin(axis=0)
    rows = candidates[best, np.arange(h)]
    return np.concatenate([best.astype(np.uint8)[:, None], rows], axis=1).tobytes()


def encode_png(
    pixels: np.ndarray, text: Mapping[str, str] | None = None, compress_level: int = 6
) -> bytes:
    """The PNG file of an 8-bit image: HW (gray), or HWC with 1, 3 (RGB) or 4 (RGBA) channels.

    `text` maps keywords to values, each written as a text chunk before the image data (see
    `text_chunk`). Anything else is a ValueError.
    """
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8:
        raise ValueError(f"PNG pixels must be uint8, got {pixels.dtype}")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    channels = 1 if pixels.ndim == 2 else (pixels.shape[2] if pixels.ndim == 3 else 0)
    if channels not in _COLOR_TYPES:
        raise ValueError(f"PNG pixels must be HW or HWC with 1, 3 or 4 channels: {pixels.shape}")
    h, w = pixels.shape[:2]
    if not (0 < h < 2**31 and 0 < w < 2**31):
        raise ValueError(f"PNG size must be at least 1x1, got {w}x{h}")
    header = struct.pack(">IIBBBBB", w, h, 8, _COLOR_TYPES[channels], 0, 0, 0)
    chunks = [_chunk(b"IHDR", header)]
    chunks += [text_chunk(k, v) for k, v in (text or {}).items()]
    data = zlib.compress(_filtered_rows(np.ascontiguousarray(pixels)), compress_level)
    chunks += [_chunk(b"IDAT", data), _chunk(b"IEND", b"")]
    return _SIGNATURE + b"".join(chunks)
