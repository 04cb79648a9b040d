"""runtime/weights/winograd.py: the numpy transform equals the cpu export's (torch, float64)."""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.runtime.weights.derived import base_key
from sdiree.runtime.weights.winograd import WINOGRAD, winograd_weight

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("m", sorted(WINOGRAD))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_same_as_the_export(m, dtype):
    from sdiree.compile.exporters.winograd import winograd_weight as export_transform

    w = np.random.default_rng(m).standard_normal((24, 16, 3, 3)).astype(dtype)
    ours = winograd_weight(w, (m + 2) ** 2)
    ref = export_transform(torch.from_numpy(w).double(), m).to(torch.from_numpy(w).dtype).numpy()
    assert ours.shape == ref.shape == ((m + 2) ** 2, 16, 24) and ours.dtype == dtype
    # float64 sums in another order: at most one unit in the last place of the result dtype
    np.testing.assert_allclose(ours, ref, rtol=float(np.finfo(dtype).eps), atol=0)


def test_refuses_what_it_cannot_transform():
    with pytest.raises(ValueError):
        winograd_weight(np.zeros((4, 4, 3, 3), np.float32), 25)  # m = 3: no such table
    with pytest.raises(ValueError):
        winograd_weight(np.zeros((4, 4, 1, 1), np.float32), 16)


def test_base_key():
    assert base_key("down_blocks.0.resnets.0.conv1.weight_winograd") == (
        "down_blocks.0.resnets.0.conv1.weight"
    )
    assert base_key("conv_in.weight") is None
