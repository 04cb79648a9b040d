"""Image output: VAE decoder result to uint8 pixels, sanity checks, and PNG files with metadata.

The conversion reproduces diffusers' ``VaeImageProcessor.postprocess`` bit for bit, the checks
turn a broken result (NaN, an all-black image) into a message instead of a useless file, and the
PNGs carry the "parameters" text chunk AUTOMATIC1111 writes, so image browsers and A1111's PNG Info
show how they were made. Output paths are checked before any generation work starts; every file
is written to a temp name and published atomically, without ever replacing a file that appeared
meanwhile unless overwriting was asked for.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UserError
from .fileutil import pid_alive, temp_path_for
from .png import encode_png

__all__ = [
    "a1111_parameters",
    "check_image",
    "check_output_paths",
    "output_paths",
    "remove_stale_temps_for",
    "save_png",
    "to_uint8",
]

# A1111's parser reads "Key: value" pairs with this key pattern (modules/infotext_utils.py).
_A1111_KEY_RE = re.compile(r"\w[\w \-/]+")


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Turn VAE decoder output (NCHW float in [-1, 1]) into NHWC uint8 pixels.

    Matches diffusers' ``VaeImageProcessor.postprocess(image, output_type="pil")`` exactly: the
    denormalisation ``(x * 0.5 + 0.5).clip(0, 1)`` runs in the input's own dtype (so a float16
    result is rounded to float16 there, as torch does), then the values are cast to float32 and
    ``(x * 255).round().astype("uint8")`` (round half to even) gives the pixels. NaN becomes 0.
    """
    x = np.asarray(images)
    if x.ndim != 4:
        raise ValueError(f"to_uint8 expects NCHW images, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"to_uint8 expects float images, got {x.dtype}")
    x = np.clip(x * 0.5 + 0.5, 0, 1).astype(np.float32, copy=False)
    x = np.nan_to_num(x, nan=0.0, copy=False)
    return (x.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)


def check_image(images_float: np.ndarray) -> None:
    """Raise UserError if decoder output (NCHW or CHW float) is unusable: NaN/inf, or flat.

    An image is flat when all its pixels convert to the same uint8 value (max - min < 1/255):
    all black is the usual symptom of a module miscompiled for this device or an fp16 overflow.
    Each image of a batch is checked on its own.
    """
    x = np.asarray(images_float)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise ValueError(f"check_image expects NCHW images, got shape {x.shape}")
    if not np.isfinite(x).all():
        what = "NaN values" if np.isnan(x).any() else "infinite values"
        raise UserError(
            f"the result contains {what}: the module may have been compiled for another arch "
            "than this device, or float16 overflowed; recompile with this device's --arch "
            "(or --dtype fp32) and retry"
        )
    pixels = to_uint8(x)
    for i, img in enumerate(pixels):
        lo, hi = int(img.min()), int(img.max())
        if lo != hi:
            continue
        which = f"image {i + 1} of {len(pixels)}" if len(pixels) > 1 else "the result"
        look = "all black" if hi == 0 else f"one flat color (every value {hi})"
        raise UserError(
            f"{which} is {look}: the module may have been compiled for another arch than this "
            "device, or float16 overflowed; recompile with this device's --arch (or --dtype fp32),"
            " or try another seed or prompt"
        )


def _quote(value: Any) -> str:
    """A1111's ``infotext_utils.quote``: JSON-quote a value holding a comma, colon or newline."""
    text = str(value)
    if "," not in text and ":" not in text and "\n" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def _number(value: float) -> str:
    """7.0 -> "7", 7.5 -> "7.5"; float32 values print at their own shortest precision."""
    v = float(str(value))
    return str(int(v)) if v.is_integer() else repr(v)


def a1111_parameters(
    prompt: str,
    negative_prompt: str,
    steps: int,
    sampler: str,
    cfg_scale: float,
    seed: int,
    width: int,
    height: int,
    model: str,
    extra: Mapping[str, Any] | None = None,
    *,
    schedule_type: str | None = None,
    model_hash: str | None = None,
    rng: str | None = "CPU",
) -> str:
    """Generation parameters as AUTOMATIC1111 writes them into a PNG "parameters" chunk.

    Line 1 is the prompt, line 2 ``Negative prompt: ...`` (left out when empty), and the last
    line the key/value pairs in the order of A1111's ``create_infotext``: ``Steps, Sampler,
    Schedule type, CFG scale, Seed, Size, Model hash, Model, RNG``, then ``extra`` in its order.
    ``RNG: CPU`` says the noise is torch's CPU generator stream (A1111 assumes GPU noise when the
    key is missing). Values with a comma, colon or newline are JSON-quoted and ``None`` values
    are skipped, both as A1111 does; the whole text is stripped like A1111's. Extra keys must
    match A1111's key pattern (a word character, then one or more word characters, spaces,
    hyphens or slashes) and must not repeat a fixed key (ValueError).
    """
    params: dict[str, Any] = {
        "Steps": int(steps),
        "Sampler": sampler,
        "Schedule type": schedule_type,
        "CFG scale": _number(cfg_scale),
        "Seed": int(seed),
        "Size": f"{int(width)}x{int(height)}",
        "Model hash": model_hash,
        "Model": model,
        "RNG": rng,
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not _A1111_KEY_RE.fullmatch(key):
            raise ValueError(f"parameter name {key!r} is not readable by A1111 parsers")
        if key in params:
            raise ValueError(f"parameter {key!r} is already written")
        params[key] = value
    line = ", ".join(f"{k}: {_quote(v)}" for k, v in params.items() if v is not None)
    negative = f"\nNegative prompt: {negative_prompt}" if negative_prompt else ""
    return f"{prompt}{negative}\n{line}".strip()


def output_paths(output: Path, n: int) -> list[Path]:
    """The PNG path of each of n images: ``[output]`` for one, else ``<stem>-<i><suffix>``.

    Numbering is 0-based (``cat-0.png``, ``cat-1.png``, ...) so the number is the image's index
    in the batch, as ImageMagick numbers frames. The suffix must be .png (any case).
    """
    output = Path(output)
    if output.suffix.lower() != ".png":
        raise UserError(f"output {output} must end in .png; sdiree writes PNG files")
    if n < 1:
        raise UserError(f"the number of images must be at least 1, got {n}")
    if n == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(n)]


def check_output_paths(paths: Sequence[Path], overwrite: bool) -> None:
    """Raise UserError if any path cannot be written; call it before any generation work.

    Each parent must be an existing, writable directory; an existing file is refused unless
    ``overwrite``, and an existing directory always is.
    """
    for path in map(Path, paths):
        parent = path.parent
        if not parent.exists():
            raise UserError(
                f"output directory {parent} does not exist; create it or choose another -o"
            )
        if not parent.is_dir():
            raise UserError(f"{parent} is not a directory; choose another -o")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(
                f"output directory {parent} is not writable; fix its permissions or choose "
                "another -o"
            )
        if path.is_dir():
            raise UserError(f"{path} is a directory; choose a file name ending in .png for -o")
        if path.exists() and not overwrite:
            raise UserError(f"{path} exists; pass --overwrite to replace it")


def _png_pixels(image: np.ndarray) -> np.ndarray:
    """HW (gray), HWC with 3 (RGB) or 4 (RGBA) channels; HW1 becomes HW."""
    pixels = np.ascontiguousarray(image)
    if pixels.dtype != np.uint8:
        raise ValueError(f"save_png expects uint8 pixels, got {pixels.dtype}")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    if pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] in (3, 4)):
        return pixels
    raise ValueError(f"save_png expects an HWC image with 1, 3 or 4 channels, got {image.shape}")


def remove_stale_temps_for(path: Path) -> None:
    """Delete temps of ``path`` left by killed sdiree runs (their pid is gone); others stay."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.tmp{re.escape(path.suffix)}")
    if not path.parent.is_dir():
        return
    for p in path.parent.glob(f".{path.name}.*.tmp*"):
        m = pattern.fullmatch(p.name)
        if m and p.is_file() and not pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _write_png(path: Path, pixels: np.ndarray, parameters: str) -> None:
    """Encode the pixels with the "parameters" chunk: tEXt if the text is latin-1, else iTXt."""
    Path(path).write_bytes(encode_png(pixels, {"parameters": parameters}))


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Move the finished temp file onto ``path``; without ``overwrite`` never replace a file.

    ``os.link`` fails with FileExistsError if ``path`` exists, in the same step that creates it,
    so two runs writing the same name cannot both succeed. Where hard links are not supported
    (FAT, some network file systems) an exclusive create reserves the name instead.
    """
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        try:
            os.replace(tmp, path)
        except OSError:
            path.unlink(missing_ok=True)  # our own empty reservation
            raise


def save_png(path: Path, image_uint8_hwc: np.ndarray, parameters: str, overwrite: bool) -> None:
    """Write one HWC uint8 image as a PNG with a "parameters" text chunk, atomically.

    The chunk is tEXt when the text is latin-1 and iTXt (UTF-8) otherwise, as A1111 writes it;
    PIL readers see it as ``Image.open(p).info["parameters"]`` either way. An existing file is
    refused (UserError) unless ``overwrite``, also one another process creates while this one
    writes. A failed write (a full disk, a read-only file system) is a UserError too, and leaves
    neither a temp file nor a change to ``path``.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it")
    pixels = _png_pixels(image_uint8_hwc)
    tmp = temp_path_for(path)
    try:
        _write_png(tmp, pixels, parameters)
        _publish(tmp, path, overwrite)
    except FileExistsError:
        raise UserError(
            f"{path} was created by another process while this one was writing it; it was left "
            "as it is: pass --overwrite to replace it, or choose another -o"
        ) from None
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise UserError(
            f"cannot write {path}: {e.strerror or e}; "
            + ("free some space or choose another -o" if full else "choose another -o")
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
