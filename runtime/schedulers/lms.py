"""Linear multistep sampler ("LMS"): numpy port of diffusers' LMSDiscreteScheduler (order 4).

Integrates dx/dsigma = d(x, sigma) = (x - x0) / sigma with an Adams-Bashforth-style method over
the last (up to) 4 derivatives: coefficient j is the integral from sigma_i to sigma_{i+1} of the
Lagrange basis polynomial through the previous sigmas. The integrand is a polynomial of degree
<= 3, so 4-point Gauss-Legendre quadrature integrates it exactly (diffusers uses scipy.quad).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import NoiseGenerator, SigmaScheduler
from .noise_schedule import BETA_DEFAULTS, TIMESTEP_SPACINGS

LMS_ORDER = 4
_GAUSS_NODES, _GAUSS_WEIGHTS = np.polynomial.legendre.leggauss(4)


class LMSDiscreteScheduler(SigmaScheduler):
    CLASS_NAME = "LMSDiscreteScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "prediction_type": "epsilon",
        "timestep_spacing": "linspace",
        "steps_offset": 0,
    }
    UNSUPPORTED_OPTIONS = ("use_exponential_sigmas", "use_beta_sigmas")
    CHOICES = {
        "prediction_type": ("epsilon", "v_prediction", "sample"),
        "timestep_spacing": TIMESTEP_SPACINGS,
    }

    def set_timesteps(self, num_inference_steps: int) -> None:
        super().set_timesteps(num_inference_steps)
        # A repeated sigma is a repeated interpolation node: the coefficients divide by zero and
        # the latents turn NaN (in diffusers too). Leading spacing with a steps_offset at
        # num_train_timesteps steps clamps its first two timesteps to the same sigma.
        steps = self.sigmas[:-1]
        repeats = np.flatnonzero(steps[1:] == steps[:-1])
        if len(repeats):
            self.num_inference_steps = None
            raise ValueError(
                f"{num_inference_steps} steps with timestep_spacing "
                f"{self.config['timestep_spacing']!r} repeat a sigma (step {int(repeats[0]) + 1}), "
                "which LMS cannot take (its coefficients divide by zero)"
            )

    def _reset_history(self) -> None:
        super()._reset_history()
        self.derivatives: list[np.ndarray] = []

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
        i, sigma, _ = self._begin_step(timestep)
        x0 = self._predict_x0(model_output, sample, sigma)
        self.derivatives.append((sample - x0) / sigma)
        if len(self.derivatives) > LMS_ORDER:
            self.derivatives.pop(0)
        order = min(i + 1, LMS_ORDER)
        prev_sample = sample
        # derivatives[-1 - j] belongs to sigma_{i - j}. A run started mid-schedule (img2img) has
        # fewer derivatives than the order: diffusers then takes the order's first coefficients
        # only, for the derivatives it has.
        for j in range(min(order, len(self.derivatives))):
            prev_sample = prev_sample + self.lms_coefficient(order, i, j) * self.derivatives[-1 - j]
        self._step_index = i + 1
        return np.asarray(prev_sample, dtype=np.float32)
