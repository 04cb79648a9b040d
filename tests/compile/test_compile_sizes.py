"""`sdiree compile --sizes`: one artifact runs several image sizes, each as diffusers makes it.

The tiny model compiled for two sizes other than its own 64x64 (a main one taller than wide, and
one more with odd latent sides, which diffusers' UNet upsamples to the skip connections' sizes)
for cpu and lavapipe, text to image only (no VAE encoder: tests/conftest.py); images at both
sizes through `sdiree run`'s own code path against diffusers' at those sizes (PSNR >= 40 dB),
and the one-line refusals of a size the artifact lacks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from conftest import SIZES, SIZES_MAIN  # noqa: E402
from parity import diffusers_images, psnr  # noqa: E402

PROMPT = "a lighthouse at dusk, oil painting"
# lavapipe runs the tiny UNet at ~2 s a step: fewer steps there.
TARGETS = {"cpu": ("cpu", "host", 12), "vulkan-lavapipe": ("vulkan-spirv", "lavapipe", 4)}


@pytest.fixture(scope="module", params=list(TARGETS))
def sized(request, compiled_sizes):
    """An artifact of the tiny model at SIZES_MAIN and SIZES (tests/conftest.py), and its
    steps."""
    target, arch, steps = TARGETS[request.param]
    return compiled_sizes.get(target, arch, "fp32"), steps


def run_image(art: Path, tmp_path: Path, width: int, height: int, steps: int) -> np.ndarray:
    from PIL import Image

    from sdiree.runtime.generate import generate_to_files

    png = tmp_path / f"{width}x{height}.png"
    generate_to_files(
        artifact_dir=art, prompt=PROMPT, negative_prompt="", steps=steps, guidance_scale=7.5,
        scheduler="euler", seed=42, num_images=1, width=width, height=height, output=png,
    )  # fmt: skip
    with Image.open(png) as im:
        assert im.text["parameters"].count(f"Size: {width}x{height}") == 1
        return np.asarray(im.convert("RGB"))[None]


def test_manifest_lists_the_sizes_and_their_functions(sized):
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.sizes import compiled_sizes

    manifest = load_manifest(sized[0])
    assert compiled_sizes(manifest) == [SIZES_MAIN, *SIZES]
    unet = manifest.submodules["unet"].functions
    shapes = {name: fn.inputs[0].shape[-2:] for name, fn in unet.items()}
    assert shapes == {
        "denoise_cfg": (8, 6), "denoise": (8, 6),
        "denoise_cfg_5x5": (5, 5), "denoise_5x5": (5, 5),
    }  # fmt: skip
    decoder = manifest.submodules["vae_decoder"].functions
    assert sorted(fn.inputs[0].shape[-2:] for fn in decoder.values()) == sorted([(8, 6), (5, 5)])


@pytest.mark.parametrize(
    "height,width", [SIZES_MAIN, *SIZES], ids=[f"{w}x{h}" for h, w in [SIZES_MAIN, *SIZES]]
)
def test_each_size_matches_diffusers(sized, tiny_model, tmp_path, height, width):
    art, steps = sized
    ours = run_image(art, tmp_path, width, height, steps)
    ref = diffusers_images(tiny_model, "euler", steps, 7.5, 42, PROMPT, "", 1, (height, width))
    assert ours.shape == ref.shape == (1, height, width, 3)
    assert psnr(ours, ref) >= 40.0


def test_a_size_it_was_not_compiled_for_is_refused(sized, tmp_path):
    from sdiree.runtime.errors import UserError

    with pytest.raises(UserError, match=r"compiled for 48x64, 40x40; recompile"):
        run_image(sized[0], tmp_path, 56, 56, 1)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "sizes,says",
    [
        ("64x60", "--sizes 64x60: its side 60 is not a positive multiple of 8"),
        ("64x8192", "is larger than sdiree compiles"),
        ("64", "'64' is not WIDTHxHEIGHT"),
        ("64x64;48x48", "is not WIDTHxHEIGHT"),
    ],
)
def test_compile_refuses_bad_sizes(tiny_model, tmp_path, sizes, says):
    from test_cli_errors import assert_clean_failure, run_compile

    out = tmp_path / "out"
    proc = run_compile(tiny_model, "--target", "cpu", "--sizes", sizes, "--out", out)
    assert_clean_failure(proc, says)
    assert not out.exists()


def test_guided_call_at_an_odd_latent_side_is_deterministic(sized):
    """iree 3.13 raced on cpu inside the guided UNet call at odd latent sides (40x40 px: 5x5
    latents) when dispatches ran concurrently: ~0.7 % of calls on a loaded 2-core machine
    returned a wrong result (rel. error up to 0.7). The cpu preset compiles with one dispatch at
    a time (compile/NOTES.md); a busy thread beside the calls makes the race show where it is."""
    import threading

    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session

    art, _ = sized
    manifest = load_manifest(art)
    session = Session(manifest, choose_device(manifest, None)[0], ["unet"])
    rng = np.random.default_rng(0)
    args = [
        rng.standard_normal(d.shape).astype(d.dtype)
        for d in session.decl("unet", "denoise_cfg_5x5").inputs
    ]
    first = session.call("unet", "denoise_cfg_5x5", *args)[0]
    stop = threading.Event()

    def busy():
        a = rng.standard_normal((256, 256)).astype(np.float32)
        while not stop.is_set():
            a = np.tanh(a @ a)

    noise = threading.Thread(target=busy)
    noise.start()
    try:
        calls = 1500 if manifest.target == "cpu" else 6  # lavapipe: 3 s a call, 0 of 20 differed
        differing = sum(
            not np.array_equal(session.call("unet", "denoise_cfg_5x5", *args)[0], first)
            for _ in range(calls)
        )
    finally:
        stop.set()
        noise.join()
    assert differing == 0, f"{differing} of {calls} calls differ from the first"
