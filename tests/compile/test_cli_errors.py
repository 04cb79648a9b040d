"""Bad input to `sdiree compile`: one clear line, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest


def run_compile(*args):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_clean_failure(proc, must_say: str):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and must_say in lines[0], lines[0]


@pytest.fixture
def broken_model(tiny_model, tmp_path):
    def make(remove: str):
        copy = tmp_path / "model"
        shutil.copytree(tiny_model, copy)
        target = copy / remove
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        return copy

    return make


def test_not_a_diffusers_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert_clean_failure(
        run_compile(tmp_path / "empty", "--target", "cpu", "--out", out), "model_index.json"
    )
    assert not out.exists()


def test_missing_model_folder(tmp_path):
    assert_clean_failure(run_compile(tmp_path / "nope", "--target", "cpu"), "does not exist")


def test_missing_submodule(broken_model, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(
        run_compile(broken_model("vae"), "--target", "cpu", "--out", out), "'vae/'"
    )
    assert not out.exists()


# Each: the arguments, what the error line says, and what else stderr names (the choices or
# the way out). vulkan-spirv's cooperative-matrix presets cannot compile the fp16 UNet.
@pytest.mark.parametrize(
    "args,says,also",
    [
        (("--target", "metal"), "unknown target 'metal'", "vulkan-spirv"),
        (("--target", "rocm", "--arch", "gfx000"), "unknown arch 'gfx000'", "gfx942"),
        (
            ("--target", "vulkan-spirv", "--arch", "ampere", "--dtype", "fp16"),
            "--dtype fp16 is refused for vulkan-spirv/ampere",
            "use --dtype fp32",
        ),
    ],
    ids=["unknown-target", "unknown-arch", "refused-dtype"],
)
def test_bad_choice_names_the_way_out(tiny_model, tmp_path, args, says, also):
    out = tmp_path / "out"
    proc = run_compile(tiny_model, *args, "--out", out)
    assert_clean_failure(proc, says)
    assert also in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--height", 100), ("--width", 36), ("--height", -8)])
def test_size_not_multiple_of_8(tiny_model, tmp_path, flag, value):
    out = tmp_path / "out"
    assert_clean_failure(
        run_compile(tiny_model, "--target", "cpu", flag, value, "--out", out), "multiple of 8"
    )
    assert not out.exists()


def test_unwritable_out(tiny_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert_clean_failure(
        run_compile(tiny_model, "--target", "cpu", "--out", blocker / "sub" / "out"), "cannot write"
    )
    assert blocker.read_text() == "not a directory"


def test_unknown_dtype(tiny_model, tmp_path):
    assert_clean_failure(
        run_compile(tiny_model, "--target", "cpu", "--dtype", "int4", "--out", tmp_path / "o"),
        "dtype",
    )
