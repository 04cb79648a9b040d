"""Noise schedules and timestep spacing for the numpy schedulers: betas (linear, scaled-linear,
cosine, trained), ``alphas_cumprod`` (zero-terminal-SNR rescaling included), training sigmas,
"linspace"/"leading"/"trailing" inference timesteps, Karras sigmas and sigma-to-timestep.

The numerics follow torch's CPU kernels as diffusers uses them, so schedules agree with
diffusers' to float32 rounding: betas are float32 (torch's linspace replayed bit for bit),
``alphas_cumprod`` is accumulated in float64 and stored as float32 (torch's CPU cumprod
accumulates float32 in double), and training sigmas are derived from that float32 array.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# Constructor defaults every diffusers scheduler here shares (the training noise schedule).
BETA_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
}


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


def make_alphas_cumprod(config: Mapping[str, Any], *, finite_sigmas: bool = False) -> np.ndarray:
    """float32 ``alphas_cumprod`` of a config's betas, rescaled when ``rescale_betas_zero_snr`` is on.

    With ``finite_sigmas`` (samplers working in sigma space) the zero-SNR last entry, which would
    give an infinite sigma, is pinned to a tiny alpha instead, as diffusers does.
    """
    betas = make_betas(config)
    zero_snr = bool(config.get("rescale_betas_zero_snr"))
    if zero_snr:
        betas = rescale_zero_terminal_snr(betas)
    alphas_cumprod = cumprod_alphas(betas)
    if zero_snr and finite_sigmas:
        alphas_cumprod[-1] = 2.0**-24
    return alphas_cumprod


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


def final_sigma(config: Mapping[str, Any], train_sigmas: np.ndarray) -> float:
    """Sigma appended after the last step: 0, or the smallest training sigma for
    ``final_sigmas_type="sigma_min"`` (a config without that key gets 0)."""
    return float(train_sigmas[0]) if config.get("final_sigmas_type") == "sigma_min" else 0.0
