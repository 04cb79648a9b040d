"""Nearest 2x upsampling on sdiree's kernel (compile/exporters/upsample_kernel.py, specs/kernels/
upsample.c): its output is the broadcast's bf16 (hi and lo parts under bf16x3) as the 3x3 conv
kernel's zero-padded rows, eagerly and compiled, over several row blocks with a short last one;
an Upsample2D goes through it only where marked, and then gives what the broadcast and the conv
kernel give; exported, the upsampling is one kernel dispatch, no broadcast or pad copy."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters import conv_amx, upsample_kernel  # noqa: E402
from sdiree.compile.exporters.amx_matmul import operand, register  # noqa: E402
from sdiree.compile.exporters.conv_matmul import CHANNELS_LAST_FORWARD  # noqa: E402

KERNEL_SYMBOL = "sdiree_upsample2x_pad_workgroup"


def _want(xh: torch.Tensor, tail: int, split: bool) -> torch.Tensor:
    """The reference: torch's nearest interpolation, as the conv kernel's padded bf16 rows."""
    up = torch.nn.functional.interpolate(xh.permute(0, 3, 1, 2), scale_factor=2, mode="nearest")
    y = operand(up.permute(0, 2, 3, 1), split)
    y = torch.nn.functional.pad(y, (0, 0, 1, 1, 1, 1)).reshape(-1, y.shape[-1])
    return torch.nn.functional.pad(y, (0, 0, 0, tail))


def _upsampler(c: int, o: int, seed: int):
    from diffusers.models.upsampling import Upsample2D

    torch.manual_seed(seed)
    u = Upsample2D(c, use_conv=True, out_channels=o).eval().requires_grad_(False)
    setattr(u.conv, CHANNELS_LAST_FORWARD, types.MethodType(conv_amx.conv3x3_amx_nhwc, u.conv))
    return u


@pytest.mark.parametrize("split", [False, True])
def test_eager_output_is_the_broadcast_padded_for_the_conv_kernel(split):
    upsample_kernel.register()
    xh = torch.randn(2, 3, 16, 64) * 3.0
    _, _, tail = conv_amx.padded_rows(2, 6, 32)
    got = upsample_kernel.upsampled_bf16(xh, tail, split)
    assert got.dtype == torch.bfloat16
    assert got.shape == (2 * 8 * 34 + tail, 128 if split else 64)
    torch.testing.assert_close(got, _want(xh, tail, split), rtol=0, atol=0)


def test_only_marked_nearest_upsamplers_with_a_conv_are_taken():
    from diffusers.models.upsampling import Upsample2D

    model = torch.nn.ModuleList(
        [
            Upsample2D(64, use_conv=True),
            Upsample2D(64, use_conv=False),
            Upsample2D(64, use_conv=True, use_conv_transpose=True),
        ]
    )
    assert upsample_kernel.set_upsample_kernel(model) == 1
    xh = torch.randn(1, 4, 16, 64)
    assert upsample_kernel.fits(model[0], xh)
    assert not upsample_kernel.fits(model[1], xh)
    assert not upsample_kernel.fits(model[0], torch.randn(1, 4, 16, 48))  # 48 % 32
    assert not upsample_kernel.fits(Upsample2D(64, use_conv=True), xh)  # unmarked


def test_upsample_conv_gives_what_the_broadcast_and_the_conv_kernel_give():
    from sdiree.compile.exporters.channels_last import upsample

    register()
    conv_amx.register()
    u = _upsampler(64, 32, 1)
    xh = torch.randn(2, 3, 16, 64)
    with torch.no_grad():
        plain = upsample(u, xh)  # unmarked: the broadcast, then the conv kernel
        upsample_kernel.set_upsample_kernel(u)
        got = upsample(u, xh)
        narrow = upsample(u, torch.randn(1, 4, 8, 64))  # 16 wide: the conv takes im2col
    assert got.shape == (2, 6, 32, 32)
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    assert narrow.shape == (1, 8, 16, 32)


@pytest.mark.parametrize("n,h,w,c,split", [(2, 11, 64, 96, 0), (1, 3, 16, 64, 1)])
def test_exported_upsampling_is_one_kernel_dispatch_and_matches(n, h, w, c, split, kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    upsample_kernel.register()
    _, _, tail = conv_amx.padded_rows(n, 2 * h, 2 * w)

    class Up(torch.nn.Module):
        def forward(self, xh):
            return upsample_kernel.upsampled_bf16(xh, tail, bool(split)).float()

    torch.manual_seed(h)
    xh = torch.randn(n, h, w, c) * 4.0  # 11 rows of 64: 8 rows a block, a short last one
    text = str(iree_aot.export(Up(), args=(xh,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_upsample2x_pad_") == 1
    out = run_amx_main(text, xh.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    want = _want(xh, tail, bool(split)).float().numpy()
    assert out.shape == want.shape
    np.testing.assert_array_equal(out, want)
