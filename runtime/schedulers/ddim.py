"""DDIM sampler ("DDIM"): numpy port of diffusers' DDIMScheduler.

Song et al. 2020, eq. 12: predict x0 and eps from the model output, then
x_prev = sqrt(a_prev) * x0 + sqrt(1 - a_prev - std^2) * eps + std * noise, with
std = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)). eta defaults to 0 (deterministic,
what diffusers' pipelines use); noise is only drawn when eta > 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import AlphaScheduler, NoiseGenerator, check_num_inference_steps, draw_noise
from .noise_schedule import BETA_DEFAULTS, TIMESTEP_SPACINGS
from .prediction import alpha_eps, alpha_x0, clip_x0


class DDIMScheduler(AlphaScheduler):
    CLASS_NAME = "DDIMScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "clip_sample": True,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "prediction_type": "epsilon",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "clip_sample_range": 1.0,
        "sample_max_value": 1.0,
        "timestep_spacing": "leading",
        "rescale_betas_zero_snr": False,
    }
    CHOICES = {
        "prediction_type": ("epsilon", "sample", "v_prediction"),
        "timestep_spacing": TIMESTEP_SPACINGS,
    }

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        t_train = int(self.config["num_train_timesteps"])
        if n > t_train:
            raise ValueError(
                f"num_inference_steps ({n}) cannot exceed num_train_timesteps ({t_train})"
            )
        timesteps = np.round(self._spaced_timesteps(n)).astype(np.int64)
        self._check_in_training_range(timesteps, n)
        self.timesteps = timesteps
        self.num_inference_steps = n

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
        *,
        eta: float = 0.0,
    ) -> np.ndarray:
        self._require_timesteps()
        cfg = self.config
        t = int(timestep)
        # As in diffusers the previous timestep is t - T // n, also for linspace/trailing spacing.
        prev_t = t - int(cfg["num_train_timesteps"]) // self.num_inference_steps
        alpha_t = self._alpha_prod(t)
        alpha_prev = self._alpha_prod(prev_t)
        beta_t = 1.0 - alpha_t

        # eps is derived from the unclipped x0, as in diffusers.
        x0 = alpha_x0(cfg["prediction_type"], model_output, sample, alpha_t)
        eps = alpha_eps(cfg["prediction_type"], model_output, sample, alpha_t)
        x0 = clip_x0(cfg, x0)

        std = 0.0
        if eta > 0:
            variance = (1.0 - alpha_prev) / beta_t * (1.0 - alpha_t / alpha_prev)
            std = eta * math.sqrt(variance)
        direction = math.sqrt(1.0 - alpha_prev - std * std) * eps
        prev_sample = math.sqrt(alpha_prev) * x0 + direction
        if eta > 0:
            prev_sample = prev_sample + std * draw_noise(generator, model_output.shape)
        return np.asarray(prev_sample, dtype=np.float32)
