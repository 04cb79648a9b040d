"""End-to-end parity: the torch-free pipeline against diffusers on the tiny model.

The 8-bit images must agree to PSNR >= 40 dB; a wrong seed, prompt or guidance gives far less
(checked here too, so the threshold is known to catch real mistakes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from parity import diffusers_images, psnr, sdiree_images  # noqa: E402

PROMPT = "a lighthouse at dusk, oil painting"
SIZE = (64, 64)
# lavapipe runs the tiny UNet at ~2 s a step, so Vulkan parity uses fewer steps.
TARGETS = [("cpu", "host", "fp32", 20), ("vulkan-spirv", "lavapipe", "fp32", 8)]


@pytest.mark.parametrize("target,arch,dtype,steps", TARGETS, ids=["cpu", "vulkan-lavapipe"])
@pytest.mark.parametrize("scheduler", ["euler", "ddim", "dpmpp-2m-karras"])
def test_matches_diffusers(compiled, target, arch, dtype, steps, scheduler):
    art = compiled.get(target, arch, dtype)
    ours, _ = sdiree_images(art, scheduler, steps, 7.5, 42, PROMPT, "", 1)
    ref = diffusers_images(compiled.model, scheduler, steps, 7.5, 42, PROMPT, "", 1, SIZE)
    assert ours.shape == ref.shape == (1, 64, 64, 3)
    assert psnr(ours, ref) >= 40.0


@pytest.mark.parametrize("scheduler", ["euler-a", "pndm", "lms", "lcm", "dpmpp-2m"])
def test_other_schedulers_match_on_cpu(compiled, scheduler):
    art = compiled.get("cpu", "host", "fp32")
    steps = 4 if scheduler == "lcm" else 20
    ours, _ = sdiree_images(art, scheduler, steps, 7.5, 7, PROMPT, "", 1)
    ref = diffusers_images(compiled.model, scheduler, steps, 7.5, 7, PROMPT, "", 1, SIZE)
    assert psnr(ours, ref) >= 40.0


def test_negative_prompt_guidance_one_and_several_images(compiled):
    art = compiled.get("cpu", "host", "fp32")
    for guidance, negative, n in ((5.0, "blurry, low quality", 1), (1.0, "", 1), (7.5, "", 3)):
        ours, _ = sdiree_images(art, "euler", 10, guidance, 3, PROMPT, negative, n)
        ref = diffusers_images(compiled.model, "euler", 10, guidance, 3, PROMPT, negative, n, SIZE)
        assert ours.shape[0] == n
        assert psnr(ours, ref) >= 40.0, (guidance, negative, n)


@pytest.mark.parametrize("per_image_seeds", [False, True], ids=["one-generator", "per-image"])
@pytest.mark.parametrize("scheduler", ["euler-a", "lcm"])
def test_several_images_with_step_noise_on_a_batch_1_artifact(compiled, scheduler, per_image_seeds):
    """Two images on a batch-1 artifact, samplers that draw noise at every step: the same images
    as diffusers with one generator (or one per image, as `sdiree run` seeds them)."""
    art = compiled.get("cpu", "host", "fp32")
    steps = 4 if scheduler == "lcm" else 10
    args = (scheduler, steps, 7.5, 1234, PROMPT, "", 2)
    ours, _ = sdiree_images(art, *args, per_image_seeds=per_image_seeds)
    ref = diffusers_images(compiled.model, *args, SIZE, per_image_seeds=per_image_seeds)
    for i in range(2):
        assert psnr(ours[i], ref[i]) >= 40.0, i


def test_threshold_catches_real_mistakes(compiled):
    art = compiled.get("cpu", "host", "fp32")
    ref = diffusers_images(compiled.model, "euler", 20, 7.5, 42, PROMPT, "", 1, SIZE)
    wrong_seed, _ = sdiree_images(art, "euler", 20, 7.5, 43, PROMPT, "", 1)
    wrong_prompt, _ = sdiree_images(art, "euler", 20, 7.5, 42, "a cat", "", 1)
    wrong_guidance, _ = sdiree_images(art, "euler", 20, 3.0, 42, PROMPT, "", 1)
    for bad in (wrong_seed, wrong_prompt, wrong_guidance):
        assert psnr(bad, ref) < 35.0


def test_cpu_bf16_image_close_to_fp32(compiled):
    """bf16 (matmul inputs in bf16, fp32 accumulation) must stay within 30 dB of the fp32 image,
    and must really differ from it (the demotion flags took effect)."""
    fp32, _ = sdiree_images(
        compiled.get("cpu", "host", "fp32"), "euler", 20, 7.5, 42, PROMPT, "", 1
    )
    bf16, manifest = sdiree_images(
        compiled.get("cpu", "host", "bf16"), "euler", 20, 7.5, 42, PROMPT, "", 1
    )
    assert manifest.dtype == "bf16"
    assert manifest.submodules["unet"].functions["denoise_cfg"].inputs[0].dtype == "float32"
    assert psnr(bf16, fp32) >= 30.0
    assert not np.array_equal(bf16, fp32)
