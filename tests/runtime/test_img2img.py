"""img2img against diffusers' StableDiffusionImg2ImgPipeline on the tiny model: same init image,
strength, seed, scheduler, steps and guidance give the same image.

First the numpy pipeline alone, its modules answered by the model's torch modules (fp32, no
compile): every scheduler matches diffusers almost bit for bit (>= 60 dB), so the generator's
draw order, the VAE sampling, the strength's schedule and add_noise are all as diffusers has
them; a wrong strength or seed gives far less. Then the compiled artifacts, cpu and lavapipe,
at the issue's >= 40 dB, and `sdiree run --init-image` itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from edit_parity import (  # noqa: E402
    TorchModules,
    diffusers_edit_images,
    pattern_image,
    sdiree_edit_images,
    torch_artifact,
)
from parity import psnr  # noqa: E402

PROMPT = "a lighthouse at dusk, oil painting"
IMAGE = pattern_image(64, 64)
SCHEDULERS = ["euler", "euler-a", "ddim", "pndm", "dpmpp-2m-karras", "lms", "lcm"]


@pytest.fixture(scope="module")
def torch_side(tiny_model, tmp_path_factory):
    """(artifact dir, TorchModules): the numpy pipeline with the torch modules as its session."""
    from sdiree.runtime.manifest import load_manifest

    art = torch_artifact(tiny_model, tmp_path_factory.mktemp("torch-artifact"))
    return art, TorchModules(tiny_model, load_manifest(art))


def both(model, art, session, scheduler, strength, seed=42, n=2, per_image_seeds=False, **kw):
    steps = kw.pop("steps", 4 if scheduler == "lcm" else 10)
    args = (scheduler, steps, 7.5, seed, PROMPT, "", n, IMAGE, None)
    ours, _ = sdiree_edit_images(
        art, *args, strength, per_image_seeds=per_image_seeds, session=session, **kw
    )
    ref = diffusers_edit_images(
        model, *args, kw.pop("ref_strength", strength), per_image_seeds=per_image_seeds
    )
    return ours, ref


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_numpy_pipeline_matches_diffusers(torch_side, tiny_model, scheduler):
    art, session = torch_side
    ours, ref = both(tiny_model, art, session, scheduler, 0.6)
    assert ours.shape == ref.shape == (2, 64, 64, 3)
    assert psnr(ours, ref) >= 60.0


@pytest.mark.parametrize("scheduler", ["euler-a", "lcm"])
def test_per_image_seeds_match_a_generator_per_image(torch_side, tiny_model, scheduler):
    """Each image draws its latent sample, its noise and its steps' noise from its own
    generator, as diffusers with a list of generators (and so as that seed alone)."""
    art, session = torch_side
    ours, ref = both(tiny_model, art, session, scheduler, 0.75, seed=7, per_image_seeds=True)
    for i in range(2):
        assert psnr(ours[i], ref[i]) >= 60.0, i
    assert psnr(ours[0], ours[1]) < 30.0


def test_the_threshold_catches_real_mistakes(torch_side, tiny_model):
    art, session = torch_side
    ref = diffusers_edit_images(tiny_model, "euler", 10, 7.5, 42, PROMPT, "", 1, IMAGE, None, 0.6)
    for change in ({"strength": 0.5}, {"seed": 43}):
        args = {"strength": 0.6, "seed": 42, **change}
        ours, _ = sdiree_edit_images(
            art, "euler", 10, 7.5, args["seed"], PROMPT, "", 1, IMAGE, None, args["strength"],
            session=session,
        )  # fmt: skip
        assert psnr(ours, ref) < 35.0, change


def test_the_image_is_encoded_once_and_the_strength_sets_the_steps(torch_side, tiny_model):
    art, session = torch_side
    session.calls.clear()
    sdiree_edit_images(art, "euler", 10, 7.5, 1, PROMPT, "", 3, IMAGE, None, 0.3, session=session)
    encodes = [c for c in session.calls if c[0] == "vae_encoder"]
    unet = [c for c in session.calls if c[0] == "unet"]
    assert encodes == [("vae_encoder", "encode", ((1, 3, 64, 64),))]
    assert len(unet) == 3 * 3  # int(10 * 0.3) steps, three images at batch 1


TARGETS = [("cpu", "host", "fp32", 20), ("vulkan-spirv", "lavapipe", "fp32", 8)]


@pytest.mark.parametrize("target,arch,dtype,steps", TARGETS, ids=["cpu", "vulkan-lavapipe"])
@pytest.mark.parametrize("scheduler", ["euler", "ddim", "dpmpp-2m-karras"])
def test_compiled_artifact_matches_diffusers(compiled, target, arch, dtype, steps, scheduler):
    art = compiled.get(target, arch, dtype)
    args = (scheduler, steps, 7.5, 42, PROMPT, "", 1, IMAGE, None, 0.6)
    ours, manifest = sdiree_edit_images(art, *args)
    ref = diffusers_edit_images(compiled.model, *args)
    assert [o.name for o in manifest.submodules["vae_encoder"].functions["encode"].outputs] == [
        "latent_mean",
        "latent_std",
    ]
    assert psnr(ours, ref) >= 40.0


def test_compiled_per_image_seeds_on_cpu(compiled):
    art = compiled.get("cpu", "host", "fp32")
    args = ("euler-a", 12, 7.5, 1234, PROMPT, "", 2, IMAGE, None, 0.8)
    ours, _ = sdiree_edit_images(art, *args, per_image_seeds=True)
    ref = diffusers_edit_images(compiled.model, *args, per_image_seeds=True)
    for i in range(2):
        assert psnr(ours[i], ref[i]) >= 40.0, i


# `sdiree run` with torch, diffusers, transformers, the IREE compiler and Pillow unimportable:
# img2img from a PNG needs none of them.
BLOCKED_RUN = """
import sys
BANNED = ("torch", "diffusers", "transformers", "iree.compiler", "iree.turbine", "PIL")

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BANNED):
            raise ImportError(f"the runtime imported {name}")

sys.meta_path.insert(0, Blocker())
sys.argv = ["sdiree", "run", *sys.argv[1:]]
from sdiree.runtime.cli import main
main()
"""


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
    )


def test_sdiree_run_init_image_torch_and_pillow_free(compiled, tmp_path):
    from PIL import Image

    from sdiree.runtime.png_decode import decode_png

    art = compiled.get("cpu", "host", "fp32")
    init = tmp_path / "in.png"
    Image.fromarray(IMAGE).save(init)
    out = tmp_path / "out.png"
    proc = run_cli(
        art, "-p", PROMPT, "--seed", 5, "--steps", 10, "--scheduler", "euler",
        "--init-image", init, "--strength", 0.6, "-o", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "img2img from" in proc.stderr and "strength 0.6" in proc.stderr
    with Image.open(out) as im:
        params = im.text["parameters"]
        pixels = np.asarray(im)
    assert "Denoising strength: 0.6, " in params and "Seed: 5," in params
    ours, _ = sdiree_edit_images(art, "euler", 10, 7.5, 5, PROMPT, "", 1, IMAGE, None, 0.6)
    np.testing.assert_array_equal(pixels, ours[0])
    assert decode_png(out.read_bytes()).pixels.shape == (64, 64, 3)
