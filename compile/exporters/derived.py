"""Parameters an export computes from the model's weights (saved to their own archive, not in
the model's files): Winograd-transformed weights (winograd.py), channels-last filters (fhwc.py)
and Linear weights as panels (linear_panels.py)."""

from __future__ import annotations

import torch

from sdiree.runtime.weights.derived import FHWC_PARAM, PANELS_PARAM, base_key

from . import fhwc, linear_panels, winograd


def is_derived(name: str) -> bool:
    """A parameter computed at export: saved to its own archive."""
    return base_key(name) is not None


def derived_weight_maker(name: str, shape: tuple[int, ...], dtype: torch.dtype, source):
    """A function computing derived parameter name (of shape, in dtype) from the model's files."""
    if name.endswith("." + FHWC_PARAM):
        maker = fhwc
    elif name.endswith("." + PANELS_PARAM):
        maker = linear_panels
    else:
        maker = winograd
    return maker.derived_weight_maker(name, shape, dtype, source)
