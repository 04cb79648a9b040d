"""Rename a single-file SD 1.x/2.x or SDXL checkpoint's tensors (the original LDM/SGM key layout)
to the diffusers layout of each component, without copying a tensor.

A single-file checkpoint holds the whole pipeline under the original repositories' names:
`model.diffusion_model.*` (the UNet, openaimodel's input/middle/output blocks),
`first_stage_model.*` (the VAE), and the text encoder as `cond_stage_model.transformer.*` (SD
1.x: Hugging Face's CLIPTextModel) or `cond_stage_model.model.*` (SD 2.x: OpenCLIP, with fused
q/k/v projections); SGM's `conditioner.embedders.0.*` for the latter two. `convert` maps them to
{"unet": ..., "vae": ..., "text_encoder": ...} as diffusers' UNet2DConditionModel,
AutoencoderKL and transformers' CLIPTextModel name their parameters.

SDXL files are in SGM's layout: the UNet has `label_emb.0.0`/`label_emb.0.2` (the pooled text
and time-id embedding, diffusers' `add_embedding.linear_1/2`), the first text encoder is CLIP
ViT-L in Hugging Face's naming under `conditioner.embedders.0.transformer.`, the second is
OpenCLIP ViT-bigG under `conditioner.embedders.1.model.` (fused q/k/v, all its layers used, and
`text_projection` stored as [width, projection] for `x @ P`: CLIPTextModelWithProjection's
`text_projection.weight` is its transpose). They come out as "text_encoder" and
"text_encoder_2". The text encoder comes out
in the flat layout transformers >= 5.6 saves (`embeddings.*`, `encoder.*`,
`final_layer_norm.*`, no `text_model.` prefix); a caller whose library wants the prefix adds it.

Every tensor stays in its dtype and is a view of the input (the fused q/k/v are split into
slices, the VAE attention's 1x1 convolution weights reshaped to linear ones), so converting a
memory-mapped file reads nothing.

EMA: LDM training checkpoints keep the EMA weights beside the trained ones (`model_ema.*`, the
key's dots removed). diffusers 0.42's from_single_file loads the non-EMA UNet by default
(`extract_ema=False`), and so does `convert`; `use_ema=True` takes the EMA ones. "EMA-only"
files have the EMA weights under `model.diffusion_model.*` already and no `model_ema.*`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError

UNET_PREFIX = "model.diffusion_model."
EMA_PREFIX = "model_ema."
VAE_PREFIXES = ("first_stage_model.", "vae.")
CLIP_PREFIXES = ("cond_stage_model.transformer.", "conditioner.embedders.0.transformer.")
OPEN_CLIP_PREFIXES = ("cond_stage_model.model.", "conditioner.embedders.0.model.")
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."  # SDXL's second text encoder (bigG)
COMPONENTS = ("unet", "vae", "text_encoder")

# Keys a full training checkpoint holds that no component needs: the DDPM schedule buffers,
# the EMA bookkeeping, the VAE's training loss, buffers the libraries rebuild themselves.
_IGNORED = re.compile(
    r"^(betas|alphas_cumprod|alphas_cumprod_prev|sqrt_alphas_cumprod|sqrt_one_minus_alphas_cumprod"
    r"|log_one_minus_alphas_cumprod|sqrt_recip_alphas_cumprod|sqrt_recipm1_alphas_cumprod"
    r"|posterior_variance|posterior_log_variance_clipped|posterior_mean_coef1"
    r"|posterior_mean_coef2|logvar|lvlb_weights|model_ema\..*|first_stage_model\.loss\..*"
    r"|vae\.loss\..*)$"
)

_UNET_TOP = {
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
    "input_blocks.0.0": "conv_in",
    "out.0": "conv_norm_out",
    "out.2": "conv_out",
    "label_emb.0.0": "add_embedding.linear_1",  # SDXL: pooled text + time ids
    "label_emb.0.2": "add_embedding.linear_2",
}
_UNET_RESNET = {
    "in_layers.0": "norm1",
    "in_layers.2": "conv1",
    "emb_layers.1": "time_emb_proj",
    "out_layers.0": "norm2",
    "out_layers.3": "conv2",
    "skip_connection": "conv_shortcut",
}
_VAE_RESNET = {
    "norm1": "norm1",
    "conv1": "conv1",
    "norm2": "norm2",
    "conv2": "conv2",
    "nin_shortcut": "conv_shortcut",
}
_VAE_ATTN = {
    "norm": "group_norm",
    "q": "to_q",
    "k": "to_k",
    "v": "to_v",
    "proj_out": "to_out.0",
}
_OPEN_CLIP_TOP = {
    "token_embedding.weight": "embeddings.token_embedding.weight",
    "positional_embedding": "embeddings.position_embedding.weight",
    "ln_final.weight": "final_layer_norm.weight",
    "ln_final.bias": "final_layer_norm.bias",
}
_OPEN_CLIP_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
# OpenCLIP parts that CLIPTextModel has no place for (SD 2.x uses the penultimate layer's
# hidden states, never the projection).
_OPEN_CLIP_DROPPED = ("text_projection", "logit_scale", "attn_mask")


@dataclass
class Converted:
    """A checkpoint's tensors per diffusers component, and the keys it did not use: `ignored`
    (known and not needed), `unknown` (under a component's prefix but not understood: a layout
    this converter does not know), `other` (elsewhere: reported, never an error)."""

    components: dict[str, dict[str, np.ndarray]]
    text_encoder: str  # "clip", "open_clip", "clip+open_clip" (SDXL) or "" (none in the file)
    ema: bool  # the UNet's weights are the EMA ones
    ignored: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # outside every component, not known


def _sub(table: dict, name: str) -> str | None:
    """name with its leading dotted part renamed by table, or None when no entry matches."""
    for old, new in table.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def layers_per_block(keys) -> int:
    """openaimodel's num_res_blocks from the UNet's keys: input block (n+1) is the first
    downsampler, or with a single level there are n+1 input blocks."""
    downs = [int(m.group(1)) for k in keys if (m := re.match(r"input_blocks\.(\d+)\.0\.op\.", k))]
    if downs:
        return min(downs) - 1
    blocks = [int(m.group(1)) for k in keys if (m := re.match(r"input_blocks\.(\d+)\.", k))]
    return max(blocks, default=1)


def _unet_key(key: str, per_level: int) -> str | None:
    top = _sub(_UNET_TOP, key)
    if top is not None:
        return top
    if m := re.fullmatch(r"input_blocks\.(\d+)\.(\d+)\.(.+)", key):
        i, part, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        level, j = divmod(i - 1, per_level)
        if j == per_level - 1:
            if part == 0 and rest.startswith("op."):
                return f"down_blocks.{level}.downsamplers.0.conv.{rest[3:]}"
            return None
        if part == 0:
            inner = _sub(_UNET_RESNET, rest)
            return None if inner is None else f"down_blocks.{level}.resnets.{j}.{inner}"
        return f"down_blocks.{level}.attentions.{j}.{rest}" if part == 1 else None
    if m := re.fullmatch(r"middle_block\.(\d+)\.(.+)", key):
        part, rest = int(m.group(1)), m.group(2)
        if part in (0, 2):
            inner = _sub(_UNET_RESNET, rest)
            return None if inner is None else f"mid_block.resnets.{part // 2}.{inner}"
        return f"mid_block.attentions.0.{rest}" if part == 1 else None
    if m := re.fullmatch(r"output_blocks\.(\d+)\.(\d+)\.(.+)", key):
        i, part, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        level, j = divmod(i, per_level)
        if part == 0:
            inner = _sub(_UNET_RESNET, rest)
            return None if inner is None else f"up_blocks.{level}.resnets.{j}.{inner}"
        if rest.startswith("conv."):  # the level's upsampler: after the resnet or attention
            return f"up_blocks.{level}.upsamplers.0.conv.{rest[5:]}" if part in (1, 2) else None
        return f"up_blocks.{level}.attentions.{j}.{rest}" if part == 1 else None
    return None


def _ema_key(unet_key: str) -> str:
    """LDM's LitEma name of a UNet parameter: "diffusion_model." + key, dots removed."""
    return EMA_PREFIX + ("diffusion_model." + unet_key).replace(".", "")


def _vae_key(key: str, up_levels: int) -> tuple[str | None, bool]:
    """(diffusers key or None, whether a conv weight must become a linear one)."""
    if re.fullmatch(r"(encoder|decoder)\.(conv_in|conv_out)\..+", key):
        return key, False
    if m := re.fullmatch(r"(encoder|decoder)\.norm_out\.(.+)", key):
        return f"{m.group(1)}.conv_norm_out.{m.group(2)}", False
    if re.fullmatch(r"(quant_conv|post_quant_conv)\..+", key):
        return key, False
    if m := re.fullmatch(r"encoder\.down\.(\d+)\.block\.(\d+)\.(.+)", key):
        inner = _sub(_VAE_RESNET, m.group(3))
        return (
            None if inner is None else f"encoder.down_blocks.{m[1]}.resnets.{m[2]}.{inner}"
        ), False
    if m := re.fullmatch(r"encoder\.down\.(\d+)\.downsample\.conv\.(.+)", key):
        return f"encoder.down_blocks.{m[1]}.downsamplers.0.conv.{m[2]}", False
    if m := re.fullmatch(r"decoder\.up\.(\d+)\.block\.(\d+)\.(.+)", key):
        inner = _sub(_VAE_RESNET, m.group(3))
        level = up_levels - 1 - int(m[1])  # LDM numbers the decoder's levels from the bottom
        return (
            None if inner is None else f"decoder.up_blocks.{level}.resnets.{m[2]}.{inner}"
        ), False
    if m := re.fullmatch(r"decoder\.up\.(\d+)\.upsample\.conv\.(.+)", key):
        level = up_levels - 1 - int(m[1])
        return f"decoder.up_blocks.{level}.upsamplers.0.conv.{m[2]}", False
    if m := re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(.+)", key):
        inner = _sub(_VAE_RESNET, m.group(3))
        k = int(m[2]) - 1
        return (None if inner is None else f"{m[1]}.mid_block.resnets.{k}.{inner}"), False
    if m := re.fullmatch(
        r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)", key
    ):
        new = f"{m[1]}.mid_block.attentions.0.{_VAE_ATTN[m[2]]}.{m[3]}"
        return new, m[2] != "norm" and m[3] == "weight"
    return None, False


def _linear(w: np.ndarray) -> np.ndarray:
    """A 1x1 convolution's weight [out, in, 1(, 1)] as a linear one [out, in] (a view)."""
    if w.ndim > 2 and all(d == 1 for d in w.shape[2:]):
        return w.reshape(w.shape[:2])
    return w


def _strip(tensors: dict, prefixes) -> tuple[str, dict]:
    """(the first of prefixes some key has, {key without it: tensor})."""
    for prefix in prefixes:
        found = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if found:
            return prefix, found
    return "", {}


def _convert_unet(tensors: dict, use_ema: bool, per_block: int | None, out: Converted) -> dict:
    src = {k[len(UNET_PREFIX) :]: v for k, v in tensors.items() if k.startswith(UNET_PREFIX)}
    if use_ema:
        missing = [k for k in src if _ema_key(k) not in tensors]
        if missing:
            raise UserError(
                f"the checkpoint has no EMA weights for the UNet (no {_ema_key(missing[0])}); "
                "convert it without EMA"
            )
        src = {k: tensors[_ema_key(k)] for k in src}
        out.ema = True
    per_level = (layers_per_block(src) if per_block is None else per_block) + 1
    unet = {}
    for key, t in src.items():
        new = _unet_key(key, per_level)
        if new is None:
            out.unknown.append(UNET_PREFIX + key)
        else:
            unet[new] = t
    return unet


def _convert_vae(tensors: dict, out: Converted) -> dict:
    prefix, src = _strip(tensors, VAE_PREFIXES)
    ups = [int(m[1]) for k in src if (m := re.match(r"decoder\.up\.(\d+)\.", k))]
    up_levels = max(ups, default=-1) + 1
    vae = {}
    for key, t in src.items():
        new, to_linear = _vae_key(key, up_levels)
        if new is None:
            (out.ignored if _IGNORED.match(prefix + key) else out.unknown).append(prefix + key)
        else:
            vae[new] = _linear(t) if to_linear else t
    return vae


def _convert_clip(src: dict, prefix: str, out: Converted) -> dict:
    te = {}
    for key, t in src.items():
        name = key[len("text_model.") :] if key.startswith("text_model.") else key
        if name == "embeddings.position_ids":
            out.ignored.append(prefix + key)  # a buffer transformers rebuilds (often damaged)
        elif name.split(".")[0] in ("embeddings", "encoder", "final_layer_norm"):
            te[name] = t
        else:
            out.unknown.append(prefix + key)
    return te


def _convert_open_clip(
    src: dict, prefix: str, text_layers: int | None, out: Converted, projection: bool = False
) -> dict:
    """projection: keep OpenCLIP's text projection as CLIPTextModelWithProjection's (SDXL)."""
    te = {}
    for key, t in src.items():
        if key in _OPEN_CLIP_TOP:
            te[_OPEN_CLIP_TOP[key]] = t
            continue
        if projection and key == "text_projection":
            if t.ndim != 2:
                raise UserError(
                    f"{prefix}{key} has shape {list(t.shape)}, not [width, projection]; the "
                    "checkpoint is damaged"
                )
            te["text_projection.weight"] = t.T  # OpenCLIP computes x @ P; a Linear x @ W.T
            continue
        if key in _OPEN_CLIP_DROPPED:
            out.ignored.append(prefix + key)
            continue
        m = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", key)
        if m is None:
            out.unknown.append(prefix + key)
            continue
        layer, rest = int(m[1]), m[2]
        if text_layers is not None and layer >= text_layers:
            out.ignored.append(prefix + key)  # past the layer SD 2.x takes its hidden states from
            continue
        base = f"encoder.layers.{layer}."
        if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
            kind = "weight" if rest.endswith("weight") else "bias"
            if t.shape[0] % 3:
                raise UserError(
                    f"{prefix}{key} has shape {list(t.shape)}: its first dimension is not "
                    "three projections (q, k, v); the checkpoint is damaged"
                )
            d = t.shape[0] // 3
            for n, part in enumerate(("q_proj", "k_proj", "v_proj")):
                te[f"{base}self_attn.{part}.{kind}"] = t[n * d : (n + 1) * d]
            continue
        inner = _sub(_OPEN_CLIP_BLOCK, rest)
        if inner is None:
            out.unknown.append(prefix + key)
        else:
            te[base + inner] = t
    return te


def convert(
    tensors: dict[str, np.ndarray],
    *,
    use_ema: bool = False,
    text_layers: int | None = None,
    text_layers_2: int | None = None,
    unet_layers_per_block: int | None = None,
) -> Converted:
    """Split an LDM-layout state dict into diffusers-layout components.

    text_layers keeps the first so many of an OpenCLIP text encoder's layers (SD 2.x's config
    has 23 of OpenCLIP-H's 24); None keeps them all; text_layers_2 is the same for SDXL's
    second text encoder. unet_layers_per_block is read from the keys when not given.
    """
    out = Converted(components={}, text_encoder="", ema=False)
    out.components["unet"] = _convert_unet(tensors, use_ema, unet_layers_per_block, out)
    out.components["vae"] = _convert_vae(tensors, out)
    prefix, src = _strip(tensors, CLIP_PREFIXES)
    if src:
        out.text_encoder = "clip"
        out.components["text_encoder"] = _convert_clip(src, prefix, out)
    else:
        prefix, src = _strip(tensors, OPEN_CLIP_PREFIXES)
        out.text_encoder = "open_clip" if src else ""
        out.components["text_encoder"] = _convert_open_clip(src, prefix, text_layers, out)
    _, src = _strip(tensors, (SDXL_OPEN_CLIP_PREFIX,))
    if src:
        out.text_encoder += "+open_clip"
        out.components["text_encoder_2"] = _convert_open_clip(
            src, SDXL_OPEN_CLIP_PREFIX, text_layers_2, out, projection=True
        )
    claimed = (UNET_PREFIX, *VAE_PREFIXES, *CLIP_PREFIXES, *OPEN_CLIP_PREFIXES)
    claimed += (SDXL_OPEN_CLIP_PREFIX,)
    for key in tensors:
        if not key.startswith(claimed):
            (out.ignored if _IGNORED.match(key) else out.other).append(key)
    return out
