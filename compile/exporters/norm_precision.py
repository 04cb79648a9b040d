"""GroupNorm statistics in float32 when a model is exported in half precision.

torch.export keeps `aten.group_norm` whole and torch-mlir decomposes it in its input's dtype, so
an fp16 export sums each group (up to 16 channels x 256 x 256 values in SD's VAE decoder) in
fp16: measured on an H100 (cuda fp16, SD 1.5 sizes, 512x512), the VAE decoder's output was
inf/NaN and the UNet was off by 6 % of its scale. torch's own kernels accumulate in float32; so
does this rewrite: every GroupNorm is traced on a float32 copy of its input and cast back. It is
memory-bound work, a small share of the time, and leaves parameter names unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _group_norm_fp32(self: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    weight = None if self.weight is None else self.weight.float()
    bias = None if self.bias is None else self.bias.float()
    return F.group_norm(x.float(), self.num_groups, weight, bias, self.eps).to(x.dtype)


def group_norms_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """For a half-precision dtype, make every GroupNorm of model compute in float32; returns
    how many (0 for float32, where nothing changes)."""
    if dtype == torch.float32:
        return 0
    count = 0
    for m in model.modules():
        if isinstance(m, torch.nn.GroupNorm):
            m.forward = types.MethodType(_group_norm_fp32, m)
            count += 1
    return count
