"""tools/dispatch_profile.py profiles a cpu artifact's call (paged, pruned archives included)."""

from __future__ import annotations

import re

import dispatch_profile  # tools/ is on sys.path: tests/conftest.py
import pytest


@pytest.mark.parametrize(
    "name,kind",
    [
        (
            "denoise_cfg$async_dispatch_115_matmul_1024x4096x40_bf16xbf16xf32",
            "matmul bf16xbf16xf32",
        ),
        ("denoise_cfg$async_dispatch_9_batch_matmul_16x128x1280x1280_f32", "matmul f32"),
        (
            "denoise_cfg$async_dispatch_420_elementwise_8192x1280_f32xf32xbf16",
            "elementwise to bf16",
        ),
        ("denoise_cfg$async_dispatch_3_elementwise_4x2x16x16x640_f32", "elementwise"),
        ("denoise_cfg$async_dispatch_116_reduction_1024x4096_f32", "reduction"),
        ("denoise_cfg$async_dispatch_1_slow_memcpy", "copy"),
        ("_encoding_0_encode_1024x40xf32_to_1024x40xf32", "encoding"),
        ("denoise_cfg$async_dispatch_5_transpose_2x320x4096_f32", "transpose"),
    ],
)
def test_dispatch_kinds(name, kind):
    assert dispatch_profile.kind(name) == kind


def test_cpu_profile_of_the_tiny_unet(compiled, tmp_path, capsys):
    art = compiled.get("cpu", "host", "fp32")
    out = tmp_path / "prof"
    dispatch_profile.main(
        [str(art), "--device", "local-task", "--group", "--top", "5", "--out", str(out)]
    )
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    head = re.match(r"(\d+) dispatch functions, (\d+) dispatches, ([\d.]+) ms in all", lines[0])
    assert head and int(head[2]) > 100 and float(head[3]) > 0, printed
    kinds = {line.split("  ")[-1]: line for line in lines[1 : lines.index("")]}
    assert "matmul f32" in kinds and "reduction" in kinds, kinds
    shares = [float(re.search(r"([\d.]+) %", line)[1]) for line in kinds.values()]
    assert sum(shares) == pytest.approx(100, abs=0.5)
    assert len(lines) - lines.index("") - 1 == 5  # the top dispatches
    assert (out / "unet.ireeprof").stat().st_size > 0
    assert not (out / "params").exists()  # the weights' copy is not kept
