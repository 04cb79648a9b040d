"""Image-to-image: the text-to-image loop started from an encoded image, as diffusers'
StableDiffusionImg2ImgPipeline does it.

The init image ([-1, 1]) goes through the VAE encoder, whose latent distribution is sampled
(mean + std * noise, the noise from the run's generator: one draw of one image's latents, shared
by all images with one generator, one per image with per-image seeds); the scheduler keeps the
last ``int(steps * strength)`` steps (``start_at_strength``), and the latents are noised to the
first of them with ``add_noise`` and a second draw. The draws come in diffusers' order, so the
same seed gives diffusers' image.
"""

from __future__ import annotations

import time

import numpy as np

from .pipeline import GenerationRequest, Text2Image, Timings
from .rng import PerImageGenerators
from .schedulers import Scheduler
from .vae_tiling import encode_image


def image_tensor(pixels: np.ndarray) -> np.ndarray:
    """HxWx3 uint8 → 1x3xHxW float32 in [-1, 1], rounded as diffusers' VaeImageProcessor
    (x / 255, then 2x - 1, in float32)."""
    x = pixels.astype(np.float32) / np.float32(255.0)
    return (np.float32(2.0) * x - np.float32(1.0)).transpose(2, 0, 1)[None].copy()


def draw_for_image(generator, shape: tuple[int, ...], num_images: int) -> np.ndarray:
    """Noise for latents sampled from the one init image: with per-image generators each image
    draws its own, else one draw serves every image (diffusers encodes the image once)."""
    if isinstance(generator, PerImageGenerators):
        return generator.randn((num_images, *shape[1:]))
    return np.repeat(generator.randn((1, *shape[1:])), num_images, axis=0)


class Image2Image(Text2Image):
    SUBMODULES = (*Text2Image.SUBMODULES, "vae_encoder")

    def __init__(self, manifest, session, text_inputs=None):
        super().__init__(manifest, session, text_inputs)
        encode = manifest.submodules["vae_encoder"].functions["encode"]
        self.encode_dtype = np.dtype(encode.inputs[0].dtype)

    def encode_distribution(
        self, image: np.ndarray, vae_tiling: str = "auto"
    ) -> tuple[np.ndarray, np.ndarray]:
        """The VAE latent distribution of one image (1x3xHxW): mean and std, scaled to
        diffusion space by the module, float32; in tiles where the encoder takes tiles."""
        mean, std = encode_image(
            self.session, image, self.batch, self.encode_dtype, manifest=self.manifest,
            mode=vae_tiling, budget_bytes=getattr(self, "vae_budget", None),
        )[:2]  # fmt: skip
        return mean, std

    def sample_latents(self, image: np.ndarray, generator, num_images: int) -> np.ndarray:
        """num_images latents sampled from the image's distribution (diffusers'
        ``retrieve_latents`` in sample mode)."""
        mean, std = self.encode_distribution(image)
        noise = draw_for_image(generator, mean.shape, num_images)
        return (mean + std * noise).astype(np.float32)

    def _initial_latents(
        self,
        req: GenerationRequest,
        sched: Scheduler,
        generator,
        timings: Timings,
        warnings: list[str],
    ) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        image_latents = self.sample_latents(image_tensor(req.init_image), generator, req.num_images)
        timings.encode = time.perf_counter() - t0
        noise = generator.randn(image_latents.shape)
        timesteps = sched.start_at_strength(req.steps, req.strength)
        return sched.add_noise(image_latents, noise, timesteps[0]), timesteps
