"""The numpy schedulers' base classes (``Scheduler``, ``SigmaScheduler``, ``AlphaScheduler``) and
what every scheduler shares besides its schedule (noise_schedule.py) and its x0 prediction
(prediction.py): config resolution and checks, noise draws, finding a timestep in a schedule.

Everything here is numpy + stdlib (the runtime never imports torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import numpy as np

from .noise_schedule import (
    final_sigma,
    interp_sigmas,
    karras_sigmas,
    make_alphas_cumprod,
    sigma_to_t,
    spaced_timesteps,
    train_sigmas,
)
from .prediction import sigma_x0


class NoiseGenerator(Protocol):
    """Source of standard normal noise, e.g. a numpy port of torch's CPU generator."""

    def randn(self, shape: tuple[int, ...]) -> np.ndarray: ...


def resolve_config(
    defaults: Mapping[str, Any], config: Mapping[str, Any] | None, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """Merge a diffusers ``scheduler_config.json`` dict into one class's defaults.

    Mirrors ``SchedulerClass.from_config(config, **overrides)``: keys the class does not take are
    ignored, missing keys (and keys listed in ``_use_default_values``) take the class default.
    """
    config = dict(config or {})
    use_defaults = set(config.get("_use_default_values") or ())
    resolved = dict(defaults)
    for key in defaults:
        if key in config and key not in use_defaults:
            resolved[key] = config[key]
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"unknown scheduler option(s): {', '.join(unknown)}")
    resolved.update(overrides)
    return resolved


def check_num_inference_steps(num_inference_steps: Any) -> int:
    if isinstance(num_inference_steps, bool) or not isinstance(
        num_inference_steps, (int, np.integer)
    ):
        raise ValueError(f"num_inference_steps must be an int, got {num_inference_steps!r}")
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    return int(num_inference_steps)


def reject_options(class_name: str, config: Mapping[str, Any], *keys: str) -> None:
    """Raise for config switches this port does not implement (only when they are switched on)."""
    for key in keys:
        if config.get(key):
            raise ValueError(
                f"{class_name}: config option {key}={config[key]!r} is not supported by the "
                "sdiree numpy schedulers"
            )


def check_choice(class_name: str, config: Mapping[str, Any], key: str, allowed: tuple) -> None:
    if config[key] not in allowed:
        raise ValueError(
            f"{class_name}: {key}={config[key]!r} is not supported (choose from {list(allowed)})"
        )


def draw_noise(generator: NoiseGenerator | None, shape: tuple[int, ...]) -> np.ndarray:
    """One ``generator.randn(shape)`` draw as float32; unseeded numpy noise without a generator."""
    if generator is None:
        return np.random.default_rng().standard_normal(shape, dtype=np.float32)
    return np.asarray(generator.randn(tuple(shape)), dtype=np.float32)


def index_for_timestep(schedule: np.ndarray, timestep: Any) -> int | None:
    """Position of ``timestep`` in the schedule; None if absent.

    With duplicates the second match wins, like diffusers: starting mid-schedule (img2img) must
    not skip a sigma.
    """
    matches = np.flatnonzero(schedule == timestep)
    if len(matches) == 0:
        return None
    return int(matches[1] if len(matches) > 1 else matches[0])


class Scheduler:
    """Common surface of every numpy scheduler.

    Subclasses set ``CLASS_NAME``, ``DEFAULTS`` (the diffusers class's constructor defaults), and
    what the port accepts: ``UNSUPPORTED_OPTIONS`` (switches rejected when on) and ``CHOICES``
    (allowed values per key, checked in order). Loop, as in diffusers' StableDiffusionPipeline::

        latents *= s.init_noise_sigma
        for t in s.timesteps:
            eps = unet(s.scale_model_input(latents, t), t)
            latents = s.step(eps, t, latents, generator)

    img2img starts from ``s.add_noise(image_latents, noise, timesteps[0])`` instead, with
    ``timesteps = s.start_at_strength(steps, strength)``.
    """

    CLASS_NAME: ClassVar[str] = ""
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    UNSUPPORTED_OPTIONS: ClassVar[tuple[str, ...]] = ()
    CHOICES: ClassVar[dict[str, tuple]] = {}
    order: int = 1
    init_noise_sigma: float = 1.0

    def __init__(self, config: Mapping[str, Any] | None = None, **overrides: Any) -> None:
        self.config = resolve_config(self.DEFAULTS, config, overrides)
        reject_options(self.CLASS_NAME, self.config, *self.UNSUPPORTED_OPTIONS)
        for key, allowed in self.CHOICES.items():
            check_choice(self.CLASS_NAME, self.config, key, allowed)
        self.num_inference_steps: int | None = None
        self.timesteps = np.empty(0, dtype=np.int64)
        self._reset_history()

    def _reset_history(self) -> None:
        """Forget per-run state (set_timesteps starts a new run); subclasses extend this."""
        self._step_index: int | None = None
        self._begin_index: int | None = None

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start the run at schedule position ``begin_index`` (diffusers' ``set_begin_index``).

        Without it the first step() looks its timestep up, and a timestep that repeats is taken
        at its second position (for img2img). A text-to-image run starts at 0: call this after
        set_timesteps, or schedules whose first timestep repeats run off their end.
        """
        self._begin_index = int(begin_index)

    def set_timesteps(self, num_inference_steps: int) -> None:
        raise NotImplementedError

    def start_at_strength(self, num_inference_steps: int, strength: float) -> np.ndarray:
        """img2img's schedule, after set_timesteps(num_inference_steps): the last
        ``int(num_inference_steps * strength)`` steps, as diffusers' ``get_timesteps`` keeps
        them (its float product and truncation included); sets the begin index there and
        returns the timesteps to run (empty when strength leaves no step)."""
        n = int(num_inference_steps)
        begin = max(n - min(int(n * strength), n), 0) * self.order
        self.set_begin_index(begin)
        return self.timesteps[begin:]

    def scale_model_input(self, sample: np.ndarray, timestep: Any) -> np.ndarray:
        return sample

    def step(
        self,
        model_output: np.ndarray,
        timestep: Any,
        sample: np.ndarray,
        generator: NoiseGenerator | None = None,
    ) -> np.ndarray:
        raise NotImplementedError

    def add_noise(self, original: np.ndarray, noise: np.ndarray, timestep: Any) -> np.ndarray:
        """``original`` noised to the level of ``timestep`` (diffusers' ``add_noise``): img2img's
        first latents, and inpainting's re-noised image latents after each step."""
        raise NotImplementedError

    def _noise_index(self, timestep: Any) -> int:
        """The schedule position whose noise level add_noise uses, chosen as diffusers does: the
        timestep looked up when no begin index was set; else the current step once stepping has
        begun (inpainting calls it after step()), else the begin index (img2img, before)."""
        if self._begin_index is None:
            index = index_for_timestep(self.timesteps, timestep)
            return self._missing_timestep_index(timestep) if index is None else index
        if self._step_index is not None:
            return self._step_index
        return self._begin_index

    def _require_timesteps(self) -> None:
        if self.num_inference_steps is None:
            raise RuntimeError(f"{self.CLASS_NAME}: call set_timesteps() before step()")

    def _spaced_timesteps(self, num_inference_steps: int) -> np.ndarray:
        """``spaced_timesteps`` for this config's spacing, train steps and offset (float64)."""
        cfg = self.config
        return spaced_timesteps(
            cfg["timestep_spacing"],
            int(cfg["num_train_timesteps"]),
            num_inference_steps,
            int(cfg["steps_offset"]),
        )

    def _init_step_index(self, timestep: Any) -> int:
        """Current step: looked up from ``timestep`` on the first call of a run, then the index
        that step() advanced to (so repeated timesteps are walked in order)."""
        if self._step_index is None and self._begin_index is not None:
            self._step_index = self._begin_index
        elif self._step_index is None:
            index = index_for_timestep(self.timesteps, timestep)
            self._step_index = self._missing_timestep_index(timestep) if index is None else index
        return self._step_index

    def _missing_timestep_index(self, timestep: Any) -> int:
        raise ValueError(f"timestep {timestep!r} is not in the schedule")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_inference_steps={self.num_inference_steps})"


class SigmaScheduler(Scheduler):
    """Base of the k-diffusion-style samplers (Euler, Euler a, LMS), which work on
    x = x0 + sigma * eps: latents start at init_noise_sigma, the model sees x / sqrt(sigma^2 + 1),
    and ``sigmas`` holds one sigma per timestep plus a final one (see ``final_sigma``).

    The schedule is the spaced timesteps with their interpolated training sigmas, or, when the
    config has ``use_karras_sigmas`` on, Karras sigmas between ``sigma_min``/``sigma_max`` (default:
    the ends of the interpolated schedule) and their fractional timesteps.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.alphas_cumprod = make_alphas_cumprod(self.config, finite_sigmas=True)
        self._train_sigmas = train_sigmas(self.alphas_cumprod)
        self.sigmas = np.concatenate([self._train_sigmas[::-1], [0.0]]).astype(np.float32)

    @property
    def init_noise_sigma(self) -> float:
        max_sigma = np.float32(self.sigmas.max())
        if self.config["timestep_spacing"] in ("linspace", "trailing"):
            return float(max_sigma)
        return float(np.sqrt(max_sigma * max_sigma + np.float32(1.0)))

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps)
        cfg = self.config
        timesteps = self._spaced_timesteps(n).astype(np.float32)
        sigmas = interp_sigmas(timesteps, self._train_sigmas)
        if cfg.get("use_karras_sigmas"):
            sigma_min, sigma_max = cfg.get("sigma_min"), cfg.get("sigma_max")
            lo = sigma_min if sigma_min is not None else float(sigmas[-1])
            hi = sigma_max if sigma_max is not None else float(sigmas[0])
            sigmas = karras_sigmas(lo, hi, n)
            timesteps = sigma_to_t(sigmas, np.log(self._train_sigmas)).astype(np.float32)
        last = final_sigma(cfg, self._train_sigmas)
        self.sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
        self.timesteps = timesteps
        self.num_inference_steps = n
        self._reset_history()

    def scale_model_input(self, sample: np.ndarray, timestep: Any) -> np.ndarray:
        sigma = float(self.sigmas[self._init_step_index(timestep)])
        return (sample / math.sqrt(sigma * sigma + 1.0)).astype(np.float32)

    def _begin_step(self, timestep: Any) -> tuple[int, float, float]:
        """Step index for ``timestep``, its sigma and the next one (step() then sets the index
        to i + 1)."""
        self._require_timesteps()
        i = self._init_step_index(timestep)
        return i, float(self.sigmas[i]), float(self.sigmas[i + 1])

    def _predict_x0(self, model_output: np.ndarray, sample: np.ndarray, sigma: float) -> np.ndarray:
        return sigma_x0(self.config["prediction_type"], model_output, sample, sigma)

    def add_noise(self, original: np.ndarray, noise: np.ndarray, timestep: Any) -> np.ndarray:
        """x = x0 + sigma * noise, sigma in float32 as diffusers casts it to the latents' dtype."""
        self._require_timesteps()
        sigma = self.sigmas[self._noise_index(timestep)]
        noise = np.asarray(noise, dtype=np.float32)
        return (np.asarray(original, dtype=np.float32) + noise * sigma).astype(np.float32)


class AlphaScheduler(Scheduler):
    """Base of the DDPM-parameterised samplers (DDIM, PNDM, LCM), which work on
    x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps with a_t = alphas_cumprod[t] at integer timesteps.

    ``final_alpha_cumprod`` stands in for a_t "before" the first training step (t < 0), used by
    the very last update: 1 with ``set_alpha_to_one``, else alphas_cumprod[0].
    """

    def __init__(self, config: Mapping[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.alphas_cumprod = make_alphas_cumprod(self.config)
        self.final_alpha_cumprod = (
            1.0 if self.config["set_alpha_to_one"] else float(self.alphas_cumprod[0])
        )

    def _check_in_training_range(self, timesteps: np.ndarray, num_inference_steps: int) -> None:
        """Refuse a schedule that reaches past the last training timestep (a "leading" spacing
        with a steps_offset at as many steps as training timesteps), where diffusers fails with an
        IndexError mid-run."""
        last = int(self.config["num_train_timesteps"]) - 1
        if len(timesteps) and int(timesteps.max()) > last:
            raise ValueError(
                f"{num_inference_steps} steps with timestep_spacing {self.config['timestep_spacing']!r}"
                f" and steps_offset {self.config['steps_offset']} reach timestep "
                f"{int(timesteps.max())}, past the last training timestep {last}"
            )

    def _alpha_prod(self, t: int) -> float:
        return float(self.alphas_cumprod[t]) if t >= 0 else self.final_alpha_cumprod

    def add_noise(self, original: np.ndarray, noise: np.ndarray, timestep: Any) -> np.ndarray:
        """x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise at the integer timestep, in float32 as
        diffusers computes it."""
        alpha = self.alphas_cumprod[int(timestep)]
        root_alpha = np.sqrt(alpha)
        root_beta = np.sqrt(np.float32(1.0) - alpha)
        original = np.asarray(original, dtype=np.float32)
        noise = np.asarray(noise, dtype=np.float32)
        return (root_alpha * original + root_beta * noise).astype(np.float32)
