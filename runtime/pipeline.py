"""Text-to-image with compiled modules: tokenizer → text encoder → scheduler loop → VAE decode.

Mirrors diffusers' StableDiffusionPipeline step for step (same tokenization, same initial
latents from the same seed, classifier-free guidance with the negative prompt as the
unconditional text, same scheduler arithmetic), so a fixed seed gives the image diffusers gives.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import schedulers
from .errors import UserError
from .manifest import Manifest
from .rng import TorchCPUGenerator
from .session import Session
from .tokenizer import ClipTokenizer


@dataclass
class GenerationRequest:
    prompt: str
    negative_prompt: str = ""
    steps: int | None = None
    guidance_scale: float = 7.5
    scheduler: str | None = None
    seed: int = 0
    num_images: int = 1
    width: int | None = None
    height: int | None = None


@dataclass
class Timings:
    text_encoding: float = 0.0
    steps: list[float] = field(default_factory=list)
    decode: float = 0.0
    total: float = 0.0

    def summary(self) -> str:
        per_step = sum(self.steps) / len(self.steps) if self.steps else 0.0
        return (
            f"text encoding {self.text_encoding:.2f}s, {per_step:.3f}s/step over "
            f"{len(self.steps)} steps, decode {self.decode:.2f}s, total {self.total:.2f}s"
        )


@dataclass
class GenerationResult:
    images: np.ndarray  # [N, 3, H, W] float32 in [-1, 1]
    scheduler: str
    steps: int
    timings: Timings
    warnings: list[str]


def scheduler_config(manifest: Manifest) -> dict:
    import json

    return json.loads(manifest.path(manifest.data["scheduler"]["config"]).read_text())


def resolve_request(manifest: Manifest, req: GenerationRequest) -> GenerationRequest:
    """Fill defaults from the artifact and reject what it cannot do, before any work."""
    config = scheduler_config(manifest)
    name = req.scheduler or schedulers.name_for_config(config) or "euler"
    if name not in schedulers.NAMES:
        raise UserError(f"unknown scheduler '{name}': choose one of {', '.join(schedulers.NAMES)}")
    steps = req.steps if req.steps is not None else schedulers.DEFAULT_STEPS[name]
    if steps < 1:
        raise UserError(f"--steps {steps}: the number of steps must be at least 1")
    if not math.isfinite(req.guidance_scale):
        raise UserError(f"--guidance-scale {req.guidance_scale} is not a finite number")
    if req.num_images < 1:
        raise UserError(f"--num-images {req.num_images} must be at least 1")
    img = manifest.image
    for label, asked, compiled in (
        ("width", req.width, img["width"]),
        ("height", req.height, img["height"]),
    ):
        if asked is not None and asked != compiled:
            raise UserError(
                f"--{label} {asked}: this artifact was compiled for {img['width']}x"
                f"{img['height']}; recompile with --{label} {asked} or leave it out"
            )
    return GenerationRequest(
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        steps=steps,
        guidance_scale=req.guidance_scale,
        scheduler=name,
        seed=req.seed,
        num_images=req.num_images,
        width=img["width"],
        height=img["height"],
    )


def progress_bar(done: int, total: int, elapsed: float, stream=sys.stderr) -> None:
    width = 30
    filled = int(width * done / total)
    rate = elapsed / done if done else 0.0
    stream.write(
        f"\r  steps {done:>3}/{total} |{'#' * filled}{'.' * (width - filled)}| {rate:.2f}s/step"
    )
    if done == total:
        stream.write("\n")
    stream.flush()


class Text2Image:
    SUBMODULES = ("text_encoder", "unet", "vae_decoder")

    def __init__(self, manifest: Manifest, session: Session):
        self.manifest = manifest
        self.session = session
        te = manifest.data["text_encoders"][0]
        self.tokenizer = ClipTokenizer.from_dir(manifest.path(te["tokenizer"]))
        self.batch = manifest.image["batch_size"]
        unet = manifest.submodules["unet"].functions
        self.dtype = np.dtype(unet["denoise"].inputs[0].dtype)
        # Artifacts before exporter revision 6 take the guided call's latents twice.
        self.cfg_repeats = unet["denoise_cfg"].inputs[0].shape[0] // self.batch

    def encode_text(self, text: str, warnings: list[str]) -> np.ndarray:
        tok = self.tokenizer.encode(text)
        if tok.num_truncated:
            warnings.append(
                f"the prompt is too long for the text encoder: {tok.num_truncated} token(s) "
                f"past {self.tokenizer.max_length} were dropped"
            )
        ids = np.repeat(tok.ids[None, :].astype(np.int64), self.batch, axis=0)
        hidden, _pooled = self.session.call("text_encoder", "encode", ids)
        return hidden

    def generate(
        self,
        req: GenerationRequest,
        progress: Callable[[int, int, float], None] | None = progress_bar,
    ) -> GenerationResult:
        t_start = time.perf_counter()
        timings = Timings()
        warnings: list[str] = []
        img = self.manifest.image
        cfg = req.guidance_scale > 1.0

        t0 = time.perf_counter()
        cond = self.encode_text(req.prompt, warnings)
        uncond = self.encode_text(req.negative_prompt, []) if cfg else None
        timings.text_encoding = time.perf_counter() - t0

        generator = TorchCPUGenerator(req.seed)
        shape = (req.num_images, img["latent_channels"], img["latent_height"], img["latent_width"])
        # One draw for all images, as diffusers draws them, then compiled-batch chunks.
        all_latents = generator.randn(shape)
        chunks = []
        for start in range(0, req.num_images, self.batch):
            latents = all_latents[start : start + self.batch]
            n = latents.shape[0]
            if n < self.batch:  # pad the last chunk to the compiled batch
                pad = np.zeros((self.batch - n, *shape[1:]), np.float32)
                latents = np.concatenate([latents, pad])
            out = self._denoise(latents, cond, uncond, req, generator, timings, progress)
            chunks.append(out[:n])
        latents = np.concatenate(chunks)

        t0 = time.perf_counter()
        images = []
        for start in range(0, latents.shape[0], self.batch):
            part = latents[start : start + self.batch]
            n = part.shape[0]
            if n < self.batch:
                part = np.concatenate(
                    [part, np.zeros((self.batch - n, *part.shape[1:]), part.dtype)]
                )
            (image,) = self.session.call("vae_decoder", "decode", part.astype(self.dtype))
            images.append(image[:n].astype(np.float32))
        timings.decode = time.perf_counter() - t0
        timings.total = time.perf_counter() - t_start
        return GenerationResult(np.concatenate(images), req.scheduler, req.steps, timings, warnings)

    def _denoise(self, latents, cond, uncond, req, generator, timings, progress):
        sched = schedulers.create(req.scheduler, scheduler_config(self.manifest))
        sched.set_timesteps(req.steps)
        latents = (latents * np.float32(sched.init_noise_sigma)).astype(np.float32)
        cfg = uncond is not None
        text = np.concatenate([uncond, cond]) if cfg else cond
        g = np.float32(req.guidance_scale)
        loop_start = time.perf_counter()
        for i, t in enumerate(sched.timesteps):
            t0 = time.perf_counter()
            x = np.concatenate([latents] * self.cfg_repeats) if cfg else latents
            x = sched.scale_model_input(x, t).astype(self.dtype)
            tstep = np.array([t], dtype=np.float32)
            fn = "denoise_cfg" if cfg else "denoise"
            (eps,) = self.session.call("unet", fn, x, tstep, text)
            eps = eps.astype(np.float32)
            if cfg:
                e_uncond, e_text = np.split(eps, 2)
                eps = e_uncond + g * (e_text - e_uncond)
            latents = sched.step(eps, t, latents, generator=generator).astype(np.float32)
            timings.steps.append(time.perf_counter() - t0)
            if progress:
                progress(i + 1, len(sched.timesteps), time.perf_counter() - loop_start)
        return latents
