"""`sdiree compile --vae FILE`: another VAE compiled in, as `sdiree run --vae` loads it.

The tiny model compiled with a VAE file (the model's VAE moved a little, in the original
layout) makes the image the plain artifact makes with the same file given at run time, and its
PNG names the VAE; a file that is not a VAE is one line with nothing written.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest

from sdiree.runtime.generate import generate_to_files

pytest.importorskip("torch")
from parity import psnr  # noqa: E402  (tools/, on sys.path via conftest)
from to_single_file import vae_to_ldm  # noqa: E402


@pytest.fixture(scope="module")
def vae_file(tiny_model, tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    (src,) = (tiny_model / "vae").glob("*.safetensors")
    rng = np.random.default_rng(8)
    sd = {
        k: v + (rng.standard_normal(v.shape) * 0.2 * (float(v.std()) + 1e-3)).astype(v.dtype)
        for k, v in load_file(src).items()
    }
    config = json.loads((tiny_model / "vae" / "config.json").read_text())
    out = tmp_path_factory.mktemp("vae") / "my-vae.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in vae_to_ldm(sd, config).items()}, str(out))
    return out


def _image(art, out, **kw):
    from PIL import Image

    (path,) = generate_to_files(
        artifact_dir=art, prompt="a harbour", steps=3, scheduler="euler", seed=2, output=out, **kw
    )
    img = Image.open(path)
    return np.asarray(img.convert("RGB")), img.text["parameters"]


def test_compiled_in_vae_equals_the_run_time_one(compiled, tiny_model, vae_file, tmp_path):
    from sdiree.compile.driver import CompileOptions, compile_model
    from sdiree.compile.report import Reporter

    plain_art = compiled.get("cpu", "host", "fp32")
    # The model's compile cache (its archives with this VAE) is the test's own, under an
    # artifacts root of its own (the default --out): the session's is copied and checked file by
    # file elsewhere. The build cache is the session's user cache, whatever --out is, so the
    # exports and modules of the plain artifact (the same architecture) are reused.
    manifest = compile_model(
        CompileOptions(
            model_dir=tiny_model,
            target="cpu",
            dtype="fp32",
            artifacts_root=tmp_path / "artifacts",
            vae=vae_file,
        ),
        Reporter(stream=io.StringIO()),
    )
    art = manifest.parent
    ours, params = _image(art, tmp_path / "a.png")
    at_run, _ = _image(plain_art, tmp_path / "b.png", vae=vae_file)
    plain, _ = _image(plain_art, tmp_path / "c.png")
    assert psnr(ours, at_run) >= 60.0
    assert psnr(ours, plain) < 40.0
    sha = hashlib.sha256(vae_file.read_bytes()).hexdigest()
    assert f"VAE hash: {sha[:10]}, VAE: my-vae.safetensors" in params


def test_a_file_that_is_not_a_vae_is_one_line(tiny_model, tmp_path):
    bad = tmp_path / "notes.safetensors"
    bad.write_text("not weights")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(tiny_model),
         "--target", "cpu", "--vae", str(bad), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "notes.safetensors" in r.stderr and not out.exists()
