"""Euler sampler ("Euler"): numpy port of diffusers' EulerDiscreteScheduler.

Deterministic first-order ODE step in sigma space (Karras et al. 2022, Algorithm 2 without
churn): x0 is predicted from the model output, d = (x - x0) / sigma, x <- x + d * (sigma_next - sigma).
The model sees x / sqrt(sigma^2 + 1). Optional Karras sigmas; s_churn is not exposed (0 in
diffusers' pipelines).
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
    index_for_timestep,
    interp_sigmas,
    karras_sigmas,
    make_betas,
    reject_options,
    rescale_zero_terminal_snr,
    sigma_to_t,
    spaced_timesteps,
    train_sigmas,
)


class EulerDiscreteScheduler(Scheduler):
    CLASS_NAME = "EulerDiscreteScheduler"
    DEFAULTS = {
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "trained_betas": None,
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

    def __init__(self, config: dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        cfg = self.config
        reject_options(self.CLASS_NAME, cfg, "use_exponential_sigmas", "use_beta_sigmas")
        check_choice(
            self.CLASS_NAME,
            cfg,
            "prediction_type",
            ("epsilon", "v_prediction", "sample", "original_sample"),
        )
        check_choice(self.CLASS_NAME, cfg, "interpolation_type", ("linear",))
        check_choice(self.CLASS_NAME, cfg, "timestep_type", ("discrete",))
        check_choice(self.CLASS_NAME, cfg, "final_sigmas_type", ("zero", "sigma_min"))
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
        t_train = int(cfg["num_train_timesteps"])
        timesteps = spaced_timesteps(
            cfg["timestep_spacing"], t_train, n, int(cfg["steps_offset"])
        ).astype(np.float32)
        sigmas = interp_sigmas(timesteps, self._train_sigmas)
        if cfg["use_karras_sigmas"]:
            log_sigmas = np.log(self._train_sigmas)
            lo = cfg["sigma_min"] if cfg["sigma_min"] is not None else float(sigmas[-1])
            hi = cfg["sigma_max"] if cfg["sigma_max"] is not None else float(sigmas[0])
            sigmas = karras_sigmas(lo, hi, n)
            timesteps = sigma_to_t(sigmas, log_sigmas).astype(np.float32)
        last = float(self._train_sigmas[0]) if cfg["final_sigmas_type"] == "sigma_min" else 0.0
        self.sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
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
        prediction = self.config["prediction_type"]
        if prediction == "epsilon":
            x0 = sample - sigma * model_output
        elif prediction == "v_prediction":
            x0 = model_output * (-sigma / math.sqrt(sigma * sigma + 1.0)) + sample / (
                sigma * sigma + 1.0
            )
        else:
            x0 = model_output
        derivative = (sample - x0) / sigma
        prev_sample = sample + derivative * (sigma_next - sigma)
        self._step_index = i + 1
        return prev_sample.astype(np.float32)
