"""GroupNorm (+ SiLU) on sdiree's kernels (compile/exporters/group_norm_kernel.py, specs/kernels/
norms.c): eagerly and compiled it is torch's GroupNorm within bf16's rounding, plain or as
the 3x3 conv kernel's zero-padded input rows (border and read-ahead rows zero), over several
row blocks with a short last one and channel counts that are not multiples of 64; a resnet's
norm, SiLU and conv go through it only where the norm is marked."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llvm_cpu import run_amx_main  # noqa: E402

from sdiree.compile.exporters import conv_amx, group_norm_kernel  # noqa: E402
from sdiree.compile.exporters.amx_matmul import register  # noqa: E402
from sdiree.compile.exporters.conv_matmul import CHANNELS_LAST_FORWARD  # noqa: E402

APPLY = "sdiree_group_norm_apply_workgroup"


def _norm(c: int, groups: int, seed: int) -> torch.nn.GroupNorm:
    torch.manual_seed(seed)
    norm = torch.nn.GroupNorm(groups, c, eps=1e-5).eval().requires_grad_(False)
    norm.weight.normal_(1.0, 0.3)
    norm.bias.normal_(0.0, 0.3)
    group_norm_kernel.set_norm_kernel(norm)
    return norm


def _want(norm, xh, silu: bool) -> torch.Tensor:
    """torch's GroupNorm (then SiLU) in float64, channels-last."""
    y = torch.nn.functional.group_norm(
        xh.double().permute(0, 3, 1, 2), norm.num_groups, norm.weight.double(),
        norm.bias.double(), norm.eps,
    ).permute(0, 2, 3, 1)  # fmt: skip
    return torch.nn.functional.silu(y) if silu else y


def _input(n, h, w, c, seed) -> torch.Tensor:
    torch.manual_seed(seed)
    # an offset far from zero per channel: sums about the first pixel must not cancel
    return torch.randn(n, h, w, c) * 2.0 + torch.linspace(-30, 30, c)


def _unpad(flat: torch.Tensor, n, h, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded rows' image part [N, H, W, C], and everything else (border and tail)."""
    c = flat.shape[-1]
    body = flat[: n * (h + 2) * (w + 2)].reshape(n, h + 2, w + 2, c)
    mask = torch.ones(n, h + 2, w + 2, dtype=torch.bool)
    mask[:, 1:-1, 1:-1] = False
    rest = torch.cat([body[mask].reshape(-1), flat[n * (h + 2) * (w + 2) :].reshape(-1)])
    return body[:, 1:-1, 1:-1], rest


def test_rows_per_block_covers_about_block_pixels():
    assert group_norm_kernel.rows_per_block(64, 64) == 8
    assert group_norm_kernel.rows_per_block(4, 8) == 4  # a small image is one block
    assert group_norm_kernel.rows_per_block(512, 1024) == 1


@pytest.mark.parametrize("silu", [False, True])
def test_eager_kernels_are_group_norm_within_bf16(silu):
    norm = _norm(96, 8, 1)
    xh = _input(2, 11, 64, 96, 2)  # 8 rows a block: a full block and a short one
    with torch.no_grad():
        got = group_norm_kernel.norm_bf16(norm, xh, silu)
        assert got.dtype == torch.bfloat16 and got.shape == xh.shape
        want = _want(norm, xh, silu)
        assert (got.double() - want).abs().max() <= 2**-8 * want.abs().max()
        _, _, tail = conv_amx.padded_rows(2, 11, 64)
        padded = group_norm_kernel.norm_bf16(norm, xh, silu, 1, tail)
        body, rest = _unpad(padded, 2, 11, 64)
        torch.testing.assert_close(body, got, rtol=0, atol=0)
        assert not rest.any()


def test_unmarked_or_training_norms_do_not_fit():
    xh = torch.randn(1, 4, 32, 64)
    assert group_norm_kernel.fits(_norm(64, 8, 0), xh)
    assert not group_norm_kernel.fits(torch.nn.GroupNorm(8, 64).eval(), xh)
    assert not group_norm_kernel.fits(_norm(48, 8, 0), torch.randn(1, 4, 32, 48))  # 48 % 32
    assert not group_norm_kernel.fits(_norm(64, 8, 0).train(), xh)


def test_resnet_norm_silu_conv_reads_the_kernels_padded_rows():
    from sdiree.compile.exporters.channels_last import norm_act_conv

    register()
    conv_amx.register()
    norm = _norm(64, 8, 3)
    conv = torch.nn.Conv2d(64, 32, 3, padding=1).requires_grad_(False)
    setattr(conv, CHANNELS_LAST_FORWARD, types.MethodType(conv_amx.conv3x3_amx_nhwc, conv))
    xh = _input(2, 5, 32, 64, 4)
    with torch.no_grad():
        got = norm_act_conv(norm, torch.nn.SiLU(), conv, xh)
        y = group_norm_kernel.norm_bf16(norm, xh, True)
        want = conv_amx.conv3x3_amx_nhwc(conv, y.float())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        unmarked = torch.nn.GroupNorm(8, 64).eval()
        plain = norm_act_conv(unmarked, torch.nn.SiLU(), conv, xh)
        ref = conv_amx.conv3x3_amx_nhwc(conv, torch.nn.functional.silu(_want(unmarked, xh, False)))
        assert (plain - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("n,h,w,c,pad,silu", [(2, 11, 64, 96, 0, 1), (1, 5, 32, 64, 1, 1)])
def test_exported_norm_is_two_kernel_dispatches_and_matches(n, h, w, c, pad, silu, kernel_isa):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    norm = _norm(c, 8, n + h)
    tail = conv_amx.padded_rows(n, h, w)[2] if pad else 0

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, xh):
            return group_norm_kernel.norm_bf16(self.norm, xh, bool(silu), pad, tail).float()

    xh = _input(n, h, w, c, 5)
    text = str(iree_aot.export(Norm(), args=(xh,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_group_norm_stats_") == 1
    assert text.count("flow.dispatch @sdiree_group_norm_apply_") == 1
    out = run_amx_main(text, xh.numpy(), kernel=APPLY)
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    with torch.no_grad():
        eager = Norm()(xh).numpy()
    assert out.shape == eager.shape
    # the same bf16 results but where the kernel's f32 sums round a value the other way
    assert np.mean(out != eager) < 0.01
    assert np.abs(out - eager).max() <= 2**-7 * np.abs(eager).max()
    if pad:
        body, rest = _unpad(torch.from_numpy(out), n, h, w)
        assert not rest.any()


def test_layer_norm_kernel_is_torchs_within_bf16_eagerly_and_compiled(kernel_isa):
    """The transformer blocks' LayerNorm on its kernel (layer_norm_kernel.py): one dispatch,
    torch's LayerNorm rounded to bf16; rows that are not a multiple of the workgroup's block."""
    iree_aot = pytest.importorskip("iree.turbine.aot")
    from sdiree.compile.exporters import layer_norm_kernel

    layer_norm_kernel.register()
    torch.manual_seed(7)
    norm = torch.nn.LayerNorm(96).eval().requires_grad_(False)
    norm.weight.normal_(1.0, 0.3)
    norm.bias.normal_(0.0, 0.3)
    x = torch.randn(2, 100, 96) * 3 + 5

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return layer_norm_kernel.layer_norm_forward(self.norm, x).float()

    with torch.no_grad():
        eager = Norm()(x)
        want = torch.nn.functional.layer_norm(x.double(), (96,), norm.weight.double(),
                                              norm.bias.double(), norm.eps)  # fmt: skip
    assert (eager.double() - want).abs().max() <= 2**-8 * want.abs().max()
    text = str(iree_aot.export(Norm(), args=(x,)).mlir_module)
    assert text.count("flow.dispatch @sdiree_layer_norm_") == 1
    out = run_amx_main(text, x.numpy(), kernel="sdiree_layer_norm_workgroup")
    if out is None:  # this CPU lacks the kernels' ISA: cross-compiled only
        return
    assert np.mean(out != eager.numpy()) < 0.01
    assert np.abs(out - eager.numpy()).max() <= 2**-7 * np.abs(eager.numpy()).max()
