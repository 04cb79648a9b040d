"""The runtime's own PNG encoder: Pillow (a test-only dependency) must read back what it wrote."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from sdiree.runtime.png import _filtered_rows, encode_png, text_chunk


def _decode(data: bytes) -> Image.Image:
    Image.open(io.BytesIO(data)).verify()  # checks every chunk's CRC
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        out.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]))
        pos += 12 + n
    return out


def _every_filter_image() -> np.ndarray:
    """Gray rows that each of the five PNG filters encodes best: noise (None), a ramp (Sub),
    repeated rows (Up), rows where each byte is the mean of left and above (Average), and a
    diagonal ramp (Paeth)."""
    rng = np.random.default_rng(0)
    w = 48
    g = np.zeros((40, w), np.int64)
    g[0:8] = rng.integers(0, 256, (8, w))
    g[8:16] = np.arange(w) * 5
    g[16:24] = g[15]
    g[24:32, 0] = rng.integers(0, 256, 8)
    for i in range(24, 32):
        for j in range(1, w):
            g[i, j] = (g[i, j - 1] + g[i - 1, j]) // 2
    y, x = np.mgrid[32:40, 0:w]
    g[32:40] = (x * 3 + y * 11) % 256
    return g.astype(np.uint8)


@pytest.mark.parametrize(
    "shape,mode",
    [((5, 7), "L"), ((5, 7, 1), "L"), ((9, 4, 3), "RGB"), ((3, 3, 4), "RGBA"), ((1, 1, 3), "RGB")],
)
def test_round_trip_modes(shape, mode):
    pixels = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    im = _decode(encode_png(pixels))
    assert im.mode == mode and im.size == (shape[1], shape[0])
    np.testing.assert_array_equal(np.asarray(im), pixels.reshape(np.asarray(im).shape))


def test_every_filter_is_used_and_decodes():
    gray = _every_filter_image()
    filters = {row[0] for row in np.frombuffer(_filtered_rows(gray), np.uint8).reshape(40, -1)}
    assert filters == {0, 1, 2, 3, 4}
    np.testing.assert_array_equal(np.asarray(_decode(encode_png(gray))), gray)
    rgb = np.stack([gray, gray[::-1], 255 - gray], axis=-1)
    np.testing.assert_array_equal(np.asarray(_decode(encode_png(rgb))), rgb)


def test_smooth_image_compresses_like_pillow():
    y, x = np.mgrid[0:128, 0:128]
    noise = np.random.default_rng(2).integers(0, 4, (128, 128, 3))
    img = (np.stack([x * 2, y * 2, x + y], axis=-1) + noise).clip(0, 255).astype(np.uint8)
    ours = encode_png(img)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    assert len(ours) < 1.1 * len(buf.getvalue())
    # filter type 0 everywhere would be far larger: the adaptive filters are doing their job
    unfiltered = zlib.compress(np.insert(img.reshape(128, -1), 0, 0, axis=1).tobytes(), 6)
    assert len(ours) < 0.8 * len(unfiltered)


def test_text_chunks_latin1_as_text_else_itxt():
    pixels = np.zeros((2, 2, 3), np.uint8)
    pixels[0, 0] = 255
    text = {"parameters": "café\nSteps: 2, Seed: 1", "Comment": "猫 🐱"}
    data = encode_png(pixels, text)
    assert _decode(data).text == text
    kinds = [kind for kind, _ in _chunks(data)]
    assert kinds == [b"IHDR", b"tEXt", b"iTXt", b"IDAT", b"IEND"]
    assert dict(_chunks(data))[b"tEXt"] == b"parameters\0" + "café\nSteps: 2, Seed: 1".encode(
        "latin-1"
    )


@pytest.mark.parametrize("keyword", ["", " lead", "trail ", "two  spaces", "x" * 80, "ta\tb", "ü€"])
def test_bad_keyword_is_refused(keyword):
    with pytest.raises(ValueError, match="keyword"):
        text_chunk(keyword, "v")


def test_nul_in_text_is_refused():
    with pytest.raises(ValueError, match="NUL"):
        encode_png(np.zeros((1, 1), np.uint8), {"parameters": "a\0b"})


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((4, 4), np.float32),
        np.zeros((4, 4, 2), np.uint8),
        np.zeros((1, 4, 4, 3), np.uint8),
        np.zeros((4,), np.uint8),
        np.zeros((0, 4, 3), np.uint8),
    ],
)
def test_bad_pixels_are_refused(bad):
    with pytest.raises(ValueError, match="PNG"):
        encode_png(bad)
