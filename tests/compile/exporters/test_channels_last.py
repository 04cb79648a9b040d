"""The channels-last building blocks (compile/exporters/channels_last.py) against diffusers'
NCHW modules in float64."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.channels_last import group_norm  # noqa: E402


@pytest.mark.parametrize("offset", [0.0, 300.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_norm_matches_float64_with_one_pass_sums(offset, dtype):
    """Its one pass of sums about each group's first-pixel mean keeps float32's precision where
    a group's mean is far from zero (an E[x^2] - E[x]^2 about zero would lose it), and a
    half-precision input is normalized in float32."""
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(4, 32).eval()
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    # per-channel means far apart within a group, and a spread that differs per group
    x = torch.randn(2, 6, 5, 32) * torch.linspace(0.5, 3, 32) + offset + torch.arange(32.0)
    with torch.no_grad():
        x = x.to(dtype)  # the reference on the same (rounded) input
        want = norm.double()(x.double().permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
        norm.float()
        got = group_norm(norm, x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert np.abs(got.double().numpy() - want).max() / np.abs(want).max() < tol
