"""Init images and masks from files: read, converted as diffusers' pipelines convert them, and
brought to the artifact's size only when the user asks how.

PNG is read by sdiree's own decoder (runtime/png_decode.py); other formats (JPEG, WebP, ...) by
Pillow when it is installed (EXIF orientation applied, as diffusers' ``load_image`` does), and
otherwise refused with a line saying to convert the file to PNG or install Pillow. The init
image becomes 8-bit RGB and the mask 8-bit gray exactly as Pillow's ``convert("RGB")`` and
``convert("L")`` make them (alpha dropped; gray = ITU-R 601 luma in Pillow's fixed point;
16-bit samples keep their high byte), which is what diffusers' pipelines are given in practice.

An image of another size than the artifact's is refused unless ``resize`` says how to fit it:
``stretch`` scales each side to the target, ``crop`` scales to cover the target and cuts the
middle out, ``fit`` scales to fit inside it and fills the borders by repeating the edge pixels.
Every resize uses a separable Lanczos-3 filter widened by the scale when shrinking (Pillow's
LANCZOS), in float, then rounded to 8 bits. A mask must be the init image's size; it is
resized with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UserError
from .png_decode import PNG_SIGNATURE, PngError, decode_png

RESIZE_MODES = ("crop", "fit", "stretch")
LANCZOS_A = 3
# Other formats by their first bytes, for the message when Pillow is not there to read them.
_MAGIC = (
    (b"\xff\xd8\xff", "a JPEG"),
    (b"GIF87a", "a GIF"),
    (b"GIF89a", "a GIF"),
    (b"BM", "a BMP"),
    (b"II*\x00", "a TIFF"),
    (b"MM\x00*", "a TIFF"),
    (b"\x00\x00\x00\x0cjP  ", "a JPEG 2000"),
)


@dataclass(frozen=True)
class EditImages:
    """The inputs of img2img and inpainting at the artifact's size."""

    image: np.ndarray  # HxWx3 uint8 RGB
    mask: np.ndarray | None  # HxW uint8 gray (inpainting: >= 128 is repainted), or None
    notes: tuple[str, ...] = ()  # what was done to them, for the user


def _format_of(head: bytes) -> str | None:
    if head.startswith(PNG_SIGNATURE):
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "a WebP"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    return None


def _pillow():
    try:
        from PIL import Image, ImageOps
    except ImportError:
        return None
    return Image, ImageOps


def read_image(path: Path, option: str, mode: str) -> tuple[np.ndarray, bool]:
    """The file's pixels converted to ``mode`` ("RGB": HxWx3, "L": HxW), uint8, and whether it
    had an alpha channel (dropped). UserError in one line for anything that is not an image."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{option} {path} is a folder, not an image file") from None
    except OSError as e:
        raise UserError(f"{option} {path} cannot be read ({e.strerror or e})") from None
    kind = _format_of(data[:16])
    if kind == "PNG":
        try:
            png = decode_png(data)
        except PngError as e:
            raise UserError(f"{option} {path} is not a readable PNG: {e}") from None
        return _convert(png.pixels, png.mode, mode), png.mode in ("LA", "RGBA")
    pil = _pillow()
    if pil is None:
        what = f"is {kind} image" if kind else "is not a PNG image"
        raise UserError(
            f"{option} {path} {what}; without Pillow sdiree reads PNG only: convert it to PNG, "
            "or install Pillow (pip install pillow)"
        )
    return _read_with_pillow(pil, path, option, mode, kind)


def _read_with_pillow(pil, path: Path, option: str, mode: str, kind: str | None):
    image_mod, ops = pil
    try:
        with image_mod.open(path) as im:
            im.load()
            im = ops.exif_transpose(im)
            alpha = "A" in im.getbands() or "transparency" in im.info
            return np.asarray(im.convert(mode), dtype=np.uint8), alpha
    except (OSError, ValueError, SyntaxError, image_mod.DecompressionBombError) as e:
        what = f"{kind} image that Pillow cannot read" if kind else "not an image"
        raise UserError(f"{option} {path} is {what} ({str(e).splitlines()[0]})") from None


def _luma(rgb: np.ndarray) -> np.ndarray:
    """Pillow's RGB → L: ITU-R 601-2 luma in 16-bit fixed point, rounded."""
    r, g, b = (rgb[..., k].astype(np.uint32) for k in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)


def _convert(pixels: np.ndarray, source: str, mode: str) -> np.ndarray:
    if pixels.dtype == np.uint16:
        pixels = (pixels >> 8).astype(np.uint8)
    color = pixels[:, :, :3] if source in ("RGB", "RGBA") else pixels[:, :, :1]
    if mode == "RGB":
        return np.ascontiguousarray(np.broadcast_to(color, (*color.shape[:2], 3)))
    return color[:, :, 0].copy() if color.shape[2] == 1 else _luma(color)


def _lanczos(x: np.ndarray) -> np.ndarray:
    out = np.sinc(x) * np.sinc(x / LANCZOS_A)
    return np.where(np.abs(x) < LANCZOS_A, out, 0.0)


def _weights(n_in: int, n_out: int) -> np.ndarray:
    """n_out x n_in Lanczos-3 resampling matrix, widened by the scale when shrinking, each row
    cut to the source and normalised (as Pillow's resampler)."""
    scale = n_in / n_out
    stretch = max(scale, 1.0)
    centers = (np.arange(n_out) + 0.5) * scale
    taps = np.arange(n_in) + 0.5
    w = _lanczos((taps[None, :] - centers[:, None]) / stretch)
    return w / w.sum(axis=1, keepdims=True)


def resample(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 HxW or HxWxC resized to width x height with the Lanczos-3 filter."""
    h, w = pixels.shape[:2]
    if (w, h) == (width, height):
        return pixels.copy()
    x = pixels.astype(np.float64)
    x = np.tensordot(_weights(h, height), x, axes=(1, 0))
    x = np.moveaxis(np.tensordot(_weights(w, width), x, axes=(1, 1)), 0, 1)
    return np.clip(np.round(x), 0, 255).astype(np.uint8)


def fit_to(pixels: np.ndarray, width: int, height: int, mode: str) -> np.ndarray:
    """The image at width x height by ``mode`` (RESIZE_MODES, see the module doc)."""
    h, w = pixels.shape[:2]
    if mode == "stretch":
        return resample(pixels, width, height)
    if mode == "crop":  # cover the target, then cut the middle out
        ratio = max(width / w, height / h)
        new_w, new_h = max(width, round(w * ratio)), max(height, round(h * ratio))
        top, left = (new_h - height) // 2, (new_w - width) // 2
        return resample(pixels, new_w, new_h)[top : top + height, left : left + width].copy()
    ratio = min(width / w, height / h)  # fit inside the target, then repeat the edges
    new_w = min(width, max(1, round(w * ratio)))
    new_h = min(height, max(1, round(h * ratio)))
    top, left = (height - new_h) // 2, (width - new_w) // 2
    pad = [(top, height - new_h - top), (left, width - new_w - left)]
    pad += [(0, 0)] * (pixels.ndim - 2)
    return np.pad(resample(pixels, new_w, new_h), pad, mode="edge")


def load_edit_images(
    init_image: Path | None,
    mask: Path | None,
    width: int,
    height: int,
    resize: str | None = None,
) -> EditImages | None:
    """The init image (and mask) at the artifact's width x height; None without an init image.
    UserError, before any work, for a file that is not an image, a mask without an init image
    or of another size than it, and an image of another size without ``resize``."""
    if init_image is None:
        if mask is not None:
            raise UserError("--mask needs --init-image: the image whose masked part is repainted")
        if resize is not None:
            raise UserError("--resize applies to --init-image; leave it out or give an image")
        return None
    if resize is not None and resize not in RESIZE_MODES:
        raise UserError(f"--resize {resize!r}: choose one of {', '.join(RESIZE_MODES)}")
    image, _ = read_image(init_image, "--init-image", "RGB")
    notes = []
    gray = None
    if mask is not None:
        gray, alpha = read_image(mask, "--mask", "L")
        if gray.shape != image.shape[:2]:
            raise UserError(
                f"--mask {mask} is {gray.shape[1]}x{gray.shape[0]} but --init-image {init_image} "
                f"is {image.shape[1]}x{image.shape[0]}: the mask must be the image's size"
            )
        if alpha:
            notes.append(
                f"--mask {mask}: its alpha channel is ignored; its gray levels say what is "
                "repainted (white, >= 128) and what is kept (black), as in diffusers"
            )
    h, w = image.shape[:2]
    if (w, h) != (width, height):
        if resize is None:
            raise UserError(
                f"--init-image {init_image} is {w}x{h} but this artifact makes {width}x{height} "
                f"images: resize it, or pass --resize crop, fit or stretch"
            )
        image = fit_to(image, width, height, resize)
        if gray is not None:
            gray = fit_to(gray, width, height, resize)
        notes.append(
            f"--init-image resized from {w}x{h} to {width}x{height} (--resize {resize}, "
            "Lanczos-3 filter)" + (", its mask with it" if gray is not None else "")
        )
    return EditImages(image, gray, tuple(notes))
