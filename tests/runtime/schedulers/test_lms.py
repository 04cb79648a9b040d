"""LMSDiscreteScheduler port ("lms", order 4) against diffusers."""

import numpy as np
import pytest

from sdiree.runtime.schedulers import create


def test_schedule(sd_config, num_steps, make_pair, check_schedule):
    ours, ref = make_pair("lms", sd_config)
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    check_schedule(ours, ref)


def test_trajectory(sd_config, make_pair, check_trajectory):
    check_trajectory(*make_pair("lms", sd_config))


@pytest.mark.parametrize(
    "overrides",
    [
        {"use_karras_sigmas": True},
        {"use_karras_sigmas": True, "prediction_type": "v_prediction"},
        {"prediction_type": "sample"},
        {"beta_schedule": "squaredcos_cap_v2"},
    ],
    ids=["karras", "karras-vpred", "sample-prediction", "squaredcos"],
)
@pytest.mark.parametrize("num_steps", [4, 20, 25])
def test_extra_options(overrides, num_steps, sd15, make_pair, check_schedule, check_trajectory):
    config = {**sd15, **overrides}
    ours, ref = make_pair("lms", config)
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    # Karras timesteps can differ from diffusers' in the last float32 bit (torch's MKL sqrt).
    check_schedule(ours, ref, timestep_rtol=1e-6 if config.get("use_karras_sigmas") else 0.0)
    check_trajectory(ours, ref, num_steps)


@pytest.mark.parametrize("num_steps", [5, 20])
def test_coefficients_match_diffusers_quadrature(num_steps, sd15, make_pair):
    ours, ref = make_pair("lms", sd15)
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    for i in range(num_steps):
        order = min(i + 1, 4)
        for j in range(order):
            expected = ref.get_lms_coefficient(order, i, j)
            np.testing.assert_allclose(ours.lms_coefficient(order, i, j), expected, rtol=1e-5)


def test_bad_input(sd15):
    scheduler = create("lms", sd15)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(0)
    with pytest.raises(ValueError, match="use_beta_sigmas"):
        create("lms", {**sd15, "use_beta_sigmas": True})
