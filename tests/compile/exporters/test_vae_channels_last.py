"""The `layout: channels_last` VAE decoder export: diffusers' decoder blocks rerun on [N, H, W, C]
give its image for every conv lowering, with the VAE's own parameters; VAEs it cannot take and
submodules it does not apply to are refused in one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.conv_matmul import set_conv_lowering  # noqa: E402
from sdiree.compile.exporters.vae import plan_vae_decoder  # noqa: E402
from sdiree.compile.exporters.vae_channels_last import decode, unsupported  # noqa: E402


def vae(**kw):
    """Two levels with an upsampler, a shortcut conv (32 -> 16 channels) and mid attention."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    config = dict(
        block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )  # fmt: skip
    return AutoencoderKL(**{**config, **kw}).eval().requires_grad_(False)


@pytest.mark.parametrize(
    "conv,split",
    [("native", None), ("matmul", None), ("winograd", None), ("winograd4", None),
     ("winograd4", 8), ("winograd", 8)],
)  # fmt: skip
def test_decoder_gives_diffusers_image_for_each_conv_lowering(conv, split):
    model = vae()
    z = torch.randn(2, 4, 8, 12)
    with torch.no_grad():
        want = model.decoder(z)
        names = list(model.state_dict())
        set_conv_lowering(model, conv, winograd_output="batched", split_min_side=split)
        got = decode(model.decoder, z)
    assert got.shape == want.shape == (2, 3, 16, 24)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)
    assert [n for n in model.state_dict() if "winograd" not in n] == names


def test_half_precision_norms_compute_in_float32():
    """As every GroupNorm of a half-precision export (norm_precision.py): an fp16 decoder's
    channels-last image is the fp16 NCHW one's, norms in float32, to fp16 rounding."""
    from sdiree.compile.exporters.norm_precision import group_norms_in_fp32

    model = vae()
    group_norms_in_fp32(model, torch.float16)
    model = model.to(torch.float16)
    z = torch.randn(1, 4, 8, 8).to(torch.float16)
    with torch.no_grad():
        want = model.decoder(z).float()
        got = decode(model.decoder, z)
    assert got.dtype == torch.float16
    # fp16 statistics were 2.4e-3 off here (of an image up to 1.2), float32 ones 9.8e-4
    torch.testing.assert_close(got.float(), want, atol=1.5e-3, rtol=0)


def test_the_plan_traces_the_channels_last_decode_and_diffusers_decode_alike():
    model = vae()
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        want = model.decode(latents / model.config.scaling_factor).sample
        plan = plan_vae_decoder(
            model, batch=1, image_hw=(16, 16), dtype=torch.float32, attention="decomposed",
            conv="winograd4", layout="channels_last",
        )  # fmt: skip
        got = plan.root(latents)
    assert plan.options["layout"] == "channels_last"
    assert type(plan.root).__name__ == "VaeDecodeChannelsLast"
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


def test_a_decoder_it_cannot_take_and_a_bad_choice_are_one_line():
    model = vae(norm_num_groups=8)
    assert unsupported(model.decoder) is None
    model.decoder.conv_norm_out = torch.nn.LayerNorm(16)
    assert unsupported(model.decoder) == "its output norm is not a GroupNorm"
    kw = dict(batch=1, image_hw=(16, 16), dtype=torch.float32, attention="decomposed")
    with pytest.raises(ValueError, match="this VAE's decoder cannot: its output norm"):
        plan_vae_decoder(model, layout="channels_last", **kw)
    with pytest.raises(ValueError, match="export layout choice must be one of"):
        plan_vae_decoder(vae(), layout="nhwc", **kw)


def test_amx_plan_puts_the_norms_and_upsamplers_on_their_kernels():
    """Under matmul_kernel amx the decoder's GroupNorms (and SiLUs) take their kernels
    (group_norm_kernel.py), those before a conv on the conv kernel writing its padded rows, and
    so does its upsampler (upsample_kernel.py): the image is diffusers' within bf16's rounding."""
    from sdiree.compile.exporters import group_norm_kernel, upsample_kernel

    model = vae(block_out_channels=(32, 64))  # channels the conv kernel takes unpadded
    latents = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        want = model.decode(latents / model.config.scaling_factor).sample
        plan = plan_vae_decoder(
            model, batch=1, image_hw=(128, 128), dtype=torch.float32, attention="chunked",
            conv="winograd", layout="channels_last", matmul_kernel="amx",
        )  # fmt: skip
        seen, ups = [], []
        original, original_up = group_norm_kernel.norm_bf16, upsample_kernel.upsampled_bf16
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(
                group_norm_kernel, "norm_bf16", lambda *a: seen.append(a[3:]) or original(*a)
            )
            mp.setattr(
                upsample_kernel, "upsampled_bf16", lambda *a: ups.append(a) or original_up(*a)
            )
            got = plan.root(latents)
    assert len(seen) == sum(isinstance(m, torch.nn.GroupNorm) for m in model.decoder.modules()) - 1
    assert any(s and s[0] == 1 for s in seen)  # written as a conv kernel's padded rows
    assert len(ups) == 1 and ups[0][0].shape == (1, 16, 16, 64)  # the one upsampler, 16 -> 32
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_amx_plan_with_amx_linears_keeps_the_image():
    """Under `linear: amx` (the cpu presets' VAE on AMX and avx512_bf16 CPUs) the mid block's
    attention projections are rebound to the AMX matmul kernel, the image still diffusers'
    within bf16's rounding."""
    from sdiree.compile.exporters.linear_flat import set_linear_lowering

    model = vae(block_out_channels=(32, 64))
    latents = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        want = model.decode(latents / model.config.scaling_factor).sample
    attn = model.decoder.mid_block.attentions[0]
    # to_q, to_k, to_v and to_out[0] of the encoder's and the decoder's mid attention
    assert set_linear_lowering(model, "amx") == 8
    assert "forward" in attn.to_q.__dict__
    with torch.no_grad():
        plan = plan_vae_decoder(
            model, batch=1, image_hw=(128, 128), dtype=torch.float32, attention="chunked",
            conv="winograd", layout="channels_last", matmul_kernel="amx",
        )  # fmt: skip
        got = plan.root(latents)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
