"""UNet exporter: (latents, timestep, text embeddings) → noise prediction.

Two entry functions share the parameters: `denoise_cfg` takes B latents and text embeddings of
batch 2B (unconditional and conditional halves in one call, so guidance is one call per step)
and returns both halves' predictions; `denoise` runs at batch B (for guidance scale 1, which skips
the unconditional half). The timestep is one float32 value. An artifact compiled for more image
sizes (`sdiree compile --sizes`) has that pair again per extra size, named for its latents
(`denoise_cfg_96x64`); all share the parameters, so each conv's Winograd tile (which names a
derived weight) is chosen once, at the main size.
"""

from __future__ import annotations

import torch

from .attention import set_attention
from .base import NUMPY_DTYPE_NAMES, ExportPlan, FunctionSpec, TensorSpec
from .cfg_prefix import share_cfg_prefix
from .conv_matmul import WINOGRAD_TILES, conv_input_sides, set_conv_lowering, tiles_by_side
from .norm_precision import group_norms_in_fp32


class UNetEntry(torch.nn.Module):
    """The UNet call; given text embeddings of twice the latents' batch (guidance's two halves),
    the latents serve both halves, as diffusers' pipelines repeat them."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        if encoder_hidden_states.shape[0] == 2 * sample.shape[0]:
            sample = torch.cat([sample, sample])
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


def plan_unet(
    unet: torch.nn.Module,
    *,
    batch: int,
    latent_hws: list[tuple[int, int]],
    text_len: int,
    text_dim: int,
    dtype: torch.dtype,
    attention: str,
    conv: str = "native",
    winograd4_min_side: int | None = None,
) -> ExportPlan:
    channels = unet.config.in_channels
    out_channels = unet.config.out_channels
    h, w = latent_hws[0]  # the main size; the others get functions named for their latents
    tiles = None
    if winograd4_min_side:  # F(4x4) where a conv's input is large, the conv choice's tile elsewhere
        sides = conv_input_sides(
            unet,
            lambda: unet(
                torch.zeros(2 * batch, channels, h, w),
                torch.zeros(1),
                torch.zeros(2 * batch, text_len, text_dim),
            ),
        )
        small, large = WINOGRAD_TILES.get(conv, 0), WINOGRAD_TILES["winograd4"]
        tiles = tiles_by_side(sides, small, large, winograd4_min_side)
    set_attention(unet, attention)
    derived = set_conv_lowering(unet, conv, tiles)
    group_norms_in_fp32(unet, dtype)
    share_cfg_prefix(unet, batch)  # last: it wraps the forwards rebound above
    unet = unet.to(dtype).eval()
    entry = UNetEntry(unet)
    dt = NUMPY_DTYPE_NAMES[dtype]

    def denoise_cfg(root, sample, timestep, encoder_hidden_states):
        return root(sample, timestep, encoder_hidden_states)

    def denoise(root, sample, timestep, encoder_hidden_states):
        return root(sample, timestep, encoder_hidden_states)

    def spec(fn, b, hw):
        h, w = hw
        return FunctionSpec(
            name=fn.__name__ if hw == latent_hws[0] else f"{fn.__name__}_{h}x{w}",
            inputs=(
                TensorSpec("sample", (batch, channels, h, w), dt),
                TensorSpec("timestep", (1,), "float32"),
                TensorSpec("encoder_hidden_states", (b, text_len, text_dim), dt),
            ),
            outputs=(TensorSpec("noise_pred", (b, out_channels, h, w), dt),),
            fn=fn,
        )

    return ExportPlan(
        submodule="unet",
        scope="unet",
        root=entry,
        params_module=unet,
        functions=[
            f
            for hw in latent_hws
            for f in (spec(denoise_cfg, 2 * batch, hw), spec(denoise, batch, hw))
        ],
        options={"attention": attention, "conv": conv, "winograd4_min_side": winograd4_min_side},
        derived=derived,
    )
