"""`linear: "amx"` (compile/exporters/linear_amx.py, amx_matmul.py): a Linear whose sizes fit
sdiree's AMX kernel (specs/kernels/amx_bf16_matmul.c) computes bf16 products summed in fp32,
its weight packed for the kernel; the export dispatches to the kernel's object, which iree links
into the module (cross-compiled for an AMX CPU on any machine), and where this CPU has AMX the
module's results are the eager op's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters.amx_matmul import KERNEL_ISAS, fits, pack_b, unpack_b  # noqa: E402
from sdiree.compile.exporters.linear_flat import set_linear_lowering  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 96)
        self.down = torch.nn.Linear(96, 32)
        self.odd = torch.nn.Linear(32, 24)  # 24 outputs: not for the kernel

    def forward(self, x):
        return self.odd(self.down(torch.nn.functional.gelu(self.up(x))))


def bf16_linear(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The product of bf16-rounded input and weight, summed in float64."""
    xb = x.to(torch.bfloat16).double()
    wb = linear.weight.to(torch.bfloat16).double()
    return (xb @ wb.t() + linear.bias.double()).float()


def test_pack_b_is_amxs_b_layout_and_reads_back():
    n, k = 64, 96
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)  # exact in bf16 below 256
    w = w % 251
    packed = pack_b(w)
    assert packed.shape == (n // 16, k // 2, 16, 2) and packed.dtype == torch.bfloat16
    flat = packed.reshape(-1)
    for kk, nn in [(0, 0), (1, 0), (0, 1), (5, 17), (95, 63), (33, 40)]:
        at = ((nn // 16) * (k // 2) + kk // 2) * 32 + (nn % 16) * 2 + kk % 2
        assert flat[at].item() == w[nn, kk].item()
    torch.testing.assert_close(unpack_b(packed).float(), w.t(), rtol=0, atol=0)


def test_fits_only_static_multiples_of_32():
    assert fits(128, 320, 640)
    assert not fits(154, 320, 640)  # the text's 2 x 77 tokens
    assert not fits(128, 24, 640) and not fits(128, 320, 40)
    assert not fits(None, 320, 640)  # a size the trace does not know


def test_amx_linears_compute_bf16_products_and_keep_the_others():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 64, 64)
    want = model(x)
    assert set_linear_lowering(model, "amx") == 2
    x40 = torch.randn(2, 64, model.odd.in_features)
    want_odd = torch.nn.functional.linear(x40, model.odd.weight, model.odd.bias)
    torch.testing.assert_close(model.odd(x40), want_odd, rtol=0, atol=0)  # its own, in fp32
    assert model.odd(x40.to(torch.bfloat16)).dtype == torch.float32  # and takes bf16
    got_up = model.up(x)
    torch.testing.assert_close(got_up, bf16_linear(model.up, x), rtol=1e-5, atol=1e-5)
    # rows that do not fit (5 tokens) take the Linear's own forward: exactly fp32
    x5 = torch.randn(1, 5, 64)
    torch.testing.assert_close(
        model.up(x5), torch.nn.functional.linear(x5, model.up.weight, model.up.bias), rtol=0, atol=0
    )
    # 2 x 77 rows (the text's tokens) are padded to 160 for the kernel, the padding dropped
    x77 = torch.randn(2, 77, 64)
    torch.testing.assert_close(model.up(x77), bf16_linear(model.up, x77), rtol=1e-5, atol=1e-5)
    rel = (model(x) - want).abs().max() / want.abs().max()
    assert 1e-5 < rel < 2e-2  # bf16 inputs: rounded, and not far
    assert set_linear_lowering(model, "native") == 3


def test_exported_module_dispatches_to_the_kernel_and_matches_torch(kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    torch.manual_seed(1)
    model = Block()
    x = torch.randn(2, 64, 64)
    set_linear_lowering(model, "amx")
    want = model(x).detach().numpy()
    text = str(iree_aot.export(model, args=(x,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_matmul_") == 2  # one function per shape
    assert text.count("util.call @sdiree_amx_matmul_") == 2
    # the biases start the kernel's accumulators (`b`): torch's result with no add after it
    assert text.count("util.call @sdiree_amx_matmul_128x64x96b(") == 1
    assert "hal.executable.object" in text and "amx_bf16_matmul-" in text
    out = run_amx_main(text, x.numpy())
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    # the same bf16 products; what differs is where GELU's output is rounded to bf16
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-3


def test_no_c_compiler_is_one_clear_error(monkeypatch, tmp_path):
    from sdiree.compile import kernel_objects
    from sdiree.runtime.errors import UserError

    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_objects, "c_compiler", lambda: None)
    with pytest.raises(UserError, match=r"needs a C compiler .*install gcc or clang"):
        kernel_objects.build_object("amx_bf16_matmul", KERNEL_ISAS["amx"])
    assert not list(tmp_path.rglob("*.o"))


def test_the_kernel_object_is_built_once_and_cached(monkeypatch, tmp_path):
    from sdiree.compile import kernel_objects

    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path))
    first = kernel_objects.build_object("amx_bf16_matmul", KERNEL_ISAS["amx"])
    assert first.is_file() and first.read_bytes()[:4] == b"\x7fELF"
    stamp = first.stat().st_mtime_ns
    again = kernel_objects.build_object("amx_bf16_matmul", KERNEL_ISAS["amx"])
    assert again == first and again.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp left


def test_geglu_is_one_kernel_dispatch_with_its_gelu_and_bf16_output(kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from diffusers.models.activations import GEGLU

    torch.manual_seed(2)
    geglu = GEGLU(64, 96)  # proj: 64 -> 2 x 96
    x = torch.randn(2, 32, 64)
    want = geglu(x)
    set_linear_lowering(geglu, "amx")
    assert "forward" in geglu.__dict__
    value, gate = bf16_linear(geglu.proj, x).chunk(2, dim=-1)
    exact_bf16 = value * torch.nn.functional.gelu(gate)
    got = geglu(x).float()
    assert geglu(x).dtype == torch.bfloat16  # the kernel's result, which the next linear takes
    torch.testing.assert_close(got, exact_bf16, rtol=8e-3, atol=1e-5)  # rounded to bf16
    assert 1e-5 < ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    torch.testing.assert_close(geglu(x[:, :5]), want[:, :5], rtol=0, atol=0)  # 10 rows: fp32
    text = str(iree_aot.export(geglu, args=(x,)).mlir_module)
    assert text.count("util.call @sdiree_amx_geglu_64x64x192(") == 1
    assert "sdiree_amx_matmul" not in text
    out = run_amx_main(text, x.numpy(), kernel="sdiree_amx_bf16_geglu_workgroup")
    if out is not None:
        # the same bf16 products; the kernel's erf and sums may round a few results one bf16
        # step apart from torch's
        assert np.abs(out - got.detach().numpy()).max() / np.abs(want.detach().numpy()).max() < 8e-3
    set_linear_lowering(geglu, "native")
    assert "forward" not in geglu.__dict__


def test_feed_forward_takes_the_geglu_result_in_bf16():
    """diffusers' FeedForward under amx: its output linear takes GEGLU's bf16 result as is (on
    the kernel, and through its own forward where its sizes do not fit the kernel)."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(3)
    for dim_out in (64, 40):  # 40: the output linear does not fit the kernel
        ff = FeedForward(64, dim_out, activation_fn="geglu").eval()
        x = torch.randn(2, 32, 64)
        with torch.no_grad():
            want = ff(x)
            set_linear_lowering(ff, "amx")
            got = ff(x)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_both_workgroup_blocks_give_the_product(kernel_isa):
    """A small weight's matmul runs in wide row-major blocks, a larger one's in the default
    strip-major blocks (amx_matmul.block_for); both compiled give the bf16 product."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from sdiree.compile.exporters.amx_matmul import BLOCK_M, BLOCK_N, WIDE_BLOCK, block_for

    assert block_for(320, 1280) == block_for(640, 640) == WIDE_BLOCK
    assert block_for(1024, 416) == block_for(1280, 1280) == (BLOCK_M, BLOCK_N)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 416), torch.nn.Linear(416, 96)).eval()
    set_linear_lowering(model, "amx")
    x = torch.randn(2, 80, 1024)  # 160 rows: a short last block of either kind
    with torch.no_grad():
        want = model(x).numpy()
    text = str(iree_aot.export(model, args=(x,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_amx_matmul_") == 2
    out = run_amx_main(text, x.numpy())
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    # the same bf16 products, summed in another order (the hidden layer's bf16 rounding then
    # differs in places); a block computed wrongly or not at all would be off by O(1)
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-3
