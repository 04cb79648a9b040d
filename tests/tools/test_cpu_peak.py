"""tools/cpu_peak.c builds for this machine's CPU and measures what it says, with right sums."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from sdiree.runtime.cpu_features import host_cpu_features

SOURCE = Path(__file__).resolve().parents[2] / "tools" / "cpu_peak.c"


def test_peak_and_register_tiles_are_measured(tmp_path):
    have = host_cpu_features()
    avx512 = {"avx512f", "avx512_bf16"} <= have
    flags = ["-mavx512f", "-mavx512bf16"] if avx512 else ["-mavx2", "-mfma"]
    exe = tmp_path / "cpu_peak"
    subprocess.run(["gcc", "-O3", *flags, str(SOURCE), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    rates = [float(x) for x in re.findall(r"(-?\d+\.\d) GFLOP/s", out)]
    if avx512:
        assert "bf16 vdpbf16ps" in out and "fp32 vfmadd" in out
    else:
        assert "fp32 vfmadd (256-bit)" in out
        # three rounds of three tiles, each -1 if a tile's sums came out wrong
        tiles = re.findall(r"8x8 \(iree's\) (-?[\d.]+), 4x16 (-?[\d.]+), 6x16 (-?[\d.]+)", out)
        assert len(tiles) == 3
        rates += [float(x) for row in tiles for x in row]
    assert rates and all(r > 0 for r in rates), out
