"""Euler sampler ("Euler"): numpy port of diffusers' EulerDiscreteScheduler.

Deterministic first-order ODE step in sigma space (Karras et al. 2022, Algorithm 2 without
churn): x0 is predicted from the model output, d = (x - x0) / sigma, x <- x + d * (sigma_next - sigma).
The model sees x / sqrt(sigma^2 + 1). Optional Karras sigmas; s_churn is not exposed (0 in
diffusers' pipelines).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import NoiseGenerator, SigmaScheduler
from .noise_schedule import BETA_DEFAULTS, TIMESTEP_SPACINGS


class EulerDiscreteScheduler(SigmaScheduler):
    CLASS_NAME = "EulerDiscreteScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "prediction_type": "epsilon",
        "interpolation_type": "linear",
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "sigma_min": None,
        "sigma_max": None,
        "timestep_spacing": "linspace",
        "timestep_type": "discrete",
        "steps_offset": 0,
        "rescale_betas_zero_snr": False,
        "final_sigmas_type": "zero",
    }
    UNSUPPORTED_OPTIONS = ("use_exponential_sigmas", "use_beta_sigmas")
    CHOICES = {
        "prediction_type": ("epsilon", "v_prediction", "sample", "original_sample"),
        "interpolation_type": ("linear",),
        "timestep_type": ("discrete",),
        "final_sigmas_type": ("zero", "sigma_min"),
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
        derivative = (sample - x0) / sigma
        prev_sample = sample + derivative * (sigma_next - sigma)
        self._step_index = i + 1
        return prev_sample.astype(np.float32)
