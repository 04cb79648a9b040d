"""Guidance's shared prefix: the layers before the first cross-attention run once for both
halves, and the guided call still equals diffusers' UNet on the repeated latents."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.cfg_prefix import cfg_prefix_modules, share_cfg_prefix  # noqa: E402
from sdiree.compile.exporters.unet import UNetEntry  # noqa: E402


def load_unet(model_dir):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(model_dir / "unet").eval()


def inputs(unet, batch):
    torch.manual_seed(1)
    c, s = unet.config.in_channels, unet.config.sample_size
    text = torch.randn(2 * batch, 77, unet.config.cross_attention_dim)
    return torch.randn(batch, c, s, s), torch.tensor([500.0]), text


def test_prefix_ends_at_the_first_self_attention(tiny_model):
    unet = load_unet(tiny_model)
    first = unet.down_blocks[0]
    block = first.attentions[0].transformer_blocks[0]
    expected = [unet.conv_in, first.resnets[0], first.attentions[0].norm]
    expected += [first.attentions[0].proj_in, block.norm1, block.attn1]
    assert cfg_prefix_modules(unet) == expected
    assert block.attn2 not in cfg_prefix_modules(unet)


def test_a_conditioned_time_embedding_leaves_only_conv_in(tiny_model):
    unet = load_unet(tiny_model)
    unet.register_to_config(addition_embed_type="text_time")
    assert cfg_prefix_modules(unet) == [unet.conv_in]


@pytest.mark.parametrize("batch", [1, 2])
def test_shared_prefix_is_exact_and_runs_at_half_batch(tiny_model, batch):
    unet = load_unet(tiny_model)
    sample, t, text = inputs(unet, batch)
    with torch.no_grad():
        ref = unet(torch.cat([sample, sample]), t, text, return_dict=False)[0]
        ref_single = unet(sample, t, text[batch:], return_dict=False)[0]
    names = list(unet.state_dict())
    assert share_cfg_prefix(unet, batch) == 6
    assert list(unet.state_dict()) == names  # one parameter archive still serves every target

    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, args[0].shape[0])

        return hook

    first = unet.down_blocks[0]
    first.resnets[0].conv1.register_forward_pre_hook(record("resnet"))
    first.attentions[0].transformer_blocks[0].attn2.register_forward_pre_hook(record("attn2"))
    entry = UNetEntry(unet)
    with torch.no_grad():
        got = entry(sample, t, text)
    assert seen["resnet"] == batch  # inside the prefix: one half
    assert seen["attn2"] == 2 * batch  # the cross-attention: both halves
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[:batch], got[batch:])  # the halves do differ after the text

    with torch.no_grad():  # `denoise`, at batch B, runs as before
        single = entry(sample, t, text[batch:])
    torch.testing.assert_close(single, ref_single, rtol=0, atol=0)
