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

from .base import (
    TIMESTEP_SPACINGS,
    NoiseGenerator,
    Scheduler,
    check_choice,
    check_num_inference_steps,
    cumprod_alphas,
    draw_noise,
    index_for_timestep,
    interp_sigmas,
    make_betas,
    rescale_zero_terminal_snr,
    spaced_timesteps,
    train_sigmas,
)


class EulerAncestralDiscreteScheduler(Scheduler):
    CLASS_NAME = "EulerAncestralDiscreteScheduler"
    DEFAULTS = {
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "trained_betas": None,
        "prediction_type": "epsilon",
        "timestep_spacing": "linspace",
        "steps_offset": 0,
        "rescale_betas_zero_snr": False,
    }

    def __init__(self, config: dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        cfg = self.config
        # diffusers has no "sample" prediction for this sampler either.
        check_choice(self.CLASS_NAME, cfg, "prediction_type", ("epsilon", "v_prediction"))
        check_choice(self.CLASS_NAME, cfg, "timestep_spacing", TIMESTEP_SPACINGS)
        betas = make_betas(cfg)
        if cfg["rescale_betas_zero_snr"]:
            betas = rescale_zero_terminal_snr(betas)
        self.alphas_cumprod = cumprod_alphas(betas)
        if cfg["rescale_betas_zero_snr"]:
            # Zero SNR would give an infinite sigma; diffusers pins it to a tiny alpha instead.
            self.alphas_cumprod[-1] = 2.0**-24
        self._train_sigmas = train_sigmas(self.alphas_cumprod)
        self.sigmas = np.concatenate([self._train_sigmas[::-1], [0.0]]).astype(np.float32)
        self._step_index: int | None = None

    @property
    def init_noise_sigma(self) -> float:
        max_sigma = np.float32(self.sigmas.max())
        if self.config["timestep_spacing"] in ("linspace", "trailing"):
            return float(max_sigma)
        return float(np.sqrt(max_sigma * max_sigma + np.float32(1.0)))

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        cfg = self.config
        timesteps = spaced_timesteps(
            cfg["timestep_spacing"], int(cfg["num_train_timesteps"]), n, int(cfg["steps_offset"])
        ).astype(np.float32)
        sigmas = interp_sigmas(timesteps, self._train_sigmas)
        self.sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        self.timesteps = timesteps
        self.num_inference_steps = n
        self._step_index = None

    def _init_step_index(self, timestep: Any) -> int:
        if self._step_index is None:
            index = index_for_timestep(self.timesteps, timestep)
            if index is None:
                raise ValueError(f"timestep {timestep!r} is not in the schedule")
            self._step_index = index
        return self._step_index

    def scale_model_input(self, sample: np.ndarray, timestep: Any) -> np.ndarray:
        sigma = float(self.sigmas[self._init_step_index(timestep)])
        return (sample / math.sqrt(sigma * sigma + 1.0)).astype(np.float32)

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
    ) -> np.ndarray:
        self._require_timesteps()
        i = self._init_step_index(timestep)
        sigma = float(self.sigmas[i])
        sigma_next = float(self.sigmas[i + 1])
        sample = sample.astype(np.float32, copy=False)
        if self.config["prediction_type"] == "epsilon":
            x0 = sample - sigma * model_output
        else:  # v_prediction
            x0 = model_output * (-sigma / math.sqrt(sigma * sigma + 1.0)) + sample / (
                sigma * sigma + 1.0
            )
        sigma_up = math.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
        sigma_down = math.sqrt(max(sigma_next**2 - sigma_up**2, 0.0))
        derivative = (sample - x0) / sigma
        prev_sample = sample + derivative * (sigma_down - sigma)
        noise = draw_noise(generator, model_output.shape)
        prev_sample = prev_sample + noise * sigma_up
        self._step_index = i + 1
        return prev_sample.astype(np.float32)
