"""Latent consistency sampler ("LCM"): numpy port of diffusers' LCMScheduler.

Luo et al. 2023. The inference timesteps are a subset of the distillation schedule
(``original_inference_steps`` points, every T/original-th training step). Each step predicts x0,
applies the consistency-model boundary condition denoised = c_out * x0 + c_skip * x with
c_skip = s_d^2 / (s^2 + s_d^2), c_out = s / sqrt(s^2 + s_d^2), s = t * timestep_scaling,
s_d = 0.5, and re-noises to the next timestep with one ``generator.randn(shape)`` call (none on
the last step), where diffusers draws its noise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import AlphaScheduler, NoiseGenerator, check_num_inference_steps, draw_noise
from .noise_schedule import BETA_DEFAULTS
from .prediction import alpha_x0, clip_x0

SIGMA_DATA = 0.5


class LCMScheduler(AlphaScheduler):
    CLASS_NAME = "LCMScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "original_inference_steps": 50,
        "clip_sample": False,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "prediction_type": "epsilon",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0,
        "timestep_spacing": "leading",  # accepted but unused, as in diffusers
        "timestep_scaling": 10.0,
        "rescale_betas_zero_snr": False,
    }
    CHOICES = {"prediction_type": ("epsilon", "sample", "v_prediction")}

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        t_train = int(self.config["num_train_timesteps"])
        original = int(self.config["original_inference_steps"])
        if original > t_train:
            raise ValueError(
                f"original_inference_steps ({original}) cannot exceed num_train_timesteps ({t_train})"
            )
        if n > original:
            raise ValueError(
                f"num_inference_steps ({n}) cannot exceed original_inference_steps ({original}) "
                "for LCM: its timesteps are a subset of the distillation schedule"
            )
        # Distillation schedule, descending: k*j - 1 for j = original..1.
        k = t_train // original
        origin = (np.arange(original, 0, -1) * k - 1).astype(np.int64)
        picks = np.floor(np.linspace(0, original, num=n, endpoint=False)).astype(np.int64)
        self.timesteps = origin[picks]
        self.num_inference_steps = n
        self._reset_history()

    def _boundary_scalings(self, t: int) -> tuple[float, float]:
        s = t * float(self.config["timestep_scaling"])
        c_skip = SIGMA_DATA**2 / (s * s + SIGMA_DATA**2)
        c_out = s / math.sqrt(s * s + SIGMA_DATA**2)
        return c_skip, c_out

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
    ) -> np.ndarray:
        self._require_timesteps()
        cfg = self.config
        t = int(timestep)
        i = self._init_step_index(t)
        prev_t = int(self.timesteps[i + 1]) if i + 1 < len(self.timesteps) else t
        alpha_t = float(self.alphas_cumprod[t])
        alpha_prev = self._alpha_prod(prev_t)
        c_skip, c_out = self._boundary_scalings(t)
        x0 = clip_x0(cfg, alpha_x0(cfg["prediction_type"], model_output, sample, alpha_t))

        denoised = c_out * x0 + c_skip * sample
        if i != self.num_inference_steps - 1:
            noise = draw_noise(generator, model_output.shape)
            prev_sample = math.sqrt(alpha_prev) * denoised + math.sqrt(1.0 - alpha_prev) * noise
        else:
            prev_sample = denoised
        self._step_index = i + 1
        return np.asarray(prev_sample, dtype=np.float32)
