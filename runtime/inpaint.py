"""Inpainting: repaint the masked part of an init image, as diffusers'
StableDiffusionInpaintPipeline does it, with either kind of UNet.

The mask is binarised at 0.5 (white, >= 128, is repainted) and brought to the latents' size by
nearest-neighbour sampling (torch's ``interpolate`` default). A dedicated inpainting UNet (9
input channels) is given, beside the scaled latents, that mask and the latents of the masked
image (the init image with its repainted part set to 0, i.e. gray). An ordinary UNet (4
channels) denoises as in img2img, and after every step the kept part is replaced by the image's
latents re-noised to the next timestep (the last step: not noised), so only the masked part
changes.

The generator is drawn in diffusers' order: the image's latents (for an ordinary UNet always,
for an inpainting one when strength < 1), the starting noise, then the masked image's latents
(drawn also for an ordinary UNet, which does not use them, so the steps' noise stays in step).
Strength 1 starts from pure noise at the scheduler's initial sigma, below 1 from the image's
latents noised to the first kept timestep, as in img2img. Per-image seeds draw each image's
latents from its own generator, so every image equals diffusers' image of its seed alone.
"""

from __future__ import annotations

import time

import numpy as np

from .img2img import Image2Image, draw_for_image, image_tensor
from .pipeline import GenerationRequest, Timings
from .schedulers import Scheduler
from .sizes import latent_size


def binarize(mask: np.ndarray) -> np.ndarray:
    """HxW uint8 → 1x1xHxW float32 of 0 and 1, as diffusers' mask processor (x / 255 >= 0.5)."""
    x = mask.astype(np.float32) / np.float32(255.0)
    return (x >= np.float32(0.5)).astype(np.float32)[None, None]


def nearest(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """1x1xHxW → 1x1xhxw by nearest neighbour with torch's indexing: floor(i * in / out),
    the ratio in float32."""
    rows = _nearest_index(mask.shape[2], height)
    cols = _nearest_index(mask.shape[3], width)
    return mask[:, :, rows][:, :, :, cols].copy()


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    scale = np.float32(n_in) / np.float32(n_out)
    index = np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64)
    return np.minimum(index, n_in - 1)


class Inpaint(Image2Image):
    def __init__(self, manifest, session, text_inputs=None):
        super().__init__(manifest, session, text_inputs)
        sample = manifest.submodules["unet"].functions["denoise"].inputs[0]
        latent_channels = manifest.image["latent_channels"]
        # latents + mask + masked image latents
        self.dedicated = sample.shape[1] == 2 * latent_channels + 1
        self._mask = self._masked_latents = self._image_latents = self._noise = None

    def _initial_latents(
        self,
        req: GenerationRequest,
        sched: Scheduler,
        generator,
        timings: Timings,
        warnings: list[str],
    ) -> tuple[np.ndarray, np.ndarray]:
        n = req.num_images
        latent_hw = latent_size(self.manifest, (req.height, req.width))
        shape = (n, self.manifest.image["latent_channels"], *latent_hw)
        image = image_tensor(req.init_image)
        mask = binarize(req.mask)
        if not mask.any():
            warnings.append("the mask is all black: nothing is repainted")
        timesteps = sched.start_at_strength(req.steps, req.strength)
        from_noise = req.strength == 1.0

        t0 = time.perf_counter()
        image_latents = None
        if not self.dedicated or not from_noise:
            image_latents = self.sample_latents(image, generator, n)
        noise = generator.randn(shape)
        if from_noise:
            latents = (noise * np.float32(sched.init_noise_sigma)).astype(np.float32)
        else:
            latents = sched.add_noise(image_latents, noise, timesteps[0])
        masked_image = image * (mask < 0.5)
        if self.dedicated:
            masked_latents = self.sample_latents(masked_image, generator, n)
        else:  # unused, but drawn as diffusers draws it
            draw_for_image(generator, shape, n)
            masked_latents = None
        timings.encode = time.perf_counter() - t0

        small = np.repeat(nearest(mask, shape[2], shape[3]), n, axis=0)
        self._mask, self._masked_latents = small, masked_latents
        self._image_latents, self._noise = image_latents, noise
        return latents, timesteps

    def _unet_input(self, x: np.ndarray, start: int) -> np.ndarray:
        if not self.dedicated:
            return x
        end = start + x.shape[0]
        parts = [x, self._mask[start:end], self._masked_latents[start:end]]
        return np.concatenate([p.astype(x.dtype) for p in parts], axis=1)

    def _after_step(self, latents: np.ndarray, i: int, timesteps, sched: Scheduler) -> np.ndarray:
        if self.dedicated:
            return latents
        kept = self._image_latents
        if i < len(timesteps) - 1:
            kept = sched.add_noise(kept, self._noise, timesteps[i + 1])
        mask = self._mask
        return ((np.float32(1.0) - mask) * kept + mask * latents).astype(np.float32)
