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

from .base import (
    TIMESTEP_SPACINGS,
    NoiseGenerator,
    Scheduler,
    check_choice,
    check_num_inference_steps,
    cumprod_alphas,
    draw_noise,
    make_betas,
    rescale_zero_terminal_snr,
    spaced_timesteps,
    threshold_sample,
)


class DDIMScheduler(Scheduler):
    CLASS_NAME = "DDIMScheduler"
    DEFAULTS = {
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "trained_betas": None,
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

    def __init__(self, config: dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        cfg = self.config
        check_choice(self.CLASS_NAME, cfg, "prediction_type", ("epsilon", "sample", "v_prediction"))
        check_choice(self.CLASS_NAME, cfg, "timestep_spacing", TIMESTEP_SPACINGS)
        betas = make_betas(cfg)
        if cfg["rescale_betas_zero_snr"]:
            betas = rescale_zero_terminal_snr(betas)
        self.alphas_cumprod = cumprod_alphas(betas)
        # alpha_cumprod "before" the first training step, used for the very last update.
        self.final_alpha_cumprod = 1.0 if cfg["set_alpha_to_one"] else float(self.alphas_cumprod[0])

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        t_train = int(self.config["num_train_timesteps"])
        if n > t_train:
            raise ValueError(
                f"num_inference_steps ({n}) cannot exceed num_train_timesteps ({t_train})"
            )
        spaced = spaced_timesteps(
            self.config["timestep_spacing"], t_train, n, int(self.config["steps_offset"])
        )
        self.timesteps = np.round(spaced).astype(np.int64)
        self.num_inference_steps = n

    def _alpha_prod(self, t: int) -> float:
        return float(self.alphas_cumprod[t]) if t >= 0 else self.final_alpha_cumprod

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

        prediction = cfg["prediction_type"]
        if prediction == "epsilon":
            x0 = (sample - math.sqrt(beta_t) * model_output) / math.sqrt(alpha_t)
            eps = model_output
        elif prediction == "sample":
            x0 = model_output
            eps = (sample - math.sqrt(alpha_t) * x0) / math.sqrt(beta_t)
        else:  # v_prediction
            x0 = math.sqrt(alpha_t) * sample - math.sqrt(beta_t) * model_output
            eps = math.sqrt(alpha_t) * model_output + math.sqrt(beta_t) * sample

        if cfg["thresholding"]:
            x0 = threshold_sample(x0, cfg["dynamic_thresholding_ratio"], cfg["sample_max_value"])
        elif cfg["clip_sample"]:
            limit = cfg["clip_sample_range"]
            x0 = np.clip(x0, -limit, limit)

        std = 0.0
        if eta > 0:
            variance = (1.0 - alpha_prev) / beta_t * (1.0 - alpha_t / alpha_prev)
            std = eta * math.sqrt(variance)
        direction = math.sqrt(1.0 - alpha_prev - std * std) * eps
        prev_sample = math.sqrt(alpha_prev) * x0 + direction
        if eta > 0:
            prev_sample = prev_sample + std * draw_noise(generator, model_output.shape)
        return np.asarray(prev_sample, dtype=np.float32)
