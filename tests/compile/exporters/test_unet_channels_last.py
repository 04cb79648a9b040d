"""The `layout: channels_last` UNet export: diffusers' UNet blocks rerun on [N, H, W, C] give
its noise prediction (SD 1.x, SD 2.x's linear projections and upcast attention, SDXL's added
conditioning and first level without attention), guided and unguided, with guidance's shared
prefix, for the conv lowerings and at sizes its upsamplers must be told; UNets it cannot take
are refused in one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters import group_norm_kernel  # noqa: E402
from sdiree.compile.exporters.amx_matmul import set_split  # noqa: E402
from sdiree.compile.exporters.cfg_prefix import share_cfg_prefix  # noqa: E402
from sdiree.compile.exporters.conv_amx import MIN_WIDTH  # noqa: E402
from sdiree.compile.exporters.conv_matmul import set_conv_lowering  # noqa: E402
from sdiree.compile.exporters.group_norm_kernel import set_norm_kernel  # noqa: E402
from sdiree.compile.exporters.layer_norm_kernel import set_layer_norm_kernel  # noqa: E402
from sdiree.compile.exporters.linear_flat import set_linear_lowering  # noqa: E402
from sdiree.compile.exporters.unet import (  # noqa: E402
    UNetEntry,
    UNetEntryChannelsLast,
    cat_text_time_embedding,
    plan_unet,
)
from sdiree.compile.exporters.unet_channels_last import unsupported  # noqa: E402

FAMILIES = ["tiny_model", "tiny_sd2_model", "tiny_sdxl_model"]


def load_unet(model_dir):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(model_dir / "unet").eval().requires_grad_(False)


def inputs(unet, batch, hw):
    torch.manual_seed(1)
    cfg = unet.config
    args = [
        torch.randn(batch, cfg.in_channels, *hw),
        torch.tensor([500.0]),
        torch.randn(2 * batch, 77, cfg.cross_attention_dim),
    ]
    if cfg.addition_embed_type == "text_time":
        text_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        args += [torch.randn(2 * batch, text_dim), torch.rand(2 * batch, 6) * 1024]
    return args


def wide_case(unet):
    """The time embedding concatenated, inputs wide enough for the conv kernel (batch 1),
    diffusers' prediction on them, and every conv marked wide (set_conv_lowering's `sides`)."""
    cat_text_time_embedding(unet)
    args = inputs(unet, 1, (2 * MIN_WIDTH, 2 * MIN_WIDTH))
    with torch.no_grad():
        want = UNetEntry(unet)(*args)
    wide = {m: MIN_WIDTH for m in unet.modules() if isinstance(m, torch.nn.Conv2d)}
    return args, want, wide


def unguided(args, batch):
    sample, t, text, *added = args
    return [sample, t, text[batch:], *(a[batch:] for a in added)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conv", ["native", "winograd"])
def test_channels_last_gives_diffusers_prediction(family, conv, request):
    unet = load_unet(request.getfixturevalue(family))
    cat_text_time_embedding(unet)
    batch = 1
    args = inputs(unet, batch, (unet.config.sample_size,) * 2)
    with torch.no_grad():
        want = UNetEntry(unet)(*args)
        want_single = UNetEntry(unet)(*unguided(args, batch))
    assert unsupported(unet) is None
    set_conv_lowering(unet, conv, split_min_side=4 if conv == "winograd" else None)
    names = list(unet.state_dict())  # with the conv lowering's derived weights
    share_cfg_prefix(unet, batch)
    entry = UNetEntryChannelsLast(unet)
    with torch.no_grad():
        got = entry(*args)
        single = entry(*unguided(args, batch))
    assert list(unet.state_dict()) == names  # the same parameter archive serves it
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(single, want_single, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got[:batch], got[batch:])


def test_sides_the_upsamplers_must_be_told(tiny_sd2_model):
    """Latent sides not divisible by the UNet's overall factor (SD 2's tiny: 4): diffusers
    passes each upsampler its skip's size, as the channels-last upsampling does."""
    unet = load_unet(tiny_sd2_model)
    args = inputs(unet, 1, (6, 10))
    with torch.no_grad():
        want = UNetEntry(unet)(*args)
        set_conv_lowering(unet, "matmul")
        got = UNetEntryChannelsLast(unet)(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_shared_prefix_runs_at_half_batch_until_the_first_cross_attention(tiny_model):
    unet = load_unet(tiny_model)
    batch = 2
    args = inputs(unet, batch, (8, 8))
    set_conv_lowering(unet, "matmul")
    share_cfg_prefix(unet, batch)
    seen = {}

    def record(name):
        def hook(module, a):
            seen.setdefault(name, a[0].shape[0])

        return hook

    first = unet.down_blocks[0]
    first.resnets[0].time_emb_proj.register_forward_pre_hook(record("temb"))
    first.resnets[0].norm1.register_forward_pre_hook(record("never: group_norm() reads it"))
    block = first.attentions[0].transformer_blocks[0]
    block.norm1.register_forward_pre_hook(record("norm1"))
    block.attn2.register_forward_pre_hook(record("attn2"))
    with torch.no_grad():
        UNetEntryChannelsLast(unet)(*args)
    assert seen == {"temb": 1, "norm1": 2 * batch, "attn2": 2 * batch}
    # norm1 gets both halves and takes one (cfg_prefix), as in diffusers' forward


def _plan(unet, **kw):
    return plan_unet(
        unet, batch=1, latent_hws=[(8, 8)], text_len=77,
        text_dim=unet.config.cross_attention_dim, dtype=torch.float32, attention="chunked",
        conv="matmul", layout="channels_last", **kw,
    )  # fmt: skip


def test_plan_records_the_layout(tiny_model):
    plan = _plan(load_unet(tiny_model))
    assert plan.options["layout"] == "channels_last"
    assert isinstance(plan.root, UNetEntryChannelsLast)


@pytest.mark.parametrize(
    "change,why",
    [
        (lambda u: u.register_to_config(center_input_sample=True), "it centres its input sample"),
        (
            lambda u: u.register_to_config(class_embed_type="timestep"),
            "it takes class or image conditioning",
        ),
        (
            lambda u: setattr(u.up_blocks[0].resnets[0], "time_embedding_norm", "scale_shift"),
            "a resnet's time embedding norm is 'scale_shift'",
        ),
        (
            lambda u: setattr(u.down_blocks[0].downsamplers[0], "use_conv", False),
            "a downsampler is not a strided conv",
        ),
    ],
)
def test_unets_it_cannot_take_are_refused_in_one_line(tiny_model, change, why):
    unet = load_unet(tiny_model)
    change(unet)
    with pytest.raises(ValueError) as e:
        _plan(unet)
    assert str(e.value) == f"export layout channels_last: this UNet cannot: {why}"


def _channels_last_watching_norms(unet, args):
    """The channels-last UNet's prediction, and what each GroupNorm kernel call was told after
    its operands (its first: whether it writes a conv's padded rows)."""
    seen = []
    original = group_norm_kernel.norm_bf16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(group_norm_kernel, "norm_bf16", lambda *a: seen.append(a[3:]) or original(*a))
        with torch.no_grad():
            got = UNetEntryChannelsLast(unet)(*args)
    return got, seen


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("operands,tolerance", [("bf16", 3e-2), ("bf16x3", 1e-4)])
def test_norms_on_their_kernels_with_the_amx_convs(family, operands, tolerance, request):
    """Under matmul_kernel amx the resnets' and transformers' GroupNorms take their kernels
    (group_norm_kernel.py), the transformer blocks' LayerNorms theirs, the convs wide enough
    read the padded bf16 rows those write, the others the bf16 cast back: the prediction is
    diffusers' within bf16's rounding, and with `amx_operands: bf16x3` (every operand as two
    bf16 parts) within fp32's class."""
    unet = load_unet(request.getfixturevalue(family))
    if operands == "bf16x3":
        set_split(unet)
    args, want, wide = wide_case(unet)
    set_conv_lowering(unet, "winograd", split_min_side=4, matmul_kernel="amx", sides=wide)
    assert set_norm_kernel(unet) > 0
    assert set_layer_norm_kernel(unet) == 0  # its linears take fp32
    set_linear_lowering(unet, "amx")
    assert set_layer_norm_kernel(unet) == 3 * sum(  # each block's three LayerNorms
        type(m).__name__ == "BasicTransformerBlock" for m in unet.modules()
    )
    got, seen = _channels_last_watching_norms(unet, args)
    assert seen and any(s and s[0] == 1 for s in seen)  # some norm wrote a conv's padded rows
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tolerance, err
    if operands == "bf16":
        assert err > 1e-4, err  # bf16 operands: rounded, so the split's bound means something


def test_direct_convs_none_keeps_the_wide_convs_winograd(tiny_model):
    """Export choice `direct_convs: none` (cpu bf16 on avx512_bf16 without AMX, where products
    are dear): under matmul_kernel amx no conv takes the direct conv kernel, so no norm writes a
    conv's padded rows; the wide convs are Winograd with transformed weights, and the prediction
    stays diffusers' within bf16's rounding."""
    unet = load_unet(tiny_model)
    args, want, wide = wide_case(unet)
    with pytest.raises(ValueError, match="direct_convs"):
        set_conv_lowering(unet, "winograd", matmul_kernel="amx", sides=wide, direct_choice="x")
    tag = set_conv_lowering(
        unet, "winograd", split_min_side=4, matmul_kernel="amx", sides=wide, direct_choice="none"
    )
    assert tag and tag.startswith("winograd")  # the wide convs' transformed weights too
    set_norm_kernel(unet)
    set_linear_lowering(unet, "amx")
    got, seen = _channels_last_watching_norms(unet, args)
    assert not any(s and s[0] == 1 for s in seen)  # no conv reads padded rows
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 1e-4 < err < 3e-2, err


@pytest.mark.parametrize("family", FAMILIES)
def test_winograd_kernel_fused_takes_the_winograd_convs(family, request):
    """Export choice `winograd_kernel: fused` (cpu bf16 on avx512_bf16 without AMX): the F(2x2)
    Winograd convs take the fused Winograd kernels (winograd_fused.py), those after a GroupNorm
    reading the padded bf16 rows its kernel writes (with the time embedding and the skip added
    in the epilogue); the prediction stays diffusers' within bf16's rounding."""
    from sdiree.compile.exporters import winograd_fused

    unet = load_unet(request.getfixturevalue(family))
    args, want, wide = wide_case(unet)
    with pytest.raises(ValueError, match="winograd_kernel"):
        set_conv_lowering(unet, "winograd", matmul_kernel="amx", winograd_kernel="x")
    set_conv_lowering(
        unet,
        "winograd",
        split_min_side=4,
        matmul_kernel="amx",
        sides=wide,
        direct_choice="none",
        winograd_kernel="fused",
    )
    set_norm_kernel(unet)
    set_linear_lowering(unet, "amx")
    calls = []
    original = winograd_fused.conv3x3_wino_padded
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            winograd_fused,
            "conv3x3_wino_padded",
            lambda *a, **k: calls.append(a[2:5]) or original(*a, **k),
        )
        got, seen = _channels_last_watching_norms(unet, args)
    resnet_convs = (
        sum(1 for m in unet.modules() if type(m).__name__ == "ResnetBlock2D") * 2
    )  # conv1 and conv2 of each
    assert len(calls) >= resnet_convs  # and the upsamplers'
    assert sum(1 for s in seen if s and s[0] == 1) >= resnet_convs  # padded rows for them
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 1e-4 < err < 3e-2, err
