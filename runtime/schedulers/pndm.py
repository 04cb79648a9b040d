"""PNDM / PLMS sampler ("PLMS"): numpy port of diffusers' PNDMScheduler.

Liu et al. 2022 (pseudo numerical methods). Every update uses the "transfer" x_t -> x_prev of
eq. 9 with an eps estimate; the estimate comes from a linear multistep (Adams-Bashforth) history
of model outputs. Two warm-up variants, chosen by config ``skip_prk_steps``:

* true (SD 1.5): the first step is a 2-evaluation Heun-like step, which is why the timestep list
  repeats its second entry (n + 1 model calls for n steps);
* false (class default): three pseudo Runge-Kutta steps, 4 model calls each, at t, t-h/2, t-h/2,
  t-h, before PLMS takes over.

The scheduler counts its calls internally, like diffusers; call ``step`` once per timestep.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import AlphaScheduler, NoiseGenerator, check_num_inference_steps
from .noise_schedule import BETA_DEFAULTS, TIMESTEP_SPACINGS
from .prediction import alpha_eps


class PNDMScheduler(AlphaScheduler):
    CLASS_NAME = "PNDMScheduler"
    DEFAULTS = {
        **BETA_DEFAULTS,
        "skip_prk_steps": False,
        "set_alpha_to_one": False,
        "prediction_type": "epsilon",
        "timestep_spacing": "leading",
        "steps_offset": 0,
    }
    CHOICES = {
        "prediction_type": ("epsilon", "v_prediction"),
        "timestep_spacing": TIMESTEP_SPACINGS,
    }

    def __init__(self, config: dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.prk_timesteps = np.empty(0, dtype=np.int64)

    def _reset_history(self) -> None:
        super()._reset_history()
        self.counter = 0
        self.ets: list[np.ndarray] = []  # model outputs at the grid points, newest last
        self.cur_sample: np.ndarray | None = None
        self.cur_model_output: np.ndarray | float = 0.0

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        cfg = self.config
        t_train = int(cfg["num_train_timesteps"])
        # Ascending grid of n training timesteps.
        grid = np.round(self._spaced_timesteps(n)).astype(np.int64)[::-1]
        self._check_in_training_range(grid, n)
        if cfg["skip_prk_steps"]:
            prk = np.empty(0, dtype=np.int64)
            # Descending, with the second point repeated for the Heun-like warm-up step.
            plms = np.concatenate([grid[:-1], grid[-2:-1], grid[-1:]])[::-1]
        else:
            if n < 4:
                raise ValueError(
                    "PNDMScheduler with skip_prk_steps=false needs num_inference_steps >= 4"
                )
            half = t_train // n // 2
            top = grid[-4:][::-1]  # g0 > g1 > g2 > g3
            prk = np.concatenate(
                [[top[k], top[k + 1] + half, top[k + 1] + half, top[k + 1]] for k in range(3)]
            ).astype(np.int64)
            plms = grid[:-3][::-1]
        self.prk_timesteps = prk
        self.timesteps = np.concatenate([prk, plms]).astype(np.int64)
        self.num_inference_steps = n
        self._reset_history()

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
    ) -> np.ndarray:
        self._require_timesteps()
        if self.counter < len(self.prk_timesteps) and not self.config["skip_prk_steps"]:
            prev_sample = self._step_prk(model_output, int(timestep), sample)
        else:
            prev_sample = self._step_plms(model_output, int(timestep), sample)
        self.counter += 1
        return np.asarray(prev_sample, dtype=np.float32)

    def _step_prk(self, model_output: np.ndarray, t: int, sample: np.ndarray) -> np.ndarray:
        half = int(self.config["num_train_timesteps"]) // self.num_inference_steps // 2
        stage = self.counter % 4
        # Stages 0 and 2 land half an interval below their own timestep, 1 and 3 on it.
        prev_t = t - (half if stage in (0, 2) else 0)
        t_start = int(self.prk_timesteps[self.counter - stage])
        if stage == 0:
            self.cur_model_output = model_output / 6
            self.ets.append(model_output)
            self.cur_sample = sample
        elif stage in (1, 2):
            self.cur_model_output = self.cur_model_output + model_output / 3
        else:
            # RK4 weights 1/6, 1/3, 1/3, 1/6 over the four evaluations.
            model_output = self.cur_model_output + model_output / 6
            self.cur_model_output = 0.0
        start = self.cur_sample if self.cur_sample is not None else sample
        return self._transfer(start, t_start, prev_t, model_output)

    def _step_plms(self, model_output: np.ndarray, t: int, sample: np.ndarray) -> np.ndarray:
        h = int(self.config["num_train_timesteps"]) // self.num_inference_steps
        prev_t = t - h
        if self.counter == 1:
            # Second call of the Heun-like warm-up: redo the first interval from the saved sample.
            prev_t, t = t, t + h
        else:
            self.ets = self.ets[-3:]
            self.ets.append(model_output)

        ets = self.ets
        if len(ets) == 1 and self.counter == 0:
            eps = model_output
            self.cur_sample = sample
        elif len(ets) == 1 and self.counter == 1:
            eps = (model_output + ets[-1]) / 2
            sample = self.cur_sample
            self.cur_sample = None
        elif len(ets) == 2:
            eps = (3 * ets[-1] - ets[-2]) / 2
        elif len(ets) == 3:
            eps = (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12
        else:
            eps = (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4]) / 24
        return self._transfer(sample, t, prev_t, eps)

    def _transfer(
        self, sample: np.ndarray, t: int, prev_t: int, model_output: np.ndarray
    ) -> np.ndarray:
        """PNDM eq. 9: move ``sample`` from timestep t to prev_t along the eps direction."""
        alpha_t = float(self.alphas_cumprod[t])
        alpha_prev = self._alpha_prod(prev_t)
        beta_t, beta_prev = 1.0 - alpha_t, 1.0 - alpha_prev
        model_output = alpha_eps(self.config["prediction_type"], model_output, sample, alpha_t)
        sample_coeff = math.sqrt(alpha_prev / alpha_t)
        denom = alpha_t * math.sqrt(beta_prev) + math.sqrt(alpha_t * beta_t * alpha_prev)
        return sample_coeff * sample - (alpha_prev - alpha_t) * model_output / denom
