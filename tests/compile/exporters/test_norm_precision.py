"""GroupNorm in float32 for half-precision exports: same values, same names, f32 statistics."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.norm_precision import group_norms_in_fp32  # noqa: E402


def test_fp32_models_are_left_alone():
    model = torch.nn.Sequential(torch.nn.GroupNorm(2, 4))
    assert group_norms_in_fp32(model, torch.float32) == 0
    assert "forward" not in vars(model[0])


@pytest.mark.parametrize("upcast", [False, True], ids=["fp16-statistics", "fp32-statistics"])
def test_compiled_fp16_group_norm_is_finite_only_with_fp32_statistics(upcast):
    """4 channels x 128 x 128 values of ~300 per group: their squares sum far past fp16's
    65504. Compiled by iree (llvm-cpu) as exported, the fp16 GroupNorm returns NaN; with the
    rewrite it matches float32 group_norm, and parameter names do not change."""
    import numpy as np
    from iree.turbine import aot
    from llvm_cpu import run_main

    torch.manual_seed(0)
    x = (torch.randn(1, 8, 128, 128) * 300).half()
    ref = torch.nn.functional.group_norm(x.float(), 2).numpy()
    model = torch.nn.Sequential(torch.nn.GroupNorm(2, 8)).half().eval()
    names = list(model.state_dict())
    assert group_norms_in_fp32(model, torch.float16 if upcast else torch.float32) == int(upcast)
    assert list(model.state_dict()) == names
    mlir = str(aot.export(model, args=(x,)).mlir_module)
    got = run_main(mlir, x.numpy()).astype(np.float32)
    if upcast:
        np.testing.assert_allclose(got, ref, atol=4e-3)
    else:  # what the rewrite is for: if iree ever sums fp16 groups in f32, drop the rewrite
        assert not np.isfinite(got).all()


def test_exported_statistics_are_float32():
    """The traced graph runs group_norm on an f32 tensor, so torch-mlir decomposes it in f32."""
    from iree.turbine import aot

    model = torch.nn.Sequential(torch.nn.GroupNorm(2, 8)).half().eval()
    group_norms_in_fp32(model, torch.float16)
    mlir = str(aot.export(model, args=(torch.randn(1, 8, 4, 4).half(),)).mlir_module)
    (line,) = [ln for ln in mlir.splitlines() if "torch.aten.group_norm" in ln]
    assert "!torch.vtensor<[1,8,4,4],f32>" in line and "f16>" not in line.split("->")[0]


@pytest.mark.parametrize(
    ("shape", "groups"),
    [((2, 64, 32, 32), 32), ((1, 12, 5, 7), 3), ((1, 32, 16), 8)],
    ids=["chunks-of-1024", "no-power-of-two", "1d"],
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_chunked_sums_compute_group_norm(shape, groups, dtype):
    """norm_sums chunked (the lavapipe preset): each group summed in chunks, then the chunks'
    sums, in float32; the values are group_norm's, the parameters keep their names, and the
    exporters' float32 rewrite leaves a chunked norm alone."""
    from sdiree.compile.exporters.norm_precision import CHUNK, set_norm_sums

    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(groups, shape[1])
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(shape) * 3 + 1
    ref = torch.nn.functional.group_norm(x, groups, norm.weight, norm.bias, norm.eps)
    model = torch.nn.Sequential(norm).to(getattr(torch, dtype))
    names = list(model.state_dict())
    assert set_norm_sums(model, "whole") == 0 and "forward" not in vars(norm)
    assert set_norm_sums(model, "chunked") == 1
    assert group_norms_in_fp32(model, torch.float16) == 0  # already float32 statistics
    assert list(model.state_dict()) == names
    got = model(x.to(model[0].weight.dtype)).float()
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    if shape == (2, 64, 32, 32):  # 2 x 32 x 32 values per group: 2 chunks of CHUNK
        from iree.turbine import aot

        mlir = str(aot.export(model, args=(x.to(model[0].weight.dtype),)).mlir_module)
        assert "torch.aten.group_norm" not in mlir
        assert f"[2,32,{2048 // CHUNK},{CHUNK}]" in mlir.replace(" ", "")


def test_unknown_norm_sums_choice_is_refused():
    from sdiree.compile.exporters.norm_precision import set_norm_sums

    with pytest.raises(ValueError, match="norm_sums"):
        set_norm_sums(torch.nn.GroupNorm(2, 4), "halves")
