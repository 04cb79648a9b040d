"""Pieces shared by the numpy schedulers: config resolution, noise schedules, timestep spacing,
x0 prediction, and the base classes (``Scheduler``, ``SigmaScheduler``, ``AlphaScheduler``).

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


# Constructor defaults every diffusers scheduler here shares (the training noise schedule).
BETA_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
}


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


# ---------------------------------------------------------------------------------------------
# Step helpers


def threshold_sample(sample: np.ndarray, ratio: float, max_value: float) -> np.ndarray:
    """Dynamic thresholding (Imagen): clip each item to its ``ratio`` quantile of |x|, rescale."""
    flat = sample.reshape(sample.shape[0], -1)
    s = np.quantile(np.abs(flat), ratio, axis=1).astype(flat.dtype)
    s = np.clip(s, 1, max_value)[:, None]
    return (np.clip(flat, -s, s) / s).reshape(sample.shape).astype(sample.dtype)


def clip_x0(config: Mapping[str, Any], x0: np.ndarray) -> np.ndarray:
    """Dynamic thresholding if ``thresholding`` is on, else clipping if ``clip_sample`` is on."""
    if config.get("thresholding"):
        return threshold_sample(
            x0, config["dynamic_thresholding_ratio"], config["sample_max_value"]
        )
    if config.get("clip_sample"):
        limit = config["clip_sample_range"]
        return np.clip(x0, -limit, limit)
    return x0


def sigma_x0(
    prediction_type: str, model_output: np.ndarray, sample: np.ndarray, sigma: float
) -> np.ndarray:
    """x0 from the model output for a sample x = x0 + sigma * eps (k-diffusion parameterisation).

    The model saw x / sqrt(sigma^2 + 1); "sample"/"original_sample" outputs are x0 already.
    """
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / math.sqrt(sigma * sigma + 1.0)) + sample / (
            sigma * sigma + 1.0
        )
    return model_output


def alpha_x0(
    prediction_type: str, model_output: np.ndarray, sample: np.ndarray, alpha_prod: float
) -> np.ndarray:
    """x0 from the model output for x_t = sqrt(a) x0 + sqrt(1 - a) eps, a = alphas_cumprod[t]."""
    if prediction_type == "epsilon":
        return (sample - math.sqrt(1.0 - alpha_prod) * model_output) / math.sqrt(alpha_prod)
    if prediction_type == "sample":
        return model_output
    # v_prediction
    return math.sqrt(alpha_prod) * sample - math.sqrt(1.0 - alpha_prod) * model_output


def alpha_eps(
    prediction_type: str, model_output: np.ndarray, sample: np.ndarray, alpha_prod: float
) -> np.ndarray:
    """eps from the model output for x_t = sqrt(a) x0 + sqrt(1 - a) eps, a = alphas_cumprod[t]."""
    if prediction_type == "epsilon":
        return model_output
    if prediction_type == "sample":
        return (sample - math.sqrt(alpha_prod) * model_output) / math.sqrt(1.0 - alpha_prod)
    # v_prediction
    return math.sqrt(alpha_prod) * model_output + math.sqrt(1.0 - alpha_prod) * sample


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
