"""UNet exporter: (latents, timestep, text embeddings) → noise prediction.

Two entry functions share the parameters: `denoise_cfg` at batch 2B (unconditional and
conditional halves in one call, so guidance is one call per step) and `denoise` at batch B (for
guidance scale 1, which skips the unconditional half). The timestep is one float32 value.
"""

from __future__ import annotations

import torch

from .base import ExportPlan, FunctionSpec, TensorSpec
from .conv_matmul import CONV_CHOICES, convs_as_matmuls


class UNetEntry(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


def set_unet_attention(unet: torch.nn.Module, attention: str) -> None:
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    # AttnProcessor is the classic bmm-softmax-bmm form; 2_0 keeps fused SDPA.
    unet.set_attn_processor(AttnProcessor() if attention == "decomposed" else AttnProcessor2_0())


def set_conv_lowering(model: torch.nn.Module, conv: str) -> None:
    if conv not in CONV_CHOICES:
        raise ValueError(f"export conv choice must be one of {CONV_CHOICES}, not {conv!r}")
    if conv != "native":
        convs_as_matmuls(model, winograd=conv == "winograd")


def plan_unet(
    unet: torch.nn.Module,
    *,
    batch: int,
    latent_hw: tuple[int, int],
    text_len: int,
    text_dim: int,
    dtype: torch.dtype,
    attention: str,
    conv: str = "native",
) -> ExportPlan:
    set_unet_attention(unet, attention)
    set_conv_lowering(unet, conv)
    unet = unet.to(dtype).eval()
    entry = UNetEntry(unet)
    dt = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    channels = unet.config.in_channels
    out_channels = unet.config.out_channels
    h, w = latent_hw

    def denoise_cfg(root, sample, timestep, encoder_hidden_states):
        return root(sample, timestep, encoder_hidden_states)

    def denoise(root, sample, timestep, encoder_hidden_states):
        return root(sample, timestep, encoder_hidden_states)

    def spec(fn, b):
        return FunctionSpec(
            name=fn.__name__,
            inputs=(
                TensorSpec("sample", (b, channels, h, w), dt),
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
        functions=[spec(denoise_cfg, 2 * batch), spec(denoise, batch)],
        options={"attention": attention, "conv": conv},
    )
