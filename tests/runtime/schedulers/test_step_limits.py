"""Every scheduler at step counts from 1 to past num_train_timesteps, on SD 1.5's config, the
cosine schedule and a zero-SNR v-prediction config, against diffusers.

A count either runs and matches diffusers (started at the first timestep, as the pipeline
starts it), or is refused by set_timesteps with a ValueError where diffusers fails or returns
NaN; ``max_steps`` agrees with which.
"""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.runtime.schedulers import NAMES, create, max_steps

from .conftest import REFERENCE, SD15, TorchNoise, fake_unet, torch

SWEEP_CONFIGS = {
    "sd15": SD15,
    "cos": {**SD15, "beta_schedule": "squaredcos_cap_v2"},
    "zero-snr-vpred-trailing": {
        **SD15,
        "rescale_betas_zero_snr": True,
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
    },
}
SWEEP_STEPS = (1, 2, 25, 50, 999, 1000, 1001)
SHAPE = (1, 2, 2, 2)
SEED = 5


def run_ours(scheduler, num_steps: int) -> np.ndarray:
    scheduler.set_timesteps(num_steps)
    scheduler.set_begin_index(0)
    start = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    x = start * np.float32(scheduler.init_noise_sigma)
    generator = TorchNoise(SEED)
    for t in scheduler.timesteps:
        x = scheduler.step(fake_unet(scheduler.scale_model_input(x, t), t), t, x, generator)
    return x


def run_diffusers(name: str, config: dict, num_steps: int) -> np.ndarray:
    """diffusers' loop; raises where diffusers raises."""
    import diffusers

    class_name, overrides = REFERENCE[name]
    ref = getattr(diffusers, class_name).from_config(config, **overrides)
    ref.set_timesteps(num_steps)
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(0)
    start = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    x = torch.from_numpy(start) * ref.init_noise_sigma
    kwargs = {"generator": torch.Generator("cpu").manual_seed(SEED)}
    if name not in ("euler-a", "lcm"):
        kwargs = {}
    for t in ref.timesteps:
        eps = fake_unet(ref.scale_model_input(x, t).numpy(), float(t))
        x = ref.step(torch.from_numpy(eps), t, x, **kwargs).prev_sample
    return x.numpy()


@pytest.mark.parametrize("num_steps", SWEEP_STEPS)
@pytest.mark.parametrize("config_name", SWEEP_CONFIGS)
@pytest.mark.parametrize("name", NAMES)
def test_runs_like_diffusers_or_refuses_up_front(name, config_name, num_steps):
    config = SWEEP_CONFIGS[config_name]
    scheduler = create(name, config)
    try:
        scheduler.set_timesteps(num_steps)
    except ValueError as refusal:
        assert "\n" not in str(refusal)
        assert max_steps(name, config, upto=num_steps) < num_steps
        try:
            expected = run_diffusers(name, config, num_steps)
        except (ValueError, IndexError):
            return  # diffusers fails too
        assert not np.isfinite(expected).all(), f"diffusers runs where we refuse: {refusal}"
        return
    if num_steps <= 1000:
        assert max_steps(name, config, upto=num_steps) == num_steps
    ours = run_ours(scheduler, num_steps)
    assert np.isfinite(ours).all()
    expected = run_diffusers(name, config, num_steps)
    # Zero-SNR schedules start at sigma = 4096: float32 cancellation in diffusers' own result.
    rtol = 1e-3 if config.get("rescale_betas_zero_snr") else 1e-5
    np.testing.assert_allclose(ours, expected, rtol=rtol, atol=rtol * float(np.abs(expected).max()))


@pytest.mark.parametrize("config_name", ["cos", "zero-snr-vpred-trailing"])
def test_karras_schedule_with_a_repeated_first_timestep(config_name):
    """DPM++ 2M Karras rounds its first sigmas to the same timestep on these schedules; looked up
    by timestep, the run starts at the second one and runs off the end (IndexError in diffusers'
    own pipeline). Started at the first, it runs as diffusers does with set_begin_index(0)."""
    config = SWEEP_CONFIGS[config_name]
    scheduler = create("dpmpp-2m-karras", config)
    scheduler.set_timesteps(25)
    assert scheduler.timesteps[0] == scheduler.timesteps[1]
    x = run_ours(scheduler, 25)
    np.testing.assert_allclose(
        x, run_diffusers("dpmpp-2m-karras", config, 25), rtol=1e-3, atol=1e-5
    )


def test_max_steps_on_sd15():
    assert {name: max_steps(name, SD15) for name in NAMES} == {
        "euler": 1000,
        "euler-a": 1000,
        "ddim": 999,  # leading spacing + steps_offset 1: 1000 steps would reach t=1000
        "pndm": 999,
        "dpmpp-2m": 999,  # 1000 steps repeat a timestep
        "dpmpp-2m-karras": 1000,
        "lms": 1000,
        "lcm": 50,  # original_inference_steps
    }
    assert max_steps("lms", {**SD15, "timestep_spacing": "leading"}) == 999
    assert max_steps("euler", SD15, upto=7) == 7
