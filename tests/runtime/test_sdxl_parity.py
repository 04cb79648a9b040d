"""SDXL end to end: the tiny SDXL compiled for cpu and lavapipe gives the images of diffusers'
own StableDiffusionXLPipeline (PSNR >= 40 dB in 8 bits) with the same prompt, negative prompt,
seed, scheduler and guidance; an empty negative prompt is zeros (force_zeros_for_empty_prompt);
guidance <= 1 and SDXL-Turbo's config run the unguided `denoise` entry; `sdiree run` writes the
PNG with its parameters. Few steps, one size, to keep the suite short."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from parity import diffusers_images, psnr, sdiree_images  # noqa: E402

PROMPT = "a lighthouse at dusk, oil painting"
NEGATIVE = "blurry"
SIZE = (64, 64)
TARGETS = [("cpu", "host", "fp32", 8), ("vulkan-spirv", "lavapipe", "fp32", 6)]


@pytest.mark.parametrize("target,arch,dtype,steps", TARGETS, ids=["cpu", "vulkan-lavapipe"])
@pytest.mark.parametrize("scheduler", ["euler", "euler-a", "dpmpp-2m-karras"])
def test_sdxl_matches_diffusers(compiled_sdxl, target, arch, dtype, steps, scheduler):
    art = compiled_sdxl.get(target, arch, dtype)
    args = (scheduler, steps, 7.5, 42, PROMPT, NEGATIVE, 1)
    ours, manifest = sdiree_images(art, *args)
    assert manifest.family == "sdxl" and manifest.pipeline == "text2img"
    ref = diffusers_images(compiled_sdxl.model, *args, SIZE)
    assert ours.shape == ref.shape == (1, 64, 64, 3)
    assert psnr(ours, ref) >= 40.0


def test_empty_negative_prompt_is_zeros_and_the_threshold_sees_it(compiled_sdxl):
    art = compiled_sdxl.get("cpu", "host", "fp32")
    args = ("euler", 6, 5.0, 7, PROMPT, "", 1)
    ours, _ = sdiree_images(art, *args)
    assert psnr(ours, diffusers_images(compiled_sdxl.model, *args, SIZE)) >= 40.0
    # encoding "" instead (what SD 1.x does) gives another image
    encoded = diffusers_images(
        compiled_sdxl.model, *args, SIZE, call_overrides={"negative_prompt": ""}
    )
    assert psnr(ours, encoded) < 35.0


def _spy_calls(monkeypatch) -> list[tuple[str, str]]:
    from sdiree.runtime.session import Session

    calls, inner = [], Session.call

    def call(self, submodule, function, *args):
        calls.append((submodule, function))
        return inner(self, submodule, function, *args)

    monkeypatch.setattr(Session, "call", call)
    return calls


def test_guidance_one_runs_the_unguided_entry(compiled_sdxl, monkeypatch):
    art = compiled_sdxl.get("cpu", "host", "fp32")
    calls = _spy_calls(monkeypatch)
    args = ("euler", 4, 1.0, 3, PROMPT, NEGATIVE, 1)
    ours, _ = sdiree_images(art, *args)
    assert ("unet", "denoise") in calls and ("unet", "denoise_cfg") not in calls
    assert {s for s, f in calls if f == "encode"} == {"text_encoder", "text_encoder_2"}
    assert psnr(ours, diffusers_images(compiled_sdxl.model, *args, SIZE)) >= 40.0


def _turbo(compiled_sdxl, tmp_path) -> tuple[Path, Path]:
    """The tiny SDXL with SDXL-Turbo's scheduler config, as a model folder and as an artifact
    (the cpu one, linked, with that config: the modules are the same)."""
    from make_tiny_sd import SDXL_TURBO_SCHEDULER_CONFIG

    from sdiree.runtime.fileutil import sha256_file
    from sdiree.runtime.manifest import HASH_CACHE

    config = {"_class_name": "EulerAncestralDiscreteScheduler", **SDXL_TURBO_SCHEDULER_CONFIG}
    model = tmp_path / "tiny-sdxl-turbo"
    shutil.copytree(compiled_sdxl.model, model)
    index = json.loads((model / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "EulerAncestralDiscreteScheduler"]
    (model / "model_index.json").write_text(json.dumps(index))
    (model / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    art = tmp_path / "turbo-art"
    shutil.copytree(compiled_sdxl.get("cpu", "host", "fp32"), art, copy_function=os.link)
    sched = art / "scheduler" / "scheduler_config.json"
    sched.unlink()
    sched.write_text(json.dumps(config))
    (art / HASH_CACHE).unlink(missing_ok=True)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["scheduler/scheduler_config.json"] = sha256_file(sched)
    manifest["scheduler"]["class"] = "EulerAncestralDiscreteScheduler"
    (art / "manifest.json").unlink()
    (art / "manifest.json").write_text(json.dumps(manifest))
    return model, art


def test_sdxl_turbo_config_matches_diffusers_unguided(compiled_sdxl, tmp_path, monkeypatch):
    """SDXL-Turbo: EulerAncestral with "trailing" timesteps, 1 and 4 steps at guidance 0."""
    model, art = _turbo(compiled_sdxl, tmp_path)
    calls = _spy_calls(monkeypatch)
    for steps in (1, 4):
        args = (None, steps, 0.0, 11, PROMPT, "", 1)
        ours, _ = sdiree_images(art, *args)
        ref = diffusers_images(model, "euler-a", *args[1:], SIZE)
        assert psnr(ours, ref) >= 40.0, steps
    assert ("unet", "denoise_cfg") not in calls
    assert calls.count(("unet", "denoise")) == 1 + 4
    # the trailing schedule is what makes it match: the leading one gives another image
    leading = diffusers_images(
        model, "euler-a", 1, 0.0, 11, PROMPT, "", 1, SIZE,
        scheduler_overrides={"timestep_spacing": "leading"},
    )  # fmt: skip
    assert psnr(sdiree_images(art, None, 1, 0.0, 11, PROMPT, "", 1)[0], leading) < 35.0


def test_sdiree_run_writes_the_sdxl_image_with_its_parameters(compiled_sdxl, tmp_path):
    from PIL import Image

    art = compiled_sdxl.get("cpu", "host", "fp32")
    out = tmp_path / "xl.png"
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "run", str(art), "--prompt", PROMPT,
         "--negative-prompt", NEGATIVE, "--seed", "42", "--steps", "8", "--scheduler", "euler",
         "-o", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    img = Image.open(out)
    params = img.text["parameters"]
    assert params.startswith(f"{PROMPT}\nNegative prompt: {NEGATIVE}\nSteps: 8, Sampler: Euler,")
    assert "Seed: 42, Size: 64x64," in params and "Model: tiny-sdxl," in params
    ref = diffusers_images(compiled_sdxl.model, "euler", 8, 7.5, 42, PROMPT, NEGATIVE, 1, SIZE)
    assert psnr(np.asarray(img)[None], ref) >= 40.0


def diffusers_edit(model, cls_name: str, init, strength: float, **call) -> np.ndarray:
    """uint8 images of diffusers' SDXL img2img/inpaint pipeline cls_name: euler, 8 steps,
    guidance 7.5, seed 42 (sdiree's side: EDIT_ARGS)."""
    import diffusers
    import torch
    from PIL import Image

    pipe = getattr(diffusers, cls_name).from_pretrained(
        model, add_watermarker=False, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        PROMPT, negative_prompt=NEGATIVE, image=Image.fromarray(init), strength=strength,
        num_inference_steps=8, guidance_scale=7.5,
        generator=torch.Generator("cpu").manual_seed(42), output_type="np", **call,
    ).images  # fmt: skip
    return (ref * 255).round().astype(np.uint8)


EDIT_ARGS = ("euler", 8, 7.5, 42, PROMPT, NEGATIVE, 1)


def test_sdxl_img2img_matches_diffusers(compiled_sdxl):
    from edit_parity import pattern_image, sdiree_edit_images

    art = compiled_sdxl.get("cpu", "host", "fp32")
    init = pattern_image(*SIZE)
    ours, _ = sdiree_edit_images(art, *EDIT_ARGS, init, None, 0.6)
    ref = diffusers_edit(compiled_sdxl.model, "StableDiffusionXLImg2ImgPipeline", init, 0.6)
    assert psnr(ours, ref) >= 40.0


def test_sdxl_inpaint_by_latent_blending_matches_diffusers(compiled_sdxl):
    """`--mask` with an ordinary (4-channel) SDXL UNet: diffusers' StableDiffusionXLInpaintPipeline
    blends the kept part's noised latents in after every step, as sdiree's text2img pipeline does."""
    from edit_parity import pattern_image, pattern_mask, sdiree_edit_images
    from PIL import Image

    art = compiled_sdxl.get("cpu", "host", "fp32")
    init, mask = pattern_image(*SIZE), pattern_mask(*SIZE)
    ours, _ = sdiree_edit_images(art, *EDIT_ARGS, init, mask, 0.7)
    ref = diffusers_edit(
        compiled_sdxl.model, "StableDiffusionXLInpaintPipeline", init, 0.7,
        mask_image=Image.fromarray(mask), height=SIZE[0], width=SIZE[1],
    )  # fmt: skip
    assert psnr(ours, ref) >= 40.0
    # a dropped mask would be noticed: img2img at the same strength is far from it
    plain, _ = sdiree_edit_images(art, *EDIT_ARGS, init, None, 0.7)
    assert psnr(plain, ref) < 30.0
