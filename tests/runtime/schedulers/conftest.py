"""Shared fixtures for the numpy scheduler tests: reference configs, a fake UNet, torch-backed
noise, and the side-by-side comparison against diffusers.

Any test asking for ``sd_config`` runs over CONFIG_CASES, any asking for ``num_steps`` over
STEP_COUNTS (see pytest_generate_tests).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from make_tiny_sd import SD15_SCHEDULER_CONFIG  # noqa: E402  (tools/ is on sys.path)

from sdiree.runtime.schedulers import Scheduler, create  # noqa: E402

# runwayml/stable-diffusion-v1-5 scheduler/scheduler_config.json (as the tiny model writes it)
SD15 = {"_class_name": "PNDMScheduler", **SD15_SCHEDULER_CONFIG}

# stabilityai/stable-diffusion-2-1 (768, v-prediction) scheduler/scheduler_config.json
SD2 = {
    "_class_name": "DDIMScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}

CONFIG_CASES: dict[str, dict[str, Any]] = {
    "sd15": SD15,
    "sd15-leading": {**SD15, "timestep_spacing": "leading"},
    "sd15-linspace": {**SD15, "timestep_spacing": "linspace"},
    "sd15-trailing": {**SD15, "timestep_spacing": "trailing"},
    "sd15-vpred": {**SD15, "prediction_type": "v_prediction"},
    "sd15-linear": {**SD15, "beta_schedule": "linear"},
    "sd2-vpred": SD2,
    "class-defaults": {},
}

STEP_COUNTS = (1, 4, 20, 25)
TRAJECTORY_STEPS = 20
LATENT_SHAPE = (2, 4, 8, 8)

# name -> (diffusers class name, from_config overrides that give the same sampler)
_DPMPP = {"algorithm_type": "dpmsolver++", "solver_order": 2, "solver_type": "midpoint"}
REFERENCE: dict[str, tuple[str, dict[str, Any]]] = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "dpmpp-2m": ("DPMSolverMultistepScheduler", {**_DPMPP, "use_karras_sigmas": False}),
    "dpmpp-2m-karras": ("DPMSolverMultistepScheduler", {**_DPMPP, "use_karras_sigmas": True}),
    "lms": ("LMSDiscreteScheduler", {}),
    "lcm": ("LCMScheduler", {}),
}


def _explicitly_parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # diffusers' schedulers call np.array() on torch tensors, which numpy 2 warns about.
    here = Path(__file__).parent
    quiet = pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    )
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(quiet)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sd_config" in metafunc.fixturenames and not _explicitly_parametrized(metafunc, "sd_config"):
        metafunc.parametrize("sd_config", list(CONFIG_CASES.values()), ids=list(CONFIG_CASES))
    if "num_steps" in metafunc.fixturenames and not _explicitly_parametrized(metafunc, "num_steps"):
        metafunc.parametrize("num_steps", STEP_COUNTS)


def fake_unet(x: np.ndarray, t: Any) -> np.ndarray:
    """Deterministic stand-in for the UNet, evaluated in float32 numpy for both sides."""
    scale = np.float32(0.01 * float(t) / 1000)
    return (np.float32(0.5) * np.tanh(x) + scale * x).astype(np.float32)


class TorchNoise:
    """Our generator protocol backed by torch's CPU generator, so streams match diffusers'."""

    def __init__(self, seed: int) -> None:
        self._gen = torch.Generator("cpu").manual_seed(seed)

    def randn(self, shape: tuple[int, ...]) -> np.ndarray:
        return torch.randn(shape, generator=self._gen).numpy()


def _make_pair(name: str, config: dict[str, Any]) -> tuple[Scheduler, Any]:
    class_name, overrides = REFERENCE[name]
    ref = getattr(diffusers, class_name).from_config(config, **overrides)
    return create(name, config), ref


def _check_schedule(
    ours: Scheduler, ref: Any, *, timestep_rtol: float = 0.0, sigma_rtol: float = 1e-6
) -> None:
    """Same timesteps (and dtype), sigmas, init_noise_sigma and order; call after set_timesteps."""
    if ours.config.get("rescale_betas_zero_snr"):
        # The rescale goes sqrt -> subtract -> square -> ratio in float32; torch's (MKL) sqrt
        # rounds differently from numpy's in the last bit and the cancellation amplifies that
        # to ~1e-6 in the sigmas.
        sigma_rtol = max(sigma_rtol, 1e-5)
    ref_t = ref.timesteps.numpy()
    assert ours.timesteps.dtype == ref_t.dtype
    if timestep_rtol:
        np.testing.assert_allclose(ours.timesteps, ref_t, rtol=timestep_rtol)
    else:
        np.testing.assert_array_equal(ours.timesteps, ref_t)
    if hasattr(ref, "sigmas"):
        np.testing.assert_allclose(ours.sigmas, ref.sigmas.numpy(), rtol=sigma_rtol, atol=0)
    np.testing.assert_allclose(ours.init_noise_sigma, float(ref.init_noise_sigma), rtol=sigma_rtol)
    assert ours.order == ref.order


def _check_trajectory(
    ours: Scheduler,
    ref: Any,
    num_steps: int = TRAJECTORY_STEPS,
    *,
    seed: int | None = None,
    ours_kwargs: dict[str, Any] | None = None,
    ref_kwargs: dict[str, Any] | None = None,
    rtol: float = 1e-5,
) -> None:
    """Run the pipeline loop on both from the same latents; compare after every step."""
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    assert len(ours.timesteps) == len(ref.timesteps)
    generator = TorchNoise(seed) if seed is not None else None
    ref_kwargs = dict(ref_kwargs or {})
    if seed is not None:
        ref_kwargs["generator"] = torch.Generator("cpu").manual_seed(seed)

    start = np.random.default_rng(1234).standard_normal(LATENT_SHAPE, dtype=np.float32)
    latents = start * np.float32(ours.init_noise_sigma)
    ref_latents = torch.from_numpy(start) * ref.init_noise_sigma
    for k, (t, ref_t) in enumerate(zip(ours.timesteps, ref.timesteps, strict=True)):
        eps = fake_unet(ours.scale_model_input(latents, t), t)
        latents = ours.step(eps, t, latents, generator, **(ours_kwargs or {}))

        ref_in = ref.scale_model_input(ref_latents, ref_t)
        ref_eps = torch.from_numpy(fake_unet(ref_in.numpy(), float(ref_t)))
        ref_latents = ref.step(ref_eps, ref_t, ref_latents, **ref_kwargs).prev_sample

        expected = ref_latents.numpy()
        assert latents.dtype == np.float32
        assert latents.shape == expected.shape
        np.testing.assert_allclose(
            latents,
            expected,
            rtol=rtol,
            atol=rtol * float(np.abs(expected).max()),
            err_msg=f"step {k} (t={t})",
        )


@pytest.fixture
def sd15() -> dict[str, Any]:
    """A fresh copy of the SD 1.5 scheduler config, to derive per-test variants from."""
    return dict(SD15)


@pytest.fixture
def make_pair() -> Callable[[str, dict[str, Any]], tuple[Scheduler, Any]]:
    """(ours, diffusers reference) for a registry name and a scheduler_config dict."""
    return _make_pair


@pytest.fixture
def check_schedule() -> Callable[..., None]:
    return _check_schedule


@pytest.fixture
def check_trajectory() -> Callable[..., None]:
    return _check_trajectory
