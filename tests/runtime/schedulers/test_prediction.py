"""runtime/schedulers/prediction.py: x0 and eps recovered from each kind of model output under
both parameterisations, and x0's clipping and dynamic thresholding against diffusers'."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdiree.runtime.schedulers import prediction as pr

RNG = np.random.default_rng(7)
X0 = RNG.standard_normal((2, 4, 8, 8)).astype(np.float64)
EPS = RNG.standard_normal((2, 4, 8, 8)).astype(np.float64)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("a", [0.9991, 0.5, 0.0047])
def test_alpha_parameterisation_recovers_x0_and_eps(kind, a):
    x_t = math.sqrt(a) * X0 + math.sqrt(1 - a) * EPS
    output = {
        "epsilon": EPS,
        "sample": X0,
        "v_prediction": math.sqrt(a) * EPS - math.sqrt(1 - a) * X0,
    }[kind]
    np.testing.assert_allclose(pr.alpha_x0(kind, output, x_t, a), X0, atol=1e-9 / math.sqrt(a))
    np.testing.assert_allclose(
        pr.alpha_eps(kind, output, x_t, a), EPS, atol=1e-9 / math.sqrt(1 - a)
    )


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("sigma", [0.03, 1.0, 14.6])
def test_sigma_parameterisation_recovers_x0(kind, sigma):
    x = X0 + sigma * EPS
    # v as the model gives it for its input x / sqrt(sigma^2 + 1), i.e. alpha = 1 / (sigma^2 + 1)
    a = 1 / (sigma * sigma + 1)
    output = {
        "epsilon": EPS,
        "sample": X0,
        "v_prediction": math.sqrt(a) * EPS - math.sqrt(1 - a) * X0,
    }[kind]
    np.testing.assert_allclose(pr.sigma_x0(kind, output, x, sigma), X0, atol=1e-9)


def test_clip_x0_clips_or_thresholds_only_when_asked():
    x0 = (X0 * 3).astype(np.float32)
    assert pr.clip_x0({}, x0) is x0
    clipped = pr.clip_x0({"clip_sample": True, "clip_sample_range": 1.5}, x0)
    assert clipped.max() == np.float32(1.5) and clipped.min() == np.float32(-1.5)
    cfg = {"thresholding": True, "dynamic_thresholding_ratio": 0.9, "sample_max_value": 2.0}
    thresholded = pr.clip_x0({**cfg, "clip_sample": True, "clip_sample_range": 0.1}, x0)
    assert np.abs(thresholded).max() <= 1.0 and np.abs(thresholded).max() > 0.1


def test_threshold_sample_matches_diffusers():
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.DDPMScheduler(
        thresholding=True, dynamic_thresholding_ratio=0.9, sample_max_value=2.5
    )
    x0 = (X0 * np.array([1.0, 4.0])[:, None, None, None]).astype(np.float32)
    want = ref._threshold_sample(torch.from_numpy(x0.copy())).numpy()
    got = pr.threshold_sample(x0, 0.9, 2.5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
