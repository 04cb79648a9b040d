"""DDIMScheduler port ("ddim") against diffusers."""

import numpy as np
import pytest

from sdiree.runtime.schedulers import create

EXTRA_CASES = {
    "clip-sample": {"clip_sample": True, "clip_sample_range": 0.8},
    "thresholding": {"thresholding": True, "sample_max_value": 1.5},
    "alpha-to-one": {"set_alpha_to_one": True},
    "sample-prediction": {"prediction_type": "sample"},
    "squaredcos": {"beta_schedule": "squaredcos_cap_v2"},
    "zero-snr-trailing-vpred": {
        "rescale_betas_zero_snr": True,
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
    },
}


def test_schedule(sd_config, num_steps, make_pair, check_schedule):
    ours, ref = make_pair("ddim", sd_config)
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    check_schedule(ours, ref)


def test_trajectory(sd_config, make_pair, check_trajectory):
    check_trajectory(*make_pair("ddim", sd_config))


@pytest.mark.parametrize("overrides", EXTRA_CASES.values(), ids=EXTRA_CASES.keys())
def test_extra_options(overrides, sd15, make_pair, check_schedule, check_trajectory):
    ours, ref = make_pair("ddim", {**sd15, **overrides})
    check_trajectory(ours, ref)
    check_schedule(ours, ref)


@pytest.mark.parametrize("num_steps", [4, 25])
def test_eta_draws_noise_like_diffusers(num_steps, sd15, make_pair, check_trajectory):
    check_trajectory(
        *make_pair("ddim", sd15),
        num_steps,
        seed=21,
        ours_kwargs={"eta": 0.6},
        ref_kwargs={"eta": 0.6},
    )


def test_eta_zero_draws_no_noise(sd15):
    class Refusing:
        def randn(self, shape):
            raise AssertionError("no noise expected with eta=0")

    scheduler = create("ddim", sd15)
    scheduler.set_timesteps(4)
    x = np.ones((1, 4, 2, 2), np.float32)
    for t in scheduler.timesteps:
        x = scheduler.step(np.zeros_like(x), t, x, Refusing())


def test_bad_input(sd15):
    scheduler = create("ddim", sd15)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(0)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(1001)
    with pytest.raises(RuntimeError):
        scheduler.step(np.zeros(1, np.float32), 1, np.zeros(1, np.float32))
