"""tools/compile_matrix.py: every GPU arch preset of the registry is a row, refused ones with the
registry's reason and not compiled; each compile's result, stage seconds, peaks and artifact size
are recorded, failures with the command's last line; a rerun resumes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sdiree.runtime.targets import load_registry

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "compile_matrix.py"
sys.path.insert(0, str(ROOT / "tools"))
import compile_matrix as matrix  # noqa: E402


def test_every_gpu_preset_is_a_combination_and_refusals_come_from_the_registry():
    reg = load_registry()
    combos = matrix.combinations(reg, dtype="fp16")
    got = {(c["target"], c["arch"]) for c in combos}
    want = {
        (t, a)
        for t, target in reg.targets.items()
        if t != "cpu"
        for a, arch in target.arches.items()
        if not arch.cpu_emulated
    }
    assert got == want
    assert ("vulkan-spirv", "lavapipe") not in got  # emulated: only when named
    assert {"rocm", "cuda", "vulkan-spirv"} <= {t for t, _ in got}
    refused = {(c["target"], c["arch"]): c["refused"] for c in combos if c["refused"]}
    baseline = reg.targets["vulkan-spirv"].arches["baseline"]
    assert refused == {("vulkan-spirv", "baseline"): baseline.refused_dtypes["fp16"]}
    named = matrix.combinations(reg, targets=["vulkan-spirv"], arches=["lavapipe", "rdna3"])
    assert [(c["arch"], c["refused"]) for c in named] == [("lavapipe", None), ("rdna3", None)]


FAKE = """
import sys, time
from pathlib import Path
args = sys.argv[1:]
arch, out = args[args.index("--arch") + 1], Path(args[args.index("--out") + 1])
if arch == "gcn":
    print("[export unet] ...", flush=True)
    print("error: gcn is not welcome here; use another arch", flush=True)
    sys.exit(2)
if arch == "rdna3":
    print("[export unet] ...", flush=True); time.sleep(0.3)
    print("[export unet] done in 0.3s", flush=True)
else:
    print("[export unet] reused (cached)", flush=True)
print("[compile unet] ...", flush=True)
block = bytearray(200 << 20); time.sleep(0.8)
print("[compile unet] done in 0.8s", flush=True)
out.mkdir(parents=True)
(out / "unet.vmfb").write_bytes(b"x" * 3_000_000)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compile_peaks reads /proc")
def test_rows_record_results_peaks_and_sizes_and_a_rerun_resumes(tmp_path):
    fake = tmp_path / "fake_sdiree.py"
    fake.write_text(textwrap.dedent(FAKE))
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "mx"
    cmd = [sys.executable, str(TOOL), "--out", str(out), "--model", f"M={model}"]
    cmd += ["--targets", "vulkan-spirv", "--arches", "rdna3,gcn,ampere,baseline"]
    cmd += ["--sdiree", f"{sys.executable} {fake}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["arch"]: r for r in matrix.read_rows(out / "rows.jsonl")}
    assert set(rows) == {"rdna3", "gcn", "ampere", "baseline"}
    assert rows["baseline"]["result"] == "refused" and "vector.bitcast" in rows["baseline"]["why"]
    assert rows["gcn"]["result"] == "fails"
    assert rows["gcn"]["why"] == "error: gcn is not welcome here; use another arch"
    for a in ("rdna3", "ampere"):
        r = rows[a]
        assert r["result"] == "compiles" and r["unet_compile_s"] == 0.8
        assert r["driver_peak"] > 150 << 20 and r["artifact_bytes"] == 3_000_000
        assert not (out / "art" / f"model-vulkan-spirv-{a}-fp16").exists()  # deleted once measured
    assert rows["rdna3"]["unet_export_s"] == 0.3 and rows["ampere"]["unet_export_s"] is None
    lines = proc.stdout.splitlines()
    assert any("| ampere | compiles |" in x and "| cached |" in x for x in lines)
    assert any("| gcn | fails: error: gcn is not welcome" in x for x in lines)

    # A rerun compiles nothing already recorded: the fake would now fail every arch.
    fake.write_text("import sys; print('error: ran again'); sys.exit(3)\n")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "ran again" not in again.stdout
    assert [json.loads(x)["arch"] for x in (out / "rows.jsonl").read_text().splitlines()] == [
        "baseline",
        "rdna3",
        "gcn",
        "ampere",
    ]
