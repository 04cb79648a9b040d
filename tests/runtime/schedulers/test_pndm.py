"""PNDMScheduler port ("pndm", PLMS) against diffusers: skip_prk_steps (SD 1.5) and the PRK path."""

import pytest

from sdiree.runtime.schedulers import create


def test_schedule(sd_config, num_steps, make_pair, check_schedule):
    ours, ref = make_pair("pndm", sd_config)
    if not ours.config["skip_prk_steps"] and num_steps < 4:
        # Three Runge-Kutta warm-up steps need four grid points; diffusers fails here too.
        with pytest.raises(ValueError, match="skip_prk_steps"):
            ours.set_timesteps(num_steps)
        return
    ours.set_timesteps(num_steps)
    ref.set_timesteps(num_steps)
    check_schedule(ours, ref)


def test_trajectory(sd_config, make_pair, check_trajectory):
    check_trajectory(*make_pair("pndm", sd_config))


@pytest.mark.parametrize("skip_prk_steps", [True, False])
@pytest.mark.parametrize("num_steps", [4, 5, 25])
def test_warmup_variants(skip_prk_steps, num_steps, sd15, make_pair, check_trajectory):
    ours, ref = make_pair("pndm", {**sd15, "skip_prk_steps": skip_prk_steps})
    check_trajectory(ours, ref, num_steps)
    # Model calls: n + 1 with the Heun-like warm-up, 12 + (n - 3) with Runge-Kutta.
    assert len(ours.timesteps) == (num_steps + 1 if skip_prk_steps else num_steps + 9)


def test_single_step(sd15, make_pair, check_trajectory):
    check_trajectory(*make_pair("pndm", sd15), 1)


def test_set_timesteps_resets_history(sd15, make_pair, check_trajectory):
    ours, ref = make_pair("pndm", sd15)
    check_trajectory(ours, ref, 6)
    check_trajectory(ours, ref, 20)  # second run on the same objects


def test_bad_input(sd15):
    scheduler = create("pndm", sd15)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(0)
    with pytest.raises(ValueError, match="prediction_type"):
        create("pndm", {**sd15, "prediction_type": "sample"})
