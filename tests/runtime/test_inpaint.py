"""Inpainting against diffusers' StableDiffusionInpaintPipeline on the tiny models: an ordinary
UNet (4 channels, latent blending after each step) and a dedicated inpainting UNet (9 channels:
latents, mask, masked-image latents), at strength 1 (from pure noise) and below.

As for img2img: the numpy pipeline with the torch modules first (>= 60 dB for every scheduler,
so the mask's binarisation and downsampling, the three generator draws in their order and the
re-noising are diffusers'), then the compiled artifacts on cpu and lavapipe (>= 40 dB), the
inpainting model's compile (family, pipeline, 9-channel UNet in the manifest) and `sdiree run
--mask`.
"""

from __future__ import annotations

import json
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
    pattern_mask,
    sdiree_edit_images,
    torch_artifact,
)
from parity import psnr  # noqa: E402

PROMPT = "a lighthouse at dusk, oil painting"
IMAGE = pattern_image(64, 64)
MASK = pattern_mask(64, 64)
SCHEDULERS = ["euler", "euler-a", "ddim", "pndm", "dpmpp-2m-karras", "lms", "lcm"]


def torch_pair(model, tmp_path_factory):
    from sdiree.runtime.manifest import load_manifest

    art = torch_artifact(model, tmp_path_factory.mktemp("torch-artifact"))
    return model, art, TorchModules(model, load_manifest(art))


@pytest.fixture(scope="module")
def ordinary(tiny_model, tmp_path_factory):
    return torch_pair(tiny_model, tmp_path_factory)


@pytest.fixture(scope="module")
def dedicated(tiny_inpaint_model, tmp_path_factory):
    return torch_pair(tiny_inpaint_model, tmp_path_factory)


def both(side, scheduler, strength, seed=42, n=2, per_image_seeds=False, mask=MASK):
    model, art, session = side
    steps = 4 if scheduler == "lcm" else 10
    args = (scheduler, steps, 7.5, seed, PROMPT, "", n, IMAGE, mask, strength)
    ours, _ = sdiree_edit_images(art, *args, per_image_seeds=per_image_seeds, session=session)
    ref = diffusers_edit_images(model, *args, per_image_seeds=per_image_seeds)
    return ours, ref


# Every scheduler with the ordinary UNet below strength 1 (its blending re-noises with
# add_noise after each step); the rest covers the draw orders of both UNets at both strengths
# with a deterministic, an ancestral and a multistep sampler.
CASES = [("ordinary", s, 0.6) for s in SCHEDULERS] + [
    (unet, s, strength)
    for unet in ("ordinary", "dedicated")
    for s in ("euler-a", "dpmpp-2m-karras", "lcm")
    for strength in (1.0, 0.6)
    if (unet, strength) != ("ordinary", 0.6)
]


@pytest.mark.parametrize("unet,scheduler,strength", CASES)
def test_numpy_pipeline_matches_diffusers(request, unet, scheduler, strength):
    side = request.getfixturevalue(unet)
    ours, ref = both(side, scheduler, strength)
    assert ours.shape == ref.shape == (2, 64, 64, 3)
    assert psnr(ours, ref) >= 60.0


@pytest.mark.parametrize("unet", ["ordinary", "dedicated"])
def test_per_image_seeds_give_each_seeds_image_alone(request, unet):
    side = request.getfixturevalue(unet)
    ours, ref = both(side, "euler-a", 0.8, seed=9, per_image_seeds=True)
    for i in range(2):
        assert psnr(ours[i], ref[i]) >= 60.0, i


def test_the_mask_decides_what_changes(ordinary):
    """The threshold catches a wrong mask; with the ordinary UNet the kept part stays close to
    the init image's VAE round trip while the repainted part does not."""
    ours, ref = both(ordinary, "euler", 1.0, n=1)
    inverted, _ = both(ordinary, "euler", 1.0, n=1, mask=255 - MASK)
    assert psnr(inverted, ref) < 35.0
    repainted = MASK >= 128
    kept_err = np.abs(ours[0].astype(int) - IMAGE)[~repainted].mean()
    painted_err = np.abs(ours[0].astype(int) - IMAGE)[repainted].mean()
    assert painted_err > kept_err


def test_nearest_matches_torch_interpolate():
    import torch

    from sdiree.runtime.inpaint import binarize, nearest

    mask = binarize(pattern_mask(64, 48))
    for size in ((8, 6), (5, 7), (16, 12)):
        want = torch.nn.functional.interpolate(torch.from_numpy(mask), size=size).numpy()
        np.testing.assert_array_equal(nearest(mask, *size), want)


TARGETS = [("cpu", "host", "fp32", 20), ("vulkan-spirv", "lavapipe", "fp32", 8)]


@pytest.mark.parametrize("target,arch,dtype,steps", TARGETS, ids=["cpu", "vulkan-lavapipe"])
@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_compiled_ordinary_unet_matches_diffusers(compiled, target, arch, dtype, steps, strength):
    art = compiled.get(target, arch, dtype)
    args = ("euler", steps, 7.5, 42, PROMPT, "", 1, IMAGE, MASK, strength)
    ours, _ = sdiree_edit_images(art, *args)
    ref = diffusers_edit_images(compiled.model, *args)
    assert psnr(ours, ref) >= 40.0


def test_inpainting_model_compiles_as_its_family_with_a_9_channel_unet(compiled_inpaint):
    art = compiled_inpaint.get("cpu", "host", "fp32")
    data = json.loads((art / "manifest.json").read_text())
    assert data["model"]["family"] == "sd1" and data["model"]["pipeline"] == "inpaint"
    assert data["model"]["pipeline_class"] == "StableDiffusionInpaintPipeline"
    assert data["image"]["latent_channels"] == 4
    for fn in ("denoise", "denoise_cfg"):
        sig = data["submodules"]["unet"]["functions"][fn]
        assert sig["inputs"][0]["shape"][1] == 9 and sig["outputs"][0]["shape"][1] == 4


@pytest.mark.parametrize("target,arch,dtype,steps", TARGETS, ids=["cpu", "vulkan-lavapipe"])
@pytest.mark.parametrize("scheduler,strength", [("euler", 1.0), ("dpmpp-2m-karras", 0.6)])
def test_compiled_inpainting_unet_matches_diffusers(
    compiled_inpaint, target, arch, dtype, steps, scheduler, strength
):
    art = compiled_inpaint.get(target, arch, dtype)
    args = (scheduler, steps, 7.5, 42, PROMPT, "", 1, IMAGE, MASK, strength)
    ours, _ = sdiree_edit_images(art, *args)
    ref = diffusers_edit_images(compiled_inpaint.model, *args)
    assert psnr(ours, ref) >= 40.0


def test_sdiree_run_mask_writes_the_pipelines_image(compiled_inpaint, tmp_path):
    from PIL import Image

    art = compiled_inpaint.get("cpu", "host", "fp32")
    Image.fromarray(IMAGE).save(tmp_path / "in.png")
    Image.fromarray(MASK).save(tmp_path / "mask.png")
    proc = subprocess.run(
        [
            sys.executable, "-m", "sdiree.runtime.cli", "run", str(art), "-p", PROMPT,
            "--seed", "3", "--steps", "10", "--scheduler", "euler", "--init-image", "in.png",
            "--mask", "mask.png", "-o", "out.png",
        ],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "inpainting with --mask mask.png" in proc.stderr and "strength 1.0" in proc.stderr
    with Image.open(tmp_path / "out.png") as im:
        params = im.text["parameters"]
        pixels = np.asarray(im)
    assert "Denoising strength: 1.0, " in params
    ours, _ = sdiree_edit_images(art, "euler", 10, 7.5, 3, PROMPT, "", 1, IMAGE, MASK, None)
    np.testing.assert_array_equal(pixels, ours[0])


def test_a_batch_2_artifact_gives_the_batch_1_images(dedicated, tmp_path):
    """Three images on a batch-2 artifact: the UNet runs in chunks of 2 (the last padded), each
    chunk with its own images' mask and masked-image latents."""
    from sdiree.runtime.manifest import load_manifest

    model, art1, session1 = dedicated
    art2 = torch_artifact(model, tmp_path / "b2", batch=2)
    session2 = TorchModules(model, load_manifest(art2))
    args = ("euler-a", 6, 7.5, 11, PROMPT, "", 3, IMAGE, MASK, 0.7)
    one, _ = sdiree_edit_images(art1, *args, per_image_seeds=True, session=session1)
    two, _ = sdiree_edit_images(art2, *args, per_image_seeds=True, session=session2)
    assert psnr(one, two) >= 60.0
    assert {c[2][0] for c in session2.calls if c[0] == "unet"} == {(2, 9, 8, 8)}
