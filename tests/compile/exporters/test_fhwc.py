"""compile/exporters/fhwc.py: convolutions on channels-last filters (cuda's UNet)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),  # a downsampler
        torch.nn.Conv2d(8, 6, 1),  # 1x1: a weight-first einsum, no derived filter
        torch.nn.Conv2d(6, 6, 3, padding=1, groups=2),  # not supported: left alone
    ).eval()


def test_the_convs_read_their_channels_last_filters_with_the_same_result(tmp_path):
    """set_conv_lowering("pointwise_einsum_fhwc") gives every supported conv with a kernel
    over 1x1 `<conv>.weight_fhwc` ([O, kh, kw, C]), which its forward reads (a changed one
    changes the output); the model's own parameters go to one archive, the derived ones to
    another; a second call adds none."""
    import iree.runtime as rt

    from sdiree.compile.exporters.base import save_parameters
    from sdiree.compile.exporters.conv_matmul import set_conv_lowering
    from sdiree.compile.exporters.derived import is_derived

    model = _model()
    own = list(model.state_dict())
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        ref = model(x)
        assert set_conv_lowering(model, "pointwise_einsum_fhwc") == "fhwc"
        derived = [n for n in model.state_dict() if is_derived(n)]
        assert derived == ["0.weight_fhwc", "1.weight_fhwc"]
        assert model[0].weight_fhwc.shape == (8, 3, 3, 4)
        assert torch.equal(model[1].weight_fhwc, model[1].weight.permute(0, 2, 3, 1))
        assert model[1].weight_fhwc.is_contiguous()
        torch.testing.assert_close(model(x), ref, rtol=1e-6, atol=1e-6)
        for i in (0, 1):
            model[i].weight.mul_(2)  # the originals are no longer read
        torch.testing.assert_close(model(x), ref, rtol=1e-6, atol=1e-6)
        model[1].weight_fhwc.mul_(2)
        assert (model(x) - ref).abs().max() > 1e-2

    save_parameters(model, tmp_path / "own.irpa")
    save_parameters(model, tmp_path / "derived.irpa", derived=True)
    for path, names in ((tmp_path / "own.irpa", own), (tmp_path / "derived.irpa", derived)):
        index = rt.ParameterIndex()
        index.load(str(path))
        assert sorted(k for k, _ in index.items()) == sorted(names)
    assert set_conv_lowering(model, "pointwise_einsum_fhwc") == "fhwc"
    assert [n for n in model.state_dict() if is_derived(n)] == derived
    only_1x1 = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1))
    assert set_conv_lowering(only_1x1, "pointwise_einsum_fhwc") is None


def test_the_trace_permutes_the_stored_filter_back():
    """What iree gets: the channels-last parameter, permuted to [O, C, kh, kw] before the conv
    (so a channels-last compile's own filter transpose cancels it), not the original weight."""
    import iree.turbine.aot as aot

    from sdiree.compile.exporters.conv_matmul import set_conv_lowering

    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1)).eval()
    set_conv_lowering(model, "pointwise_einsum_fhwc")
    aot.externalize_module_parameters(model)
    mlir = str(aot.export(model, args=(torch.zeros(1, 4, 8, 8),)).mlir_module)
    assert '"0.weight_fhwc"' in mlir and '"0.weight"' not in mlir
    assert "torch.aten.permute" in mlir


def test_derived_from_the_files_as_at_export_and_at_run_time():
    """The archive's maker (from the model's files, compile/exporters/derived.py) and the
    runtime's numpy derivation (runtime/weights/derived.py, for --weights/--lora) give the
    parameter the export registered, bit for bit; a placeholder weight gets a placeholder of
    the channels-last shape."""
    from sdiree.compile.exporters.derived import derived_weight_maker, is_derived
    from sdiree.compile.exporters.fhwc import _fhwc_parameter
    from sdiree.compile.placeholders import is_placeholder, mark, placeholder
    from sdiree.runtime.weights.derived import base_key, derived_weight

    conv = torch.nn.Conv2d(5, 7, 3, padding=1).half()
    registered = _fhwc_parameter(conv.weight)

    class Files:
        def tensor(self, name):
            assert name == "down.conv.weight"
            return conv.weight.detach().float()  # as a fp32 file holds it

    key = "down.conv.weight_fhwc"
    assert is_derived(key) and base_key(key) == "down.conv.weight"
    made = derived_weight_maker(key, (7, 3, 3, 5), torch.float16, Files())()
    assert made.dtype == torch.float16 and torch.equal(made, registered)
    ours = derived_weight(key, conv.weight.detach().numpy(), (7, 3, 3, 5))
    np.testing.assert_array_equal(ours, registered.numpy())
    assert ours.flags["C_CONTIGUOUS"]
    with pytest.raises(ValueError, match="no derived weight"):
        derived_weight("down.conv.weight", ours, ours.shape)
    weight = mark(torch.nn.Parameter(placeholder((7, 5, 3, 3), torch.float16), requires_grad=False))
    fake = _fhwc_parameter(weight)
    assert is_placeholder(fake) and tuple(fake.shape) == (7, 3, 3, 5)


def test_a_unet_on_channels_last_filters_computes_the_same():
    """A diffusers UNet (every kind of conv SD has: in/out, resnets, shortcuts, down- and
    upsamplers) gives the same output on its channels-last filters; its own parameter names
    stay, each non-1x1 conv gains one `_fhwc`."""
    from diffusers import UNet2DConditionModel

    from sdiree.compile.exporters.conv_matmul import set_conv_lowering

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=8,
        attention_head_dim=4,
    ).eval()
    names = list(unet.state_dict())
    wide = [n for n, m in unet.named_modules()
            if isinstance(m, torch.nn.Conv2d) and tuple(m.kernel_size) != (1, 1)]  # fmt: skip
    x, t, e = torch.randn(2, 4, 8, 8), torch.tensor(10.0), torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = unet(x, t, e).sample
        assert set_conv_lowering(unet, "pointwise_einsum_fhwc") == "fhwc"
        got = unet(x, t, e).sample
    after = list(unet.state_dict())
    assert [n for n in after if n in names] == names
    assert sorted(set(after) - set(names)) == sorted(f"{n}.weight_fhwc" for n in wide)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
