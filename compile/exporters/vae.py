"""VAE exporters: decoder (latents → image) and encoder (image → the latent distribution's
mean and standard deviation).

Both apply the VAE scaling factor inside the module (decode divides by it, encode multiplies
the mean and the std), so the runtime works with diffusion-space latents throughout; the
manifest records that. The encoder returns the distribution rather than one latent so that the
runtime samples it, mean + std * noise, with its own generator, as diffusers' img2img and
inpainting pipelines do. The image is in [-1, 1], NCHW. Both modules take their weights from
one "vae" parameter scope.
"""

from __future__ import annotations

import torch

from .attention import set_attention
from .base import NUMPY_DTYPE_NAMES, ExportPlan, FunctionSpec, TensorSpec
from .conv_amx import MIN_WIDTH
from .conv_matmul import set_conv_lowering
from .group_norm_kernel import set_norm_kernel
from .norm_precision import group_norms_in_fp32
from .upsample_kernel import set_upsample_kernel

SCOPE = "vae"


class VaeDecodeEntry(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module, scaling_factor: float):
        super().__init__()
        self.vae = vae
        self.scaling_factor = scaling_factor

    def forward(self, latents):
        return self.vae.decode(latents / self.scaling_factor, return_dict=False)[0]


class VaeDecodeChannelsLast(VaeDecodeEntry):
    """VaeDecodeEntry with the decoder's activations channels-last (vae_channels_last.py)."""

    def forward(self, latents):
        from .vae_channels_last import decode

        z = latents / self.scaling_factor
        if self.vae.post_quant_conv is not None:
            z = self.vae.post_quant_conv(z)
        return decode(self.vae.decoder, z)


class VaeEncodeEntry(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module, scaling_factor: float):
        super().__init__()
        self.vae = vae
        self.scaling_factor = scaling_factor

    def forward(self, image):
        dist = self.vae.encode(image, return_dict=False)[0]
        return dist.mean * self.scaling_factor, dist.std * self.scaling_factor


def _plan(
    vae, *, submodule, entry_cls, fname, in_name, out_names, batch, image_hw, dtype, attention, conv,
    winograd_output, winograd_split_min_side, attention_block_bytes, layout="native",
    matmul_kernel="iree",
):  # fmt: skip
    from .vae_channels_last import LAYOUTS, unsupported

    if layout not in LAYOUTS:
        raise ValueError(f"export layout choice must be one of {LAYOUTS}, not {layout!r}")
    if layout == "channels_last":
        why = unsupported(vae.decoder)
        if why:
            raise ValueError(f"export layout channels_last: this VAE's decoder cannot: {why}")
        entry_cls = VaeDecodeChannelsLast
    set_attention(vae, attention, attention_block_bytes, matmul_kernel)
    # under amx every conv the AMX conv kernel fits takes it, at any of the plans' sizes (the
    # decoder's and encoder's plans share one model and its derived archive; at SD sizes their
    # inputs are 64 or wider, and a narrower one takes im2col at the call)
    wide = {m: MIN_WIDTH for m in vae.modules() if isinstance(m, torch.nn.Conv2d)}
    derived = set_conv_lowering(
        vae, conv, winograd_output=winograd_output, split_min_side=winograd_split_min_side,
        matmul_kernel=matmul_kernel, sides=wide,
    )  # fmt: skip
    group_norms_in_fp32(vae, dtype)
    if matmul_kernel == "amx" and layout == "channels_last":
        set_norm_kernel(vae)
        set_upsample_kernel(vae)
    vae = vae.to(dtype).eval()
    dt = NUMPY_DTYPE_NAMES[dtype]
    h, w = image_hw
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    latent = (batch, vae.config.latent_channels, h // f, w // f)
    image = (batch, vae.config.out_channels if fname == "decode" else vae.config.in_channels, h, w)
    shapes = {"latents": latent, "latent_mean": latent, "latent_std": latent, "image": image}

    def entry(root, x):
        return root(x)

    entry.__name__ = fname
    return ExportPlan(
        submodule=submodule,
        scope=SCOPE,
        root=entry_cls(vae, vae.config.scaling_factor),
        params_module=vae,
        functions=[
            FunctionSpec(
                name=fname,
                inputs=(TensorSpec(in_name, shapes[in_name], dt),),
                outputs=tuple(TensorSpec(name, shapes[name], dt) for name in out_names),
                fn=entry,
            )
        ],
        options={"attention": attention, "conv": conv, "layout": layout},
        derived=derived,
    )


def plan_vae_decoder(
    vae, *, batch, image_hw, dtype, attention, conv="native", winograd_output="batched",
    winograd_split_min_side=None, attention_block_bytes=None, layout="native",
    matmul_kernel="iree",
) -> ExportPlan:  # fmt: skip
    return _plan(
        vae, submodule="vae_decoder", entry_cls=VaeDecodeEntry, fname="decode",
        in_name="latents", out_names=("image",),
        batch=batch, image_hw=image_hw, dtype=dtype, attention=attention, conv=conv,
        winograd_output=winograd_output, winograd_split_min_side=winograd_split_min_side,
        attention_block_bytes=attention_block_bytes, layout=layout, matmul_kernel=matmul_kernel,
    )  # fmt: skip


def plan_vae_encoder(
    vae, *, batch, image_hw, dtype, attention, conv="native", winograd_output="batched",
    winograd_split_min_side=None, attention_block_bytes=None, matmul_kernel="iree",
) -> ExportPlan:  # fmt: skip
    return _plan(
        vae, submodule="vae_encoder", entry_cls=VaeEncodeEntry, fname="encode",
        in_name="image", out_names=("latent_mean", "latent_std"),
        batch=batch, image_hw=image_hw, dtype=dtype, attention=attention, conv=conv,
        winograd_output=winograd_output, winograd_split_min_side=winograd_split_min_side,
        attention_block_bytes=attention_block_bytes, matmul_kernel=matmul_kernel,
    )  # fmt: skip
