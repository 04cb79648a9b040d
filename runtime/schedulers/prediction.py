"""What a scheduler step computes from the model's output: x0 (or eps) under the sigma
(k-diffusion) and alpha (DDPM) parameterisations for "epsilon", "v_prediction" and "sample"
outputs, and x0's clipping or dynamic thresholding (Imagen)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def threshold_sample(sample: np.ndarray, ratio: float, max_value: float) -> np.ndarray:
    """Dynamic thresholding (Imagen): clip each item to its ``ratio`` quantile of |x|, rescale."""
    flat = sample.reshape(sample.shape[0], -1)
    s = np.quantile(np.abs(flat), ratio, axis=1).astype(flat.dtype)
    s = np.clip(s, 1, max_value)[:, None]
    return (np.clip(flat, -s, s) / s).reshape(sample.shape).astype(sample.dtype)


def clip_x0(config: Mapping[str, Any], x0: np.ndarray) -> np.ndarray:
    """Dynamic thresholding if ``thresholding`` is on, else clipping if ``clip_sample`` is on."""
    if config.get("thresholding"):
        return threshold_sample(
            x0, config["dynamic_thresholding_ratio"], config["sample_max_value"]
        )
    if config.get("clip_sample"):
        limit = config["clip_sample_range"]
        return np.clip(x0, -limit, limit)
    return x0


def sigma_x0(
    prediction_type: str, model_output: np.ndarray, sample: np.ndarray, sigma: float
) -> np.ndarray:
    """x0 from the model output for a sample x = x0 + sigma * eps (k-diffusion parameterisation).

    The model saw x / sqrt(sigma^2 + 1); "sample"/"original_sample" outputs are x0 already.
    """
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / math.sqrt(sigma * sigma + 1.0)) + sample / (
            sigma * sigma + 1.0
        )
    return model_output


def alpha_x0(
    prediction_type: str, model_output: np.ndarray, sample: np.ndarray, alpha_prod: float
) -> np.ndarray:
    """x0 from the model output for x_t = sqrt(a) x0 + sqrt(1 - a) eps, a = alphas_cumprod[t]."""
    if prediction_type == "epsilon":
        return (sample - math.sqrt(1.0 - alpha_prod) * model_output) / math.sqrt(alpha_prod)
    if prediction_type == "sample":
        return model_output
    # v_prediction
    return math.sqrt(alpha_prod) * sample - math.sqrt(1.0 - alpha_prod) * model_output


def alpha_eps(
    prediction_type: str, model_output: np.ndarray, sample: np.ndarray, alpha_prod: float
) -> np.ndarray:
    """eps from the model output for x_t = sqrt(a) x0 + sqrt(1 - a) eps, a = alphas_cumprod[t]."""
    if prediction_type == "epsilon":
        return model_output
    if prediction_type == "sample":
        return (sample - math.sqrt(alpha_prod) * model_output) / math.sqrt(1.0 - alpha_prod)
    # v_prediction
    return math.sqrt(alpha_prod) * model_output + math.sqrt(1.0 - alpha_prod) * sample
