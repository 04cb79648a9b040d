"""tools/cuda_conv_sweep.py: its candidate tiles are valid configurations that the cuda compile
takes (the configuration dump shows each one on the conv), its conv module computes the conv,
its timer runs a module on a device (cpu here; the GPU on a lent machine), and its choice and
spec keep the compiler's config unless a candidate is right and clearly faster."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import cuda_conv_sweep as sweep  # noqa: E402
from cuda_conv_sweep import MARKER, SHAPES, Shape, Tile  # noqa: E402


def test_candidates_are_whole_warp_tiles():
    tiles = sweep.candidates()
    assert len({t.name for t in tiles}) == len(tiles) > 50
    for t in tiles:
        assert t.rows % t.warp_rows == 0 and t.channels % (8 * t.warp_n) == 0
        assert 1 <= t.warps <= 8
    # the compiler's own choice for these convs is among them (so the sweep can tie with it)
    assert Tile(8, 32, 2, 2, 8) in tiles


def test_conv_module_computes_the_conv_and_the_timer_runs_it(tmp_path):
    """The sweep's module (here compiled for cpu, stride 2 and a batch of 1 and 2) against a
    numpy convolution, through the sweep's own timer."""
    import iree.runtime as rt

    cpu = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu"]
    device = rt.get_driver("local-task").create_default_device()
    for shape in (Shape(2, 4, 16, 32, 2), Shape(1, 4, 16, 32)):
        src = tmp_path / f"{shape.name}.mlir"
        src.write_text(sweep.conv_mlir(shape))
        vmfb = tmp_path / f"{shape.name}.vmfb"
        assert sweep.compile_one(src, vmfb, cpu, None) is None
        x, w, b = sweep.inputs(shape)
        args = [rt.asdevicearray(device, a) for a in (x, w, b)]
        seconds, out = sweep.time_module(vmfb, device, args, runs=3, warmup=1)
        assert seconds > 0
        s, k = shape.side, shape.stride
        xf, wf = x.astype(np.float32), w.astype(np.float32)
        ref = np.zeros((shape.batch, s, s, shape.cout), np.float32) + b.astype(np.float32)
        for i in range(3):
            for j in range(3):
                patch = xf[:, i : i + k * (s - 1) + 1 : k, j : j + k * (s - 1) + 1 : k, :]
                ref += patch @ wf[:, i, j, :].T
        assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max(), shape


def test_dry_sweep_compiles_each_candidate_for_cuda_with_its_tile(tmp_path):
    """Two candidates and the compiler's own config, for SD 1.5's 8² conv (guided) and its 16²
    unguided one: every module builds, the spec's marker is on the conv and its workgroup is
    the candidate's, and the compiler's own is the 128-pixel by 32-channel tile it measured."""
    tiles = "r4c32w2x2k8,r2c64w1x4k4"
    result = sweep.main(
        ["--dry", "--shapes", "0,6", "--tiles", tiles, "--out", str(tmp_path), "--jobs", "2"]
    )
    assert json.loads((tmp_path / "sweep.json").read_text()) == result
    rows = result["rows"]
    assert len(rows) == 6 and all(r["error"] is None for r in rows), rows
    got = {(Shape(**r["shape"]).name, r["tile"] and Tile(**r["tile"]).name): r for r in rows}
    assert got[(SHAPES[0].name, None)]["workgroup"] == [1, 8, 16, 32, 0]
    assert got[(SHAPES[0].name, "r4c32w2x2k8")]["workgroup"] == [1, 4, 16, 32, 0]
    assert got[(SHAPES[0].name, "r2c64w1x4k4")]["workgroup"] == [1, 2, 16, 64, 0]
    assert got[(SHAPES[6].name, "r4c32w2x2k8")]["workgroup"] == [4, 16, 32, 0]
    assert not (tmp_path / "cuda_small_convs.mlir").exists()  # dry: nothing timed, no spec


def _row(shape, tile, seconds, rel=0.0):
    return {
        "shape": shape.__dict__,
        "tile": tile and tile.__dict__,
        "error": None,
        "seconds": seconds,
        "rel_error": rel,
    }


def test_choice_takes_only_right_and_clearly_faster_tiles():
    a, b = Tile(4, 32, 2, 2, 8), Tile(2, 64, 1, 4, 4)
    s0, s1, s2 = SHAPES[0], SHAPES[3], SHAPES[5]
    rows = [
        _row(s0, None, 1.0),
        _row(s0, a, 0.80),
        _row(s0, b, 0.70, rel=0.5),  # fastest but wrong: not taken
        _row(s1, None, 1.0),
        _row(s1, a, 0.99),  # within MIN_GAIN: the compiler's config stays
        _row(s2, a, 0.5),  # no default timed: nothing to compare with
    ]
    assert sweep.choose({"rows": rows}) == {s0: a}


@pytest.fixture(scope="module")
def written_spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "cuda_small_convs.mlir"
    path.write_text(sweep.spec({SHAPES[0]: Tile(4, 32, 2, 2, 8)}))
    return path


@pytest.mark.parametrize(
    "shape, tuned",
    [(SHAPES[0], True), (Shape(2, 8, 1280, 640), False), (Shape(2, 12, 1280, 1280), False)],
)
def test_written_spec_matches_exactly_the_measured_size(written_spec, shape, tuned, tmp_path):
    """The spec from the choice tunes the conv it measured and leaves other channel counts and
    image sizes (SD 2.1's 12² at 768²) to the compiler."""
    src = tmp_path / "conv.mlir"
    src.write_text(sweep.conv_mlir(shape))
    out = tmp_path / "conv.vmfb"
    flags = ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]
    assert sweep.compile_one(src, out, flags, written_spec.read_text()) is None
    text = sweep.configured(out)
    assert (MARKER in text) == tuned
    if tuned:
        assert sweep.workgroup(text) == [1, 4, 16, 32, 0]
