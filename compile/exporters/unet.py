"""UNet exporter: (latents, timestep, text embeddings) → noise prediction.

Two entry functions share the parameters: `denoise_cfg` takes B latents and text embeddings of
batch 2B (unconditional and conditional halves in one call, so guidance is one call per step)
and returns both halves' predictions; `denoise` runs at batch B (for guidance scale 1, which skips
the unconditional half). The timestep is one float32 value. A UNet with added conditioning
(SDXL's `addition_embed_type` "text_time") takes it after the text, one row per text row:
`text_embeds` (the second text encoder's pooled projection, in the model's dtype) and
`time_ids` (original size, crop top-left, target size; float32, as the UNet's sinusoidal
projection computes in float32 whatever it is given). An artifact compiled for more image
sizes (`sdiree compile --sizes`) has its functions again per extra size, named for its latents
(`denoise_cfg_96x64`); all share the parameters, so each conv's Winograd tile (which names a
derived weight) is chosen once, at the main size.
"""

from __future__ import annotations

import torch

from .attention import set_attention
from .base import NUMPY_DTYPE_NAMES, ExportPlan, FunctionSpec, TensorSpec
from .cfg_prefix import share_cfg_prefix
from .channels_first import set_transformer_layout
from .conv_matmul import conv_input_sides, set_conv_lowering, tiles_by_side
from .group_norm_kernel import set_norm_kernel
from .layer_norm_kernel import set_layer_norm_kernel
from .norm_precision import group_norms_in_fp32
from .upsample_kernel import set_upsample_kernel
from .winograd import WINOGRAD_TILES


class UNetEntry(torch.nn.Module):
    """The UNet call; given text embeddings of twice the latents' batch (guidance's two halves),
    the latents serve both halves, as diffusers' pipelines repeat them."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds=None, time_ids=None):
        if encoder_hidden_states.shape[0] == 2 * sample.shape[0]:
            sample = torch.cat([sample, sample])
        added = None
        if text_embeds is not None:
            added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.denoise(sample, timestep, encoder_hidden_states, added)

    def denoise(self, sample, timestep, encoder_hidden_states, added):
        return self.unet(
            sample, timestep, encoder_hidden_states, added_cond_kwargs=added, return_dict=False
        )[0]


class UNetEntryChannelsLast(UNetEntry):
    """UNetEntry with the UNet's activations channels-last (unet_channels_last.py)."""

    def denoise(self, sample, timestep, encoder_hidden_states, added):
        from .unet_channels_last import denoise

        return denoise(self.unet, sample, timestep, encoder_hidden_states, added)


def cat_text_time_embedding(unet: torch.nn.Module) -> bool:
    """Rebind a "text_time" UNet's added embedding (SDXL: the pooled text and the time ids'
    sinusoidal embeddings, joined, through `add_embedding`) to join them with torch.cat.
    diffusers joins them with torch.concat, which reaches iree as `torch.aten.concat`, an op
    iree 3.13 does not legalize ("failed to legalize operation 'torch.operator'"); the values
    are the same. False where the UNet has no such embedding."""
    if unet.config.get("addition_embed_type") != "text_time":
        return False

    def get_aug_embed(emb, encoder_hidden_states, added_cond_kwargs):
        text_embeds = added_cond_kwargs["text_embeds"]
        times = unet.add_time_proj(added_cond_kwargs["time_ids"].flatten())
        joined = torch.cat([text_embeds, times.reshape(text_embeds.shape[0], -1)], dim=-1)
        return unet.add_embedding(joined.to(emb.dtype))

    unet.get_aug_embed = get_aug_embed
    return True


def example_added(added: dict[str, int] | None, rows: int, dtype=torch.float32) -> dict:
    """Zero inputs of the added conditioning for `rows` text rows ({} where there is none)."""
    if not added:
        return {}
    return {
        "text_embeds": torch.zeros(rows, added["text_embeds"], dtype=dtype),
        "time_ids": torch.zeros(rows, added["time_ids"]),
    }


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
    winograd_output: str = "batched",
    winograd_split_min_side: int | None = None,
    attention_block_bytes: int | None = None,
    winograd4_min_side: int | None = None,
    plain_from_downscale: int | None = None,
    added_conditioning: dict[str, int] | None = None,
    transformer: str = "native",
    matmul_kernel: str = "iree",
    layout: str = "native",
    direct_convs: str = "wide",
    winograd_kernel: str = "none",
) -> ExportPlan:
    from .unet_channels_last import unsupported
    from .vae_channels_last import LAYOUTS

    if layout not in LAYOUTS:
        raise ValueError(f"export layout choice must be one of {LAYOUTS}, not {layout!r}")
    if layout == "channels_last" and (why := unsupported(unet)):
        raise ValueError(f"export layout channels_last: this UNet cannot: {why}")
    channels = unet.config.in_channels
    out_channels = unet.config.out_channels
    h, w = latent_hws[0]  # the main size; the others get functions named for their latents
    tiles = sides = None
    # F(4x4) where a conv's input is large, a plain matmul where it is at most the latent's
    # side / plain_from_downscale, the conv choice's tile elsewhere; the AMX conv kernel (under
    # matmul_kernel amx) where the input is wide enough for it
    if winograd4_min_side or plain_from_downscale or matmul_kernel == "amx":
        sides = conv_input_sides(
            unet,
            lambda: unet(
                torch.zeros(2 * batch, channels, h, w),
                torch.zeros(1),
                torch.zeros(2 * batch, text_len, text_dim),
                added_cond_kwargs=example_added(added_conditioning, 2 * batch) or None,
            ),
        )
    if winograd4_min_side or plain_from_downscale:
        small, large = WINOGRAD_TILES.get(conv, 0), WINOGRAD_TILES["winograd4"]
        plain = min(h, w) // plain_from_downscale if plain_from_downscale else 0
        tiles = tiles_by_side(sides, small, large, winograd4_min_side, plain)
    set_attention(unet, attention, attention_block_bytes, matmul_kernel)
    cat_text_time_embedding(unet)
    derived = set_conv_lowering(
        unet,
        conv,
        tiles,
        winograd_output,
        winograd_split_min_side,
        matmul_kernel,
        sides,
        direct_convs,
        winograd_kernel,
    )
    set_transformer_layout(unet, transformer)
    group_norms_in_fp32(unet, dtype)
    if matmul_kernel == "amx" and layout == "channels_last":
        set_norm_kernel(unet)
        set_upsample_kernel(unet)
        set_layer_norm_kernel(unet)
    share_cfg_prefix(unet, batch)  # last: it wraps the forwards rebound above
    unet = unet.to(dtype).eval()
    entry = (UNetEntryChannelsLast if layout == "channels_last" else UNetEntry)(unet)
    dt = NUMPY_DTYPE_NAMES[dtype]

    if added_conditioning:

        def denoise_cfg(root, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
            return root(sample, timestep, encoder_hidden_states, text_embeds, time_ids)

        def denoise(root, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
            return root(sample, timestep, encoder_hidden_states, text_embeds, time_ids)

    else:

        def denoise_cfg(root, sample, timestep, encoder_hidden_states):
            return root(sample, timestep, encoder_hidden_states)

        def denoise(root, sample, timestep, encoder_hidden_states):
            return root(sample, timestep, encoder_hidden_states)

    def spec(fn, b, hw):
        h, w = hw
        added = ()
        if added_conditioning:
            added = (
                TensorSpec("text_embeds", (b, added_conditioning["text_embeds"]), dt),
                TensorSpec("time_ids", (b, added_conditioning["time_ids"]), "float32"),
            )
        return FunctionSpec(
            name=fn.__name__ if hw == latent_hws[0] else f"{fn.__name__}_{h}x{w}",
            inputs=(
                TensorSpec("sample", (batch, channels, h, w), dt),
                TensorSpec("timestep", (1,), "float32"),
                TensorSpec("encoder_hidden_states", (b, text_len, text_dim), dt),
                *added,
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
        options={
            "attention": attention,
            "conv": conv,
            "winograd4_min_side": winograd4_min_side,
            "plain_from_downscale": plain_from_downscale,
            "transformer": transformer,
            "layout": layout,
        },
        derived=derived,
    )
