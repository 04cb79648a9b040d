"""DPMSolverMultistepScheduler port ("dpmpp-2m", "dpmpp-2m-karras") against diffusers."""

import pytest

from sdiree.runtime.schedulers import create

NAMES = ["dpmpp-2m", "dpmpp-2m-karras"]

EXTRA_CASES = {
    "euler-at-final": {"euler_at_final": True},
    "no-lower-order-final": {"lower_order_final": False},
    "final-sigma-min": {"final_sigmas_type": "sigma_min"},
    "final-sigma-min-no-lower-order": {
        "final_sigmas_type": "sigma_min",
        "lower_order_final": False,
    },
    "lambda-min-clipped": {"lambda_min_clipped": -3.0},
    "thresholding": {"thresholding": True, "sample_max_value": 1.5},
    "sample-prediction": {"prediction_type": "sample"},
    "zero-snr-trailing-vpred": {
        "rescale_betas_zero_snr": True,
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
    },
    # Another DPM config loaded as DPM++ 2M: the name's algorithm wins, as in the reference.
    "sde-config": {"algorithm_type": "sde-dpmsolver++", "solver_order": 3},
}


@pytest.mark.parametrize("name", NAMES)
def test_schedule(name, sd_config, num_steps, make_pair, check_schedule):
    ours, ref = make_pair(name, sd_config)
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    check_schedule(ours, ref)


@pytest.mark.parametrize("name", NAMES)
def test_trajectory(name, sd_config, make_pair, check_trajectory):
    check_trajectory(*make_pair(name, sd_config))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("overrides", EXTRA_CASES.values(), ids=EXTRA_CASES.keys())
@pytest.mark.parametrize("num_steps", [4, 20])
def test_extra_options(
    name, overrides, num_steps, sd15, make_pair, check_schedule, check_trajectory
):
    ours, ref = make_pair(name, {**sd15, **overrides})
    # The first step of a zero-SNR schedule starts at sigma = 4096 (float32 cancellation).
    rtol = 1e-3 if overrides.get("rescale_betas_zero_snr") else 1e-5
    check_trajectory(ours, ref, num_steps, rtol=rtol)
    check_schedule(ours, ref)


@pytest.mark.parametrize("num_steps", [4, 20])
def test_squaredcos(num_steps, sd15, make_pair, check_schedule, check_trajectory):
    # Only without Karras: there diffusers truncates (not rounds) the fractional timesteps, the
    # first one repeats, and its own step index runs past the end.
    ours, ref = make_pair("dpmpp-2m", {**sd15, "beta_schedule": "squaredcos_cap_v2"})
    check_trajectory(ours, ref, num_steps)
    check_schedule(ours, ref)


@pytest.mark.parametrize("num_steps", [1, 25])
def test_other_lengths(num_steps, sd15, make_pair, check_trajectory):
    for name in NAMES:
        check_trajectory(*make_pair(name, sd15), num_steps)


def test_name_sets_karras(sd15):
    assert (
        create("dpmpp-2m", {**sd15, "use_karras_sigmas": True}).config["use_karras_sigmas"] is False
    )
    assert create("dpmpp-2m-karras", sd15).config["use_karras_sigmas"] is True


def test_bad_input(sd15):
    scheduler = create("dpmpp-2m", sd15)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(0)
    for option in ("use_lu_lambdas", "use_exponential_sigmas", "use_flow_sigmas"):
        with pytest.raises(ValueError, match=option):
            create("dpmpp-2m", {**sd15, option: True})
