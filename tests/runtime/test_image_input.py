"""runtime/image_input: init images and masks read as Pillow's convert("RGB")/convert("L") reads
them, other formats through Pillow or refused in one line without it, and sizes made to match
only when the user says how."""

from __future__ import annotations

import io

import numpy as np
import pytest

from sdiree.runtime import image_input
from sdiree.runtime.errors import UserError
from sdiree.runtime.image_input import fit_to, load_edit_images, read_image, resample

Image = pytest.importorskip("PIL.Image")


def smooth(h: int, w: int, c: int, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    planes = [
        (np.sin(x / rng.uniform(3, 9) + k) * np.cos(y / rng.uniform(3, 9)) * 110 + 128)
        for k in range(c)
    ]
    return np.stack(planes, axis=2).round().clip(0, 255).astype(np.uint8)


def save(tmp_path, name: str, image, fmt: str = "PNG", **options):
    path = tmp_path / name
    image.save(path, fmt, **options)
    return path


@pytest.mark.parametrize("mode", ["L", "LA", "RGB", "RGBA", "P", "1", "I;16"])
def test_png_reads_as_pillow_converts(tmp_path, mode):
    rgba = smooth(24, 20, 4)
    image = Image.fromarray(rgba, "RGBA")
    if mode == "P":
        image = image.convert("RGB").quantize(40)
    elif mode == "I;16":
        image = Image.fromarray(rgba[:, :, 0].astype(np.uint16) * 257)
    else:
        image = image.convert(mode)
    path = save(tmp_path, "a.png", image)
    rgb, alpha = read_image(path, "--init-image", "RGB")
    gray, _ = read_image(path, "--mask", "L")
    assert alpha == (mode in ("LA", "RGBA"))
    if mode == "I;16":  # Pillow clips 16-bit values to 8; sdiree keeps the high byte
        np.testing.assert_array_equal(gray, rgba[:, :, 0])
        return
    with Image.open(path) as ref:
        np.testing.assert_array_equal(rgb, np.asarray(ref.convert("RGB")))
        np.testing.assert_array_equal(gray, np.asarray(ref.convert("L")))
    assert rgb.dtype == gray.dtype == np.uint8 and rgb.shape == (24, 20, 3)


def test_other_formats_through_pillow_or_refused_without_it(tmp_path, monkeypatch):
    path = save(tmp_path, "a.jpg", Image.fromarray(smooth(16, 16, 3)), "JPEG", quality=95)
    pixels, _ = read_image(path, "--init-image", "RGB")
    with Image.open(path) as ref:
        np.testing.assert_array_equal(pixels, np.asarray(ref.convert("RGB")))
    webp = save(tmp_path, "a.webp", Image.fromarray(smooth(16, 16, 3)), "WEBP")
    monkeypatch.setattr(image_input, "_pillow", lambda: None)
    for p, kind in ((path, "a JPEG"), (webp, "a WebP")):
        with pytest.raises(UserError) as info:
            read_image(p, "--init-image", "RGB")
        msg = str(info.value)
        assert f"is {kind} image" in msg and "convert it to PNG" in msg
        assert "pip install pillow" in msg and "\n" not in msg


def test_exif_orientation_is_applied(tmp_path):
    tall = Image.fromarray(smooth(20, 10, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    path = tmp_path / "r.jpg"
    tall.save(path, "JPEG", exif=exif.tobytes(), quality=95)
    pixels, _ = read_image(path, "--init-image", "RGB")
    assert pixels.shape == (10, 20, 3)


@pytest.mark.parametrize("pillow", [True, False], ids=["with-pillow", "without-pillow"])
def test_not_an_image_is_one_line(tmp_path, monkeypatch, pillow):
    if not pillow:
        monkeypatch.setattr(image_input, "_pillow", lambda: None)
    text = tmp_path / "notes.png"
    text.write_text("not an image at all\n")
    with pytest.raises(UserError) as info:
        read_image(text, "--init-image", "RGB")
    msg = str(info.value)
    assert "\n" not in msg and str(text) in msg
    assert ("is not an image" if pillow else "is not a PNG image") in msg
    broken = tmp_path / "cut.png"
    broken.write_bytes(_png_bytes(smooth(16, 16, 3))[:60])
    with pytest.raises(UserError, match="is not a readable PNG: .*truncated"):
        read_image(broken, "--init-image", "RGB")
    with pytest.raises(UserError, match="no such file"):
        read_image(tmp_path / "missing.png", "--init-image", "RGB")
    with pytest.raises(UserError, match="is a folder"):
        read_image(tmp_path, "--mask", "L")


def _png_bytes(a) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def test_sizes_must_match_unless_resize_is_given(tmp_path):
    image = save(tmp_path, "i.png", Image.fromarray(smooth(48, 80, 3)))
    with pytest.raises(UserError) as info:
        load_edit_images(image, None, 64, 64)
    assert "is 80x48 but this artifact makes 64x64" in str(info.value)
    assert "--resize crop, fit or stretch" in str(info.value)
    for mode in ("crop", "fit", "stretch"):
        edit = load_edit_images(image, None, 64, 64, mode)
        assert edit.image.shape == (64, 64, 3) and edit.mask is None
        assert any(f"--resize {mode}" in n and "Lanczos" in n for n in edit.notes)
    same = save(tmp_path, "s.png", Image.fromarray(smooth(64, 64, 3)))
    edit = load_edit_images(same, None, 64, 64)
    assert edit.notes == () and np.array_equal(edit.image, smooth(64, 64, 3))


def test_mask_must_be_the_images_size_and_follows_its_resize(tmp_path):
    image = save(tmp_path, "i.png", Image.fromarray(smooth(48, 80, 3)))
    small = save(tmp_path, "m.png", Image.fromarray(np.zeros((40, 80), np.uint8)))
    with pytest.raises(UserError, match="--mask .* is 80x40 but --init-image .* is 80x48"):
        load_edit_images(image, small, 64, 64, "crop")
    mask = np.zeros((48, 80), np.uint8)
    mask[:, 40:] = 255
    path = save(tmp_path, "m2.png", Image.fromarray(mask))
    edit = load_edit_images(image, path, 64, 64, "stretch")
    assert edit.mask.shape == (64, 64)
    assert edit.mask[:, :28].max() == 0 and edit.mask[:, 36:].min() == 255
    with pytest.raises(UserError, match="--mask needs --init-image"):
        load_edit_images(None, path, 64, 64)
    with pytest.raises(UserError, match="--resize applies to --init-image"):
        load_edit_images(None, None, 64, 64, "crop")


def test_mask_alpha_is_ignored_with_a_note(tmp_path):
    image = save(tmp_path, "i.png", Image.fromarray(smooth(32, 32, 3)))
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., :3] = 255
    rgba[:16, :, 3] = 0  # transparent top half: ignored, the gray levels count
    mask = save(tmp_path, "m.png", Image.fromarray(rgba, "RGBA"))
    edit = load_edit_images(image, mask, 32, 32)
    assert edit.mask.min() == 255
    assert any("alpha channel is ignored" in n for n in edit.notes)


def test_resample_is_close_to_pillows_lanczos():
    a = smooth(90, 120, 3)
    for w, h in ((60, 45), (64, 64), (240, 180), (101, 77)):
        ours = resample(a, w, h).astype(np.int16)
        ref = np.asarray(Image.fromarray(a).resize((w, h), Image.LANCZOS)).astype(np.int16)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).mean() < 0.6 and np.abs(ours - ref).max() <= 4, (w, h)


def test_crop_keeps_the_middle_and_fit_repeats_the_edges():
    wide = np.zeros((10, 30), np.uint8)
    wide[:, 10:20] = 200  # a bright middle third
    crop = fit_to(wide, 10, 10, "crop")
    assert crop.shape == (10, 10) and crop.min() == 200
    fit = fit_to(wide, 30, 30, "fit")
    assert fit.shape == (30, 30)
    np.testing.assert_array_equal(fit[:10], np.repeat(fit[10:11], 10, axis=0))
    stretch = fit_to(wide, 20, 20, "stretch")
    assert stretch.shape == (20, 20)
