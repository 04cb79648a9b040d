"""runtime/png_decode: every PNG colour type, bit depth and filter, interlaced or not, decodes to
the pixels Pillow reads; damaged files are a PngError that says what is wrong."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

from sdiree.runtime.png import encode_png
from sdiree.runtime.png_decode import PngError, decode_png

Image = pytest.importorskip("PIL.Image")


def smooth(h: int, w: int, c: int, seed: int = 0) -> np.ndarray:
    """Gradients with wrap-arounds: rows that the encoders filter with every filter type."""
    rng = np.random.default_rng(seed)
    return (np.cumsum(np.cumsum(rng.integers(-3, 4, (h, w, c)), 0), 1) % 256).astype(np.uint8)


def pil_png(image, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", **options)
    return buf.getvalue()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def raw_png(width, height, depth, color, rows: list[bytes], interlace=0, extra=b"") -> bytes:
    """A PNG whose scanlines (filter byte included) are given as they are."""
    header = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, interlace)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + extra
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("mode,channels", [("L", 1), ("LA", 2), ("RGB", 3), ("RGBA", 4)])
@pytest.mark.parametrize("optimize", [False, True])
def test_8_bit_images_from_pillow(mode, channels, optimize):
    a = smooth(37, 53, channels)
    image = Image.fromarray(a[:, :, 0] if channels == 1 else a, mode)
    png = decode_png(pil_png(image, optimize=optimize))
    assert png.mode == mode and png.bit_depth == 8 and not png.interlaced
    np.testing.assert_array_equal(png.pixels, a)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_our_encoders_output_round_trips(channels):
    """runtime/png.py picks every one of the five filters, Average and Paeth included."""
    a = smooth(64, 65, channels, seed=channels)
    np.testing.assert_array_equal(decode_png(encode_png(a)).pixels, a)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_palette_images(bits):
    image = Image.fromarray(smooth(40, 41, 3)).quantize(2**bits)
    data = pil_png(image, bits=bits)
    png = decode_png(data)
    assert png.mode == "RGB" and png.bit_depth == bits
    np.testing.assert_array_equal(
        png.pixels, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    )


def test_palette_transparency_gives_alpha():
    image = Image.fromarray(smooth(20, 21, 3)).quantize(16)
    data = pil_png(image, transparency=3)
    png = decode_png(data)
    assert png.mode == "RGBA"
    np.testing.assert_array_equal(
        png.pixels, np.asarray(Image.open(io.BytesIO(data)).convert("RGBA"))
    )


def test_one_bit_and_sixteen_bit_gray():
    bits = Image.fromarray(smooth(40, 45, 1)[:, :, 0] > 128)
    data = pil_png(bits)
    png = decode_png(data)
    assert png.bit_depth == 1
    np.testing.assert_array_equal(
        png.pixels[:, :, 0], np.asarray(Image.open(io.BytesIO(data)).convert("L"))
    )
    deep = np.random.default_rng(1).integers(0, 65536, (30, 31)).astype(np.uint16)
    png = decode_png(pil_png(Image.fromarray(deep)))
    assert png.bit_depth == 16 and png.pixels.dtype == np.uint16
    np.testing.assert_array_equal(png.pixels[:, :, 0], deep)


def test_two_and_four_bit_gray_scale_as_pillow():
    for depth in (2, 4):
        levels = np.arange(8 * 3) % (1 << depth)  # one row of 24 samples
        packed = np.packbits(
            np.unpackbits(levels.astype(np.uint8)[:, None], axis=1)[:, 8 - depth :].ravel()
        )
        data = raw_png(24, 1, depth, 0, [b"\0" + packed.tobytes()])
        want = np.asarray(Image.open(io.BytesIO(data)).convert("L"))
        np.testing.assert_array_equal(decode_png(data).pixels[:, :, 0], want)


def adam7(a: np.ndarray, depth_bytes: int = 1) -> list[bytes]:
    """Scanlines of an interlaced 8-bit image, unfiltered."""
    rows = []
    for y0, x0, dy, dx in ((0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2),
                           (0, 1, 2, 2), (1, 0, 2, 1)):  # fmt: skip
        part = a[y0::dy, x0::dx]
        if part.size:
            rows += [b"\0" + row.tobytes() for row in part]
    return rows


def test_interlaced_image():
    a = smooth(13, 11, 3)
    data = raw_png(11, 13, 8, 2, adam7(a), interlace=1)
    png = decode_png(data)
    assert png.interlaced
    np.testing.assert_array_equal(png.pixels, a)
    np.testing.assert_array_equal(png.pixels, np.asarray(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize(
    "damage,says",
    [
        (lambda d: b"GIF89a" + d[6:], "PNG signature"),
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: d[:40] + bytes([d[40] ^ 0xFF]) + d[41:], "CRC"),
        (lambda d: d[:-12], "truncated"),
    ],
)
def test_damaged_files_say_why(damage, says):
    data = encode_png(smooth(16, 16, 3))
    with pytest.raises(PngError, match=says):
        decode_png(damage(data))


def test_bad_headers_and_filters():
    with pytest.raises(PngError, match="colour type 5"):
        decode_png(raw_png(1, 1, 8, 5, [b"\0\0"]))
    with pytest.raises(PngError, match="bit depth 4"):
        decode_png(raw_png(1, 1, 4, 2, [b"\0\0"]))
    with pytest.raises(PngError, match="filter type 7"):
        decode_png(raw_png(2, 1, 8, 0, [b"\7\0\0"]))
    with pytest.raises(PngError, match="shorter than its size"):
        decode_png(raw_png(4, 4, 8, 0, [b"\0\0\0\0\0"]))
    with pytest.raises(PngError, match="without a palette"):
        decode_png(raw_png(1, 1, 8, 3, [b"\0\0"]))
    palette = chunk(b"PLTE", b"\0\0\0")
    with pytest.raises(PngError, match="past the end of its palette"):
        decode_png(raw_png(1, 1, 8, 3, [b"\0\5"], extra=palette))
