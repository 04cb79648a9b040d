"""Weights an export computes from a model weight, each a parameter of its own, and how the
runtime computes them again from replaced weights (`sdiree run --weights/--lora`):

- `<conv>.weight_winograd`: a 3x3 conv's Winograd-transformed weight (cpu; winograd.py);
- `<conv>.weight_fhwc`: a conv's filter channels-last, [O, kh, kw, C] (cuda's UNet, whose convs
  iree compiles channels-last: a filter stored so needs no transpose in the module, so IREE
  hoists none, and the unguided and guided functions share one copy on the device;
  compile/exporters/fhwc.py).
"""

from __future__ import annotations

import numpy as np

from .winograd import WINOGRAD_PARAM, winograd_weight

FHWC_PARAM = "weight_fhwc"
DERIVED_PARAMS = (WINOGRAD_PARAM, FHWC_PARAM)


def base_key(derived_key: str) -> str | None:
    """`<conv>.weight` for `<conv>.weight_winograd` or `<conv>.weight_fhwc`; None for any other
    key."""
    for param in DERIVED_PARAMS:
        if derived_key.endswith("." + param):
            return derived_key[: -len(param)] + "weight"
    return None


def fhwc_weight(weight: np.ndarray) -> np.ndarray:
    """A [O, C, kh, kw] conv filter as [O, kh, kw, C]."""
    if weight.ndim != 4:
        raise ValueError(f"a conv filter is 4-D, not {weight.shape}")
    return np.ascontiguousarray(weight.transpose(0, 2, 3, 1))


def derived_weight(key: str, weight: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The derived parameter key (of shape) from its base weight."""
    if key.endswith("." + FHWC_PARAM):
        return fhwc_weight(weight)
    if key.endswith("." + WINOGRAD_PARAM):
        return winograd_weight(weight, shape[0])
    raise ValueError(f"{key} is no derived weight")
