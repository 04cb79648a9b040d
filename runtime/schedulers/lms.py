"""Linear multistep sampler ("LMS"): numpy port of diffusers' LMSDiscreteScheduler (order 4).

Integrates dx/dsigma = d(x, sigma) = (x - x0) / sigma with an Adams-Bashforth-style method over
the last (up to) 4 derivatives: coefficient j is the integral from sigma_i to sigma_{i+1} of the
Lagrange basis polynomial through the previous sigmas. The integrand is a polynomial of degree
<= 3, so 4-point Gauss-Legendre quadrature integrates it exactly (diffusers uses scipy.quad).
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
    sigma_to_t,
    spaced_timesteps,
    train_sigmas,
)

LMS_ORDER = 4
_GAUSS_NODES, _GAUSS_WEIGHTS = np.polynomial.legendre.leggauss(4)


class LMSDiscreteScheduler(Scheduler):
    CLASS_NAME = "LMSDiscreteScheduler"
    DEFAULTS = {
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "trained_betas": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "prediction_type": "epsilon",
        "timestep_spacing": "linspace",
        "steps_offset": 0,
    }

    def __init__(self, config: dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        cfg = self.config
        reject_options(self.CLASS_NAME, cfg, "use_exponential_sigmas", "use_beta_sigmas")
        check_choice(self.CLASS_NAME, cfg, "prediction_type", ("epsilon", "v_prediction", "sample"))
        check_choice(self.CLASS_NAME, cfg, "timestep_spacing", TIMESTEP_SPACINGS)
        self.alphas_cumprod = cumprod_alphas(make_betas(cfg))
        self._train_sigmas = train_sigmas(self.alphas_cumprod)
        self.sigmas = np.concatenate([self._train_sigmas[::-1], [0.0]]).astype(np.float32)
        self._reset_history()

    def _reset_history(self) -> None:
        self._step_index: int | None = None
        self.derivatives: list[np.ndarray] = []

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
        if cfg["use_karras_sigmas"]:
            sigmas = karras_sigmas(float(sigmas[-1]), float(sigmas[0]), n)
            timesteps = sigma_to_t(sigmas, np.log(self._train_sigmas)).astype(np.float32)
        self.sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        self.timesteps = timesteps
        self.num_inference_steps = n
        self._reset_history()

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

    def lms_coefficient(self, order: int, i: int, j: int) -> float:
        """Integral over [sigma_i, sigma_{i+1}] of the Lagrange basis for derivative i - j."""
        nodes = [float(self.sigmas[i - k]) for k in range(order)]
        a, b = float(self.sigmas[i]), float(self.sigmas[i + 1])
        tau = 0.5 * (b - a) * _GAUSS_NODES + 0.5 * (a + b)
        basis = np.ones_like(tau)
        for k in range(order):
            if k != j:
                basis *= (tau - nodes[k]) / (nodes[j] - nodes[k])
        return float(0.5 * (b - a) * np.dot(_GAUSS_WEIGHTS, basis))

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
        prediction = self.config["prediction_type"]
        if prediction == "epsilon":
            x0 = sample - sigma * model_output
        elif prediction == "v_prediction":
            x0 = model_output * (-sigma / math.sqrt(sigma * sigma + 1.0)) + sample / (
                sigma * sigma + 1.0
            )
        else:
            x0 = model_output
        self.derivatives.append((sample - x0) / sigma)
        if len(self.derivatives) > LMS_ORDER:
            self.derivatives.pop(0)
        order = min(i + 1, LMS_ORDER)
        prev_sample = sample
        # derivatives[-1 - j] belongs to sigma_{i - j}.
        for j in range(order):
            prev_sample = prev_sample + self.lms_coefficient(order, i, j) * self.derivatives[-1 - j]
        self._step_index = i + 1
        return np.asarray(prev_sample, dtype=np.float32)
