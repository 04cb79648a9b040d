"""conv `matmul`, `winograd`, `winograd4` and `pointwise_einsum` export choices compute what
Conv2d computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.conv_matmul import conv1x1_as_einsum, convs_as_matmuls  # noqa: E402
from sdiree.compile.exporters.im2col import conv2d_as_matmul  # noqa: E402
from sdiree.compile.exporters.winograd import conv2d_winograd, winograd_applies  # noqa: E402


@pytest.mark.parametrize(
    "cin,cout,kernel,stride,padding,bias",
    [
        (8, 16, 3, 1, 1, True),  # resnet conv
        (8, 8, 3, 2, 1, True),  # downsampler
        (8, 12, 1, 1, 0, True),  # 1x1 shortcut / proj
        (4, 8, 3, 1, 1, False),
        (3, 5, (3, 1), (2, 1), (1, 0), True),  # rectangular kernel, stride and padding
        (6, 6, 3, 2, 0, True),  # no padding, odd output size
    ],
)
def test_matches_conv2d(cin, cout, kernel, stride, padding, bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=bias)
    x = torch.randn(2, cin, 11, 9)
    ref = conv(x)
    for lowering in (conv2d_as_matmul, conv1x1_as_einsum):
        got = lowering(conv, x)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pointwise_einsum_puts_the_weight_first():
    """The einsum form must trace with the weight as the contraction's first operand (the
    order iree's cuda fp16 codegen gets right); other convs keep Conv2d's own forward."""
    conv = torch.nn.Conv2d(8, 12, 1)
    graph = torch.fx.symbolic_trace(lambda x: conv1x1_as_einsum(conv, x)).graph
    (einsum,) = [n for n in graph.nodes if n.target is torch.functional.einsum]
    assert einsum.args[0] == "oc,nchw->nohw"
    assert str(einsum.args[1]) != "x" and str(einsum.args[2]) == "x"


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize(
    "cin,cout,h,w,stride,applies",
    [
        (8, 16, 12, 8, 1, True),
        (64, 64, 16, 16, 1, True),
        (8, 16, 10, 6, 1, None),  # 10x6: F(2x2) applies, F(4x4) falls back to im2col
        (8, 8, 12, 12, 2, False),  # stride 2: im2col
    ],
)
def test_winograd_matches_conv2d(m, cin, cout, h, w, stride, applies):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
    x = torch.randn(2, cin, h, w)
    expected = (m == 2) if applies is None else applies
    assert winograd_applies(conv, x, m) == expected
    with torch.no_grad():
        ref = conv(x)
        got = conv2d_winograd(conv, x, m)
    assert got.shape == ref.shape
    # F(4x4,3x3)'s transforms (1/24, 8, ...) round more than F(2x2,3x3)'s
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < (2e-6 if m == 2 else 3e-5), rel


def tiny_unet(sample_size: int):
    """A two-level SD-style UNet (cross-attention at the top level), seeded."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=sample_size,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=8,
        attention_head_dim=4,
    ).eval()


@pytest.mark.parametrize("conv", ["matmul", "winograd", "winograd4", "pointwise_einsum"])
def test_rewrites_a_unet_without_changing_outputs_or_parameter_names(conv):
    unet = tiny_unet(8)
    names = list(unet.state_dict())
    x, t, e = torch.randn(2, 4, 8, 8), torch.tensor(10.0), torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = unet(x, t, e).sample
        count = convs_as_matmuls(unet, conv)
        got = unet(x, t, e).sample
    n_convs = sum(isinstance(m, torch.nn.Conv2d) for m in unet.modules())
    assert count == n_convs > 0
    assert list(unet.state_dict()) == names
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert all("forward" in vars(m) for m in unet.modules() if isinstance(m, torch.nn.Conv2d))


def test_grouped_convolutions_are_left_alone():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=2)
    assert convs_as_matmuls(torch.nn.Sequential(conv)) == 0
    assert "forward" not in vars(conv)


def test_winograd_weights_are_derived_parameters_with_the_same_result(tmp_path):
    """set_conv_lowering("winograd") adds G g G^T as `<conv>.weight_winograd` to eligible convs
    only; the forward uses it (a changed one changes the output); the model's own parameters go
    to one archive, the derived ones to another."""
    import iree.runtime as rt

    from sdiree.compile.exporters.base import save_parameters
    from sdiree.compile.exporters.conv_matmul import set_conv_lowering
    from sdiree.compile.exporters.derived import is_derived

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1),  # eligible
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),  # stride 2: im2col
        torch.nn.Conv2d(8, 6, 1),  # 1x1: im2col
    ).eval()
    own = list(model.state_dict())
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        ref = model(x)
        assert set_conv_lowering(model, "winograd") == "winograd2"
        derived = [n for n in model.state_dict() if is_derived(n)]
        assert derived == ["0.weight_winograd"]
        assert model[0].weight_winograd.shape == (16, 4, 8)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
        model[0].weight_winograd.mul_(2)
        assert (model(x) - ref).abs().max() > 1e-2

    save_parameters(model, tmp_path / "own.irpa")
    save_parameters(model, tmp_path / "derived.irpa", derived=True)
    for path, names in ((tmp_path / "own.irpa", own), (tmp_path / "derived.irpa", derived)):
        index = rt.ParameterIndex()
        index.load(str(path))
        assert sorted(k for k, _ in index.items()) == sorted(names)
    assert set_conv_lowering(model, "winograd") == "winograd2"  # again: still has them
    assert [n for n in model.state_dict() if is_derived(n)] == derived
    assert set_conv_lowering(torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1)), "winograd") is None
    assert set_conv_lowering(torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3)), "native") is None


def test_winograd4_derives_its_own_weights_and_refuses_a_second_tile_on_the_same_model():
    """`winograd4` adds F(4x4,3x3) weights (36 per channel pair) to their own archive tag and
    uses them; a second plan on the same model (the VAE's decoder and encoder share one) asking
    for the other tile is refused, since both would read one `<conv>.weight_winograd`."""
    from sdiree.compile.exporters.conv_matmul import set_conv_lowering

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1)).eval()
    x = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        ref = model(x)
        assert set_conv_lowering(model, "winograd4") == "winograd4"
        assert model[0].weight_winograd.shape == (36, 4, 8)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
        model[0].weight_winograd.mul_(2)
        assert (model(x) - ref).abs().max() > 1e-2
    assert set_conv_lowering(model, "winograd4") == "winograd4"  # the same tile again is fine
    with pytest.raises(ValueError, match=r"F\(4x4,3x3\) weights, not F\(2x2,3x3\)"):
        set_conv_lowering(model, "winograd")
    with pytest.raises(ValueError, match="export conv choice must be one of"):
        set_conv_lowering(model, "winograd8")


def test_winograd4_min_side_gives_large_inputs_f4_and_names_the_mix():
    """plan_unet with winograd4_min_side: a fake-tensor forward records each conv's input size;
    3x3 convs on inputs at least that large get F(4x4,3x3) weights and the rest the conv
    choice's F(2x2); outputs still match; the derived archive's tag names the assignment, so
    another latent size (another assignment) gets another archive."""
    from sdiree.compile.exporters.unet import plan_unet

    def plan(latent, min_side):
        return plan_unet(
            tiny_unet(16), batch=1, latent_hws=[(latent, latent)], text_len=5, text_dim=16,
            dtype=torch.float32, attention="decomposed", conv="winograd",
            winograd4_min_side=min_side,
        )  # fmt: skip

    p = plan(16, 16)
    unet = p.params_module
    tiles = {
        name: m.weight_winograd.shape[0]
        for name, m in unet.named_modules()
        if hasattr(m, "weight_winograd")
    }
    # 16x16 level: conv_in, down 0, up 1 and the upsampler's conv; 8x8: down 1, up 0, mid
    assert tiles["conv_in"] == tiles["down_blocks.0.resnets.0.conv1"] == 36
    assert tiles["up_blocks.0.upsamplers.0.conv"] == tiles["conv_out"] == 36
    assert tiles["down_blocks.1.resnets.0.conv1"] == tiles["mid_block.resnets.0.conv2"] == 16
    assert p.derived.startswith("winograd2+4-")
    assert p.options["winograd4_min_side"] == 16

    ref = tiny_unet(16)
    x, t, e = torch.randn(1, 4, 16, 16), torch.tensor(10.0), torch.randn(2, 5, 16)
    x = torch.cat([x, x])  # guidance's halves: the plan runs the layers before the text once
    with torch.no_grad():
        torch.testing.assert_close(unet(x, t, e).sample, ref(x, t, e).sample, rtol=1e-4, atol=2e-5)
        unet.conv_in.weight_winograd.mul_(2)
        assert (unet(x, t, e).sample - ref(x, t, e).sample).abs().max() > 1e-3

    assert plan(32, 16).derived == "winograd4"  # every level large enough
    assert plan(16, 64).derived == "winograd2"  # none large enough
    with pytest.raises(ValueError, match="need a Winograd conv choice"):
        plan_unet(
            tiny_unet(16), batch=1, latent_hws=[(16, 16)], text_len=5, text_dim=16,
            dtype=torch.float32, attention="decomposed", conv="matmul", winograd4_min_side=16,
        )  # fmt: skip


@pytest.mark.parametrize("split_min_side,split,batched", [(None, 0, 1), (16, 1, 1), (8, 1, 0)])
def test_winograd_split_min_side_splits_the_large_inputs_convs(
    monkeypatch, split_min_side, split, batched
):  # fmt: skip
    """plan_unet with winograd_split_min_side: the Winograd convs whose input side is at least
    that run one 2-D matmul per tile element, the others one batched matmul; outputs match the
    model's own either way."""
    from sdiree.compile.exporters import winograd
    from sdiree.compile.exporters.unet import plan_unet

    calls = {"_winograd_products": 0, "_winograd_batched": 0}
    for name in calls:

        def counted(*args, _name=name, _real=getattr(winograd, name)):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(winograd, name, counted)
    p = plan_unet(
        tiny_unet(16), batch=1, latent_hws=[(16, 16)], text_len=5, text_dim=16,
        dtype=torch.float32, attention="decomposed", conv="winograd",
        winograd_output="interleaved", winograd_split_min_side=split_min_side,
    )  # fmt: skip
    ref = tiny_unet(16)
    x, t, e = torch.randn(1, 4, 16, 16), torch.tensor(10.0), torch.randn(2, 5, 16)
    x = torch.cat([x, x])
    with torch.no_grad():
        out = p.params_module(x, t, e).sample
        torch.testing.assert_close(out, ref(x, t, e).sample, rtol=1e-4, atol=2e-5)
    # the 16x16 level's convs split from 16, the 8x8 level's too from 8
    assert (calls["_winograd_products"] > 0) == bool(split), calls
    assert (calls["_winograd_batched"] > 0) == bool(batched), calls


def test_plain_from_downscale_runs_the_smallest_inputs_as_plain_matmuls():
    """plan_unet with plain_from_downscale: 3x3 convs whose input side is at most the latent's
    side over it get no Winograd weight (a plain im2col matmul, 9/16 of F(2x2)'s weight
    memory); the others keep their tiles; outputs still match the model's own."""
    from sdiree.compile.exporters.unet import plan_unet

    def plan(**kw):
        return plan_unet(
            tiny_unet(16), batch=1, latent_hws=[(16, 16)], text_len=5, text_dim=16,
            dtype=torch.float32, attention="decomposed", conv="winograd", **kw,
        )  # fmt: skip

    p = plan(winograd4_min_side=16, plain_from_downscale=2)  # plain at 8x8, F(4x4) at 16x16
    unet = p.params_module
    tiles = {n: m.weight_winograd.shape[0] for n, m in unet.named_modules()
             if hasattr(m, "weight_winograd")}  # fmt: skip
    assert tiles["conv_in"] == tiles["down_blocks.0.resnets.0.conv1"] == tiles["conv_out"] == 36
    for plain in ("down_blocks.1.resnets.0.conv1", "mid_block.resnets.0.conv2",
                  "up_blocks.0.resnets.0.conv1"):  # fmt: skip
        assert plain not in tiles, plain
    assert p.derived == "winograd4"
    assert p.options["plain_from_downscale"] == 2
    ref = tiny_unet(16)
    x, t, e = torch.randn(1, 4, 16, 16), torch.tensor(10.0), torch.randn(2, 5, 16)
    x = torch.cat([x, x])
    with torch.no_grad():
        torch.testing.assert_close(unet(x, t, e).sample, ref(x, t, e).sample, rtol=1e-4, atol=2e-5)
        unet.mid_block.resnets[0].conv2.weight.mul_(2)  # the plain conv reads its own weight
        assert (unet(x, t, e).sample - ref(x, t, e).sample).abs().max() > 1e-3
    # without F(4x4): F(2x2) above the plain level
    q = plan(plain_from_downscale=2)
    assert q.derived == "winograd2"
    assert not hasattr(q.params_module.mid_block.resnets[0].conv2, "weight_winograd")


def test_derived_weights_of_an_fp16_file_are_rounded_once_to_the_export_dtype():
    """An fp16 model compiled in fp32: G g G^T in float64, rounded to fp32 only (rounding it
    to fp16 first cost ~1e-3 relative and made the weights unrecoverable for pruning)."""
    from sdiree.compile.exporters.winograd import derived_weight_maker, winograd_weight

    g = (torch.randn(8, 4, 3, 3) * 0.02).half()

    class Source:
        def tensor(self, name):
            assert name == "conv.weight"
            return g

    for tile in (2, 4):
        made = derived_weight_maker("conv.weight_winograd", ((tile + 2) ** 2, 4, 8),
                                    torch.float32, Source())()  # fmt: skip
        exact = winograd_weight(g.double(), tile).float()
        assert made.dtype == torch.float32 and torch.equal(made, exact)
        twice = winograd_weight(g.double(), tile).half().float()
        assert not torch.equal(made, twice)


def test_a_derived_archive_of_an_older_revision_is_written_again(tmp_path):
    """The cache's record of a derived archive carries DERIVED_REVISION; one without it (or of
    another) reads as absent, so the archive is computed again. Own archives are unaffected."""
    import json

    from sdiree.compile.driver import Builder
    from sdiree.compile.exporters import DERIVED_REVISION

    b = Builder.__new__(Builder)
    own, derived = tmp_path / "unet.irpa", tmp_path / "unet.winograd2+4-abcd1234.irpa"
    for path in (own, derived):
        path.write_bytes(b"x")
        b.record_digest(path, "d" * 64)
        assert b.recorded_digest(path)[0] == "d" * 64
    assert (
        json.loads(Builder.digest_path(derived).read_text())["derived_revision"] == DERIVED_REVISION
    )
    for path in (own, derived):  # as an older sdiree recorded them
        rec = json.loads(Builder.digest_path(path).read_text())
        rec.pop("derived_revision", None)
        Builder.digest_path(path).write_text(json.dumps(rec))
    assert b.recorded_digest(own)[0] == "d" * 64
    assert b.recorded_digest(derived) == ("", None)
