"""tools/winograd_conv_bench.py times one conv's Winograd forms, each checked against torch."""

from __future__ import annotations

import pytest
import winograd_conv_bench  # tools/ is on sys.path: tests/conftest.py


def test_every_form_matches_torch_and_is_timed(capsys):
    variants = "2:batched:0,2:interleaved:4,4:batched:4,4:batched:0,plain"
    rows = winograd_conv_bench.main(["8", "8", "1", variants, "--runs", "2", "--warmup", "1"])
    assert [r["variant"] for r in rows] == variants.split(",")
    for row in rows:
        # F(4x4)'s transforms round more than F(2x2)'s; both far below a wrong conv's ~1
        assert row["rel_err"] < (1e-4 if row["variant"].startswith("4") else 1e-5)
        assert row["ms"] > 0 and row["ratio"] > 0
    assert rows[0]["ratio"] == 1.0
    assert capsys.readouterr().out.count("8 ch 8² batch 1") == 5


def test_a_wrong_conv_would_show_in_its_error(monkeypatch):
    """The error is the compiled conv's against torch's: a compiled conv off by its bias fails."""
    real = winograd_conv_bench.build

    def off(*args):
        vmfb, x, ref = real(*args)
        return vmfb, x, ref + 1.0

    monkeypatch.setattr(winograd_conv_bench, "build", off)
    (row,) = winograd_conv_bench.main(["8", "8", "1", "2:batched:0", "--runs", "1"])
    assert row["rel_err"] > 0.1


@pytest.mark.parametrize("bad", ["3:batched:0", "2:sideways:0", "4:interleaved:4", "2:batched"])
def test_unknown_forms_are_refused_before_any_compile(bad, capsys):
    with pytest.raises(SystemExit) as e:
        winograd_conv_bench.main(["8", "8", "1", f"2:batched:0,{bad}", "--runs", "1"])
    assert e.value.code == 2
    assert f"variant '{bad}' is not plain or m:inverse:split" in capsys.readouterr().err


def test_kernel_forms_run_bf16_on_sdirees_kernels(capsys):
    """--kernels: the split Winograd products on the matmul kernel, the fused Winograd kernels
    and the direct conv kernel, bf16, each within bf16's rounding of torch's conv plus the
    residual."""
    pytest.importorskip("iree.turbine.aot")
    from sdiree.compile.exporters import KERNEL_FEATURES
    from sdiree.runtime.cpu_features import host_cpu_features

    if not set(KERNEL_FEATURES["avx512_bf16"]) <= host_cpu_features():
        pytest.skip("this CPU cannot run the avx512_bf16 kernels")
    from sdiree.compile.exporters.amx_matmul import current_kernel_isa, set_kernel_isa

    forms = "2:interleaved:4,fused,direct"
    args = ["32", "8", "1", forms, "--kernels", "avx512_bf16", "--runs", "1"]
    before = current_kernel_isa()
    try:
        rows = winograd_conv_bench.main(args)
    finally:
        set_kernel_isa(before)  # the tool sets the process's kernel ISA
    assert [r["variant"] for r in rows] == forms.split(",")
    for row in rows:
        assert 1e-5 < row["rel_err"] < 2e-2  # bf16 operands: rounded, far below a wrong conv
    assert capsys.readouterr().out.count("32 ch 8² batch 1") == 3
