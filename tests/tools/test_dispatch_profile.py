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
        ("denoise_cfg_async_dispatch_83_attention_2x8x4096x40x40x4096", "attention"),  # ncu's
        (
            "denoise_cfg_async_dispatch_12_conv_2x320x64x64x320x3x3_f16xf16xf32",
            "matmul f16xf16xf32",
        ),
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


def test_ncu_csv_to_dispatch_rows():
    head = (
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"\n'
    )

    def line(i, name, unit, value):
        return (
            f'"{i}","7","iree-run-module","127.0.0.1","{name}","1","13","(64, 1, 1)",'
            f'"(80, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum",'
            f'"{unit}","{value}"\n'
        )

    mm = "denoise_cfg_async_dispatch_7_matmul_like_2x4096x320x320_f16xf16xf32"
    text = (
        "==PROF== Connected to process 7\n"
        + head
        + line(0, mm, "nsecond", "1,500")
        + line(1, "denoise_cfg_async_dispatch_9_elementwise_2x320_f16", "usecond", "2.5")
        + line(2, mm, "nsecond", "500")
    )
    rows = {r["key"]: r for r in dispatch_profile.ncu_rows(text)}
    assert rows[mm]["count"] == 2 and rows[mm]["total_ns"] == 2000.0
    ew = rows["denoise_cfg_async_dispatch_9_elementwise_2x320_f16"]
    assert ew["total_ns"] == 2500.0 and dispatch_profile._total_ns(ew) == 2500.0
    assert dispatch_profile.kind(mm) == "matmul f16xf16xf32"
