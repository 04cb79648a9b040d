"""The fused AMX attention (compile/exporters/attention_amx.py, specs/kernels/
amx_bf16_attention.c): `chunked` attention under `matmul_kernel: "amx"` without a mask, a query
count a multiple of 32 and a head dim of at most 160 is one dispatch to the kernel, within
bf16's rounding of attention; the rest keeps the chunked path; the module links the kernel
(cross-compiled for an AMX CPU on any machine), and where this CPU has AMX its results are
attention's over several key blocks (the online softmax's rescaling, also where a later block's
scores pass the first's maxima), key counts the kernel masks (77 text keys at every head dim),
head dims and heads."""

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
    assert attention_amx.fits(q, torch.zeros(2, 77, 40), None)  # the text's: the kernel masks
    assert attention_amx.fits(torch.zeros(2, 64, 160), torch.zeros(2, 77, 160), None)
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
        (2, 64, 77, 160),  # ... at SD 1.5's 16x16 level: a head dim without padding
        (1, 32, 200, 64),  # a last key block of 72 keys, 56 of them real
    ],
)
def test_exported_attention_is_one_kernel_dispatch_and_matches(bh, nq, nk, d, kernel_isa):
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
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    want = _attention64(q, k, v, d**-0.5).numpy()
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-2
    # the eager op (what a trace's shape probes see) is the same computation but for the
    # kernel's rounding of the probabilities to bf16 (2^-9 relative); both round the output to
    # bf16, a unit apart at most
    eager = Attend()(q, k, v).numpy()
    assert np.abs(out - eager).max() / np.abs(eager).max() < 1e-2


@pytest.mark.parametrize("split", [0, 1])
def test_scores_past_the_first_blocks_maxima_rescale(split, kernel_isa):
    """Keys that grow along the sequence: each later key block's scores pass the first block's
    row maxima by far more than the kernel's slack, so its rows move their references and
    rescale what they summed (both softmax paths: bf16 and bf16x3 operands)."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    attention_amx.register()

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attention_amx.amx_attention(q, k, v, 40**-0.5, bool(split))

    torch.manual_seed(3)
    q = torch.randn(2, 32, 40).abs()
    k = torch.randn(2, 416, 40).abs() * torch.linspace(0.1, 6, 416)[None, :, None]
    v = torch.randn(2, 416, 40)
    text = str(iree_aot.export(Attend(), args=(q, k, v)).mlir_module)
    out = run_amx_main(text, q.numpy(), k.numpy(), v.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:
        return
    want = _attention64(q, k, v, 40**-0.5).numpy()
    assert np.abs(out - want).max() / np.abs(want).max() < (1e-4 if split else 2e-2)


def _split(t, heads):
    b, n, hd = t.shape
    return t.reshape(b, n, heads, hd // heads).permute(0, 2, 1, 3).reshape(b * heads, n, -1)


def _merge(t, b):
    bh, n, d = t.shape
    return t.reshape(b, bh // b, n, d).permute(0, 2, 1, 3).reshape(b, n, -1)


@pytest.mark.parametrize("nk", [96, 77])
def test_heads_in_place_is_attention_per_head(nk):
    """amx_attention_heads on the projections [batch, tokens, heads * dim] is amx_attention on
    the split heads, merged back."""
    attention_amx.register()
    torch.manual_seed(nk)
    q, k, v = torch.randn(2, 64, 120), torch.randn(2, nk, 120), torch.randn(2, nk, 120)
    assert attention_amx.fits_heads(q, k, 3, None)
    got = attention_amx.amx_attention_heads(q, k, v, 3, 40**-0.5)
    assert got.dtype == torch.bfloat16  # the output projection's operand
    split = attention_amx.amx_attention(_split(q, 3), _split(k, 3), _split(v, 3), 40**-0.5)
    torch.testing.assert_close(got.float(), _merge(split, 2), rtol=0, atol=0)
    want = _merge(_attention64(_split(q, 3), _split(k, 3), _split(v, 3), 40**-0.5), 2)
    assert _rel(got, want) < 2e-2


def test_exported_heads_in_place_read_and_write_strided_rows(kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    attention_amx.register()

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attention_amx.amx_attention_heads(q, k, v, 4, 40**-0.5).float()

    torch.manual_seed(7)
    q, k, v = torch.randn(2, 64, 160) * 3, torch.randn(2, 77, 160), torch.randn(2, 77, 160)
    text = str(iree_aot.export(Attend(), args=(q, k, v)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_attention_2x64x4x") == 1
    assert text.count("flow.dispatch @sdiree_amx_pack_") == 2  # the keys' and values' packing
    out = run_amx_main(text, q.numpy(), k.numpy(), v.numpy(), kernel=KERNEL_SYMBOL)
    if out is None:
        return
    want = _merge(_attention64(_split(q, 4), _split(k, 4), _split(v, 4), 40**-0.5), 2).numpy()
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-2


@pytest.mark.parametrize("values", [0, 1])
@pytest.mark.parametrize(
    "nk, heads, d",
    [
        (64, 8, 40),  # SD 1.5's 64x64 level: the head dim padded to 64
        (77, 4, 40),  # the text's keys, padded to 96 (zeros past 77)
        (32, 3, 80),
        (96, 1, 160),  # a head dim with no padding
    ],
)
def test_exported_pack_kv_is_one_dispatch_and_the_graphs_packing(nk, heads, d, values, kernel_isa):
    """pack_kv (the keys' or values' cast, head split, padding and packing in one pass of the
    kernel) gives the attention kernel's operand bit for bit as the graph's ops pack it."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    attention_amx.register()

    class Pack(torch.nn.Module):
        def forward(self, x):
            return attention_amx.pack_kv(x, heads, values).float()

    torch.manual_seed(nk + d + values)
    x = torch.randn(2, nk, heads * d)
    text = str(iree_aot.export(Pack(), args=(x,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_pack_") == 1
    want = attention_amx._eager_pack(x, heads, values).float().numpy()
    out = run_amx_main(text, x.numpy(), kernel="sdiree_amx_bf16_pack_kv_workgroup")
    if out is None:
        return
    assert out.shape == want.shape
    assert np.array_equal(out, want)
    # the head dim's padding is zeros (the keys': pairs of columns past d)
    assert not (out[:, :, d // 2 :] if not values else out[:, d // 16 + (d % 16 > 0) :]).any()


@pytest.mark.parametrize("cross", [False, True])
def test_chunked_processor_sends_the_projections_as_they_are(monkeypatch, cross):
    """ChunkedAttnProcessor under amx calls the kernel on [batch, tokens, heads * dim] (self-
    and cross-attention, 77 text keys), within bf16's rounding of diffusers' attention."""
    from diffusers.models.attention_processor import Attention

    from sdiree.compile.exporters.attention import ChunkedAttnProcessor

    attention_amx.register()
    torch.manual_seed(11)
    attn = Attention(120, heads=3, dim_head=40, cross_attention_dim=48 if cross else None).eval()
    x = torch.randn(2, 64, 120)
    ctx = torch.randn(2, 77, 48) if cross else None
    with torch.no_grad():
        want = attn(x, ctx)
        calls = []
        inner = attention_amx.amx_attention_heads
        monkeypatch.setattr(
            attention_amx, "amx_attention_heads", lambda *a: calls.append(a[0].shape) or inner(*a)
        )
        attn.set_processor(ChunkedAttnProcessor(matmul="amx"))
        got = attn(x, ctx)
    assert calls == [(2, 64, 120)]
    assert 1e-5 < _rel(got, want) < 2e-2
