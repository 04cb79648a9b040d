"""Export choice `winograd_kernel: fused` under `matmul_kernel: f32`: an F(2x2) Winograd conv as
two dispatches to sdiree's fp32 Winograd kernels (input transform; products with the output
transform, bias, per-image add and residual), against torch in float64 (run where this CPU has
AVX-512; elsewhere the module is only cross-compiled)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import DATA_TILING, call_main, compile_main  # noqa: E402

from sdiree.compile.exporters import winograd_f32  # noqa: E402
from sdiree.compile.exporters.winograd import add_winograd_weights  # noqa: E402

SYMBOL = b"sdiree_wino2f_conv_workgroup"


def _run(text: str, *inputs: np.ndarray) -> np.ndarray | None:
    from sdiree.runtime.cpu_features import host_cpu_features

    runs = set(winograd_f32.CPU_FEATURES) <= host_cpu_features()
    vmfb = compile_main(text, DATA_TILING, "host" if runs else "znver4")
    assert SYMBOL in vmfb
    return call_main(vmfb, *inputs) if runs else None


def test_pack_is_the_transformed_weight_in_panels():
    u = torch.randn(16, 5, 128)
    assert torch.equal(winograd_f32.unpack(winograd_f32.pack(u)), u)


@pytest.mark.parametrize(
    "images, side, cin, cout, add_rows, residual",
    [
        ((2, (8, 6), 32, 128, 2, True)),  # 24 tiles: four full 6-tile register tiles
        ((1, (14, 2), 16, 64, 1, False)),  # 7 tiles: a short last register tile, no residual
        ((2, (4, 4), 528, 64, 1, True)),  # depth past one 512 step; the image's add broadcast
    ],
)
def test_conv_is_two_kernel_dispatches_and_matches_float64(
    images, side, cin, cout, add_rows, residual
):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    torch.manual_seed(cin + cout)
    conv = torch.nn.Conv2d(cin, cout, 3, padding=1).eval()
    torch.nn.init.normal_(conv.bias)
    add_winograd_weights(conv, 2)
    assert winograd_f32.fuse(conv, None, 2) == 1
    h, w = side
    x = torch.randn(images, h, w, cin)
    add = torch.randn(add_rows, cout)
    res = torch.randn(images, h, w, cout) if residual else None

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x, add, *res):
            return winograd_f32.conv3x3_nhwc(self.conv, x, add, res[0] if res else None)

    with torch.no_grad():
        ref = (
            torch.nn.functional.conv2d(
                x.double().permute(0, 3, 1, 2), conv.weight.double(), conv.bias.double(), padding=1
            ).permute(0, 2, 3, 1)
            + add.double()[:, None, None, :]
        )
        want = (ref if res is None else ref + res.double()).numpy()
        args = (x, add) if res is None else (x, add, res)
        eager = Conv()(*args).numpy()
    assert np.abs(eager - want).max() / np.abs(want).max() < 1e-5
    assert winograd_f32.takes(conv, x.shape)
    text = str(iree_aot.export(Conv(), args=args).mlir_module)
    assert text.count("flow.dispatch @sdiree_wino2f_") == 2
    out = _run(text, *(a.numpy() for a in args))
    if out is None:
        return
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-5


def test_only_marked_fp32_convs_with_whole_panels_take_the_kernels():
    conv = torch.nn.Conv2d(16, 40, 3, padding=1)
    add_winograd_weights(conv, 2)
    assert not winograd_f32.takes(conv, (1, 4, 4, 16))  # not marked
    winograd_f32.fuse(conv, None, 2)
    assert not winograd_f32.takes(conv, (1, 4, 4, 16))  # 40 outputs: not whole panels
    conv = torch.nn.Conv2d(16, 64, 3, padding=1)
    add_winograd_weights(conv, 2)
    winograd_f32.fuse(conv, None, 2)
    assert winograd_f32.takes(conv, (1, 4, 4, 16))
    assert not winograd_f32.takes(conv, (1, 5, 4, 16))  # an odd side
    assert not winograd_f32.takes(conv, (1, 4, 4, 16), torch.bfloat16)


def test_blocks_keep_both_workers_busy():
    assert winograd_f32.blocks(512, 640) == (256, 128)  # 10 workgroups
    assert winograd_f32.blocks(256, 640) == (256, 64)  # 5 at 128 wide: halved to 10
    assert winograd_f32.blocks(300, 1280) == (150, 128)  # equal blocks of tiles
