"""The fused fp32 attention kernel (export choice `attention: fused_f32`): one dispatch per
attention, read from and written to the projections' layout, against torch's attention in
float64 (run where this CPU has AVX-512; elsewhere the module is only cross-compiled)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import DATA_TILING, call_main, compile_main  # noqa: E402

from sdiree.compile.exporters import attention_f32  # noqa: E402

SYMBOL = b"sdiree_f32_attention_workgroup"


def _run(text: str, *inputs: np.ndarray) -> np.ndarray | None:
    from sdiree.runtime.cpu_features import host_cpu_features

    runs = set(attention_f32.CPU_FEATURES) <= host_cpu_features()
    vmfb = compile_main(text, DATA_TILING, "host" if runs else "znver4")
    assert SYMBOL in vmfb
    return call_main(vmfb, *inputs) if runs else None


def _want(q, k, v, heads: int, scale: float) -> np.ndarray:
    return attention_f32.reference(
        q.double(), k.double(), v.double(), heads, scale * attention_f32.LOG2_E
    ).numpy()


def test_fits_unmasked_f32_head_dims_in_steps_of_8():
    q, k = torch.zeros(2, 100, 320), torch.zeros(2, 77, 320)
    assert attention_f32.fits_heads(q, k, 8, None)  # 40 wide, ragged token counts
    assert attention_f32.fits_heads(torch.zeros(2, 64, 1280), torch.zeros(2, 64, 1280), 8, None)
    assert not attention_f32.fits_heads(q, k, 8, torch.zeros(2, 1, 77))  # a mask
    assert not attention_f32.fits_heads(q, k, 64, None)  # 5 wide
    assert not attention_f32.fits_heads(
        torch.zeros(2, 64, 96), torch.zeros(2, 64, 96), 8, None
    )  # 12
    assert not attention_f32.fits_heads(torch.zeros(1, 32, 192), torch.zeros(1, 32, 192), 1, None)
    assert not attention_f32.fits_heads(q.half(), k.half(), 8, None)


@pytest.mark.parametrize(
    "b, nq, nk, heads, d",
    [
        (1, 64, 416, 2, 40),  # keys: three blocks of 128 and one of 32
        (2, 100, 77, 3, 40),  # cross-attention's 77 keys; a last block of 4 queries
        (2, 32, 64, 2, 80),
        (1, 48, 200, 1, 160),  # the largest head dim; a last key block of 72
        (1, 32, 130, 2, 64),  # SD 2.x's and SDXL's head dim; a last key block of 2
        (1, 33, 1, 2, 8),  # one key: the output is its value
    ],
)
def test_exported_attention_is_one_dispatch_and_matches_float64(b, nq, nk, heads, d):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    attention_f32.register()
    scale = d**-0.5

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attention_f32.f32_attention_heads(q, k, v, heads, scale)

    torch.manual_seed(nq + nk)
    # keys that grow along the sequence: later key blocks raise the rows' maxima, which rescales
    # what the earlier ones summed
    q = torch.randn(b, nq, heads * d) * 2
    k = torch.randn(b, nk, heads * d) * torch.linspace(0.2, 3, nk)[None, :, None]
    v = torch.randn(b, nk, heads * d)
    text = str(iree_aot.export(Attend(), args=(q, k, v)).mlir_module)
    assert text.count("flow.dispatch @sdiree_f32_attention_") == 1
    assert "transpose" not in text  # heads read in place
    want = _want(q, k, v, heads, scale)
    eager = Attend()(q, k, v).numpy()  # the op's own torch form: what traces' probes see
    assert np.abs(eager - want).max() / np.abs(want).max() < 1e-5
    out = _run(text, q.numpy(), k.numpy(), v.numpy())
    if out is None:
        return
    assert out.shape == want.shape
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-5
    if nk == 1:
        np.testing.assert_allclose(out, np.broadcast_to(v.numpy(), out.shape), rtol=1e-6)


@pytest.mark.parametrize("cross", [False, True])
def test_processor_sends_fitting_attention_to_the_kernel_and_the_rest_chunked(cross):
    """A diffusers Attention under `fused_f32`: one kernel dispatch, its result torch's."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from diffusers.models.attention_processor import Attention

    from sdiree.compile.exporters.attention import FusedF32AttnProcessor

    attention_f32.register()
    torch.manual_seed(5)
    attn = Attention(64, cross_attention_dim=48 if cross else None, heads=2, dim_head=32).eval()
    x = torch.randn(2, 96, 64)
    text_states = torch.randn(2, 77, 48)
    with torch.no_grad():
        want = attn(x, text_states if cross else None).numpy()
    attn.set_processor(FusedF32AttnProcessor())

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x, c):
            return self.attn(x, c if cross else None)

    text = str(iree_aot.export(Layer(), args=(x, text_states)).mlir_module)
    assert text.count("flow.dispatch @sdiree_f32_attention_") == 1
    out = _run(text, x.numpy(), text_states.numpy())
    if out is not None:
        assert np.abs(out - want).max() / np.abs(want).max() < 1e-5
    # a mask keeps the chunked path: no kernel
    mask = torch.zeros(2, 1, 77 if cross else 96)
    with torch.no_grad():
        masked = attn(x, text_states if cross else None, attention_mask=mask).numpy()
    assert np.abs(masked - want).max() / np.abs(want).max() < 1e-5
