"""Attention upcast (SD 2.x's `upcast_attention`): under every export choice the attention
scores of such a layer are computed in fp32 in a half-precision model; SD 1.x layers keep the
processors they had."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diffusers.models.attention_processor import Attention, AttnProcessor2_0  # noqa: E402

from sdiree.compile.exporters.attention import (  # noqa: E402
    ChunkedAttnProcessor,
    UpcastSdpaProcessor,
    set_attention,
)


def unet_of(model_dir):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(model_dir / "unet").eval()


def attentions(model):
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_sdpa_upcasts_only_the_layers_that_ask(tiny_model, tiny_sd2_model):
    sd2 = unet_of(tiny_sd2_model)
    set_attention(sd2, "sdpa")
    layers = attentions(sd2)
    assert layers and all(m.upcast_attention for m in layers)
    assert all(type(m.processor) is UpcastSdpaProcessor for m in layers)
    from diffusers import AutoencoderKL

    sd1 = unet_of(tiny_model)
    vae = AutoencoderKL.from_pretrained(tiny_model / "vae").eval()
    for model in (sd1, vae):  # the VAE's upcast_softmax layers keep the plain fused op too
        set_attention(model, "sdpa")
        assert all(type(m.processor) is AttnProcessor2_0 for m in attentions(model))
    assert any(m.upcast_softmax for m in attentions(vae))


def _sdpa_input_dtypes(monkeypatch) -> list:
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "chunked", "decomposed"])
def test_fp16_sd2_unet_attends_in_fp32_and_matches_fp32(tiny_sd2_model, monkeypatch, attention):
    torch.manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8), torch.randn(2, 77, 32)
    ref_unet = unet_of(tiny_sd2_model)
    with torch.no_grad():
        ref = ref_unet(sample, 500.0, text).sample
    unet = unet_of(tiny_sd2_model)
    set_attention(unet, attention)
    unet = unet.half()
    seen = _sdpa_input_dtypes(monkeypatch)
    with torch.no_grad():
        got = unet(sample.half(), 500.0, text.half()).sample.float()
    if attention == "sdpa":
        assert seen and all(d == (torch.float32,) * 3 for d in seen), seen
    else:
        assert not seen  # the other choices trace no fused op
    if attention == "chunked":
        assert all(isinstance(m.processor, ChunkedAttnProcessor) for m in attentions(unet))
    assert torch.isfinite(got).all()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


def test_upcast_sdpa_survives_scores_past_fp16_range():
    """Scores of ~1e5 overflow fp16 (max 65504): the upcast processor still gives softmax
    attention; plain fp16 scores would be inf and the softmax NaN."""
    attn = Attention(query_dim=8, heads=1, dim_head=8, upcast_attention=True).eval()
    proc = UpcastSdpaProcessor()
    q = torch.full((1, 1, 8), 120.0, dtype=torch.float16)
    k = torch.full((1, 3, 8), 120.0, dtype=torch.float16)
    v = torch.arange(24, dtype=torch.float16).reshape(1, 3, 8)
    assert torch.isinf((q.float() @ k.float().transpose(1, 2)).half()).all()
    out = proc.attend(q.float(), k.float(), v.float(), 1.0, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, v.float().mean(1, keepdim=True))  # equal scores: the mean
    assert attn.upcast_attention
