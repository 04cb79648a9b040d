"""tools/compile_peaks.py: each stage a command reports gets its time and the peak memory of
the command (and of its children) while it ran."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compile_peaks.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_each_stage_gets_its_time_and_the_peak_of_its_process_and_children(tmp_path):
    script = tmp_path / "stages.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            print("[small step] ...", flush=True); time.sleep(0.6)
            print("[small step] done in 0.6s", flush=True)
            print("[big step] ...", flush=True)
            block = bytearray(400 << 20)  # touched: 400 MiB of this process
            time.sleep(1.0)
            print("[big step] done in 1.0s", flush=True)
            del block
            print("[child step] ...", flush=True)
            subprocess.run([sys.executable, "-c",
                            "import time; b = bytearray(300 << 20); time.sleep(1.0)"])
            print("[child step] done in 1.1s", flush=True)
            """
        )
    )
    out = tmp_path / "peaks.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--json", str(out), "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| big step | 1.0 |" in proc.stdout
    stages = json.loads(out.read_text())["stages"]
    gib = 2**30
    assert stages["big step"]["driver"] > 0.35 * gib > stages["small step"]["driver"]
    assert stages["big step"]["anon"] > 0.35 * gib
    assert stages["child step"]["child"] > 0.25 * gib > stages["big step"]["child"]
