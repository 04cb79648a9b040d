"""`sdiree run` with bad img2img/inpainting input: one `error:` line, a non-zero exit and nothing
written, before any module is loaded (so a stand-in artifact without modules serves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from edit_parity import pattern_image, pattern_mask, torch_artifact  # noqa: E402

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def files(tiny_model, tiny_inpaint_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("edit-inputs")
    Image.fromarray(pattern_image(64, 64)).save(root / "in.png")
    Image.fromarray(pattern_image(48, 80)).save(root / "wide.png")
    Image.fromarray(pattern_mask(64, 64)).save(root / "mask.png")
    Image.fromarray(pattern_mask(32, 32)).save(root / "small-mask.png")
    (root / "notes.png").write_text("these are notes, not pixels\n")
    (root / "cut.png").write_bytes((root / "in.png").read_bytes()[:100])
    old = torch_artifact(tiny_model, root / "old-artifact")
    data = json.loads((old / "manifest.json").read_text())
    data["submodules"]["vae_encoder"]["functions"]["encode"]["outputs"].pop()  # mean only
    (old / "manifest.json").write_text(json.dumps(data))
    return {
        "dir": root,
        "art": torch_artifact(tiny_model, root / "artifact"),
        "inpaint": torch_artifact(tiny_inpaint_model, root / "inpaint-artifact"),
        "old": old,
    }


CASES = {
    "not-an-image": (["--init-image", "notes.png"], "is not an image"),
    "truncated-png": (["--init-image", "cut.png"], "is not a readable PNG"),
    "strength-nan": (["--init-image", "in.png", "--strength", "nan"], "--strength nan"),
    "strength-zero": (["--init-image", "in.png", "--strength", "0"], "above 0 and at most 1"),
    "strength-above-one": (["--init-image", "in.png", "--strength", "1.5"], "at most 1"),
    "no-step-left": (
        ["--init-image", "in.png", "--strength", "0.05", "--steps", "10"],
        "leaves no step to run",
    ),
    "strength-alone": (["--strength", "0.5"], "--strength applies to --init-image"),
    "mask-alone": (["--mask", "mask.png"], "--mask needs --init-image"),
    "mask-size": (
        ["--init-image", "in.png", "--mask", "small-mask.png"],
        "the mask must be the image's size",
    ),
    "image-size": (["--init-image", "wide.png"], "pass --resize crop, fit or stretch"),
    "missing": (["--init-image", "nowhere.png"], "no such file"),
}


def run(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "run", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
    )


def check_refused(proc, says: str, cwd: Path, before: set):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert says in lines[0], lines[0]
    assert set(cwd.iterdir()) == before  # nothing written, no temp file left


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(files, case):
    extra, says = CASES[case]
    cwd = files["dir"]
    before = set(cwd.iterdir())
    proc = run([files["art"], "-p", "a cat", "-o", "out.png", *extra], cwd)
    check_refused(proc, says, cwd, before)


def test_an_inpainting_model_needs_a_mask(files):
    cwd = files["dir"]
    before = set(cwd.iterdir())
    for extra in ([], ["--init-image", "in.png"]):
        proc = run([files["inpaint"], "-p", "a cat", "-o", "out.png", *extra], cwd)
        check_refused(proc, "holds an inpainting model", cwd, before)


def test_an_artifact_whose_encoder_gives_the_mean_only_is_refused(files):
    cwd = files["dir"]
    before = set(cwd.iterdir())
    proc = run([files["old"], "-p", "a cat", "--init-image", "in.png", "-o", "out.png"], cwd)
    check_refused(proc, "recompile it", cwd, before)


def test_an_unknown_resize_mode_is_a_usage_error(files):
    proc = run(
        [files["art"], "-p", "a", "--init-image", "wide.png", "--resize", "zoom"], files["dir"]
    )
    assert proc.returncode == 2 and "--resize" in proc.stderr
    assert np.asarray(Image.open(files["dir"] / "wide.png")).shape == (48, 80, 3)
