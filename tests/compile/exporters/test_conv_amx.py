"""The AMX implicit-matmul 3x3 conv (compile/exporters/conv_amx.py, specs/kernels/
amx_bf16_matmul.c): a 3x3 stride-1 conv that fits is one kernel dispatch within bf16's rounding
of torch's conv, its padding rows dropped; other convs and narrow inputs take the im2col matmul;
the module links the kernel (cross-compiled for an AMX CPU on any machine) and where this CPU
has AMX it gives the conv, over images, rows and channel blocks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters import conv_amx  # noqa: E402
from sdiree.compile.exporters.amx_matmul import register  # noqa: E402

KERNEL_SYMBOL = "sdiree_amx_bf16_conv3x3_out_workgroup"


def _bf16_conv(conv, xh):
    """torch's conv on bf16-rounded input and weight, in float64 (channels-last in and out)."""
    x = xh.to(torch.bfloat16).double().permute(0, 3, 1, 2)
    w = conv.weight.to(torch.bfloat16).double()
    y = torch.nn.functional.conv2d(x, w, conv.bias.double(), padding=1)
    return y.permute(0, 2, 3, 1)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_fits_3x3_stride_1_convs():
    assert conv_amx.fits_conv(torch.nn.Conv2d(64, 32, 3, padding=1))
    assert conv_amx.fits_conv(torch.nn.Conv2d(4, 32, 3, padding=1))  # conv_in: channels padded
    assert conv_amx.fits_conv(torch.nn.Conv2d(64, 4, 3, padding=1))  # conv_out
    assert not conv_amx.fits_conv(torch.nn.Conv2d(64, 32, 3, stride=2, padding=1))
    assert not conv_amx.fits_conv(torch.nn.Conv2d(64, 32, 1))


def test_eager_conv_is_torchs_on_bf16_operands_and_narrow_inputs_take_im2col():
    register()
    conv_amx.register()
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 32, 3, padding=1)
    xh = torch.randn(2, 5, 32, 64)
    with torch.no_grad():
        got = conv_amx.conv3x3_amx_nhwc(conv, xh)
        want = _bf16_conv(conv, xh)
        assert got.shape == (2, 5, 32, 32)
        assert _rel(got, want) < 1e-5  # the same bf16 products, summed in f32
        narrow = torch.randn(1, 8, 16, 64)  # below MIN_WIDTH: im2col
        assert _rel(conv_amx.conv3x3_amx_nhwc(conv, narrow), _bf16_conv(conv, narrow)) < 1e-5
        nchw = conv_amx.conv3x3_amx(conv, xh.permute(0, 3, 1, 2))
        torch.testing.assert_close(nchw, got.permute(0, 3, 1, 2))


@pytest.mark.parametrize(
    "n,h,w,c,o", [(2, 6, 32, 64, 96), (1, 4, 40, 32, 64), (1, 3, 32, 4, 64), (2, 2, 32, 64, 3)]
)
def test_exported_conv_is_one_kernel_dispatch_and_matches(n, h, w, c, o, kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    register()
    conv_amx.register()
    torch.manual_seed(n + w)
    conv = torch.nn.Conv2d(c, o, 3, padding=1).requires_grad_(False)

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, xh):
            return conv_amx.conv3x3_amx_nhwc(self.conv, xh)

    xh = torch.randn(n, h, w, c)
    text = str(iree_aot.export(Conv(), args=(xh,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_conv3x3o_") == 1
    assert "sdiree_amx_matmul" not in text
    out = run_amx_main(text, xh.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    want = _bf16_conv(conv, xh).numpy()
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("add_rows,residual", [(2, True), (1, False)])
def test_epilogue_adds_a_row_per_image_and_the_residual(add_rows, residual, kernel_isa):
    """conv3x3_amx_padded's epilogue: the bias plus a vector per image (a resnet's time
    embedding) or one for all, plus the residual (its skip), on the real pixels only."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    register()
    conv_amx.register()
    torch.manual_seed(add_rows)
    n, h, w, c, o = 2, 5, 32, 64, 64
    conv = torch.nn.Conv2d(c, o, 3, padding=1).requires_grad_(False)

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, xh, add, res):
            tail = conv_amx.padded_rows(n, h, w)[2]
            xp = torch.nn.functional.pad(xh, (0, 0, 1, 1, 1, 1)).reshape(-1, c)
            xp = torch.nn.functional.pad(xp, (0, 0, 0, tail)).to(torch.bfloat16)
            return conv_amx.conv3x3_amx_padded(
                self.conv, xp, n, h, w, add, res if residual else None
            )

    xh, add, res = torch.randn(n, h, w, c), torch.randn(add_rows, o), torch.randn(n, h, w, o)
    want = _bf16_conv(conv, xh) + add.double()[:, None, None, :] + (res.double() if residual else 0)
    with torch.no_grad():
        assert _rel(Conv()(xh, add, res), want) < 1e-5
    text = str(iree_aot.export(Conv(), args=(xh, add, res)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_conv3x3o") == 1
    out = run_amx_main(text, xh.numpy(), add.numpy(), res.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    assert np.abs(out - want.numpy()).max() / np.abs(want.numpy()).max() < 1e-5


def test_calls_that_differ_only_in_their_add_rows_get_functions_of_their_own(kernel_isa):
    """An add of one row (for every image) and one of a row per image type the call apart: each
    gets its own function (a kernel op's function is made once per name)."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from llvm_cpu import compile_main

    register()
    conv_amx.register()
    n, h, w, c = 2, 2, 32, 32
    conv = torch.nn.Conv2d(c, c, 3, padding=1).requires_grad_(False)
    tail = conv_amx.padded_rows(n, h, w)[2]

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, xh, one, per_image):
            xp = torch.nn.functional.pad(xh, (0, 0, 1, 1, 1, 1)).reshape(-1, c)
            xp = torch.nn.functional.pad(xp, (0, 0, 0, tail)).to(torch.bfloat16)
            a = conv_amx.conv3x3_amx_padded(self.conv, xp, n, h, w, one)
            b = conv_amx.conv3x3_amx_padded(self.conv, xp, n, h, w, per_image)
            return a.sum() + b.sum()

    args = (torch.randn(n, h, w, c), torch.randn(1, c), torch.randn(n, c))
    text = str(iree_aot.export(Two(), args=args).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_conv3x3o") == 2
    assert compile_main(text, cpu="sapphirerapids")  # the types agree: it compiles
