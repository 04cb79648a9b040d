"""runtime/weights/recover.py: weights an artifact drops are read back from its encoded archives.

Unpacking inverts a region's pack (padding and tiling included) and reports what it could not
cover; the Winograd inverse gives back a 3x3 weight from either transform within float32
rounding; an Archive with a sidecar lists the dropped keys as `recovered` and reads them back.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.layout import Layout, Region
from sdiree.runtime.weights.recover import sidecar_path, unpack, winograd_inverse
from sdiree.runtime.weights.winograd import winograd_weight


def test_unpack_inverts_a_padded_tiled_pack_and_reports_gaps():
    w = np.random.default_rng(0).standard_normal((20, 3)).astype(np.float32)
    tiled = Region("w", 0, (20, 3), ((0, 16, 2), (1, 1, 3), (0, 1, 16)))  # N padded to 32
    got, covered = unpack(tiled, tiled.pack(w))
    assert covered.all()
    np.testing.assert_array_equal(got, w)
    # a copy of the first 16 rows only: the rest is not there to read back
    part = Region("w", 0, (20, 3), ((1, 1, 3), (0, 1, 16)))
    _, covered = unpack(part, part.pack(w))
    assert covered[:16].all() and not covered[16:].any()


@pytest.mark.parametrize("taps", [16, 36])
def test_the_winograd_inverse_gives_the_weight_back(taps):
    w = (np.random.default_rng(taps).standard_normal((24, 8, 3, 3)) * 0.05).astype(np.float32)
    back = winograd_inverse(winograd_weight(w, taps))
    assert back.shape == w.shape and back.dtype == w.dtype
    assert np.abs(back - w).max() <= 1e-6 * np.abs(w).max()
    assert not np.array_equal(back, np.zeros_like(w))


def _pruned_archive(tmp_path, weights: dict, dropped: list[str], regions: list[Region]):
    """A tiny artifact-like folder: an archive of weights without `dropped`, an encoded archive
    holding the regions' packed copies, their layout and the sidecar."""
    import iree.runtime as rt

    def meta(a):
        return "PYTORCH:" + json.dumps({"dtype": str(a.dtype), "shape": list(a.shape)})

    index = rt.ParameterIndex()
    for k, a in weights.items():
        if k not in dropped:
            index.add_buffer(
                k, np.ascontiguousarray(a).view(np.uint8).reshape(-1), metadata=meta(a)
            )
    index.create_archive_file(str(tmp_path / "m.irpa"))
    packed, placed, offset = [], [], 0
    for r in regions:
        base = r.param[: -len("weight_winograd")] + "weight" if "winograd" in r.param else r.param
        w = weights[base]
        data = r.pack(winograd_weight(w, 16) if "winograd" in r.param else w)
        placed.append(Region(r.param, offset, r.shape, r.levels))
        packed.append(data.view(np.uint8))
        offset += data.nbytes
    enc = rt.ParameterIndex()
    enc.add_buffer("parameter0", np.concatenate(packed))
    enc.create_archive_file(str(tmp_path / "m.encoded.irpa"))
    Layout({"parameter0": placed}, complete=True).save(tmp_path / "m.layout.json")
    keys = {k: {"shape": list(weights[k].shape), "dtype": "float32"} for k in dropped}
    src = [{"encoded": "m.encoded.irpa", "layout": "m.layout.json"}]
    sidecar_path(tmp_path / "m.irpa").write_text(
        json.dumps({"version": 1, "keys": keys, "from": src})
    )
    return Archive(tmp_path / "m.irpa")


def test_an_archive_reads_its_dropped_keys_back(tmp_path):
    rng = np.random.default_rng(1)
    weights = {
        "lin.weight": rng.standard_normal((20, 3)).astype(np.float32),
        "conv.weight": rng.standard_normal((5, 4, 3, 3)).astype(np.float32),
        "norm.bias": rng.standard_normal(7).astype(np.float32),
        "gone.weight": rng.standard_normal((4, 4)).astype(np.float32),
    }
    regions = [
        Region("lin.weight", 0, (20, 3), ((0, 16, 2), (1, 1, 3), (0, 1, 16))),
        Region("conv.weight_winograd", 0, (16, 4, 5), ((0, 1, 16), (1, 1, 4), (2, 1, 5))),
    ]
    a = _pruned_archive(tmp_path, weights, ["lin.weight", "conv.weight", "gone.weight"], regions)
    assert {k for k, e in a.entries.items() if e.recovered} == {
        "lin.weight", "conv.weight", "gone.weight"
    }  # fmt: skip
    np.testing.assert_array_equal(a.array("lin.weight"), weights["lin.weight"])
    conv = a.array("conv.weight")
    assert (
        np.abs(conv - weights["conv.weight"]).max() <= 1e-5 * np.abs(weights["conv.weight"]).max()
    )
    np.testing.assert_array_equal(a.array("norm.bias"), weights["norm.bias"])
    assert not a.array("lin.weight").flags.writeable
    with pytest.raises(KeyError):
        a.array("gone.weight")  # listed, but no layout holds it
