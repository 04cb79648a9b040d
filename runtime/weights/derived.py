"""Weights an export computes from a model weight, each a parameter of its own, and how the
runtime computes them again from replaced weights (`sdiree run --weights/--lora`):

- `<conv>.weight_winograd`: a 3x3 conv's Winograd-transformed weight (cpu; winograd.py);
- `<conv>.weight_fhwc`: a conv's filter channels-last, [O, kh, kw, C] (cuda's UNet, whose convs
  iree compiles channels-last: a filter stored so needs no transpose in the module, so IREE
  hoists none, and the unguided and guided functions share one copy on the device;
  compile/exporters/fhwc.py);
- `<linear>.weight_panels`: a Linear's [N, K] weight as N/16 panels of [K, 16] (cpu fp32 on
  CPUs without AVX-512, compile/exporters/linear_panels.py), read as it is by the module.
"""

from __future__ import annotations

import numpy as np

from .winograd import WINOGRAD_PARAM, winograd_weight

FHWC_PARAM = "weight_fhwc"
PANELS_PARAM = "weight_panels"
PANEL_WIDTH = 16  # output features a panel holds: the f32 register tile's N on AVX2
DERIVED_PARAMS = (WINOGRAD_PARAM, FHWC_PARAM, PANELS_PARAM)


def base_key(derived_key: str) -> str | None:
    """`<m>.weight` for `<m>.weight_winograd`, `<m>.weight_fhwc` or `<m>.weight_panels`; None
    for any other key."""
    for param in DERIVED_PARAMS:
        if derived_key.endswith("." + param):
            return derived_key[: -len(param)] + "weight"
    return None


def fhwc_weight(weight: np.ndarray) -> np.ndarray:
    """A [O, C, kh, kw] conv filter as [O, kh, kw, C]."""
    if weight.ndim != 4:
        raise ValueError(f"a conv filter is 4-D, not {weight.shape}")
    return np.ascontiguousarray(weight.transpose(0, 2, 3, 1))


def panels_weight(weight: np.ndarray) -> np.ndarray:
    """A Linear's [N, K] weight as [N / 16, K, 16]: panel j holds output features 16j..16j+15,
    each row k of it the 16 weights that input feature k contributes to them."""
    if weight.ndim != 2 or weight.shape[0] % PANEL_WIDTH:
        raise ValueError(
            f"panels need a 2-D weight of a multiple of {PANEL_WIDTH} rows, not {weight.shape}"
        )
    n, k = weight.shape
    return np.ascontiguousarray(weight.reshape(n // PANEL_WIDTH, PANEL_WIDTH, k).transpose(0, 2, 1))


def unpanel(panels: np.ndarray) -> np.ndarray:
    """The [N, K] weight panels_weight made panels from."""
    j, k, p = panels.shape
    return np.ascontiguousarray(panels.transpose(0, 2, 1).reshape(j * p, k))


def derived_weight(key: str, weight: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The derived parameter key (of shape) from its base weight."""
    if key.endswith("." + FHWC_PARAM):
        return fhwc_weight(weight)
    if key.endswith("." + WINOGRAD_PARAM):
        return winograd_weight(weight, shape[0])
    if key.endswith("." + PANELS_PARAM):
        return panels_weight(weight)
    raise ValueError(f"{key} is no derived weight")
