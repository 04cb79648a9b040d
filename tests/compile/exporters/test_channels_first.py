"""The `transformer: channels_first` export: diffusers' transformer blocks on [channels, tokens],
the same outputs, in torch and through iree's llvm-cpu."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.cfg_prefix import share_cfg_prefix  # noqa: E402
from sdiree.compile.exporters.channels_first import set_transformer_layout  # noqa: E402


def unet(linear_projection: bool, layers: int = 2):
    """Cross-attention on both levels and in the middle, `layers` blocks per transformer."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=8,
        attention_head_dim=4,
        use_linear_projection=linear_projection,
        transformer_layers_per_block=layers,
    ).eval()


@pytest.mark.parametrize("linear_projection", [False, True], ids=["conv-proj", "linear-proj"])
def test_a_unet_gives_diffusers_outputs_with_its_own_parameters(linear_projection):
    model = unet(linear_projection)
    names = list(model.state_dict())
    x, e = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16)
    with torch.no_grad():
        want = model(x, 10.0, e).sample
        # 2 down, 1 middle, 4 up transformers
        assert set_transformer_layout(model, "channels_first") == 7
        got = model(x, 10.0, e).sample
    assert list(model.state_dict()) == names
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert set_transformer_layout(model, "native") == 7
    assert not any("forward" in vars(m) for m in model.modules() if hasattr(m, "proj_in"))


@pytest.mark.parametrize("attention", ["chunked", "sdpa", "decomposed", "sdpa_pow2"])
def test_attention_is_computed_as_the_attention_choice_says(attention, monkeypatch):
    from sdiree.compile.exporters import attention as choices
    from sdiree.compile.exporters.attention import set_attention

    model = unet(True)
    x, e = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16)
    set_attention(model, attention)
    with torch.no_grad():
        want = model(x, 10.0, e).sample
        set_transformer_layout(model, "channels_first")
        calls = []
        fused = choices.fused_attention
        monkeypatch.setattr(choices, "fused_attention", lambda *a: calls.append(1) or fused(*a))
        got = model(x, 10.0, e).sample
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the padded choice goes through its processor, which calls the fused op
    assert bool(calls) == (attention == "sdpa_pow2")


def test_guidance_prefix_runs_once_and_gives_the_same_outputs():
    """share_cfg_prefix hands the first transformer its half batch: its norm runs on one image's
    rows, and the guided pair's outputs are those of diffusers."""
    model = unet(False)
    x, e = torch.randn(1, 4, 8, 8), torch.randn(2, 5, 16)
    pair = torch.cat([x, x])
    with torch.no_grad():
        want = model(pair, 10.0, e).sample
        set_transformer_layout(model, "channels_first")
        share_cfg_prefix(model, 1)
        first = model.down_blocks[0].attentions[0]
        assert first.cfg_prefix_batch == 1
        rows = []
        hook = first.norm.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        got = model(pair, 10.0, e).sample
        hook.remove()
    assert rows == [1]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_transformers_it_does_not_reproduce_keep_their_forward():
    model = unet(False, layers=1)
    block = model.down_blocks[0].attentions[0].transformer_blocks[0]
    block.only_cross_attention = True
    assert set_transformer_layout(model, "channels_first") == 6
    assert "forward" not in vars(model.down_blocks[0].attentions[0])


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="unknown transformer export choice 'nhwc'"):
        set_transformer_layout(torch.nn.Module(), "nhwc")


def test_compiled_transformer_matches_diffusers():
    """One transformer (two blocks of self- and cross-attention) through iree's llvm-cpu with the
    cpu target's data tiling and ukernels."""
    import numpy as np
    from iree.turbine import aot
    from llvm_cpu import DATA_TILING, run_main

    from sdiree.compile.exporters.attention import set_attention

    model = unet(False)
    set_attention(model, "chunked")  # the cpu target's choice
    transformer = model.down_blocks[0].attentions[0]
    x, e = torch.randn(2, 16, 8, 8), torch.randn(2, 5, 16)
    with torch.no_grad():
        want = transformer(x, e).sample

    class Entry(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = transformer

        def forward(self, x, e):
            return self.t(x, e, return_dict=False)[0]

    set_transformer_layout(transformer, "channels_first")
    mlir = str(aot.export(Entry(), args=(x, e)).mlir_module)
    # attention as `chunked` traces it: per block, self- and cross-attention 2 images x 4 heads
    assert mlir.count("torch.aten.exp ") == 2 * (2 * 4 + 2 * 4)
    got = run_main(mlir, x.numpy(), e.numpy(), flags=DATA_TILING)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-4)
