"""`sdiree run`: check everything, generate, and save PNGs with their parameters.

Every check that can fail on bad input (seed, prompt text, artifact, manifest, files, device,
arch, sizes, steps, guidance, scheduler, output paths) runs before the first module call, so a
bad invocation costs nothing and leaves nothing behind.

Seeds follow AUTOMATIC1111: image i of a run is made from its own generator seeded with
``seed + i`` (diffusers with a list of generators; the images still run together in batches of
the compiled batch) and its PNG records that seed, so any image is remade alone with ``--seed``
(and image 0, or a one-image run, gets exactly the latents diffusers draws from that seed).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

from . import schedulers
from .device_select import choose_device
from .embeddings import load_embeddings, ti_hashes
from .errors import UserError
from .image_input import load_edit_images
from .image_output import (
    a1111_parameters,
    check_image,
    check_output_paths,
    output_paths,
    remove_stale_temps_for,
    save_png,
    to_uint8,
)
from .manifest import HASH_CACHE, Manifest, check_files, load_manifest
from .pipeline import GenerationRequest, pipeline_class, pipeline_submodules, resolve_request
from .session import with_fresh_device_on_loss
from .sizes import resolve_size
from .text_inputs import TextInputs
from .weights.sources import LoraRequest, build_overrides, parse_lora_option

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
RANDOM_SEED = -1  # as in A1111 and every SD tool


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_seed(seed: int | None, num_images: int) -> int:
    """The run's first seed: random for None or -1; refuse what does not fit in 64 bits."""
    if seed is None or seed == RANDOM_SEED:
        return random.SystemRandom().randrange(2**32)
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed {seed}: the seed must be in 0..2**64-1, or -1 for a random one")
    if seed + max(num_images, 1) - 1 > MAX_SEED:
        raise UserError(
            f"--seed {seed} with --num-images {num_images}: image i uses seed {seed}+i, past "
            f"2**64-1; choose a seed of at most {MAX_SEED - num_images + 1}"
        )
    return seed


def check_text(option: str, text: str) -> None:
    """Refuse text that is not valid UTF-8 (undecodable argv bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = (
            f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        )
        raise UserError(
            f"{option} is not valid UTF-8 text ({what} at character {e.start}); pass it in "
            "UTF-8 (check the encoding of the terminal or script that sent it)"
        ) from None


def model_hash(manifest: Manifest) -> str | None:
    """The "Model hash" of the PNG parameters: 10 hex digits, or None when unknown.

    A1111 writes the first 10 hex digits of the checkpoint file's sha256 ("AutoV2"): so does
    sdiree for a model compiled from a single file (the manifest's `model.file.sha256`). A
    diffusers folder has no single checkpoint file, so then it is the first 10 of the model's
    content hash (sha256 over every config and weight file of the folder): the same folder
    always gives the same hash, but not the AutoV2 hash of a file holding the same weights.
    """
    model = manifest.data.get("model", {})
    file_sha = model.get("file", {}).get("sha256") if isinstance(model.get("file"), dict) else None
    digest = (
        file_sha or model.get("content_hash") or manifest.data.get("build", {}).get("model_hash")
    )
    return digest[:10] if isinstance(digest, str) and digest else None


def sampler_and_schedule(scheduler: str) -> tuple[str, str | None]:
    """A1111's sampler name and "Schedule type" (since A1111 1.9: "DPM++ 2M" + "Karras").

    Other schedulers leave the schedule type out, which A1111 reads as "Automatic", the
    sampler's own schedule.
    """
    label = schedulers.SAMPLER_LABELS[scheduler]
    if label.endswith(" Karras"):
        return label.removesuffix(" Karras"), "Karras"
    return label, None


def lora_requests_of(
    prompt: str, options: list[str], lora_dir: Path | None
) -> tuple[str, list[LoraRequest]]:
    """The prompt without its <lora:NAME:X> tags, and every LoRA to merge: --lora options
    first, then the prompt's tags (found in lora_dir)."""
    from .lora import extract_prompt_loras, resolve_lora_name

    requests = [parse_lora_option(o) for o in options]
    clean, tags = extract_prompt_loras(prompt)
    for tag in tags:
        path = resolve_lora_name(tag.name, lora_dir, tag.tag)
        requests.append(LoraRequest(path, tag.strength, te_strength=tag.te_strength))
    return clean, requests


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
    init_image: Path | None = None,
    mask: Path | None = None,
    strength: float | None = None,
    resize: str | None = None,
    weights: Path | None = None,
    vae: Path | None = None,
    loras: list[str] | None = None,
    lora_dir: Path | None = None,
    embeddings: list[str] | None = None,
    vae_tiling: str = "auto",
    vae_memory_mib: int | None = None,
) -> list[Path]:
    check_text("--prompt", prompt)
    if vae_memory_mib is not None and vae_memory_mib <= 0:
        raise UserError(f"--vae-memory {vae_memory_mib}: give the MiB one VAE call may take")
    check_text("--negative-prompt", negative_prompt)
    embedding_files = load_embeddings(embeddings or [])
    written_prompt = prompt  # as the user wrote it, LoRA tags included (as A1111 keeps it)
    prompt, lora_requests = lora_requests_of(prompt, loras or [], lora_dir)
    seed = resolve_seed(seed, num_images)
    manifest = load_manifest(artifact_dir)
    size_h, size_w = resolve_size(manifest, width, height)  # what an init image is fitted to
    edit = load_edit_images(init_image, mask, size_w, size_h, resize)
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
            init_image=edit.image if edit else None,
            mask=edit.mask if edit else None,
            strength=strength,
            vae_tiling=vae_tiling,
            vae_budget=None if vae_memory_mib is None else vae_memory_mib << 20,
        ),
    )
    paths = output_paths(Path(output), num_images)
    check_output_paths(paths, overwrite)
    info, why = choose_device(manifest, device, force=force_device)
    check_files(manifest, Path(artifact_dir) / HASH_CACHE)
    overrides, provenance, weight_warnings = build_overrides(manifest, weights, vae, lora_requests)
    for w in weight_warnings:
        say(f"warning: {w}")
    if provenance.model:
        say(f"weights: {weights} (instead of the compiled ones)")
    if provenance.vae:
        say(f"VAE: {vae}")
    elif isinstance(compiled_vae := manifest.data["model"].get("vae"), dict):
        provenance.vae = compiled_vae.get("file")  # compiled in with `sdiree compile --vae`
        provenance.vae_hash = str(compiled_vae.get("sha256", ""))[:10]
    for req_lora in lora_requests:
        say(f"LoRA: {req_lora.path} at {req_lora.strength:g}")
    encoders = [te.get("submodule", "text_encoder") for te in manifest.data["text_encoders"]]
    # every text encoder gets the embeddings (SDXL's: each its own vector set, same words)
    text_inputs = [
        TextInputs.for_artifact(
            manifest, embedding_files, replaced=overrides.tensors.get(sub), encoder=i
        )
        for i, sub in enumerate(encoders)
    ]
    for e in embedding_files:
        words = " or ".join(w for w, _ in e.words)
        say(f"embedding: {e.path} ({len(e.vectors)} vector(s)) as {words}")

    say(f"device: {info.label} ({info.name}); {why}")
    seeds = [req.seed + i for i in range(req.num_images)]
    shown = f"seed {req.seed}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]}"
    say(
        f"{shown}, {req.scheduler} {req.steps} steps, guidance {req.guidance_scale}, "
        f"{req.width}x{req.height}, {manifest.target}/{manifest.arch}/{manifest.dtype}"
    )
    if edit:
        what = f"inpainting with --mask {mask}" if edit.mask is not None else "img2img"
        say(f"{what} from {init_image}, strength {req.strength}")
        for note in edit.notes:
            say(note)
    req = dataclasses.replace(req, per_image_seeds=True)
    pipeline = pipeline_class(req)
    result = with_fresh_device_on_loss(
        manifest,
        info,
        pipeline_submodules(manifest, pipeline),
        lambda session: pipeline(manifest, session, text_inputs).generate(req),
        warn=lambda msg: say(f"warning: {msg}"),
        overrides=overrides or None,
    )
    for w in result.warnings:
        say(f"warning: {w}")
    images = result.images
    check_image(images)
    sampler, schedule = sampler_and_schedule(req.scheduler)
    for path, image, s in zip(paths, to_uint8(images), seeds, strict=True):
        params = a1111_parameters(
            prompt=written_prompt,
            negative_prompt=req.negative_prompt,
            steps=req.steps,
            sampler=sampler,
            schedule_type=schedule,
            cfg_scale=req.guidance_scale,
            seed=s,
            width=req.width,
            height=req.height,
            model_hash=provenance.model_hash or model_hash(manifest),
            model=provenance.model or manifest.data["model"]["name"],
            extra={
                **provenance.png_fields(),
                "Denoising strength": req.strength,  # None (left out) for text-to-image
                "TI hashes": ti_hashes(result.embeddings),  # None (left out) when none used
                "Target": manifest.target,
                "Arch": manifest.arch,
                "Dtype": manifest.dtype,
            },
        )
        remove_stale_temps_for(path)
        save_png(path, image, params, overwrite)
        say(f"wrote {path}")
    say(result.timings.summary())
    return paths
