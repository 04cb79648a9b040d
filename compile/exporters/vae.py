"""VAE exporters: decoder (latents → image) and encoder (image → latent mean).

Both apply the VAE scaling factor inside the module (decode divides by it, encode multiplies),
so the runtime works with diffusion-space latents throughout; the manifest records that. The
image is in [-1, 1], NCHW. Both modules take their weights from one "vae" parameter scope.
"""

from __future__ import annotations

import torch

from .base import ExportPlan, FunctionSpec, TensorSpec
from .unet import set_unet_attention

SCOPE = "vae"


class VaeDecodeEntry(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module, scaling_factor: float):
        super().__init__()
        self.vae = vae
        self.scaling_factor = scaling_factor

    def forward(self, latents):
        return self.vae.decode(latents / self.scaling_factor, return_dict=False)[0]


class VaeEncodeEntry(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module, scaling_factor: float):
        super().__init__()
        self.vae = vae
        self.scaling_factor = scaling_factor

    def forward(self, image):
        return self.vae.encode(image, return_dict=False)[0].mean * self.scaling_factor


def _prepare(vae, dtype, attention):
    set_unet_attention(vae, attention)
    return vae.to(dtype).eval()


def plan_vae_decoder(vae, *, batch, image_hw, dtype, attention) -> ExportPlan:
    vae = _prepare(vae, dtype, attention)
    dt = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    h, w = image_hw
    lc = vae.config.latent_channels
    f = 2 ** (len(vae.config.block_out_channels) - 1)

    def decode(root, latents):
        return root(latents)

    return ExportPlan(
        submodule="vae_decoder",
        scope=SCOPE,
        root=VaeDecodeEntry(vae, vae.config.scaling_factor),
        params_module=vae,
        functions=[
            FunctionSpec(
                name="decode",
                inputs=(TensorSpec("latents", (batch, lc, h // f, w // f), dt),),
                outputs=(TensorSpec("image", (batch, vae.config.out_channels, h, w), dt),),
                fn=decode,
            )
        ],
        options={"attention": attention},
    )


def plan_vae_encoder(vae, *, batch, image_hw, dtype, attention) -> ExportPlan:
    vae = _prepare(vae, dtype, attention)
    dt = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    h, w = image_hw
    lc = vae.config.latent_channels
    f = 2 ** (len(vae.config.block_out_channels) - 1)

    def encode(root, image):
        return root(image)

    return ExportPlan(
        submodule="vae_encoder",
        scope=SCOPE,
        root=VaeEncodeEntry(vae, vae.config.scaling_factor),
        params_module=vae,
        functions=[
            FunctionSpec(
                name="encode",
                inputs=(TensorSpec("image", (batch, vae.config.in_channels, h, w), dt),),
                outputs=(TensorSpec("latent_mean", (batch, lc, h // f, w // f), dt),),
                fn=encode,
            )
        ],
        options={"attention": attention},
    )
