"""SD 2.x end to end: the tiny SD 2.1-architecture model (v-prediction, OpenCLIP-style text
encoder, attention upcast) compiled for cpu and lavapipe gives diffusers' own
StableDiffusionPipeline's images (PSNR >= 40 dB in 8 bits) with the same prompt, negative
prompt, seed, scheduler and guidance; few steps, one size, to keep the suite short."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from parity import diffusers_images, psnr, sdiree_images  # noqa: E402

PROMPT = "a lighthouse at dusk, oil painting"
NEGATIVE = "blurry"
SIZE = (64, 64)
TARGETS = [("cpu", "host", "fp32", 10), ("vulkan-spirv", "lavapipe", "fp32", 6)]


@pytest.mark.parametrize("target,arch,dtype,steps", TARGETS, ids=["cpu", "vulkan-lavapipe"])
@pytest.mark.parametrize("scheduler", ["euler", "euler-a", "dpmpp-2m-karras"])
def test_sd2_matches_diffusers(compiled_sd2, target, arch, dtype, steps, scheduler):
    art = compiled_sd2.get(target, arch, dtype)
    args = (scheduler, steps, 7.5, 42, PROMPT, NEGATIVE, 1)
    ours, manifest = sdiree_images(art, *args)
    assert manifest.family == "sd2" and manifest.pipeline == "text2img"
    ref = diffusers_images(compiled_sd2.model, *args, SIZE)
    assert ours.shape == ref.shape == (1, 64, 64, 3)
    assert psnr(ours, ref) >= 40.0


def test_sd2_v_prediction_is_what_makes_it_match(compiled_sd2):
    """Read as epsilon, the same model gives another image: the threshold sees v-prediction."""
    art = compiled_sd2.get("cpu", "host", "fp32")
    args = ("euler", 10, 7.5, 42, PROMPT, NEGATIVE, 1)
    ours, _ = sdiree_images(art, *args)
    wrong = diffusers_images(
        compiled_sd2.model, *args, SIZE, scheduler_overrides={"prediction_type": "epsilon"}
    )
    assert psnr(ours, wrong) < 35.0
