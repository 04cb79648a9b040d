"""Blocks of diffusers' UNets and VAE decoders rerun on channels-last activations [N, H, W, C].

The building blocks the channels-last exports share (vae_channels_last.py, unet_channels_last.py):
GroupNorm over (pixels, channels of a group), a conv through its lowering's channels-last form
(conv_matmul.CHANNELS_LAST_FORWARD), a ResnetBlock2D with or without a time embedding, nearest
upsampling as a broadcast, a stride-2 downsampling conv. Each computes what the diffusers module
computes on NCHW, with the module's own parameters, up to the order of GroupNorm's sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import group_norm_kernel, upsample_kernel, winograd_f32
from .conv_matmul import CHANNELS_LAST_FORWARD


def group_norm(norm: torch.nn.GroupNorm, xh: torch.Tensor) -> torch.Tensor:
    """norm on a channels-last tensor: each group's mean and variance over its pixels and
    channels, in float32 whatever the input's dtype (as norm_precision.py has every GroupNorm
    of a half-precision export compute). Both from one pass of sums about a reference (the
    group's mean over the first pixel, so the variance's E[d^2] - E[d]^2 does not cancel), where
    the mean, then the centred variance, took iree two passes over the activations (SD 1.5's
    64x64 norm with SiLU, batch 2: 3.9 -> 1.9 ms on 2 Zen 5 cores), then one that applies it as
    a per-channel scale and shift."""
    n, h, w, c = xh.shape
    g = norm.num_groups
    x = xh.float().reshape(n, h * w, g, c // g)
    ref = x[:, :1].mean(dim=3, keepdim=True)
    d = x - ref
    count = h * w * (c // g)
    m = d.sum(dim=(1, 3), keepdim=True) / count
    var = (d * d).sum(dim=(1, 3), keepdim=True) / count - m * m
    scale = torch.rsqrt(var + norm.eps)
    shift = -(ref + m) * scale
    if norm.affine:
        weight = norm.weight.float().reshape(1, 1, g, c // g)
        scale, shift = scale * weight, shift * weight + norm.bias.float().reshape(1, 1, g, c // g)
    return (x * scale + shift).reshape(n, h, w, c).to(xh.dtype)


def conv(mod: torch.nn.Conv2d, xh: torch.Tensor) -> torch.Tensor:
    """mod's channels-last lowering where it has one, else its own forward between transposes."""
    forward = getattr(mod, CHANNELS_LAST_FORWARD, None)
    if forward is not None:
        return forward(xh)
    return mod(xh.permute(0, 3, 1, 2).to(mod.weight.dtype)).permute(0, 2, 3, 1)


def norm_act_conv(
    norm, act, mod, xh: torch.Tensor, dropout=None, add=None, residual=None
) -> torch.Tensor:
    """residual + mod(dropout(act(norm(xh)))) + add (add [N or 1, O] per image and channel;
    either may be None): the norm and act on the GroupNorm kernels where norm is marked for them
    and fits (group_norm_kernel.py; dropout is then inactive: eval mode), the conv adding add
    and residual in its epilogue where it is on the AMX conv kernel or the fp32 Winograd ones
    (winograd_f32.py)."""
    y = group_norm_kernel.norm_act_conv(norm, act, mod, xh, add, residual)
    if y is not None:
        return y
    y = act(group_norm(norm, xh))
    y = dropout(y) if dropout is not None else y
    if winograd_f32.takes(mod, y.shape, y.dtype):  # it adds add and residual itself
        return winograd_f32.conv3x3_nhwc(mod, y, add, residual)
    return with_added(conv(mod, y), add, residual)


def with_added(y: torch.Tensor, add=None, residual=None) -> torch.Tensor:
    if add is not None:
        y = y + add[:, None, None, :]
    return y if residual is None else residual + y


def norm_bf16(norm, xh: torch.Tensor) -> torch.Tensor:
    """norm(xh) as a matmul's input: bf16 from the GroupNorm kernels where norm is marked for
    them and fits, else group_norm's."""
    if group_norm_kernel.fits(norm, xh):
        return group_norm_kernel.norm_bf16(norm, xh)
    return group_norm(norm, xh)


def resnet(r, xh: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
    """A ResnetBlock2D without resampling, its time embedding (time_embedding_norm "default")
    added after conv1 where it has one; temb [N or 1, channels] before the block's activation."""
    add = None
    if r.time_emb_proj is not None and temb is not None:
        add = r.time_emb_proj(temb if r.skip_time_act else r.nonlinearity(temb))
    h = norm_act_conv(r.norm1, r.nonlinearity, r.conv1, xh, add=add)
    skip = xh if r.conv_shortcut is None else conv(r.conv_shortcut, xh)
    if r.output_scale_factor == 1:  # the skip added in conv2's epilogue where it can be
        return norm_act_conv(r.norm2, r.nonlinearity, r.conv2, h, r.dropout, residual=skip)
    h = norm_act_conv(r.norm2, r.nonlinearity, r.conv2, h, r.dropout)
    return (skip + h) / r.output_scale_factor


def resnet_unsupported(r) -> str | None:
    """Why resnet() cannot compute r (None: it can)."""
    from diffusers.models.resnet import ResnetBlock2D

    if not isinstance(r, ResnetBlock2D) or r.upsample or r.downsample:
        return f"{type(r).__name__} resamples"
    if not isinstance(r.norm1, torch.nn.GroupNorm) or not isinstance(r.norm2, torch.nn.GroupNorm):
        return "a resnet has another norm than GroupNorm"
    if r.time_emb_proj is not None and r.time_embedding_norm != "default":
        return f"a resnet's time embedding norm is {r.time_embedding_norm!r}"
    return None


def upsample(u, xh: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
    """An Upsample2D (nearest, then its conv): 2x on the upsampling kernel where u is marked for
    it and fits (upsample_kernel.py), else as a broadcast; another size (diffusers'
    `upsample_size`, for sides not divisible by the UNet's overall factor) by interpolation."""
    n, h, w, c = xh.shape
    conv_mod = u.conv if u.name == "conv" else u.Conv2d_0
    if size is None or tuple(size) == (2 * h, 2 * w):
        y = upsample_kernel.upsample_conv(u, conv_mod, xh)  # the kernel's, where u is marked
        if y is not None:
            return y
        up = xh[:, :, None, :, None, :].expand(n, h, 2, w, 2, c).reshape(n, 2 * h, 2 * w, c)
    else:
        up = F.interpolate(xh.permute(0, 3, 1, 2), size=tuple(size), mode="nearest")
        up = up.permute(0, 2, 3, 1)
    return conv(conv_mod, up)


def upsample_unsupported(u) -> str | None:
    from diffusers.models.upsampling import Upsample2D

    if not isinstance(u, Upsample2D) or u.norm is not None or u.use_conv_transpose:
        return "an upsampler is not nearest 2x + conv"
    if not (u.use_conv and u.interpolate):
        return "an upsampler is not nearest 2x + conv"
    return None


def downsample(d, xh: torch.Tensor) -> torch.Tensor:
    """A Downsample2D with a conv (stride 2; zero-padded right and bottom where it has no
    padding of its own, as diffusers pads)."""
    if d.padding == 0:
        xh = F.pad(xh, (0, 0, 0, 1, 0, 1))
    return conv(d.conv, xh)


def downsample_unsupported(d) -> str | None:
    from diffusers.models.downsampling import Downsample2D

    if not isinstance(d, Downsample2D) or d.norm is not None or not d.use_conv:
        return "a downsampler is not a strided conv"
    return None
