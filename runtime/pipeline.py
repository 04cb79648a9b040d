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
from .families import PIPELINES
from .manifest import Manifest
from .rng import PerImageGenerators, TorchCPUGenerator
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
    # False: one generator for all images, as diffusers with one torch.Generator (and ComfyUI).
    # True: image i from its own generator seeded seed + i, as diffusers with a list of
    # generators and AUTOMATIC1111, so each image is remade alone from its seed.
    per_image_seeds: bool = False
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
    if manifest.pipeline not in PIPELINES:
        raise UserError(
            f"{manifest.root} holds a {manifest.family} model run by the "
            f"'{manifest.pipeline}' pipeline, which this sdiree does not have (it runs "
            f"{', '.join(PIPELINES)}); run it with the sdiree that compiled it, or a newer one"
        )
    config = scheduler_config(manifest)
    try:
        name = schedulers.resolve_name(req.scheduler) if req.scheduler else None
    except ValueError as e:
        raise UserError(str(e)) from None
    name = name or schedulers.name_for_config(config) or "euler"
    steps = req.steps if req.steps is not None else schedulers.DEFAULT_STEPS[name]
    if steps < 1:
        raise UserError(f"--steps {steps}: the number of steps must be at least 1")
    check_steps(name, config, steps)
    if not math.isfinite(req.guidance_scale):
        raise UserError(f"--guidance-scale {req.guidance_scale} is not a finite number")
    if req.num_images < 1:
        raise UserError(f"--num-images {req.num_images} must be at least 1")
    img = manifest.image
    for label, asked, compiled in (
        ("width", req.width, img["width"]),
        ("height", req.height, img["height"]),
    ):
        if asked is not None and (asked <= 0 or asked % 8):
            raise UserError(f"--{label} {asked} is not a positive multiple of 8; leave it out")
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
        per_image_seeds=req.per_image_seeds,
        width=img["width"],
        height=img["height"],
    )


def make_scheduler(name: str, config: dict) -> schedulers.Scheduler:
    try:
        return schedulers.create(name, config)
    except ValueError as e:
        raise UserError(
            f"the {name} scheduler cannot use this model's scheduler config ({e}); "
            "choose another --scheduler"
        ) from None


def check_steps(name: str, config: dict, steps: int) -> None:
    """Refuse a step count the scheduler cannot take with this config, naming the limit.

    Checked here rather than mid-run: a count past num_train_timesteps would otherwise build a
    schedule of that length (--steps 100000000000 asked for hundreds of GiB), and some counts
    below it fail only at their last step.
    """
    sched = make_scheduler(name, config)
    train = int(sched.config["num_train_timesteps"])
    if steps > train:
        limit = schedulers.max_steps(name, config)
        also = "" if limit == train else f", of which {name} can take at most {limit}"
        raise UserError(
            f"--steps {steps}: this model's scheduler has {train} training timesteps{also}"
            + (f"; use at most {limit}" if limit else "")
        )
    try:
        sched.set_timesteps(steps)
    except ValueError as e:
        limit = schedulers.max_steps(name, config, upto=steps - 1)
        raise UserError(
            f"--steps {steps}: {name} cannot take {steps} steps with this model's scheduler "
            f"config ({e})" + (f"; use at most {limit}" if limit else "")
        ) from None


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

        if req.per_image_seeds:
            generator = PerImageGenerators([(req.seed + i) % 2**64 for i in range(req.num_images)])
        else:
            generator = TorchCPUGenerator(req.seed)
        shape = (req.num_images, img["latent_channels"], img["latent_height"], img["latent_width"])
        # One draw for all images, as diffusers draws them; the scheduler then steps all images
        # at once (its ancestral noise is one draw per step too, per image with per-image seeds)
        # and only the UNet runs in chunks of the compiled batch.
        latents = self._denoise(
            generator.randn(shape), cond, uncond, req, generator, timings, progress
        )

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
        sched.set_begin_index(0)
        latents = (latents * np.float32(sched.init_noise_sigma)).astype(np.float32)
        guided = uncond is not None
        text = np.concatenate([uncond, cond]) if guided else cond
        scale = np.float32(req.guidance_scale) if guided else None
        loop_start = time.perf_counter()
        for i, t in enumerate(sched.timesteps):
            t0 = time.perf_counter()
            x = sched.scale_model_input(latents, t).astype(self.dtype)
            tstep = np.array([t], dtype=np.float32)
            eps = np.concatenate(
                [
                    self._noise_pred(x[start : start + self.batch], tstep, text, scale)
                    for start in range(0, x.shape[0], self.batch)
                ]
            )
            latents = sched.step(eps, t, latents, generator=generator).astype(np.float32)
            timings.steps.append(time.perf_counter() - t0)
            if progress:
                progress(i + 1, len(sched.timesteps), time.perf_counter() - loop_start)
        return latents

    def _noise_pred(self, x, tstep, text, scale):
        """The UNet's noise prediction for one chunk of at most the compiled batch (padded to
        it), guided with ``scale`` unless that is None."""
        n = x.shape[0]
        if n < self.batch:
            x = np.concatenate([x, np.zeros((self.batch - n, *x.shape[1:]), x.dtype)])
        if scale is None:
            (eps,) = self.session.call("unet", "denoise", x, tstep, text)
            return eps[:n].astype(np.float32)
        x = np.concatenate([x] * self.cfg_repeats)
        (eps,) = self.session.call("unet", "denoise_cfg", x, tstep, text)
        e_uncond, e_text = np.split(eps.astype(np.float32), 2)
        return (e_uncond + scale * (e_text - e_uncond))[:n]
