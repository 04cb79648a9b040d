"""Export choice `layout: "channels_last"` for the VAE decoder: its activations stay [N, H, W, C]
from conv_in to conv_out.

diffusers' decoder is NCHW, and every conv that sdiree states as matmuls (Winograd, im2col)
computes channels-last: each conv then moved its input to channels-last and its output back, two
whole-tensor transposes a conv. At 512x512 the decoder's last levels hold 128-256 channels x
256²-512² pixels, where those transposes and the output tiles' interleave cost as much as the
convs' matmuls (tools/PERFORMANCE.md, twenty-sixth session). Here the decoder's own blocks are
rerun on channels-last tensors: GroupNorm over (pixels, channels of a group), SiLU, the convs'
channels-last lowerings (conv_matmul.CHANNELS_LAST_FORWARD), the nearest 2x upsampling as a
broadcast, residual adds; only the mid block's attention sees NCHW (at the latents' size). The
parameters and their names are the decoder's own. Same arithmetic as diffusers' up to the
order of GroupNorm's sums (tests/compile/exporters/test_vae_channels_last.py).
"""

from __future__ import annotations

import torch

from .conv_matmul import CHANNELS_LAST_FORWARD

LAYOUTS = ("native", "channels_last")


def unsupported(decoder: torch.nn.Module) -> str | None:
    """Why decoder's blocks cannot run channels-last here (None: they can): the AutoencoderKL
    decoder of SD 1.x/2.x/SDXL, GroupNorm everywhere, no time or latent embeddings."""
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.upsampling import Upsample2D

    if not isinstance(decoder.conv_norm_out, torch.nn.GroupNorm):
        return "its output norm is not a GroupNorm"
    for block in [decoder.mid_block, *decoder.up_blocks]:
        for r in block.resnets:
            if not isinstance(r, ResnetBlock2D) or r.upsample or r.downsample:
                return f"{type(r).__name__} resamples"
            if r.time_emb_proj is not None or not isinstance(r.norm2, torch.nn.GroupNorm):
                return "a resnet takes a time embedding or another norm"
        for u in getattr(block, "upsamplers", None) or []:
            if not isinstance(u, Upsample2D) or u.norm is not None or u.use_conv_transpose:
                return "an upsampler is not nearest 2x + conv"
            if not (u.use_conv and u.interpolate):
                return "an upsampler is not nearest 2x + conv"
    return None


def group_norm(norm: torch.nn.GroupNorm, xh: torch.Tensor) -> torch.Tensor:
    """norm on a channels-last tensor: each group's mean and variance over its pixels and
    channels, in float32 whatever the input's dtype (as norm_precision.py has every GroupNorm
    of a half-precision export compute)."""
    n, h, w, c = xh.shape
    x = xh.float().reshape(n, h * w, norm.num_groups, c // norm.num_groups)
    mean = x.mean(dim=(1, 3), keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(dim=(1, 3), keepdim=True)
    y = (centered * torch.rsqrt(var + norm.eps)).reshape(n, h, w, c)
    if norm.affine:
        y = y * norm.weight.float() + norm.bias.float()
    return y.to(xh.dtype)


def conv(mod: torch.nn.Conv2d, xh: torch.Tensor) -> torch.Tensor:
    """mod's channels-last lowering where it has one, else its own forward between transposes."""
    forward = getattr(mod, CHANNELS_LAST_FORWARD, None)
    if forward is not None:
        return forward(xh)
    return mod(xh.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


def resnet(r, xh: torch.Tensor) -> torch.Tensor:
    h = conv(r.conv1, r.nonlinearity(group_norm(r.norm1, xh)))
    h = conv(r.conv2, r.dropout(r.nonlinearity(group_norm(r.norm2, h))))
    skip = xh if r.conv_shortcut is None else conv(r.conv_shortcut, xh)
    return (skip + h) / r.output_scale_factor


def upsample(u, xh: torch.Tensor) -> torch.Tensor:
    n, h, w, c = xh.shape
    up = xh[:, :, None, :, None, :].expand(n, h, 2, w, 2, c).reshape(n, 2 * h, 2 * w, c)
    return conv(u.conv if u.name == "conv" else u.Conv2d_0, up)


def decode(decoder: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """decoder(z) for NCHW latents z, computed channels-last; the image NCHW."""
    xh = conv(decoder.conv_in, z.permute(0, 2, 3, 1))
    mid = decoder.mid_block
    xh = resnet(mid.resnets[0], xh)
    for attn, r in zip(mid.attentions, mid.resnets[1:], strict=True):
        if attn is not None:
            xh = attn(xh.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        xh = resnet(r, xh)
    for block in decoder.up_blocks:
        for r in block.resnets:
            xh = resnet(r, xh)
        for u in block.upsamplers or []:
            xh = upsample(u, xh)
    xh = decoder.conv_act(group_norm(decoder.conv_norm_out, xh))
    return conv(decoder.conv_out, xh).permute(0, 3, 1, 2)
