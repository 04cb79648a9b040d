"""GroupNorm statistics in float32 when a model is exported in half precision, and in chunks
where a target's shaders cannot loop over a whole group.

torch.export keeps `aten.group_norm` whole and torch-mlir decomposes it in its input's dtype, so
an fp16 export sums each group (up to 16 channels x 256 x 256 values in SD's VAE decoder) in
fp16: measured on an H100 (cuda fp16, SD 1.5 sizes, 512x512), the VAE decoder's output was
inf/NaN and the UNet was off by 6 % of its scale. torch's own kernels accumulate in float32; so
does this rewrite: every GroupNorm is traced on a float32 copy of its input and cast back. It is
memory-bound work, a small share of the time, and leaves parameter names unchanged.

Export choice `norm_sums: chunked` (the lavapipe preset) sums each group in chunks of at most
CHUNK values, then the chunks' sums: iree configures a reduction without subgroup operations as
one thread looping over the whole group, 4 values per iteration, and llvmpipe ends a shader's
loops after 65,535 iterations without an error (compile/NOTES.md, "lavapipe's loop limiter and
the VAE's GroupNorm"), so a group of more than 262,140 values (SD 1.5's VAE decoder at 256²:
8 channels x 256 x 256) was summed in part and the image came out wrong, with NaN. Chunked,
the first pass loops CHUNK / 4 times per chunk and the second size / CHUNK / 4 times per group
(512 for SD's largest, 2M values at 512²; a group whose size has fewer factors of two than
CHUNK gets smaller chunks and a longer second pass). The statistics are float32 either way.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F


def _group_norm_fp32(self: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    weight = None if self.weight is None else self.weight.float()
    bias = None if self.bias is None else self.bias.float()
    return F.group_norm(x.float(), self.num_groups, weight, bias, self.eps).to(x.dtype)


NORM_SUMS = ("whole", "chunked")
CHUNK = 1024  # values summed by one loop of a chunked GroupNorm's first pass


def _sums(v: torch.Tensor) -> torch.Tensor:
    """Each group's sum over v's last two dims (chunks, values): a sum per chunk, then theirs."""
    return v.sum(dim=-1).sum(dim=-1)


def _group_norm_chunked(self: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    n, c = x.shape[:2]
    g = self.num_groups
    size = x.numel() // (n * g)  # values per group
    chunk = math.gcd(size, CHUNK)
    v = x.float().reshape(n, g, size // chunk, chunk)
    mean = _sums(v) / size
    d = v - mean[..., None, None]
    var = _sums(d * d) / size  # centred: no E[x^2] - E[x]^2 cancellation
    y = (d * torch.rsqrt(var + self.eps)[..., None, None]).reshape(x.shape)
    if self.affine:
        shape = (1, c) + (1,) * (x.dim() - 2)
        y = y * self.weight.float().reshape(shape) + self.bias.float().reshape(shape)
    return y.to(x.dtype)


def set_norm_sums(model: torch.nn.Module, sums: str) -> int:
    """Export choice norm_sums: `chunked` makes every GroupNorm of model sum in chunks (and in
    float32); returns how many were changed (0 for `whole`)."""
    if sums not in NORM_SUMS:
        raise ValueError(f"export norm_sums choice must be one of {NORM_SUMS}, not {sums!r}")
    if sums == "whole":
        return 0
    count = 0
    for m in model.modules():
        if isinstance(m, torch.nn.GroupNorm):
            m.forward = types.MethodType(_group_norm_chunked, m)
            count += 1
    return count


def group_norms_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """For a half-precision dtype, make every GroupNorm of model compute in float32; returns
    how many (0 for float32, where nothing changes). Chunked ones (set_norm_sums) already do."""
    if dtype == torch.float32:
        return 0
    count = 0
    for m in model.modules():
        chunked = getattr(vars(m).get("forward"), "__func__", None) is _group_norm_chunked
        if isinstance(m, torch.nn.GroupNorm) and not chunked:
            m.forward = types.MethodType(_group_norm_fp32, m)
            count += 1
    return count
