"""Export choice `layout: "channels_last"` for the UNet: its activations stay [N, H, W, C] from
conv_in to conv_out.

diffusers' UNet is NCHW, while every conv that sdiree states as matmuls (Winograd, im2col)
computes channels-last and every transformer block works on tokens [N, H·W, C], which is
channels-last: each conv moved its input to channels-last and its output back, and each
transformer its input to tokens and its output back, whole-tensor transposes that took ~19 % of
SD 1.5's bf16 UNet call at 512² on an AMX CPU (compile/NOTES.md). Here the UNet's own blocks are
rerun channels-last (channels_last.py): the resnets with their time embedding, the transformers'
GroupNorm and projections around diffusers' own transformer blocks (which already take tokens),
strided-conv downsampling, nearest upsampling as a broadcast, the skip connections joined along
the channels. Time and added embeddings are diffusers' own. Guidance's shared prefix
(cfg_prefix.py) is kept: under `denoise_cfg` conv_in, and for a UNet conditioned only through its
text, everything up to the first transformer block's self-attention, run on one half. The
parameters and their names are the UNet's own; the same arithmetic as diffusers' up to the order
of GroupNorm's sums (tests/compile/exporters/test_unet_channels_last.py).
"""

from __future__ import annotations

import torch

from .amx_matmul import from_operand, is_split
from .channels_last import (
    conv,
    downsample,
    downsample_unsupported,
    norm_act_conv,
    norm_bf16,
    resnet,
    resnet_unsupported,
    upsample,
    upsample_unsupported,
)

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn",)


def unsupported(unet: torch.nn.Module) -> str | None:
    """Why unet cannot run channels-last here (None: it can): a UNet2DConditionModel of SD
    1.x/2.x/SDXL's kinds (cross-attention and plain down/up blocks, GroupNorm, continuous
    transformers, no class embedding)."""
    cfg = unet.config
    if type(unet).__name__ != "UNet2DConditionModel":
        return f"it is a {type(unet).__name__}, not a UNet2DConditionModel"
    if cfg.get("center_input_sample"):
        return "it centres its input sample"
    if cfg.get("class_embed_type") or cfg.get("addition_embed_type") not in (None, "text_time"):
        return "it takes class or image conditioning"
    if unet.conv_norm_out is not None and not isinstance(unet.conv_norm_out, torch.nn.GroupNorm):
        return "its output norm is not a GroupNorm"
    mid = [unet.mid_block] if unet.mid_block is not None else []
    for block, kinds in [
        *((b, DOWN_BLOCKS) for b in unet.down_blocks),
        *((b, MID_BLOCKS) for b in mid),
        *((b, UP_BLOCKS) for b in unet.up_blocks),
    ]:
        if type(block).__name__ not in kinds:
            return f"it has a {type(block).__name__}"
        if getattr(block, "s1", None) is not None:
            return "FreeU is enabled"
        for why in (
            *map(resnet_unsupported, block.resnets),
            *map(_transformer_unsupported, getattr(block, "attentions", None) or []),
            *map(downsample_unsupported, getattr(block, "downsamplers", None) or []),
            *map(upsample_unsupported, getattr(block, "upsamplers", None) or []),
        ):
            if why:
                return why
    return None


def _transformer_unsupported(t) -> str | None:
    if type(t).__name__ != "Transformer2DModel" or not getattr(t, "is_input_continuous", False):
        return f"a {type(t).__name__} is not a transformer on continuous input"
    if not isinstance(t.norm, torch.nn.GroupNorm):
        return "a transformer's input norm is not a GroupNorm"
    return None


class _Halves:
    """Guidance's shared prefix: rows of tensors computed for the first half only are repeated
    to every image where they meet the rest."""

    def __init__(self, images: int):
        self.images = images

    def full(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if 2 * x.shape[0] == self.images else x


def _transformer(t, xh: torch.Tensor, context, halves: _Halves) -> torch.Tensor:
    """A Transformer2DModel on channels-last xh: diffusers' own blocks on its tokens."""
    n, h, w, c = xh.shape
    x = norm_bf16(t.norm, xh)
    if x.dtype != xh.dtype and not _takes_bf16(t.proj_in):
        x = from_operand(x, is_split(t.norm)).to(xh.dtype)
    if t.use_linear_projection:
        x = t.proj_in(x.reshape(n, h * w, x.shape[-1]))
    else:
        x = conv(t.proj_in, x)
        x = x.reshape(n, h * w, x.shape[-1])
    x = halves.full(x)  # the first block's norm1 and attn1 take one half again (cfg_prefix.py)
    for block in t.transformer_blocks:
        x = block(x, encoder_hidden_states=context)
    if t.use_linear_projection:
        x = t.proj_out(x)
        x = x.reshape(-1, h, w, x.shape[-1])
    else:
        x = conv(t.proj_out, x.reshape(-1, h, w, x.shape[-1]))
    return x + halves.full(xh)


def _takes_bf16(proj) -> bool:
    """Whether a transformer's projection casts its input itself: a conv (channels_last.conv),
    or a Linear on the AMX kernel (linear_amx.py)."""
    from .linear_amx import casts_input

    return isinstance(proj, torch.nn.Conv2d) or casts_input(proj)


def _embedding(unet, sample, timestep, context, added):
    """The UNet's time embedding (one row: the timestep is one value), with its added
    conditioning's rows where it has one."""
    t_emb = unet.get_time_embed(sample=sample[:1], timestep=timestep)
    emb = unet.time_embedding(t_emb, None)
    aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=context, added_cond_kwargs=added)
    if aug is not None:
        emb = emb + aug
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    return emb


def denoise(unet, sample, timestep, context, added_cond_kwargs=None) -> torch.Tensor:
    """unet(sample, timestep, context) for NCHW sample, computed channels-last; NCHW out."""
    added = added_cond_kwargs or {}
    emb = _embedding(unet, sample, timestep, context, added)
    context = unet.process_encoder_hidden_states(context, added)
    halves = _Halves(sample.shape[0])
    prefix = getattr(unet, "cfg_prefix_batch", None)
    xh = sample.permute(0, 2, 3, 1)
    if prefix and 2 * prefix == sample.shape[0]:
        xh = xh[:prefix]
    xh = conv(unet.conv_in, xh)
    if unet.config.get("addition_embed_type"):  # its resnets see each half's own embedding
        xh = halves.full(xh)
    skips = [xh]
    for block in unet.down_blocks:
        for r, a in zip(block.resnets, _attentions(block), strict=True):
            xh = resnet(r, xh, emb)
            if a is not None:
                xh = _transformer(a, xh, context, halves)
            skips.append(xh)
        for d in block.downsamplers or []:
            xh = downsample(d, xh)
            skips.append(xh)
    if unet.mid_block is not None:
        mid = unet.mid_block
        xh = resnet(mid.resnets[0], xh, emb)
        for a, r in zip(mid.attentions, mid.resnets[1:], strict=True):
            xh = resnet(r, _transformer(a, xh, context, halves), emb)
    for block in unet.up_blocks:
        mine, skips = skips[-len(block.resnets) :], skips[: -len(block.resnets)]
        for r, a in zip(block.resnets, _attentions(block), strict=True):
            skip = mine.pop()
            if skip.shape[0] != xh.shape[0]:
                xh, skip = halves.full(xh), halves.full(skip)
            xh = resnet(r, torch.cat([xh, skip], dim=-1), emb)
            if a is not None:
                xh = _transformer(a, xh, context, halves)
        size = tuple(skips[-1].shape[1:3]) if skips else None
        for u in block.upsamplers or []:
            xh = upsample(u, xh, size)
    if unet.conv_norm_out is not None:
        out = norm_act_conv(unet.conv_norm_out, unet.conv_act, unet.conv_out, xh)
    else:
        out = conv(unet.conv_out, xh)
    return halves.full(out).permute(0, 3, 1, 2)


def _attentions(block) -> list:
    attentions = getattr(block, "attentions", None)
    return list(attentions) if attentions else [None] * len(block.resnets)
