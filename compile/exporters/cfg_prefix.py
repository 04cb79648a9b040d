"""Guidance's shared prefix: the UNet layers that see only the latents and the timestep run once
for both halves of `denoise_cfg`.

A guided step calls the UNet on the same latents and timestep twice, with the unconditional and
the conditional text embeddings; the text first enters at the first cross-attention. Everything
before it (conv_in, the first ResNet, and the first transformer's norm, input projection and
self-attention; for SD 1.5 at 512x512, 3-4 % of the call's time) computes the same values for both
halves. `share_cfg_prefix` rebinds those modules' forwards: given a batch of 2B, they run on its
first B rows and repeat the result. That is exact only because the one caller at batch 2B,
`UNetEntry` under `denoise_cfg`, feeds both halves the same latents; at batch B (`denoise`) the
modules run as before.
"""

from __future__ import annotations

import torch


def cfg_prefix_modules(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of a diffusers UNet2DConditionModel, in call order, whose inputs depend only
    on the latents and the timestep: up to the first transformer block's self-attention."""
    cfg = unet.config
    if cfg.get("class_embed_type") or cfg.get("addition_embed_type"):
        return [unet.conv_in]  # the time embedding (so every ResNet) also sees the conditioning
    modules = [unet.conv_in]
    for block in unet.down_blocks:
        attentions = getattr(block, "attentions", None) or []
        for i, resnet in enumerate(block.resnets):
            modules.append(resnet)
            if i < len(attentions):
                return modules + _before_cross_attention(attentions[i])
        modules += list(getattr(block, "downsamplers", None) or [])
    return modules


def _before_cross_attention(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """A Transformer2DModel's modules that run before its first block's cross-attention (the
    transformer itself when exported channels first: it shares that prefix on its own)."""
    if getattr(transformer, "channels_first", False):
        return [transformer]
    modules = [transformer.norm, transformer.proj_in]
    first = transformer.transformer_blocks[0]
    if (
        first.norm_type == "layer_norm"
        and not first.only_cross_attention
        and first.pos_embed is None
        and not first.attn1.is_cross_attention
    ):
        modules += [first.norm1, first.attn1]
    return modules


def share_cfg_prefix(unet: torch.nn.Module, batch: int) -> int:
    """Rebind the forward of each of `cfg_prefix_modules(unet)`, so that an input of batch
    2 * batch runs at batch `batch` and its output is repeated; returns how many."""
    modules = cfg_prefix_modules(unet)
    # for forwards that do not call these modules' own (unet_channels_last.py)
    unet.cfg_prefix_batch = batch
    for module in modules:
        if getattr(module, "channels_first", False):
            module.cfg_prefix_batch = batch  # compile/exporters/channels_first.py
        else:
            module.forward = _first_half_forward(module.forward, batch)
    return len(modules)


def _first_half_forward(inner, batch: int):
    pair = 2 * batch

    def forward(*args, **kwargs):
        if not (args and torch.is_tensor(args[0]) and args[0].shape[0] == pair):
            return inner(*args, **kwargs)

        def half(x):
            return x[:batch] if torch.is_tensor(x) and x.ndim and x.shape[0] == pair else x

        out = inner(*map(half, args), **{k: half(v) for k, v in kwargs.items()})
        return torch.cat([out, out])

    return forward
