"""A PNG decoder (zlib + struct + numpy): every PNG colour type and bit depth, interlaced or not.

The runtime reads init images and masks without Pillow, as it writes its PNGs without it
(runtime/png.py). ``decode_png`` returns the samples as stored: gray, gray + alpha, RGB or RGBA
(palette images looked up in their palette), 8 or 16 bits; sub-byte gray is scaled to 8 bits
as Pillow scales it. Anything that is not a well-formed PNG is a ``PngError`` saying what is
wrong (bad signature, a chunk's CRC, truncated data, an unknown colour type...).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["PNG_SIGNATURE", "PngError", "PngImage", "decode_png"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# colour type -> (samples per pixel, allowed bit depths)
_COLOR_TYPES = {
    0: (1, (1, 2, 4, 8, 16)),  # gray
    2: (3, (8, 16)),  # RGB
    3: (1, (1, 2, 4, 8)),  # palette index
    4: (2, (8, 16)),  # gray + alpha
    6: (4, (8, 16)),  # RGBA
}
# Adam7 passes: (row start, column start, row step, column step)
_ADAM7 = (
    (0, 0, 8, 8),
    (0, 4, 8, 8),
    (4, 0, 8, 4),
    (0, 2, 4, 4),
    (2, 0, 4, 2),
    (0, 1, 2, 2),
    (1, 0, 2, 1),
)
MAX_PIXELS = 1 << 28  # refuse a header claiming more (a decompression bomb)


class PngError(ValueError):
    """The data is not a PNG this decoder can read; the message says why."""


@dataclass(frozen=True)
class PngImage:
    pixels: np.ndarray  # HxWxC, uint8 or uint16 (big-endian values, native dtype)
    mode: str  # "L", "LA", "RGB" or "RGBA" (a palette image is decoded to RGB or RGBA)
    bit_depth: int  # as stored: 1, 2, 4, 8 or 16
    interlaced: bool


def _chunks(data: bytes):
    pos = len(PNG_SIGNATURE)
    while True:
        if pos + 8 > len(data):
            raise PngError("it ends before its IEND chunk (truncated)")
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        end = pos + 8 + length + 4
        if end > len(data):
            raise PngError(f"its {kind.decode('latin-1')!r} chunk is cut short (truncated)")
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[end - 4 : end])
        if zlib.crc32(body, zlib.crc32(kind)) != crc:
            raise PngError(f"its {kind.decode('latin-1')!r} chunk fails its CRC (damaged)")
        yield kind, body
        if kind == b"IEND":
            return
        pos = end


def _unfilter(raw: bytes, height: int, row_bytes: int, bpp: int) -> np.ndarray:
    """The filtered scanlines (each led by its filter type byte) → HxROW uint8 samples."""
    need = height * (row_bytes + 1)
    if len(raw) < need:
        raise PngError("its image data is shorter than its size says (truncated)")
    rows = np.frombuffer(raw, np.uint8, need).reshape(height, row_bytes + 1)
    kinds, data = rows[:, 0], rows[:, 1:]
    if kinds.max(initial=0) > 4:
        raise PngError(f"a row has the unknown filter type {int(kinds.max())} (damaged)")
    out = np.zeros((height, row_bytes), np.uint8)
    prev = np.zeros(row_bytes, np.uint8)
    for y in range(height):
        f, line = kinds[y], data[y]
        if f == 0:
            cur = line.copy()
        elif f == 2:  # Up
            cur = line + prev
        elif f == 1:  # Sub: a running sum per byte position within a pixel
            cur = np.zeros(row_bytes, np.uint8)
            for k in range(bpp):
                cur[k::bpp] = np.cumsum(line[k::bpp], dtype=np.uint64).astype(np.uint8)
        else:  # Average, Paeth: each byte needs its decoded left neighbour
            cur = _unfilter_sequential(f, line, prev, bpp)
        out[y] = cur
        prev = cur
    return out


def _unfilter_sequential(kind: int, line: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    x = bytearray(line.tobytes())
    b = prev.tobytes()
    n = len(x)
    if kind == 3:  # Average
        for i in range(min(bpp, n)):
            x[i] = (x[i] + (b[i] >> 1)) & 0xFF
        for i in range(bpp, n):
            x[i] = (x[i] + ((x[i - bpp] + b[i]) >> 1)) & 0xFF
    else:  # Paeth
        for i in range(min(bpp, n)):
            x[i] = (x[i] + b[i]) & 0xFF
        for i in range(bpp, n):
            a, up, c = x[i - bpp], b[i], b[i - bpp]
            pa, pb, pc = abs(up - c), abs(a - c), abs(a + up - 2 * c)
            pred = a if pa <= pb and pa <= pc else (up if pb <= pc else c)
            x[i] = (x[i] + pred) & 0xFF
    return np.frombuffer(bytes(x), np.uint8)


def _samples(rows: np.ndarray, width: int, channels: int, depth: int) -> np.ndarray:
    """Unfiltered rows → HxWxC samples (uint8, or uint16 for 16-bit)."""
    h = rows.shape[0]
    if depth == 16:
        return rows.view(">u2").astype(np.uint16).reshape(h, width, channels)
    if depth == 8:
        return rows.reshape(h, width, channels)
    # 1, 2 or 4 bits: one channel (gray or palette index), packed high bits first
    shifts = np.arange(8 - depth, -1, -depth, dtype=np.uint8)
    unpacked = (rows[:, :, None] >> shifts) & ((1 << depth) - 1)
    return unpacked.reshape(h, -1)[:, :width].reshape(h, width, 1)


def _decode_pass(raw: bytes, width: int, height: int, channels: int, depth: int):
    bits_pp = channels * depth
    row_bytes = (width * bits_pp + 7) // 8
    bpp = max(1, bits_pp // 8)
    rows = _unfilter(raw, height, row_bytes, bpp)
    return _samples(rows, width, channels, depth), height * (row_bytes + 1)


def decode_png(data: bytes) -> PngImage:
    """Decode a whole PNG file's bytes (see the module doc); PngError if it is not one."""
    if not data.startswith(PNG_SIGNATURE):
        raise PngError("it does not start with the PNG signature")
    header = palette = trns = None
    idat = []
    for kind, body in _chunks(data):
        if kind == b"IHDR":
            if len(body) != 13:
                raise PngError("its IHDR chunk has the wrong length (damaged)")
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            if len(body) % 3 or not body:
                raise PngError("its palette has a length that is not a multiple of 3 (damaged)")
            palette = np.frombuffer(body, np.uint8).reshape(-1, 3)
        elif kind == b"tRNS":
            trns = body
        elif kind == b"IDAT":
            idat.append(body)
        elif header is None:
            raise PngError("its first chunk is not IHDR (damaged)")
    if header is None:
        raise PngError("it has no IHDR chunk")
    width, height, depth, color, compression, filtering, interlace = header
    if color not in _COLOR_TYPES:
        raise PngError(f"its colour type {color} is not one PNG defines")
    channels, depths = _COLOR_TYPES[color]
    if depth not in depths:
        raise PngError(f"bit depth {depth} is not allowed with colour type {color}")
    if compression or filtering or interlace > 1:
        raise PngError("it uses a compression, filter or interlace method PNG does not define")
    if not (width and height) or width * height > MAX_PIXELS:
        raise PngError(f"its size {width}x{height} is empty or too large")
    if color == 3 and palette is None:
        raise PngError("it is a palette image without a palette (damaged)")
    if not idat:
        raise PngError("it has no image data")
    try:
        raw = zlib.decompress(b"".join(idat))
    except zlib.error as e:
        raise PngError(f"its image data does not decompress ({e}; damaged or truncated)") from None

    if interlace:
        dtype = np.uint16 if depth == 16 else np.uint8
        samples = np.zeros((height, width, channels), dtype)
        pos = 0
        for y0, x0, dy, dx in _ADAM7:
            w = (width - x0 + dx - 1) // dx
            h = (height - y0 + dy - 1) // dy
            if w <= 0 or h <= 0:
                continue
            part, used = _decode_pass(raw[pos:], w, h, channels, depth)
            samples[y0::dy, x0::dx] = part
            pos += used
    else:
        samples, _ = _decode_pass(raw, width, height, channels, depth)

    if color == 3:
        index = samples[:, :, 0]
        if int(index.max()) >= len(palette):
            raise PngError("a pixel indexes past the end of its palette (damaged)")
        rgb = palette[index]
        if trns:  # alpha per palette entry
            table = np.full(len(palette), 255, np.uint8)
            alpha = np.frombuffer(trns[: len(palette)], np.uint8)
            table[: len(alpha)] = alpha
            rgba = np.concatenate([rgb, table[index][:, :, None]], axis=2)
            return PngImage(rgba, "RGBA", depth, bool(interlace))
        return PngImage(rgb, "RGB", depth, bool(interlace))
    if color == 0 and depth < 8:
        # Pillow scales 2- and 4-bit gray to 0..255 and reads 1-bit as 0/255.
        samples = (samples.astype(np.uint16) * (255 // ((1 << depth) - 1))).astype(np.uint8)
    mode = {0: "L", 2: "RGB", 4: "LA", 6: "RGBA"}[color]
    return PngImage(samples, mode, depth, bool(interlace))
