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

from .channels_last import (
    conv,
    norm_act_conv,
    resnet,
    resnet_unsupported,
    upsample,
    upsample_unsupported,
)

LAYOUTS = ("native", "channels_last")


def unsupported(decoder: torch.nn.Module) -> str | None:
    """Why decoder's blocks cannot run channels-last here (None: they can): the AutoencoderKL
    decoder of SD 1.x/2.x/SDXL, GroupNorm everywhere, no time or latent embeddings."""
    if not isinstance(decoder.conv_norm_out, torch.nn.GroupNorm):
        return "its output norm is not a GroupNorm"
    for block in [decoder.mid_block, *decoder.up_blocks]:
        for r in block.resnets:
            why = resnet_unsupported(r)
            if why or r.time_emb_proj is not None:
                return why or "a resnet takes a time embedding"
        for u in getattr(block, "upsamplers", None) or []:
            why = upsample_unsupported(u)
            if why:
                return why
    return None


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
    return norm_act_conv(decoder.conv_norm_out, decoder.conv_act, decoder.conv_out, xh).permute(
        0, 3, 1, 2
    )
