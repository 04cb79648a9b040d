"""Text-to-image with compiled modules: tokenizer → text encoder → scheduler loop → VAE decode.

Mirrors diffusers' StableDiffusionPipeline step for step (same tokenization, same initial
latents from the same seed, classifier-free guidance with the negative prompt as the
unconditional text, same scheduler arithmetic), so a fixed seed gives the image diffusers gives.
Text2Image is also the frame of img2img (runtime/img2img.py) and inpainting
(runtime/inpaint.py): they change where the loop starts (``_initial_latents``), what the UNet
is given (``_unet_input``) and what follows each step (``_after_step``); ``pipeline_class``
picks the one a request needs.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import schedulers
from .conditioning import Conditioner, text_encoder_submodules
from .embeddings import Embedding
from .errors import UserError
from .families import PIPELINES
from .manifest import Manifest
from .rng import PerImageGenerators, TorchCPUGenerator
from .schedulers import Scheduler
from .session import Session
from .sizes import latent_size, resolve_size, unet_function
from .text_inputs import TextInputs
from .vae_tiling import check_decode, decode_latents


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
    # img2img and inpainting (runtime/image_input.py reads them at the artifact's size)
    init_image: np.ndarray | None = None  # HxWx3 uint8 RGB
    mask: np.ndarray | None = None  # HxW uint8 gray: >= 128 (0.5) is repainted, the rest kept
    strength: float | None = None  # default: DEFAULT_STRENGTH of the pipeline
    vae_tiling: str = "auto"  # `sdiree run --vae-tiling`: auto, on or off
    vae_budget: int | None = None  # `sdiree run --vae-memory`: bytes one VAE call may take

    @property
    def edits(self) -> bool:
        return self.init_image is not None


# diffusers' defaults: StableDiffusionImg2ImgPipeline 0.8, StableDiffusionInpaintPipeline 1.0.
DEFAULT_STRENGTH = {"img2img": 0.8, "inpaint": 1.0}


@dataclass
class Timings:
    text_encoding: float = 0.0
    steps: list[float] = field(default_factory=list)
    decode: float = 0.0
    total: float = 0.0
    encode: float = 0.0  # the VAE encoder's, for img2img and inpainting

    def summary(self) -> str:
        per_step = sum(self.steps) / len(self.steps) if self.steps else 0.0
        encode = f"image encoding {self.encode:.2f}s, " if self.encode else ""
        return (
            f"text encoding {self.text_encoding:.2f}s, {encode}{per_step:.3f}s/step over "
            f"{len(self.steps)} steps, decode {self.decode:.2f}s, total {self.total:.2f}s"
        )


@dataclass
class GenerationResult:
    images: np.ndarray  # [N, 3, H, W] float32 in [-1, 1]
    scheduler: str
    steps: int
    timings: Timings
    warnings: list[str]
    embeddings: list[Embedding] = field(default_factory=list)  # those the prompts called


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
    height, width = resolve_size(manifest, req.width, req.height)
    check_decode(
        manifest,
        mode=req.vae_tiling,
        budget_bytes=req.vae_budget,
        latent_hw=latent_size(manifest, (height, width)),
    )
    req = dataclasses.replace(req, width=width, height=height)
    return dataclasses.replace(
        req,
        steps=steps,
        scheduler=name,
        strength=resolve_edit(manifest, req, steps),
    )


def resolve_edit(manifest: Manifest, req: GenerationRequest, steps: int) -> float | None:
    """The strength of an img2img or inpainting request (None for text-to-image), after
    refusing what the artifact or the request cannot do."""
    inpaint_model = manifest.pipeline == "inpaint"
    if req.mask is not None and not req.edits:
        raise UserError("--mask needs --init-image: the image whose masked part is repainted")
    if inpaint_model and req.mask is None:
        raise UserError(
            f"{manifest.root} holds an inpainting model (its UNet takes a mask and an image): "
            "give --init-image and --mask"
        )
    if not req.edits:
        if req.strength is not None:
            raise UserError("--strength applies to --init-image; leave it out or give an image")
        return None
    kind = "img2img" if req.mask is None else "inpaint"
    strength = DEFAULT_STRENGTH[kind] if req.strength is None else float(req.strength)
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        raise UserError(
            f"--strength {req.strength}: give a number above 0 and at most 1 (how much of the "
            "schedule repaints the image: 1 starts from pure noise)"
        )
    if min(int(steps * strength), steps) < 1:
        raise UserError(
            f"--strength {strength} with {steps} steps leaves no step to run (it runs the last "
            f"int(steps * strength) of them); raise --strength or --steps"
        )
    encoder = manifest.submodules.get("vae_encoder")
    outputs = (
        encoder.functions["encode"].outputs if encoder and "encode" in encoder.functions else ()
    )
    if len(outputs) < 2:
        raise UserError(
            f"{manifest.root} was compiled by an older sdiree: its VAE encoder gives the latent "
            "mean only, not the distribution img2img samples; recompile it with `sdiree compile`"
        )
    for what, pixels, want in (
        ("--init-image", req.init_image, (req.height, req.width, 3)),
        ("--mask", req.mask, (req.height, req.width)),
    ):
        if pixels is not None and tuple(pixels.shape) != want:
            raise UserError(f"{what} has shape {pixels.shape}, not the artifact's {want}")
    return strength


def pipeline_class(req: GenerationRequest) -> type[Text2Image]:
    """The pipeline that runs a resolved request: Text2Image, Image2Image or Inpaint."""
    if not req.edits:
        return Text2Image
    if req.mask is None:
        from .img2img import Image2Image

        return Image2Image
    from .inpaint import Inpaint

    return Inpaint


def pipeline_submodules(manifest: Manifest, cls: type[Text2Image]) -> tuple[str, ...]:
    """The submodules a pipeline class opens for this artifact: its own, with "text_encoder"
    standing for every text encoder of the artifact's recipe (SDXL: two)."""
    subs: list[str] = []
    for s in cls.SUBMODULES:
        subs += text_encoder_submodules(manifest) if s == "text_encoder" else [s]
    return tuple(dict.fromkeys(subs))


def _as_inputs(cond) -> tuple[np.ndarray, ...]:
    """A prompt's UNet inputs as a tuple (an encode_text replaced by a caller may give the
    hidden states alone, as before the UNet took more)."""
    return (cond,) if isinstance(cond, np.ndarray) else tuple(cond)


def make_generator(req: GenerationRequest):
    """The run's noise source: one generator per image seeded seed + i, or one for all."""
    if req.per_image_seeds:
        return PerImageGenerators([(req.seed + i) % 2**64 for i in range(req.num_images)])
    return TorchCPUGenerator(req.seed)


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

    def __init__(
        self,
        manifest: Manifest,
        session: Session,
        text_inputs: TextInputs | list[TextInputs] | None = None,
    ):
        self.manifest = manifest
        self.session = session
        # one TextInputs per text encoder; those not given read the artifact's own
        given = [text_inputs] if isinstance(text_inputs, TextInputs) else list(text_inputs or [])
        count = len(text_encoder_submodules(manifest))
        all_inputs = given + [
            TextInputs.for_artifact(manifest, encoder=i) for i in range(len(given), count)
        ]
        self.text_inputs = all_inputs[0]
        self.tokenizer = self.text_inputs.tokenizer
        self.conditioner = Conditioner(manifest, session, all_inputs)
        self.used_embeddings: dict[str, Embedding] = {}
        self.batch = manifest.image["batch_size"]
        unet = manifest.submodules["unet"].functions
        self.dtype = np.dtype(unet["denoise"].inputs[0].dtype)
        # the VAE's own dtype: fp32 in an fp16 build whose family upcasts it (SDXL)
        self.vae_dtype = np.dtype(
            manifest.submodules["vae_decoder"].functions["decode"].inputs[0].dtype
            if "vae_decoder" in manifest.submodules
            else self.dtype
        )
        # Artifacts before exporter revision 6 take the guided call's latents twice.
        self.cfg_repeats = unet["denoise_cfg"].inputs[0].shape[0] // self.batch

    def encode_text(self, text: str, warnings: list[str]) -> tuple[np.ndarray, ...]:
        """The UNet's conditioning inputs for text (runtime/conditioning.py)."""
        cond, enc = self.conditioner.encode(text)
        if enc.num_truncated:
            warnings.append(
                f"the prompt is too long for the text encoder: {enc.num_truncated} token(s) "
                f"past {self.tokenizer.max_length} were dropped"
            )
        for e in enc.used:
            self.used_embeddings.setdefault(e.name, e)
        return cond

    def encode_negative(self, text: str, cond: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """The unconditional half's inputs: the negative prompt encoded, or zeros for an empty
        one where the model asks for that (SDXL's force_zeros_for_empty_prompt)."""
        if not text and self.conditioner.zero_empty_negative:
            return self.conditioner.zeros_like(cond)
        return self.encode_text(text, [])

    def generate(
        self,
        req: GenerationRequest,
        progress: Callable[[int, int, float], None] | None = progress_bar,
    ) -> GenerationResult:
        t_start = time.perf_counter()
        timings = Timings()
        warnings: list[str] = []
        self.used_embeddings = {}
        self.vae_budget = req.vae_budget
        if req.height and req.width:
            self.conditioner.set_image_size(req.height, req.width)
        cfg = req.guidance_scale > 1.0

        t0 = time.perf_counter()
        cond = _as_inputs(self.encode_text(req.prompt, warnings))
        uncond = _as_inputs(self.encode_negative(req.negative_prompt, cond)) if cfg else None
        self._phase_done(*text_encoder_submodules(self.manifest))
        timings.text_encoding = time.perf_counter() - t0

        generator = make_generator(req)
        sched = schedulers.create(req.scheduler, scheduler_config(self.manifest))
        sched.set_timesteps(req.steps)
        # All images' latents at once, as diffusers draws them; the scheduler then steps all
        # images together (its ancestral noise is one draw per step too, per image with
        # per-image seeds) and only the UNet runs in chunks of the compiled batch.
        latents, timesteps = self._initial_latents(req, sched, generator, timings, warnings)
        self._phase_done("vae_encoder")  # img2img and inpainting encoded their image
        latents = self._denoise(
            latents, timesteps, sched, cond, uncond, req, generator, timings, progress
        )
        self._phase_done("unet")

        t0 = time.perf_counter()
        images = decode_latents(
            self.session, latents, self.batch, self.vae_dtype, manifest=self.manifest,
            mode=req.vae_tiling, budget_bytes=req.vae_budget,
        )  # fmt: skip
        self._phase_done("vae_decoder")
        timings.decode = time.perf_counter() - t0
        timings.total = time.perf_counter() - t_start
        return GenerationResult(
            images,
            req.scheduler,
            req.steps,
            timings,
            warnings,
            list(self.used_embeddings.values()),
        )

    def _phase_done(self, *submodules: str) -> None:
        """Give back what these modules hold resident (Session.release): a run uses each
        module in one phase, so the peak is the largest phase's, not the sum of all. A
        session without release (a test's stand-in) keeps everything."""
        release = getattr(self.session, "release", None)
        if release is not None:
            release(submodules)

    def _initial_latents(
        self,
        req: GenerationRequest,
        sched: Scheduler,
        generator,
        timings: Timings,
        warnings: list[str],
    ) -> tuple[np.ndarray, np.ndarray]:
        """The latents the loop starts from and the timesteps it runs: noise at the
        scheduler's initial sigma, over the whole schedule."""
        latent_hw = latent_size(self.manifest, (req.height, req.width))
        shape = (req.num_images, self.manifest.image["latent_channels"], *latent_hw)
        latents = generator.randn(shape)
        sched.set_begin_index(0)
        return (latents * np.float32(sched.init_noise_sigma)).astype(np.float32), sched.timesteps

    def _unet_input(self, x: np.ndarray, start: int) -> np.ndarray:
        """What the UNet is given for images start.. of the scaled latents chunk ``x``."""
        return x

    def _after_step(self, latents: np.ndarray, i: int, timesteps, sched: Scheduler) -> np.ndarray:
        """The latents after step i (of ``timesteps``); inpainting blends the kept part here."""
        return latents

    def _denoise(self, latents, timesteps, sched, cond, uncond, req, generator, timings, progress):
        guided = uncond is not None
        text = (
            tuple(np.concatenate([u, c]) for u, c in zip(uncond, cond, strict=True))
            if guided
            else cond
        )
        scale = np.float32(req.guidance_scale) if guided else None
        loop_start = time.perf_counter()
        for i, t in enumerate(timesteps):
            t0 = time.perf_counter()
            x = sched.scale_model_input(latents, t).astype(self.dtype)
            tstep = np.array([t], dtype=np.float32)
            eps = np.concatenate(
                [
                    self._noise_pred(
                        self._unet_input(x[start : start + self.batch], start), tstep, text, scale
                    )
                    for start in range(0, x.shape[0], self.batch)
                ]
            )
            latents = sched.step(eps, t, latents, generator=generator).astype(np.float32)
            latents = self._after_step(latents, i, timesteps, sched)
            timings.steps.append(time.perf_counter() - t0)
            if progress:
                progress(i + 1, len(timesteps), time.perf_counter() - loop_start)
        return latents

    def _noise_pred(self, x, tstep, text, scale):
        """The UNet's noise prediction for one chunk of at most the compiled batch (padded to
        it), guided with ``scale`` unless that is None."""
        n = x.shape[0]
        if n < self.batch:
            x = np.concatenate([x, np.zeros((self.batch - n, *x.shape[1:]), x.dtype)])
        fn = unet_function(self.manifest, x.shape[-2:], guided=scale is not None)
        if scale is None:
            (eps,) = self.session.call("unet", fn, x, tstep, *text)
            return eps[:n].astype(np.float32)
        x = np.concatenate([x] * self.cfg_repeats)
        (eps,) = self.session.call("unet", fn, x, tstep, *text)
        e_uncond, e_text = np.split(eps.astype(np.float32), 2)
        return (e_uncond + scale * (e_text - e_uncond))[:n]
