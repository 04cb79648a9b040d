"""End-to-end parity: `sdiree run`'s pipeline against diffusers' StableDiffusionPipeline.

For the families that pipeline runs: SD 1.x and SD 2.x against StableDiffusionPipeline (the
scheduler config carries 2.x's v-prediction), SDXL against StableDiffusionXLPipeline (the class
model_index.json names; no watermark, so the images compare).

Same model folder, seed (CPU generator), scheduler, steps, guidance and prompts; the 8-bit
images are compared by PSNR. Used by the tests and by hand:

    python tools/parity.py ARTIFACT_DIR MODEL_DIR --scheduler euler --steps 20 --seed 42
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# diffusers class and config overrides for each sdiree scheduler name.
DIFFUSERS_SCHEDULERS = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "lcm": ("LCMScheduler", {}),
    "dpmpp-2m": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False},
    ),
    "dpmpp-2m-karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def diffusers_images(
    model_dir,
    scheduler,
    steps,
    guidance,
    seed,
    prompt,
    negative,
    n,
    size,
    per_image_seeds=False,
    scheduler_overrides=None,
    call_overrides=None,
):
    """uint8 NHWC images from diffusers on the CPU, fp32: one CPU generator for all images, or
    with per_image_seeds a list of them seeded seed + i. scheduler_overrides change the model's
    scheduler config (e.g. a wrong prediction_type, to show a test would see it), call_overrides
    the pipeline call's arguments (e.g. an SDXL time id)."""
    import json

    import diffusers
    import torch

    cls = json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"]
    if cls.startswith("StableDiffusionXL"):
        pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(
            model_dir, add_watermarker=False, local_files_only=True
        )
    else:
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(
            model_dir, safety_checker=None, requires_safety_checker=False, local_files_only=True
        )
    pipe.set_progress_bar_config(disable=True)
    cls_name, overrides = DIFFUSERS_SCHEDULERS[scheduler]
    pipe.scheduler = getattr(diffusers, cls_name).from_config(
        pipe.scheduler.config, **overrides, **(scheduler_overrides or {})
    )
    call = {
        "negative_prompt": negative or None,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "generator": (
            [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]
            if per_image_seeds
            else torch.Generator("cpu").manual_seed(seed)
        ),
        "num_images_per_prompt": n,
        "height": size[0],
        "width": size[1],
        "output_type": "np",
    }
    out = pipe(prompt, **{**call, **(call_overrides or {})}).images
    return (out * 255).round().astype(np.uint8)


def sdiree_images(
    artifact_dir,
    scheduler,
    steps,
    guidance,
    seed,
    prompt,
    negative,
    n,
    device=None,
    per_image_seeds=False,
):
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.image_output import to_uint8
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.pipeline import (
        GenerationRequest,
        Text2Image,
        pipeline_submodules,
        resolve_request,
    )
    from sdiree.runtime.session import with_fresh_device_on_loss

    manifest = load_manifest(artifact_dir)
    info, _ = choose_device(manifest, device)
    req = resolve_request(
        manifest,
        GenerationRequest(
            prompt, negative, steps, guidance, scheduler, seed, n, per_image_seeds=per_image_seeds
        ),
    )
    result = with_fresh_device_on_loss(
        manifest,
        info,
        pipeline_submodules(manifest, Text2Image),
        lambda session: Text2Image(manifest, session).generate(req, progress=None),
        warn=lambda msg: print(f"warning: {msg}", file=sys.stderr),
    )
    return to_uint8(result.images), manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact_dir", type=Path)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--scheduler", default="euler")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance-scale", type=float, default=7.5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--prompt", default="a lighthouse at dusk")
    ap.add_argument("--negative-prompt", default="")
    ap.add_argument("--num-images", type=int, default=1)
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    ours, manifest = sdiree_images(
        a.artifact_dir, a.scheduler, a.steps, a.guidance_scale, a.seed, a.prompt,
        a.negative_prompt, a.num_images, a.device,
    )  # fmt: skip
    size = (manifest.image["height"], manifest.image["width"])
    ref = diffusers_images(
        a.model_dir, a.scheduler, a.steps, a.guidance_scale, a.seed, a.prompt,
        a.negative_prompt, a.num_images, size,
    )  # fmt: skip
    print(f"PSNR {psnr(ours, ref):.2f} dB ({a.scheduler}, {a.steps} steps, seed {a.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
