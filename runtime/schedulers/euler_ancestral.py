"""Ancestral Euler sampler ("Euler a"): numpy port of diffusers' EulerAncestralDiscreteScheduler.

Each step goes deterministically from sigma down to sigma_down with an Euler step, then adds fresh
noise of size sigma_up, where sigma_up^2 + sigma_down^2 = sigma_next^2 and
sigma_up = sigma_next * sqrt(1 - sigma_next^2 / sigma^2) (k-diffusion's get_ancestral_step, eta=1).
The noise is one ``generator.randn(shape)`` call per step, after the deterministic part, exactly
where diffusers draws it, so equal generator streams give equal results.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import NoiseGenerator, SigmaScheduler, draw_noise
from .noise_schedule import BETA_DEFAULTS, TIMESTEP_SPACINGS


class EulerAncestralDiscreteScheduler(SigmaScheduler):
    CLASS_NAME = "EulerAncestralDiscreteScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "prediction_type": "epsilon",
        "timestep_spacing": "linspace",
        "steps_offset": 0,
        "rescale_betas_zero_snr": False,
    }
    # No Karras sigmas and a final sigma of 0 (the config has neither key); diffusers has no
    # "sample" prediction for this sampler either.
    CHOICES = {
        "prediction_type": ("epsilon", "v_prediction"),
        "timestep_spacing": TIMESTEP_SPACINGS,
    }

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
    ) -> np.ndarray:
        i, sigma, sigma_next = self._begin_step(timestep)
        sample = sample.astype(np.float32, copy=False)
        x0 = self._predict_x0(model_output, sample, sigma)
        sigma_up = math.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
        sigma_down = math.sqrt(max(sigma_next**2 - sigma_up**2, 0.0))
        derivative = (sample - x0) / sigma
        prev_sample = sample + derivative * (sigma_down - sigma)
        noise = draw_noise(generator, model_output.shape)
        prev_sample = prev_sample + noise * sigma_up
        self._step_index = i + 1
        return prev_sample.astype(np.float32)
