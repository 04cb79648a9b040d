"""The fused AMX attention (compile/exporters/attention_amx.py, specs/kernels/
amx_bf16_attention.c): `chunked` attention under `matmul_kernel: "amx"` without a mask, token
counts multiples of 32 and a head dim of at most 160 is one dispatch to the kernel, within
bf16's rounding of attention; the rest keeps the chunked path; the module links the kernel
(cross-compiled for an AMX CPU on any machine), and where this CPU has AMX its results are
attention's over several key blocks (the online softmax's rescaling), head dims and heads."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters import attention_amx  # noqa: E402
from sdiree.compile.exporters.attention import chunked_attention  # noqa: E402

KERNEL_SYMBOL = "sdiree_amx_bf16_attention_workgroup"


def _attention64(q, k, v, scale):
    s = q.double() @ k.double().transpose(1, 2) * scale
    return torch.softmax(s, -1) @ v.double()


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_fits_only_unmasked_multiples_of_32_and_small_heads():
    q = torch.zeros(2, 64, 40)
    assert attention_amx.fits(q, torch.zeros(2, 96, 40), None)
    assert attention_amx.fits(q, torch.zeros(2, 77, 40), None)  # the text's, masked in padding
    assert not attention_amx.fits(torch.zeros(2, 64, 64), torch.zeros(2, 77, 64), None)  # no room
    assert not attention_amx.fits(torch.zeros(2, 48, 40), torch.zeros(2, 96, 40), None)
    assert not attention_amx.fits(q, torch.zeros(2, 96, 40), torch.zeros(2, 1, 96))
    assert attention_amx.fits(torch.zeros(1, 64, 160), torch.zeros(1, 64, 160), None)
    assert not attention_amx.fits(torch.zeros(1, 64, 512), torch.zeros(1, 64, 512), None)  # VAE


def test_chunked_amx_attention_takes_the_fused_op_within_bf16_rounding():
    from sdiree.compile.exporters.amx_matmul import register

    register()
    attention_amx.register()
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 64, 40), torch.randn(2, 96, 40), torch.randn(2, 96, 40)
    want = _attention64(q, k, v, 40**-0.5)
    got = chunked_attention(q, k, v, 40**-0.5, None, 1 << 18, "amx")
    assert got.shape == want.shape and got.dtype == torch.float32
    assert 1e-4 < _rel(got, want) < 2e-2  # bf16 operands: rounded, and not far
    # a mask keeps the chunked path (its products on the AMX matmul): a different computation
    masked = chunked_attention(q, k, v, 40**-0.5, torch.zeros(2, 1, 96), 1 << 18, "amx")
    assert _rel(masked, want) < 2e-2 and not torch.equal(masked, got)


@pytest.mark.parametrize(
    "bh, nq, nk, d",
    [
        (3, 64, 416, 40),  # keys: three blocks of 128 and one of 32
        (2, 32, 64, 80),  # SD 1.5's 32x32-level head dim, padded to 96
        (1, 96, 160, 160),  # the largest head dim the kernel takes
        (2, 64, 77, 40),  # cross-attention's 77 text keys: padded to 96, masked out
        (2, 32, 77, 80),
    ],
)
def test_exported_attention_is_one_kernel_dispatch_and_matches(bh, nq, nk, d):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    attention_amx.register()

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return chunked_attention(q, k, v, d**-0.5, None, 1 << 18, "amx")

    torch.manual_seed(bh + d)
    # scores spread wide (x3), so a later key block raises a row's max and rescales the output
    q = torch.randn(bh, nq, d) * 3
    k, v = torch.randn(bh, nk, d), torch.randn(bh, nk, d)
    text = str(iree_aot.export(Attend(), args=(q, k, v)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_attention_") == 1
    assert "sdiree_amx_matmul" not in text  # not the chunked path
    out = run_amx_main(text, q.numpy(), k.numpy(), v.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:  # this CPU lacks AMX: cross-compiled only
        return
    want = _attention64(q, k, v, d**-0.5).numpy()
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-2
    # the eager op (what a trace's shape probes see) is the same computation but for the
    # kernel's rounding of the probabilities to bf16 (2^-9 relative)
    eager = Attend()(q, k, v).numpy()
    assert np.abs(out - eager).max() / np.abs(eager).max() < 5e-3
