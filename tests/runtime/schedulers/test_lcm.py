"""LCMScheduler port ("lcm") against diffusers, with shared noise streams."""

import numpy as np
import pytest

from sdiree.runtime.schedulers import create

# SimianLuo/LCM_Dreamshaper_v7 scheduler/scheduler_config.json
LCM_DREAMSHAPER = {
    "_class_name": "LCMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "clip_sample_range": 1.0,
    "dynamic_thresholding_ratio": 0.995,
    "num_train_timesteps": 1000,
    "original_inference_steps": 50,
    "prediction_type": "epsilon",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "set_alpha_to_one": True,
    "steps_offset": 1,
    "thresholding": False,
    "timestep_scaling": 10.0,
    "timestep_spacing": "leading",
    "trained_betas": None,
}

EXTRA_CASES = {
    "lcm-dreamshaper": LCM_DREAMSHAPER,
    "original-steps-25": {**LCM_DREAMSHAPER, "original_inference_steps": 25},
    "timestep-scaling": {**LCM_DREAMSHAPER, "timestep_scaling": 5.0},
    "clip-sample": {**LCM_DREAMSHAPER, "clip_sample": True},
    "thresholding": {**LCM_DREAMSHAPER, "thresholding": True},
    "alpha-to-one-false": {**LCM_DREAMSHAPER, "set_alpha_to_one": False},
    "vpred-zero-snr": {
        **LCM_DREAMSHAPER,
        "prediction_type": "v_prediction",
        "rescale_betas_zero_snr": True,
    },
}


def test_schedule(sd_config, num_steps, make_pair, check_schedule):
    ours, ref = make_pair("lcm", sd_config)
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    check_schedule(ours, ref)


def test_trajectory(sd_config, make_pair, check_trajectory):
    check_trajectory(*make_pair("lcm", sd_config), seed=13)


@pytest.mark.parametrize("config", EXTRA_CASES.values(), ids=EXTRA_CASES.keys())
@pytest.mark.parametrize("num_steps", [1, 4, 8, 20])
def test_lcm_configs(config, num_steps, make_pair, check_schedule, check_trajectory):
    ours, ref = make_pair("lcm", config)
    check_trajectory(ours, ref, num_steps, seed=num_steps)
    check_schedule(ours, ref)


def test_noise_draws(sd15):
    class Counting:
        def __init__(self):
            self.calls = 0

        def randn(self, shape):
            self.calls += 1
            return np.zeros(shape, np.float32)

    scheduler = create("lcm", sd15)
    scheduler.set_timesteps(4)
    gen = Counting()
    x = np.ones((1, 4, 2, 2), np.float32)
    for t in scheduler.timesteps:
        x = scheduler.step(np.zeros_like(x), t, x, gen)
    assert gen.calls == 3  # none on the last step


def test_bad_input():
    scheduler = create("lcm", LCM_DREAMSHAPER)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(0)
    with pytest.raises(ValueError, match="original_inference_steps"):
        scheduler.set_timesteps(51)
