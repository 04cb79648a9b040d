"""`sdiree run`: check everything, generate, and save PNGs with their parameters.

Every check that can fail on bad input (artifact, manifest, files, device, arch, sizes, steps,
guidance, scheduler, output paths) runs before the first module call, so a bad invocation costs
nothing and leaves nothing behind.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from . import schedulers
from .device_select import choose_device
from .image_output import (
    a1111_parameters,
    check_image,
    check_output_paths,
    output_paths,
    save_png,
    to_uint8,
)
from .manifest import check_files, load_manifest
from .pipeline import GenerationRequest, Text2Image, resolve_request
from .session import with_fresh_device_on_loss

HASH_CACHE = ".verified.json"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def generate_to_files(
    *,
    artifact_dir: Path,
    prompt: str,
    negative_prompt: str = "",
    steps: int | None = None,
    guidance_scale: float = 7.5,
    scheduler: str | None = None,
    seed: int | None = None,
    num_images: int = 1,
    width: int | None = None,
    height: int | None = None,
    device: str | None = None,
    output: Path = Path("sdiree.png"),
    overwrite: bool = False,
    force_device: bool = False,
) -> list[Path]:
    manifest = load_manifest(artifact_dir)
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    req = resolve_request(
        manifest,
        GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt,
            steps=steps,
            guidance_scale=guidance_scale,
            scheduler=scheduler,
            seed=seed,
            num_images=num_images,
            width=width,
            height=height,
        ),
    )
    paths = output_paths(Path(output), num_images)
    check_output_paths(paths, overwrite)
    info, why = choose_device(manifest, device, force=force_device)
    check_files(manifest, Path(artifact_dir) / HASH_CACHE)

    say(f"device: {info.label} ({info.name}); {why}")
    say(
        f"seed {req.seed}, {req.scheduler} {req.steps} steps, guidance {req.guidance_scale}, "
        f"{req.width}x{req.height}, {manifest.target}/{manifest.arch}/{manifest.dtype}"
    )
    result = with_fresh_device_on_loss(
        manifest,
        info,
        Text2Image.SUBMODULES,
        lambda session: Text2Image(manifest, session).generate(req),
        warn=lambda msg: say(f"warning: {msg}"),
    )
    for w in result.warnings:
        say(f"warning: {w}")
    check_image(result.images)
    pixels = to_uint8(result.images)
    params = a1111_parameters(
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        steps=req.steps,
        sampler=schedulers.SAMPLER_LABELS[req.scheduler],
        cfg_scale=req.guidance_scale,
        seed=req.seed,
        width=req.width,
        height=req.height,
        model=manifest.data["model"]["name"],
        extra={"Target": manifest.target, "Arch": manifest.arch, "Dtype": manifest.dtype},
    )
    for path, image in zip(paths, pixels, strict=True):
        save_png(path, image, params, overwrite)
        say(f"wrote {path}")
    say(result.timings.summary())
    return paths
