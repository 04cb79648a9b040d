"""Export choice `linear: f32`: nn.Linear as one dispatch to sdiree's fp32 linear kernel, bias
added by the kernel, against torch in float64 (run where this CPU has AVX-512; elsewhere the
module is only cross-compiled)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import DATA_TILING, call_main, compile_main  # noqa: E402

from sdiree.compile.exporters import linear_f32  # noqa: E402
from sdiree.compile.exporters.linear_flat import set_linear_lowering  # noqa: E402

SYMBOL = b"sdiree_f32_linear_workgroup"


def _run(
    text: str, *inputs: np.ndarray, kernel: bool = True, symbol: bytes = SYMBOL
) -> np.ndarray | None:
    from sdiree.runtime.cpu_features import host_cpu_features

    runs = set(linear_f32.CPU_FEATURES) <= host_cpu_features()
    vmfb = compile_main(text, DATA_TILING, "host" if runs else "znver4")
    assert (symbol in vmfb) == kernel
    return call_main(vmfb, *inputs) if runs else None


def test_pack_is_the_weights_transpose_in_panels():
    w = torch.randn(128, 7)
    assert torch.equal(linear_f32.unpack(linear_f32.pack(w)), w.t())
    assert linear_f32.pack(w).shape == (2, 7, 64)


@pytest.mark.parametrize(
    "shape, k, n, bias",
    [
        ((2, 77, 96), 96, 320, True),  # rows not a multiple of the 6-row tile; N in 5 panels
        ((1, 77, 96), 96, 768, True),  # one text's tokens: one 78-row block, 128-wide columns
        ((150, 600), 600, 512, False),  # depth past one 512 step, no bias: zeros added
        ((1, 1030, 40), 40, 1280, True),  # rows in 96-row blocks, the last one short
        ((3, 64), 64, 64, True),  # under MIN_ROWS: the Linear's own forward
    ],
)
def test_linear_is_one_kernel_dispatch_and_matches_float64(shape, k, n, bias):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    torch.manual_seed(k + n)
    lin = torch.nn.Linear(k, n, bias=bias).eval()
    if bias:
        torch.nn.init.normal_(lin.bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        want = (x.double() @ lin.weight.double().t()).numpy()
        if bias:
            want = want + lin.bias.double().numpy()
    assert set_linear_lowering(lin, "f32") == 1
    text = str(iree_aot.export(lin, args=(x,)).mlir_module)
    rows = int(np.prod(shape[:-1]))
    assert text.count("flow.dispatch @sdiree_f32_linear_") == (rows >= linear_f32.MIN_ROWS)
    with torch.no_grad():
        eager = lin(x).numpy()  # the op's own torch form
    assert np.abs(eager - want).max() / np.abs(want).max() < 1e-5
    out = _run(text, x.numpy(), kernel=rows >= linear_f32.MIN_ROWS)
    if out is None:
        return
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-5


def test_up_to_96_rows_are_one_row_block():
    """A text's 77 tokens in one block (each weight strip read once), 154 in 48-row blocks."""
    assert linear_f32.block_for(77, 768) == (78, 128)  # 6 column blocks: both workers busy
    assert linear_f32.block_for(77, 3072) == (78, 256)
    assert linear_f32.block_for(154, 768) == (48, 256)
    assert linear_f32.block_for(8192, 320) == (96, 320)


def test_only_outputs_in_whole_panels_take_the_kernel():
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 40))
    assert set_linear_lowering(model, "f32") == 1
    assert model[1].__dict__.get("forward") is None  # 40 outputs: its own forward


def test_split_winograd_products_take_the_kernel_under_matmul_kernel_f32():
    """`matmul_kernel: f32`: a split Winograd F(2x2) conv's 16 products on the kernel, the conv
    still torch's."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from sdiree.compile.exporters.winograd import conv2d_winograd_nhwc

    linear_f32.register()
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(16, 64, 3, padding=1).eval()

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return conv2d_winograd_nhwc(self.conv, x, 2, "interleaved", 8, "f32")

    x = torch.randn(1, 8, 8, 16)
    with torch.no_grad():
        want = conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
        eager = Conv()(x).numpy()
    assert np.abs(eager - want).max() / np.abs(want).max() < 1e-5
    text = str(iree_aot.export(Conv(), args=(x,)).mlir_module)
    assert text.count("util.call @sdiree_f32_linear_") == 16, text.count("call @sdiree")
    out = _run(text, x.numpy())
    if out is not None:
        assert np.abs(out - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize(
    "cin, cout, kernel, stride, side",
    [
        (16, 64, 1, 1, 6),  # a 1x1 conv: the input as it is
        (8, 128, 3, 2, 8),  # a strided 3x3 (a downsampler): im2col first
        (24, 64, 3, 1, 4),  # a plain 3x3 (`plain_from_downscale`)
    ],
)
def test_im2col_convs_take_the_kernel_under_matmul_kernel_f32(cin, cout, kernel, stride, side):
    """`matmul_kernel: f32`: an im2col conv's matmul on the kernel, its bias in the epilogue."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from sdiree.compile.exporters.im2col import conv2d_as_matmul_nhwc

    linear_f32.register()
    torch.manual_seed(cin + cout)
    conv = torch.nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2).eval()
    torch.nn.init.normal_(conv.bias)

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return conv2d_as_matmul_nhwc(self.conv, x, "f32")

    x = torch.randn(2, side, side, cin)
    with torch.no_grad():
        want = conv.double()(x.double().permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
        conv.float()
        eager = Conv()(x).numpy()
    assert np.abs(eager - want).max() / np.abs(want).max() < 1e-5
    text = str(iree_aot.export(Conv(), args=(x,)).mlir_module)
    assert text.count("util.call @sdiree_f32_linear_") == 1
    out = _run(text, x.numpy())
    if out is not None:
        assert out.shape == want.shape
        assert np.abs(out - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("shape, dim, inner", [((2, 45, 64), 64, 128), ((1, 20, 600), 600, 64)])
def test_geglu_is_one_kernel_dispatch_and_matches_float64(shape, dim, inner):
    """A diffusers GEGLU under `linear: f32`: projection, exact GELU of the gate and the product
    as one dispatch (rows in a short last tile; a depth past the linear's 512 step)."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from diffusers.models.activations import GEGLU

    torch.manual_seed(dim + inner)
    geglu = GEGLU(dim, inner).eval()
    torch.nn.init.normal_(geglu.proj.bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        value, gate = torch.nn.functional.linear(
            x.double(), geglu.proj.weight.double(), geglu.proj.bias.double()
        ).chunk(2, dim=-1)
        want = (value * torch.nn.functional.gelu(gate)).numpy()
    set_linear_lowering(geglu, "f32")
    with torch.no_grad():
        eager = geglu(x).numpy()
    assert np.abs(eager - want).max() / np.abs(want).max() < 1e-5
    text = str(iree_aot.export(geglu, args=(x,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_f32_geglu_") == 1
    assert "flow.dispatch @sdiree_f32_linear_" not in text
    out = _run(text, x.numpy(), symbol=b"sdiree_f32_geglu_workgroup")
    if out is not None:
        assert out.shape == want.shape
        assert np.abs(out - want).max() / np.abs(want).max() < 1e-5
