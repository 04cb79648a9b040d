"""`matmul_kernel: "amx"`: a split Winograd conv's products (compile/exporters/winograd.py
`_product`) and the two matmuls of `chunked` attention that the fused kernel does not take (a
mask, a head dim over 160: attention.py, attention_amx.py) that fit sdiree's AMX kernel take it, with bf16 operands (the transformed weight's slices, keys and values packed for the
kernel); each stays its computation within bf16's rounding, what does not fit keeps iree's
matmul, and where this CPU has AMX the compiled module gives the eager result."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters.conv_matmul import set_conv_lowering  # noqa: E402


def _conv(c=64, o=96):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(c, o, 3, padding=1), torch.nn.Conv2d(o, 8, 3, padding=1)
    )


def _lowered(matmul):
    model = _conv()
    set_conv_lowering(model, "winograd", None, "interleaved", 16, matmul)
    return model


def test_amx_products_are_the_conv_in_bf16_and_odd_channels_stay_fp32():
    x = torch.randn(2, 64, 16, 16)
    want = torch.nn.functional.conv2d(
        x.double(), _conv()[0].weight.double(), _conv()[0].bias.double(), padding=1
    )
    iree_way, amx_way = _lowered("iree"), _lowered("amx")
    a, b = iree_way[0](x).double(), amx_way[0](x).double()
    rel_iree = ((a - want).abs().max() / want.abs().max()).item()
    rel_amx = ((b - want).abs().max() / want.abs().max()).item()
    assert rel_iree < 1e-5 and 1e-5 < rel_amx < 1e-2  # bf16 operands: rounded, not far
    # 8 output channels: no product fits, so the second conv is fp32's exactly
    y = a.float()
    torch.testing.assert_close(amx_way[1](y), iree_way[1](y), rtol=0, atol=0)


def test_exported_split_conv_dispatches_its_products_to_the_kernel(kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    model = _lowered("amx")
    x = torch.randn(2, 64, 16, 16)
    want = model(x).detach().numpy()
    text = str(iree_aot.export(model, args=(x,)).mlir_module)
    assert text.count("util.call @sdiree_amx_matmul_128x64x96(") == 16  # 4x4 elements
    out = run_amx_main(text, x.numpy())
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-3


def _three_convs_on_the_kernel(seed: int, shape: tuple):
    """A 3x3 conv (Winograd), a stride-2 one and a 1x1 one (im2col), lowered with
    `matmul_kernel: amx`, on a random input of shape: (their exported MLIR, the input, the eager
    result), the eager result checked against the exact convs within bf16's rounding."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(64, 96, 3, padding=1),
        torch.nn.Conv2d(96, 64, 3, stride=2, padding=1),
        torch.nn.Conv2d(64, 32, 1),
    )
    x = torch.randn(*shape)
    exact = model(x).double()
    set_conv_lowering(model, "winograd", None, "interleaved", 16, "amx")
    got = model(x)
    rel = ((got.double() - exact).abs().max() / exact.abs().max()).item()
    assert 1e-5 < rel < 2e-2  # bf16 operands: rounded, and not far
    return str(iree_aot.export(model, args=(x,)).mlir_module), x, got.detach().numpy()


def _runs_as_eager(text: str, x: torch.Tensor, want: np.ndarray) -> None:
    out = run_amx_main(text, x.numpy())
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-3


def test_batched_winograd_and_im2col_convs_take_the_kernel(kernel_isa):
    """Below the split side a conv's 16 products are one batched dispatch to the kernel (the
    grid's third axis); a stride-2 conv's and a 1x1 conv's im2col matmuls go to it too."""
    # 8x8: batched Winograd; im2col 2x4x4 rows, K 864; 1x1 32 rows
    text, x, want = _three_convs_on_the_kernel(3, (2, 64, 8, 8))
    assert text.count("util.call @sdiree_amx_matmul_16x32x64x96(") == 1  # 16 elements, 2x4x4 tiles
    # the im2col convs' biases start the kernel's accumulators (`b`): no add after them
    assert text.count("util.call @sdiree_amx_matmul_32x864x64b(") == 1
    assert text.count("util.call @sdiree_amx_matmul_32x64x32b(") == 1
    _runs_as_eager(text, x, want)


def test_rows_off_the_kernels_multiple_are_padded_onto_it(kernel_isa):
    """An unguided call's 144 Winograd tiles and 144 pixels (SD 2.1's 24² and 12² levels at
    768²) are not a multiple of the kernel's 32 rows: padded to 160 with zeros, their products
    go to the kernel as the linears' do, not to iree's matmul over an f32 copy of the weight
    (2.5 GB more archive at SD 2.1 size); the padding's rows leave no trace in the result."""
    # 24x24, split from 16: 16 products of 144 rows; im2col and 1x1 at 12x12: 144 rows
    text, x, want = _three_convs_on_the_kernel(5, (1, 64, 24, 24))
    assert text.count("util.call @sdiree_amx_matmul_160x64x96(") == 16
    assert text.count("util.call @sdiree_amx_matmul_160x864x64b(") == 1
    assert text.count("util.call @sdiree_amx_matmul_160x64x32b(") == 1
    assert "linalg.matmul" not in text and "torch.aten.mm" not in text
    _runs_as_eager(text, x, want)


def test_amx_attention_is_attention_in_bf16_and_odd_key_counts_are_masked():
    from sdiree.compile.exporters import attention_amx
    from sdiree.compile.exporters.amx_matmul import register
    from sdiree.compile.exporters.attention import chunked_attention

    register()
    attention_amx.register()  # the fused kernel's ops (the test passed alone only after others)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 256, 40) for _ in range(3))
    zero = torch.zeros(2, 1, 256)  # a mask: the fused kernel does not take it
    want = torch.softmax(q.double() @ k.double().transpose(1, 2) * 40**-0.5, -1) @ v.double()
    plain = chunked_attention(q, k, v, 40**-0.5, zero, 1 << 18, "iree")
    amx = chunked_attention(q, k, v, 40**-0.5, zero, 1 << 18, "amx")
    assert ((plain - want).abs().max() / want.abs().max()).item() < 1e-5
    assert 1e-4 < ((amx - want).abs().max() / want.abs().max()).item() < 2e-2
    # 77 keys at a head dim without padding (64): the fused kernel masks the padded keys
    q64 = torch.randn(2, 256, 64)
    k77, v77 = torch.randn(2, 77, 64), torch.randn(2, 77, 64)
    want77 = torch.softmax(q64.double() @ k77.double().transpose(1, 2) * 0.1, -1) @ v77.double()
    fused = chunked_attention(q64, k77, v77, 0.1, None, 1 << 18, "amx")
    assert 1e-4 < ((fused - want77).abs().max() / want77.abs().max()).item() < 2e-2


def test_exported_attention_dispatches_both_matmuls_to_the_kernel(tmp_path):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from sdiree.compile.exporters.amx_matmul import register
    from sdiree.compile.exporters.attention import chunked_attention

    register()

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return chunked_attention(q, k, v, 40**-0.5, mask, 1 << 18, "amx")

    q, k, v = (torch.randn(2, 256, 40) for _ in range(3))
    mask = torch.zeros(2, 1, 256)
    text = str(iree_aot.export(Attend(), args=(q, k, v, mask)).mlir_module)
    # 2 heads x 1 query block (256 x 256 fp32 scores fit 256 KiB): QK^T 256x64x256, P.V 256x256x64
    assert text.count("util.call @sdiree_amx_matmul_256x64x256(") == 2
    assert text.count("util.call @sdiree_amx_matmul_256x256x64(") == 2
