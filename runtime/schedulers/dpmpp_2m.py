"""DPM-Solver++(2M) sampler ("DPM++ 2M", "DPM++ 2M Karras"): numpy port of diffusers'
DPMSolverMultistepScheduler restricted to algorithm_type="dpmsolver++", solver_order=2,
solver_type="midpoint".

Lu et al. 2022 (arXiv 2211.01095), multistep second order in the data-prediction form. With
lambda = log(alpha / sigma) and h = lambda_next - lambda_cur:

    x_next = (sigma_next / sigma_cur) x - alpha_next (e^-h - 1) (D0 + D1 / 2)
    D0 = x0_cur, D1 = (x0_cur - x0_prev) / r, r = h_prev / h   (first step and, by default, the
    last step use D1 = 0, i.e. DPM-Solver++ 1 = DDIM)

The algorithm/order/solver keys of a config are overridden by this class (they define the
sampler); everything else (spacing, Karras sigmas, final sigma, lower_order_final, euler_at_final,
lambda_min_clipped, thresholding) follows the config like diffusers' from_config.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import NoiseGenerator, Scheduler, check_num_inference_steps
from .noise_schedule import (
    BETA_DEFAULTS,
    TIMESTEP_SPACINGS,
    final_sigma,
    interp_sigmas,
    karras_sigmas,
    make_alphas_cumprod,
    sigma_to_t,
    train_sigmas,
)
from .prediction import clip_x0

# The keys that make this "DPM++ 2M"; forced whatever the loaded config says.
FIXED_OPTIONS = {"algorithm_type": "dpmsolver++", "solver_order": 2, "solver_type": "midpoint"}


class DPMSolverMultistepScheduler(Scheduler):
    CLASS_NAME = "DPMSolverMultistepScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "solver_order": 2,
        "prediction_type": "epsilon",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0,
        "algorithm_type": "dpmsolver++",
        "solver_type": "midpoint",
        "lower_order_final": True,
        "euler_at_final": False,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_lu_lambdas": False,
        "use_flow_sigmas": False,
        "flow_shift": 1.0,
        "final_sigmas_type": "zero",
        "lambda_min_clipped": -float("inf"),
        "variance_type": None,
        "timestep_spacing": "linspace",
        "steps_offset": 0,
        "rescale_betas_zero_snr": False,
        "use_dynamic_shifting": False,
        "time_shift_type": "exponential",
    }
    UNSUPPORTED_OPTIONS = (
        "use_exponential_sigmas",
        "use_beta_sigmas",
        "use_lu_lambdas",
        "use_flow_sigmas",
        "use_dynamic_shifting",
        "variance_type",
    )
    CHOICES = {
        **{key: (value,) for key, value in FIXED_OPTIONS.items()},
        "prediction_type": ("epsilon", "sample", "v_prediction"),
        "final_sigmas_type": ("zero", "sigma_min"),
        "timestep_spacing": TIMESTEP_SPACINGS,
    }

    def __init__(self, config: dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **{**FIXED_OPTIONS, **overrides})
        self.alphas_cumprod = make_alphas_cumprod(self.config, finite_sigmas=True)
        self._train_sigmas = train_sigmas(self.alphas_cumprod)
        # log(alpha_t / sigma_t) per training step, float32 as diffusers keeps it.
        self._train_lambdas = np.log(np.sqrt(self.alphas_cumprod)) - np.log(
            np.sqrt(np.float32(1.0) - self.alphas_cumprod)
        )
        self.sigmas = self._train_sigmas.copy()

    def _reset_history(self) -> None:
        super()._reset_history()
        self._prev_x0: np.ndarray | None = None
        self._lower_order_nums = 0

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        cfg = self.config
        t_train = int(cfg["num_train_timesteps"])
        # Skip the tail of the schedule where lambda falls below lambda_min_clipped.
        clipped = int(np.searchsorted(self._train_lambdas[::-1], cfg["lambda_min_clipped"]))
        last = t_train - clipped
        spacing = cfg["timestep_spacing"]
        # n + 1 points including 0, of which 0 is dropped (differs from the other samplers).
        if spacing == "linspace":
            timesteps = np.linspace(0, last - 1, n + 1).round()[::-1][:-1]
        elif spacing == "leading":
            ratio = last // (n + 1)
            timesteps = (np.arange(n + 1) * ratio)[::-1][:-1] + int(cfg["steps_offset"])
        else:  # trailing
            timesteps = np.arange(last, 0, -t_train / n).round() - 1
        timesteps = timesteps.astype(np.int64)

        if cfg["use_karras_sigmas"]:
            sigmas = karras_sigmas(float(self._train_sigmas[0]), float(self._train_sigmas[-1]), n)
            t_frac = sigma_to_t(sigmas, np.log(self._train_sigmas))
            if cfg["beta_schedule"] != "squaredcos_cap_v2":
                t_frac = t_frac.round()
            timesteps = t_frac.astype(np.int64)
        else:
            sigmas = interp_sigmas(timesteps, self._train_sigmas)
        sigmas = np.concatenate([sigmas, [final_sigma(cfg, self._train_sigmas)]]).astype(np.float32)
        self._check_no_zero_interval(sigmas, n)
        self.sigmas = sigmas
        self.timesteps = timesteps
        self.num_inference_steps = len(timesteps)
        self._reset_history()

    def _first_order_final(self, i: int, n: int) -> bool:
        """Whether step i of n takes the first-order update although history is there."""
        cfg = self.config
        return i == n - 1 and (
            cfg["euler_at_final"]
            or (cfg["lower_order_final"] and n < 15)
            or cfg["final_sigmas_type"] == "zero"
        )

    def _check_no_zero_interval(self, sigmas: np.ndarray, n: int) -> None:
        """Refuse a schedule with a repeated sigma that a second-order step would divide by.

        Past about num_train_timesteps - 1 steps the rounded timesteps repeat; the step after a
        repeat has h_prev = 0, and r = h_prev / h = 0 gives diffusers NaN latents (and took this
        port into a ZeroDivisionError).
        """
        steps = len(sigmas) - 1
        for i in range(1, steps):
            if sigmas[i - 1] == sigmas[i] and not self._first_order_final(i, steps):
                raise ValueError(
                    f"{n} steps with timestep_spacing {self.config['timestep_spacing']!r} repeat "
                    f"a timestep (step {i}), which DPM++ 2M cannot take (its next update divides "
                    "by zero)"
                )

    @staticmethod
    def _alpha_sigma(sigma: float) -> tuple[float, float]:
        """VP coefficients (alpha_t, sigma_t) of a Karras sigma: alpha = 1/sqrt(1+s^2)."""
        alpha = 1.0 / math.sqrt(sigma * sigma + 1.0)
        return alpha, sigma * alpha

    def _predict_x0(self, model_output: np.ndarray, sample: np.ndarray, sigma: float):
        # In VP form with (alpha_t, sigma_t) of the Karras sigma, as diffusers computes it here:
        # the same x0 as base.sigma_x0 mathematically, but rounded differently.
        prediction = self.config["prediction_type"]
        alpha_t, sigma_t = self._alpha_sigma(sigma)
        if prediction == "epsilon":
            x0 = (sample - sigma_t * model_output) / alpha_t
        elif prediction == "v_prediction":
            x0 = alpha_t * sample - sigma_t * model_output
        else:
            x0 = model_output
        return clip_x0(self.config, x0)

    def add_noise(self, original: np.ndarray, noise: np.ndarray, timestep: Any) -> np.ndarray:
        """alpha_t x0 + sigma_t noise at the step's sigma, in float32 as diffusers computes it."""
        self._require_timesteps()
        sigma = self.sigmas[self._noise_index(timestep)]
        one = np.float32(1.0)
        alpha_t = one / np.sqrt(sigma * sigma + one)
        sigma_t = sigma * alpha_t
        original = np.asarray(original, dtype=np.float32)
        noise = np.asarray(noise, dtype=np.float32)
        return (alpha_t * original + sigma_t * noise).astype(np.float32)

    def _missing_timestep_index(self, timestep: Any) -> int:
        # diffusers starts at the last step when the timestep is not in the schedule.
        return len(self.timesteps) - 1

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
    ) -> np.ndarray:
        self._require_timesteps()
        i = self._init_step_index(timestep)
        first_order_final = self._first_order_final(i, len(self.timesteps))

        sample = sample.astype(np.float32, copy=False)
        sigma_cur = float(self.sigmas[i])
        sigma_next = float(self.sigmas[i + 1])
        x0 = self._predict_x0(model_output, sample, sigma_cur)
        prev_x0, self._prev_x0 = self._prev_x0, x0

        alpha_next, s_next = self._alpha_sigma(sigma_next)
        _, s_cur = self._alpha_sigma(sigma_cur)
        if sigma_next == 0.0:
            # lambda_next = +inf: the update collapses to the x0 prediction.
            prev_sample = x0
        else:
            lam_next = -math.log(sigma_next)  # log(alpha/sigma_t) = -log(Karras sigma)
            lam_cur = -math.log(sigma_cur)
            h = lam_next - lam_cur
            phi = math.expm1(-h)
            # h == 0 (Karras + final sigma_min repeat the last sigma): a no-op step either way.
            if self._lower_order_nums < 1 or first_order_final or prev_x0 is None or h == 0.0:
                prev_sample = (s_next / s_cur) * sample - (alpha_next * phi) * x0
            else:
                lam_prev = -math.log(float(self.sigmas[i - 1]))
                r = (lam_cur - lam_prev) / h
                d1 = (x0 - prev_x0) * (1.0 / r)
                prev_sample = (
                    (s_next / s_cur) * sample
                    - (alpha_next * phi) * x0
                    - (0.5 * alpha_next * phi) * d1
                )
        if self._lower_order_nums < 2:
            self._lower_order_nums += 1
        self._step_index = i + 1
        return np.asarray(prev_sample, dtype=np.float32)
