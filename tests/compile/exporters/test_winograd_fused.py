"""The fused Winograd F(2x2) conv (compile/exporters/winograd_fused.py, specs/kernels/
winograd_bf16.c): a 3x3 conv as two kernel dispatches (input transform; products, output
transform and epilogue) within bf16's rounding of torch's conv, with the bias, a per-image add
and a residual in its epilogue, over images, tile blocks that end mid-block and channel blocks;
the module links the kernels for either instruction set and, where this CPU runs them, gives
the eager op's result."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters import winograd_fused  # noqa: E402
from sdiree.compile.exporters.winograd import add_winograd_weights  # noqa: E402

KERNEL_SYMBOL = "sdiree_wino2_conv_workgroup"


def _conv(c: int, o: int, seed: int) -> torch.nn.Conv2d:
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(c, o, 3, padding=1).requires_grad_(False)
    holder = torch.nn.Sequential(conv)
    add_winograd_weights(holder, 2)
    winograd_fused.mark(conv)
    return conv


def _ref(conv, xh, add=None, res=None):
    """torch's conv of the bf16-rounded input, float64, channels-last, plus add and res."""
    x = xh.to(torch.bfloat16).double().permute(0, 3, 1, 2)
    y = torch.nn.functional.conv2d(x, conv.weight.double(), conv.bias.double(), padding=1)
    y = y.permute(0, 2, 3, 1)
    if add is not None:
        y = y + add.double()[:, None, None, :]
    return y if res is None else y + res.double()


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_takes_even_sides_and_channels_in_32s_only():
    conv = _conv(64, 32, 0)
    assert winograd_fused.takes(conv, (2, 8, 8, 64))
    assert not winograd_fused.takes(conv, (2, 7, 8, 64))  # odd side
    assert not winograd_fused.takes(_conv(48, 32, 0), (2, 8, 8, 48))
    plain = torch.nn.Conv2d(64, 32, 3, padding=1)
    assert not winograd_fused.takes(plain, (2, 8, 8, 64))  # not marked


def test_blocks_split_channels_only_for_small_grids():
    most = winograd_fused.TILE_BLOCK_MAX
    assert winograd_fused.blocks(2048, 320, 320) == (most, 320)
    tb, nb = winograd_fused.blocks(128, 1280, 1280)
    assert tb == most and (128 // tb) * (1280 // nb) >= winograd_fused.MIN_WORKGROUPS
    assert winograd_fused.blocks(96, 64, 64) == (32, 32)  # no smaller than the kernels' 32


def test_eager_ops_are_the_conv_within_bf16_rounding():
    winograd_fused.register()
    conv = _conv(64, 96, 1)
    xh, add, res = torch.randn(2, 6, 10, 64), torch.randn(2, 96), torch.randn(2, 6, 10, 96)
    with torch.no_grad():
        got = winograd_fused.conv3x3_wino_nhwc(conv, xh, add, res)
    # the transformed tiles and weights rounded to bf16 (F(2x2)'s ~1e-2 class, NOTES)
    assert got.shape == (2, 6, 10, 96)
    assert _rel(got, _ref(conv, xh, add, res)) < 2e-2


@pytest.mark.parametrize(
    "n,h,w,c,o,with_add,with_res",
    [
        (2, 6, 10, 64, 96, True, True),
        (1, 8, 8, 32, 64, False, False),
        (2, 16, 16, 64, 256, True, False),
    ],
)
def test_exported_conv_is_two_kernel_dispatches_and_matches(
    n, h, w, c, o, with_add, with_res, kernel_isa
):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    winograd_fused.register()
    conv = _conv(c, o, n + h + o)
    rows = 1 if not with_add else n

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, xh, add, res):
            return winograd_fused.conv3x3_wino_nhwc(
                self.conv, xh, add if with_add else None, res if with_res else None
            )

    xh, add, res = torch.randn(n, h, w, c), torch.randn(rows, o), torch.randn(n, h, w, o)
    with torch.no_grad():
        eager = Conv()(xh, add, res).numpy()
    want = _ref(conv, xh, add if with_add else None, res if with_res else None).numpy()
    assert _rel(eager, want) < 2e-2
    text = str(iree_aot.export(Conv(), args=(xh, add, res)).mlir_module)
    assert text.count("flow.dispatch @sdiree_wino2_input_") == 1
    assert text.count("flow.dispatch @sdiree_wino2_conv") == 1
    out = run_amx_main(text, xh.numpy(), add.numpy(), res.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    assert out.shape == want.shape
    # the kernels' own products against the eager op's (the same bf16 operands, f32 sums)
    assert _rel(out, eager) < 1e-5


def test_a_residual_that_broadcasts_is_added_after_the_kernels():
    """Guidance's shared prefix gives a conv of two images one image's skip: it broadcasts."""
    winograd_fused.register()
    conv = _conv(32, 32, 3)
    xh, res = torch.randn(2, 4, 4, 32), torch.randn(1, 4, 4, 32)
    with torch.no_grad():
        got = winograd_fused.conv3x3_wino_nhwc(conv, xh, None, res)
    assert got.shape == (2, 4, 4, 32)
    assert _rel(got, _ref(conv, xh, None, res)) < 2e-2


def test_calls_that_differ_only_in_images_get_functions_of_their_own(kernel_isa):
    """One image's 16 tiles and two images' 32 both round up to 32 rows: each call still gets
    its own function (a kernel op's function is made once per name)."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from llvm_cpu import compile_main

    winograd_fused.register()
    conv = _conv(32, 32, 4)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, one, two):
            a = winograd_fused.conv3x3_wino_nhwc(self.conv, one)
            b = winograd_fused.conv3x3_wino_nhwc(self.conv, two)
            return a.sum() + b.sum()

    args = (torch.randn(1, 8, 8, 32), torch.randn(2, 8, 8, 32))
    text = str(iree_aot.export(Two(), args=args).mlir_module)
    assert text.count("flow.dispatch @sdiree_wino2_conv") == 2
    assert compile_main(text, cpu="sapphirerapids")  # the types agree: it compiles
