"""Pieces shared by the numpy schedulers: config resolution, noise schedules, timestep spacing.

Everything here is numpy + stdlib (the runtime never imports torch). The numerics follow what
diffusers computes on CPU closely enough that schedules agree to float32 rounding: betas are
float32, ``alphas_cumprod`` is accumulated in float64 and stored as float32 (torch's CPU cumprod
accumulates float32 in double), and training sigmas are derived from that float32 array.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import numpy as np


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


# ---------------------------------------------------------------------------------------------
# Noise schedule


def _cosine_alpha_bar(t: float) -> float:
    return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2


def linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """float32 linspace computed the way torch's CPU kernel does, so betas match bit for bit.

    torch rounds the step to float32 and fills the first half as start + step*i and the second
    half as end - step*(n-1-i), each with one fused multiply-add (emulated here in float64,
    where the product is exact).
    """
    lo, hi = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([lo], dtype=np.float32)
    step = np.float64(np.float32((hi - lo) / np.float32(n - 1)))
    i = np.arange(n, dtype=np.float64)
    from_start = (np.float64(lo) + step * i).astype(np.float32)
    from_end = (np.float64(hi) - step * (n - 1 - i)).astype(np.float32)
    return np.where(i < n // 2, from_start, from_end)


def make_betas(config: Mapping[str, Any]) -> np.ndarray:
    """float32 betas from ``trained_betas`` or ``beta_schedule``/``beta_start``/``beta_end``."""
    n = int(config["num_train_timesteps"])
    if config.get("trained_betas") is not None:
        return np.asarray(config["trained_betas"], dtype=np.float32)
    schedule = config["beta_schedule"]
    start, end = float(config["beta_start"]), float(config["beta_end"])
    if schedule == "linear":
        return linspace_f32(start, end, n)
    if schedule == "scaled_linear":
        # Squared in float32, after the float32 linspace, as diffusers does.
        return linspace_f32(start**0.5, end**0.5, n) ** 2
    if schedule == "squaredcos_cap_v2":
        # Nichol & Dhariwal cosine schedule, betas capped at 0.999.
        betas = [
            min(1.0 - _cosine_alpha_bar((i + 1) / n) / _cosine_alpha_bar(i / n), 0.999)
            for i in range(n)
        ]
        return np.asarray(betas, dtype=np.float32)
    raise ValueError(
        f"beta_schedule {schedule!r} is not supported "
        "(choose from 'linear', 'scaled_linear', 'squaredcos_cap_v2')"
    )


def cumprod_alphas(betas: np.ndarray) -> np.ndarray:
    """``alphas_cumprod`` as float32, accumulated in float64 like torch's CPU cumprod."""
    alphas = (np.float32(1.0) - betas.astype(np.float32)).astype(np.float64)
    return np.cumprod(alphas).astype(np.float32)


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Shift/scale sqrt(alphas_cumprod) so the last step has zero SNR (arXiv 2305.08891, Alg. 1)."""
    root = np.sqrt(cumprod_alphas(betas))
    first, last = root[0], root[-1]
    root = (root - last) * (first / (first - last))
    alpha_bar = root**2
    alphas = np.concatenate([alpha_bar[:1], alpha_bar[1:] / alpha_bar[:-1]])
    return (np.float32(1.0) - alphas).astype(np.float32)


def train_sigmas(alphas_cumprod: np.ndarray) -> np.ndarray:
    """Karras-style sigma per training timestep (float32, ascending with t)."""
    return np.sqrt((np.float32(1.0) - alphas_cumprod) / alphas_cumprod).astype(np.float32)


TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")


def spaced_timesteps(
    spacing: str, num_train_timesteps: int, num_inference_steps: int, steps_offset: int = 0
) -> np.ndarray:
    """Descending float64 inference timesteps for "linspace", "leading" or "trailing" spacing.

    "linspace" values are left fractional: the Euler family keeps them, DDIM/PNDM round them.
    """
    t_train, n = num_train_timesteps, num_inference_steps
    if spacing == "linspace":
        return np.linspace(0, t_train - 1, n)[::-1].copy()
    if spacing == "leading":
        return (np.arange(n) * (t_train // n)).astype(np.float64)[::-1] + steps_offset
    if spacing == "trailing":
        return np.round(np.arange(t_train, 0, -t_train / n)) - 1
    raise ValueError(
        f"timestep_spacing {spacing!r} is not supported (choose from 'linspace', 'leading', 'trailing')"
    )


def interp_sigmas(timesteps: np.ndarray, sigmas: np.ndarray) -> np.ndarray:
    """Training sigmas linearly interpolated at (possibly fractional) timesteps; float64."""
    return np.interp(timesteps, np.arange(len(sigmas)), sigmas)


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. (2022) eq. 5: n sigmas from sigma_max down to sigma_min, spaced in sigma^(1/rho)."""
    ramp = np.linspace(0, 1, n)
    hi, lo = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timestep of each sigma, interpolating linearly in log-sigma.

    ``log_sigmas`` is log(train_sigmas), ascending with t (float32 like diffusers keeps it).
    """
    log_sigma = np.log(np.maximum(np.asarray(sigmas, dtype=np.float64), 1e-10))
    low = np.searchsorted(log_sigmas, log_sigma, side="right") - 1
    low = np.clip(low, 0, len(log_sigmas) - 2)
    high = low + 1
    w = (log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[high])
    w = np.clip(w, 0, 1)
    return (1 - w) * low + w * high


# ---------------------------------------------------------------------------------------------
# Step helpers


def threshold_sample(sample: np.ndarray, ratio: float, max_value: float) -> np.ndarray:
    """Dynamic thresholding (Imagen): clip each item to its ``ratio`` quantile of |x|, rescale."""
    flat = sample.reshape(sample.shape[0], -1)
    s = np.quantile(np.abs(flat), ratio, axis=1).astype(flat.dtype)
    s = np.clip(s, 1, max_value)[:, None]
    return (np.clip(flat, -s, s) / s).reshape(sample.shape).astype(sample.dtype)


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

    Subclasses set ``DEFAULTS`` (the diffusers class's constructor defaults) and ``CLASS_NAME``.
    Loop, as in diffusers' StableDiffusionPipeline::

        latents *= s.init_noise_sigma
        for t in s.timesteps:
            eps = unet(s.scale_model_input(latents, t), t)
            latents = s.step(eps, t, latents, generator)
    """

    CLASS_NAME: ClassVar[str] = ""
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    order: int = 1
    init_noise_sigma: float = 1.0

    def __init__(self, config: Mapping[str, Any] | None = None, **overrides: Any) -> None:
        self.config = resolve_config(self.DEFAULTS, config, overrides)
        self.num_inference_steps: int | None = None
        self.timesteps = np.empty(0, dtype=np.int64)

    def set_timesteps(self, num_inference_steps: int) -> None:
        raise NotImplementedError

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

    def _require_timesteps(self) -> None:
        if self.num_inference_steps is None:
            raise RuntimeError(f"{self.CLASS_NAME}: call set_timesteps() before step()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_inference_steps={self.num_inference_steps})"
