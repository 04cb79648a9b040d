"""Tests of runtime/image_output.py: pixel conversion against diffusers, result checks, A1111
parameters text, output path planning and atomic PNG writes with a "parameters" chunk."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdiree.runtime import image_output
from sdiree.runtime.errors import UserError
from sdiree.runtime.image_output import (
    a1111_parameters,
    check_image,
    check_output_paths,
    output_paths,
    remove_stale_temps_for,
    save_png,
    to_uint8,
)

# AUTOMATIC1111 modules/infotext_utils.py: how its "PNG Info" tab reads the parameters back.
RE_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def _unquote(text: str) -> str:
    if not text or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except Exception:  # noqa: BLE001 - A1111 falls back to the raw text
        return text


def parse_a1111(text: str) -> tuple[str, str, dict[str, str]]:
    """A1111's parse_generation_parameters, reduced to prompt, negative prompt and key/values."""
    *lines, lastline = text.strip().split("\n")
    if len(RE_PARAM.findall(lastline)) < 3:
        lines.append(lastline)
        lastline = ""
    prompt, negative, done = "", "", False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            done = True
            line = line[16:].strip()
        if done:
            negative += ("" if negative == "" else "\n") + line
        else:
            prompt += ("" if prompt == "" else "\n") + line
    return prompt, negative, {k: _unquote(v) for k, v in RE_PARAM.findall(lastline)}


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------- to_uint8


def _diffusers_pixels(images: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    processor = pytest.importorskip("diffusers.image_processor").VaeImageProcessor()
    t = torch.from_numpy(images)
    ref = (processor.postprocess(t, output_type="np") * 255).round().astype("uint8")
    pil = processor.postprocess(t, output_type="pil")
    np.testing.assert_array_equal(np.stack([np.asarray(im) for im in pil]), ref)
    return ref


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_to_uint8_matches_diffusers_random(dtype):
    rng = np.random.default_rng(0)
    images = (rng.standard_normal((2, 3, 32, 48)) * 0.7).astype(dtype)  # some values out of range
    out = to_uint8(images)
    assert out.dtype == np.uint8 and out.shape == (2, 32, 48, 3)
    np.testing.assert_array_equal(out, _diffusers_pixels(images))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_to_uint8_matches_diffusers_every_float16_value(dtype):
    # Every finite float16 in [-1.5, 1.5]: the float16 path must round exactly like torch's.
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    values = values[np.isfinite(values) & (np.abs(values) <= 1.5)]
    values = values[: len(values) // 3 * 3].reshape(1, 3, 1, -1).astype(dtype)
    np.testing.assert_array_equal(to_uint8(values), _diffusers_pixels(values))


def test_to_uint8_rounding_and_clamping():
    x = np.array([-2.0, -1.0, 0.0, 1.0, 3.0, np.inf, -np.inf, np.nan], np.float32)
    out = to_uint8(x.reshape(1, 1, 1, -1))[0, 0, :, 0]
    assert out.tolist() == [0, 0, 128, 255, 255, 255, 0, 0]  # 127.5 rounds half to even


def test_to_uint8_does_not_modify_input_and_rejects_bad_input():
    x = np.full((1, 3, 2, 2), 5.0, np.float32)
    to_uint8(x)
    assert (x == 5.0).all()
    with pytest.raises(ValueError):
        to_uint8(np.zeros((3, 2, 2), np.float32))
    with pytest.raises(ValueError):
        to_uint8(np.zeros((1, 3, 2, 2), np.uint8))


# ---------------------------------------------------------------- check_image


def _good_image(dtype=np.float32) -> np.ndarray:
    return np.linspace(-1, 1, 2 * 3 * 8 * 8, dtype=np.float32).reshape(2, 3, 8, 8).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_check_image_accepts_a_normal_result(dtype):
    check_image(_good_image(dtype))
    check_image(_good_image(dtype)[0])  # a single CHW image


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_image_nan_and_inf(bad):
    images = _good_image()
    images[1, 2, 3, 4] = bad
    with pytest.raises(UserError, match="NaN" if np.isnan(bad) else "infinite") as e:
        check_image(images)
    assert "arch" in str(e.value) and "\n" not in str(e.value)


def test_check_image_all_black():
    images = _good_image()
    images[1] = -1.0
    with pytest.raises(UserError, match=r"^image 2 of 2 is all black") as e:
        check_image(images)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"^the result is all black"):
        check_image(np.full((1, 3, 8, 8), -1.3, np.float16))


def test_check_image_flat_color_and_near_flat():
    with pytest.raises(UserError, match="one flat color"):
        check_image(np.full((1, 3, 8, 8), 0.25, np.float32))
    # Differences below one uint8 step still count as flat.
    noise = np.random.default_rng(1).uniform(-1, -1 + 1 / 512, (1, 3, 8, 8)).astype(np.float32)
    with pytest.raises(UserError, match="all black"):
        check_image(noise)
    # A dark image with a single lit pixel is fine.
    dark = np.full((1, 3, 8, 8), -1.0, np.float32)
    dark[0, 0, 0, 0] = -0.99
    check_image(dark)


# ---------------------------------------------------------------- a1111_parameters


def test_a1111_format_and_parse_back():
    text = a1111_parameters(
        "a cat, sitting: on a mat",
        "blurry, low quality",
        20,
        "Euler a",
        7.5,
        42,
        512,
        768,
        "sd15",
        {"Target": "vulkan-spirv", "Arch": "rdna3", "Note": "a, b: c", "Skipped": None},
    )
    lines = text.split("\n")
    assert lines == [
        "a cat, sitting: on a mat",
        "Negative prompt: blurry, low quality",
        "Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 42, Size: 512x768, Model: sd15, "
        'RNG: CPU, Target: vulkan-spirv, Arch: rdna3, Note: "a, b: c"',
    ]
    prompt, negative, params = parse_a1111(text)
    assert prompt == "a cat, sitting: on a mat"
    assert negative == "blurry, low quality"
    assert params == {
        "Steps": "20",
        "Sampler": "Euler a",
        "CFG scale": "7.5",
        "Seed": "42",
        "Size": "512x768",
        "Model": "sd15",
        "RNG": "CPU",
        "Target": "vulkan-spirv",
        "Arch": "rdna3",
        "Note": "a, b: c",
    }
    assert list(params) == ["Steps", "Sampler", "CFG scale", "Seed", "Size", "Model", "RNG"] + [
        "Target",
        "Arch",
        "Note",
    ]


def test_a1111_without_negative_prompt_and_number_formats():
    text = a1111_parameters("dog", "", 4, "LCM", np.float32(7.0), 2**40, 512, 512, "m", {})
    assert (
        text == "dog\nSteps: 4, Sampler: LCM, CFG scale: 7, Seed: 1099511627776, Size: 512x512, "
        "Model: m, RNG: CPU"
    )
    text = a1111_parameters("dog", "", 4, "LCM", np.float32(1.3), 1, 64, 64, "m", None)
    assert "CFG scale: 1.3," in text
    prompt, negative, params = parse_a1111(text)
    assert (prompt, negative, params["CFG scale"]) == ("dog", "", "1.3")


def test_a1111_multiline_prompts_and_quoted_model():
    text = a1111_parameters(
        "line one\nline two",
        "neg one\nneg two",
        30,
        "DPM++ 2M",
        5,
        7,
        64,
        64,
        "C:\\m",
        {"VAE dtype": "fp16"},
    )
    prompt, negative, params = parse_a1111(text)
    assert prompt == "line one\nline two"
    assert negative == "neg one\nneg two"
    assert params["Model"] == "C:\\m" and params["VAE dtype"] == "fp16"


def test_a1111_key_order_of_create_infotext():
    # A1111 1.10 create_infotext: Steps, Sampler, Schedule type, CFG scale, Seed, Size,
    # Model hash, Model, ..., RNG, then extra_generation_params.
    text = a1111_parameters("p", "n", 20, "DPM++ 2M", 7, 2**64 - 1, 512, 512, "sd15",
                            {"Target": "cpu"}, schedule_type="Karras",
                            model_hash="0123456789")  # fmt: skip
    assert text.split("\n")[-1] == (
        "Steps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, "
        "Seed: 18446744073709551615, Size: 512x512, Model hash: 0123456789, Model: sd15, "
        "RNG: CPU, Target: cpu"
    )
    params = parse_a1111(text)[2]
    assert params["Model hash"] == "0123456789" and params["RNG"] == "CPU"
    # RNG: None leaves the key out (A1111 then assumes GPU noise).
    assert "RNG" not in a1111_parameters("p", "", 1, "Euler", 7, 1, 8, 8, "m", rng=None)


def test_a1111_rejects_bad_extra_keys():
    args = ("p", "", 1, "Euler", 7.5, 1, 64, 64, "m")
    with pytest.raises(ValueError):
        a1111_parameters(*args, {"Seed": 3})
    with pytest.raises(ValueError):
        a1111_parameters(*args, {"RNG": "GPU"})
    with pytest.raises(ValueError):
        a1111_parameters(*args, {"bad:key": 3})
    with pytest.raises(ValueError):
        a1111_parameters(*args, {"X": 3})  # A1111 keys have at least two characters


# ---------------------------------------------------------------- output paths


def test_output_paths(tmp_path):
    out = tmp_path / "cat.png"
    assert output_paths(out, 1) == [out]
    assert output_paths(out, 3) == [tmp_path / f"cat-{i}.png" for i in range(3)]
    assert output_paths(Path("a.b.PNG"), 2) == [Path("a.b-0.PNG"), Path("a.b-1.PNG")]


@pytest.mark.parametrize("name", ["cat.jpg", "cat", "cat.png.txt"])
def test_output_paths_requires_png(name):
    with pytest.raises(UserError, match=r"must end in \.png"):
        output_paths(Path(name), 1)


def test_output_paths_rejects_zero_images():
    with pytest.raises(UserError):
        output_paths(Path("cat.png"), 0)


def test_check_output_paths(tmp_path):
    paths = output_paths(tmp_path / "cat.png", 3)
    check_output_paths(paths, overwrite=False)
    paths[1].write_bytes(b"old")
    with pytest.raises(UserError, match=r"cat-1\.png exists; pass --overwrite to replace it$"):
        check_output_paths(paths, overwrite=False)
    check_output_paths(paths, overwrite=True)


def test_check_output_paths_missing_parent_and_directory_target(tmp_path):
    missing = tmp_path / "nope" / "cat.png"
    with pytest.raises(UserError, match="does not exist; create it or choose another -o$") as e:
        check_output_paths([missing], overwrite=True)
    assert str(missing.parent) in str(e.value)
    (tmp_path / "d.png").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        check_output_paths([tmp_path / "d.png"], overwrite=True)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UserError, match="is not a directory"):
        check_output_paths([tmp_path / "file" / "cat.png"], overwrite=True)


# ---------------------------------------------------------------- save_png


def _pixels(h=16, w=24) -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_save_png_round_trip(tmp_path):
    path = tmp_path / "cat.png"
    params = a1111_parameters("a cat", "dog", 20, "Euler a", 7.5, 42, 24, 16, "sd15", {})
    pixels = _pixels()
    save_png(path, pixels, params, overwrite=False)
    assert _files(tmp_path) == ["cat.png"]
    with Image.open(path) as im:
        assert im.format == "PNG" and im.mode == "RGB"
        assert im.text["parameters"] == params
        assert im.info["parameters"] == params
        np.testing.assert_array_equal(np.asarray(im), pixels)
    assert b"tEXtparameters\x00" in path.read_bytes()  # latin-1 text: a plain tEXt chunk


def test_save_png_unicode_prompt_uses_itxt(tmp_path):
    path = tmp_path / "u.png"
    params = a1111_parameters(
        "猫, ein Kätzchen 🐱", "ぼやけた", 20, "Euler a", 7.5, 1, 24, 16, "m", {}
    )
    save_png(path, _pixels(), params, overwrite=False)
    with Image.open(path) as im:
        assert im.text["parameters"] == params
        assert im.info["parameters"] == params
    data = path.read_bytes()
    assert b"iTXtparameters\x00" in data and b"tEXt" not in data
    assert parse_a1111(params)[:2] == ("猫, ein Kätzchen 🐱", "ぼやけた")


def test_save_png_latin1_prompt_stays_text(tmp_path):
    path = tmp_path / "l.png"
    save_png(path, _pixels(), "café crème\nSteps: 1, Sampler: x, Seed: 1", overwrite=False)
    with Image.open(path) as im:
        assert im.info["parameters"] == "café crème\nSteps: 1, Sampler: x, Seed: 1"
    assert b"tEXtparameters\x00" in path.read_bytes()


def test_save_png_refuses_existing_file_unless_overwrite(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(b"old")
    with pytest.raises(UserError, match="exists; pass --overwrite"):
        save_png(path, _pixels(), "p", overwrite=False)
    assert path.read_bytes() == b"old"
    save_png(path, _pixels(), "p", overwrite=True)
    with Image.open(path) as im:
        assert im.info["parameters"] == "p"
    assert _files(tmp_path) == ["cat.png"]


@pytest.mark.parametrize(
    "bad",
    [np.zeros((16, 24, 2), np.uint8), np.zeros((1, 16, 24, 3), np.uint8), np.zeros((16, 24, 3))],
)
def test_save_png_bad_array_leaves_nothing(tmp_path, bad):
    path = tmp_path / "cat.png"
    with pytest.raises(ValueError):
        save_png(path, bad, "p", overwrite=False)
    assert _files(tmp_path) == []


def test_save_png_failing_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "cat.png"
    path.write_bytes(b"old")

    def failing_write(tmp, *args):
        Path(tmp).write_bytes(b"partial")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(image_output, "_write_png", failing_write)
    with pytest.raises(UserError, match="cannot write .*cat.png: Input/output error; choose"):
        save_png(path, _pixels(), "p", overwrite=True)
    assert _files(tmp_path) == ["cat.png"]
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("overwrite", [False, True])
def test_save_png_full_disk_is_one_line_and_leaves_no_temp(tmp_path, monkeypatch, overwrite):
    def full_disk(tmp, *args):
        Path(tmp).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(image_output, "_write_png", full_disk)
    with pytest.raises(UserError) as e:
        save_png(tmp_path / "cat.png", _pixels(), "p", overwrite=overwrite)
    assert str(e.value).endswith("No space left on device; free some space or choose another -o")
    assert "\n" not in str(e.value)
    assert _files(tmp_path) == []


def test_save_png_never_replaces_a_file_created_meanwhile(tmp_path, monkeypatch):
    # Another run publishes the same name between our existence check and our rename.
    path = tmp_path / "cat.png"
    real_write = image_output._write_png

    def racing_write(tmp, *args):
        real_write(tmp, *args)
        path.write_bytes(b"theirs")

    monkeypatch.setattr(image_output, "_write_png", racing_write)
    with pytest.raises(UserError, match="created by another process.*--overwrite") as e:
        save_png(path, _pixels(), "p", overwrite=False)
    assert "\n" not in str(e.value)
    assert path.read_bytes() == b"theirs" and _files(tmp_path) == ["cat.png"]
    save_png(path, _pixels(), "p", overwrite=True)  # asked for: replaced
    with Image.open(path) as im:
        assert im.info["parameters"] == "p"
    assert _files(tmp_path) == ["cat.png"]


def test_save_png_without_hard_links_still_refuses_existing(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(image_output.os, "link", no_links)
    path = tmp_path / "cat.png"
    save_png(path, _pixels(), "p", overwrite=False)
    with Image.open(path) as im:
        assert im.info["parameters"] == "p"
    assert _files(tmp_path) == ["cat.png"]

    real_write = image_output._write_png
    other = tmp_path / "dog.png"

    def racing_write(tmp, *args):
        real_write(tmp, *args)
        other.write_bytes(b"theirs")

    monkeypatch.setattr(image_output, "_write_png", racing_write)
    with pytest.raises(UserError, match="created by another process"):
        save_png(other, _pixels(), "p", overwrite=False)
    assert other.read_bytes() == b"theirs" and _files(tmp_path) == ["cat.png", "dog.png"]


def test_remove_stale_temps_for_only_touches_dead_runs_of_that_name(tmp_path):
    path = tmp_path / "cat.png"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".cat.png.{dead.pid}.tmp.png"
    live = tmp_path / f".cat.png.{os.getpid()}.tmp.png"
    other = tmp_path / f".dog.png.{dead.pid}.tmp.png"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    remove_stale_temps_for(path)
    assert _files(tmp_path) == sorted([live.name, other.name])


@pytest.mark.parametrize("shape", [(16, 24), (16, 24, 1), (16, 24, 4)])
def test_save_png_gray_and_rgba(tmp_path, shape):
    path = tmp_path / "x.png"
    pixels = np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8)
    save_png(path, pixels, "p", overwrite=False)
    with Image.open(path) as im:
        assert im.mode == {2: "L", 1: "L", 4: "RGBA"}[shape[-1] if len(shape) == 3 else 2]
        expected = pixels[:, :, 0] if shape[-1:] == (1,) else pixels
        np.testing.assert_array_equal(np.asarray(im), expected)


def test_end_to_end_batch(tmp_path):
    decoded = _good_image()
    check_image(decoded)
    paths = output_paths(tmp_path / "out.png", len(decoded))
    check_output_paths(paths, overwrite=False)
    for i, (p, img) in enumerate(zip(paths, to_uint8(decoded), strict=True)):
        save_png(p, img, f"image {i}\nSteps: 1, Sampler: x, Seed: {i}", overwrite=False)
    assert _files(tmp_path) == ["out-0.png", "out-1.png"]
    with Image.open(paths[1]) as im:
        assert parse_a1111(im.info["parameters"])[2]["Seed"] == "1"
