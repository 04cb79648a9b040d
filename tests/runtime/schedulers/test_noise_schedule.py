"""runtime/schedulers/noise_schedule.py against diffusers' own schedules: betas and
alphas_cumprod bit for bit, spaced timesteps, Karras sigmas and sigma-to-timestep."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from sdiree.runtime.schedulers import noise_schedule as ns  # noqa: E402

BETAS = {
    "linear": {"beta_schedule": "linear"},
    "scaled_linear": {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},
    "cosine": {"beta_schedule": "squaredcos_cap_v2"},
    "zero_snr": {
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "rescale_betas_zero_snr": True,
    },
}


def _config(**kw) -> dict:
    return {**ns.BETA_DEFAULTS, **kw}


@pytest.mark.parametrize("case", sorted(BETAS))
def test_alphas_cumprod_match_diffusers(case):
    """Bit for bit, but for the zero-SNR rescaling: torch's float32 arithmetic is not replayed,
    and what torch runs differs per CPU: on the Xeons and the AVX2 Zen its schedule was within
    an ulp of ours, on a Zen 5 (AVX-512, no AMX) up to 3.8e-6 relative; both are 3.8e-5 from
    the float64 schedule, float32's own error through 1,000 products."""
    ref = diffusers.DDIMScheduler(**BETAS[case])
    ours = ns.make_alphas_cumprod(_config(**BETAS[case]))
    assert ours.dtype == np.float32
    if case == "zero_snr":
        np.testing.assert_allclose(ours, ref.alphas_cumprod.numpy(), rtol=1e-5, atol=0)
        return
    np.testing.assert_array_equal(ours, ref.alphas_cumprod.numpy())
    np.testing.assert_array_equal(ns.make_betas(_config(**BETAS[case])), ref.betas.numpy())


def test_trained_betas_are_taken_as_given():
    given = np.linspace(1e-4, 2e-2, 10)
    betas = ns.make_betas(_config(num_train_timesteps=10, trained_betas=given.tolist()))
    np.testing.assert_array_equal(betas, given.astype(np.float32))


def test_unknown_beta_schedule_names_the_choices():
    with pytest.raises(ValueError, match="'linear', 'scaled_linear', 'squaredcos_cap_v2'"):
        ns.make_betas(_config(beta_schedule="sigmoid"))


def test_zero_snr_in_sigma_space_stays_finite():
    cfg = _config(**BETAS["zero_snr"])
    assert ns.make_alphas_cumprod(cfg)[-1] == 0.0
    pinned = ns.make_alphas_cumprod(cfg, finite_sigmas=True)
    assert pinned[-1] == np.float32(2.0**-24)
    assert np.isfinite(ns.train_sigmas(pinned)).all()


@pytest.mark.parametrize("spacing", ns.TIMESTEP_SPACINGS)
@pytest.mark.parametrize("steps", [1, 7, 20, 50])
def test_spaced_timesteps_match_diffusers_euler(spacing, steps):
    ref = diffusers.EulerDiscreteScheduler(timestep_spacing=spacing, steps_offset=1)
    ref.set_timesteps(steps)
    ours = ns.spaced_timesteps(spacing, 1000, steps, steps_offset=1)
    np.testing.assert_allclose(ours.astype(np.float32), ref.timesteps.numpy(), rtol=0, atol=1e-3)


def test_unknown_spacing_is_refused():
    with pytest.raises(ValueError, match="timestep_spacing 'even'"):
        ns.spaced_timesteps("even", 1000, 10)


@pytest.mark.parametrize("steps", [2, 10, 30])
def test_karras_sigmas_and_their_timesteps_match_diffusers(steps):
    beta = BETAS["scaled_linear"]
    ref = diffusers.EulerDiscreteScheduler(**beta, use_karras_sigmas=True)
    ref.set_timesteps(steps)
    train = ns.train_sigmas(ns.make_alphas_cumprod(_config(**beta)))
    sigmas = ns.karras_sigmas(float(train[0]), float(train[-1]), steps)
    np.testing.assert_allclose(sigmas, ref.sigmas.numpy()[:-1], rtol=1e-5)
    t = ns.sigma_to_t(sigmas, np.log(train))
    np.testing.assert_allclose(t, ref.timesteps.numpy(), rtol=0, atol=2e-3)


def test_sigma_to_t_inverts_the_training_sigmas_and_clamps_outside_them():
    train = ns.train_sigmas(ns.make_alphas_cumprod(_config()))
    logs = np.log(train)
    np.testing.assert_allclose(ns.sigma_to_t(train, logs), np.arange(len(train)), atol=1e-5)
    assert ns.sigma_to_t(np.array([train[-1] * 10]), logs)[0] == len(train) - 1
    assert ns.sigma_to_t(np.array([0.0]), logs)[0] == 0


def test_final_sigma():
    train = np.array([0.03, 1.0, 14.6], dtype=np.float32)
    assert ns.final_sigma({}, train) == 0.0
    assert ns.final_sigma({"final_sigmas_type": "zero"}, train) == 0.0
    assert ns.final_sigma({"final_sigmas_type": "sigma_min"}, train) == pytest.approx(0.03)
