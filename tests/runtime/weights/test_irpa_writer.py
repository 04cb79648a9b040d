"""The in-place archive writer (runtime/weights/irpa_writer.py) against iree's own writer."""

import os

import numpy as np
import pytest

from sdiree.runtime.weights import irpa_writer

rt = pytest.importorskip("iree.runtime")

CASES = {
    "mixed": [
        ("a", 5, "PYTORCH:{}", None),
        ("splat.\u00e9", 64, "", b"\x01\x02\x03\x04"),
        ("b", 0, "", None),
        ("c", 4097, "m" * 37, None),
        ("d", 63, "", None),
        ("e", 16, "x", b"\xaa"),
        ("f", 65, "", None),
    ],
    "splat first": [("s", 8, "", b"\x00" * 8), ("a", 3, "meta", None)],
    "splats only": [("s", 32, "q", b"\x07" * 16), ("t", 2, "", b"\x01\x02")],
    "one": [("only", 4096, "", None)],
    "none": [],
}


def _reference(entries, data, path):
    index = rt.ParameterIndex()
    for key, length, meta, splat in entries:
        if splat is not None:
            index.add_splat(
                key, np.frombuffer(splat, np.uint8).copy(), length, metadata=meta or None
            )
        else:
            index.add_buffer(key, data[key], metadata=meta or None)
    index.create_archive_file(str(path))


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_bytes_as_iree(case, tmp_path):
    entries = CASES[case]
    rng = np.random.default_rng(0)
    data = {k: rng.integers(0, 256, n, dtype=np.uint8) for k, n, _, s in entries if s is None}
    _reference(entries, data, tmp_path / "ref.irpa")
    ours = tmp_path / "ours.irpa"
    offsets = irpa_writer.create(
        ours, [irpa_writer.Entry(k, n, m.encode(), s) for k, n, m, s in entries]
    )
    assert sorted(offsets) == sorted(data)
    assert all(at % 64 == 0 for at in offsets.values())
    fd = os.open(ours, os.O_RDWR)
    try:
        for key, at in offsets.items():
            irpa_writer.pwrite_all(fd, data[key], at)
    finally:
        os.close(fd)
    assert ours.read_bytes() == (tmp_path / "ref.irpa").read_bytes()
    loaded = rt.ParameterIndex()
    loaded.load(str(ours))
    assert sorted(k for k, _ in loaded.items()) == sorted(k for k, *_ in entries)


def test_data_reads_as_zeros_until_written(tmp_path):
    offsets = irpa_writer.create(tmp_path / "z.irpa", [irpa_writer.Entry("w", 1 << 20)])
    raw = (tmp_path / "z.irpa").read_bytes()
    assert raw[offsets["w"] : offsets["w"] + (1 << 20)] == bytes(1 << 20)


def test_bad_entries_are_refused(tmp_path):
    with pytest.raises(ValueError, match="same name"):
        irpa_writer.layout([irpa_writer.Entry("a", 1), irpa_writer.Entry("a", 2)])
    with pytest.raises(ValueError, match="splat pattern"):
        irpa_writer.layout([irpa_writer.Entry("a", 6, splat=b"\x01\x02\x03")])
    with pytest.raises(ValueError, match="splat pattern"):
        irpa_writer.layout([irpa_writer.Entry("a", 6, splat=b"\x01\x02\x03\x04")])


def test_copy_range_between_files(tmp_path, monkeypatch):
    src = tmp_path / "src"
    payload = np.random.default_rng(1).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    src.write_bytes(payload)
    for kernel in (True, False):
        if not kernel:  # the fallback through memory, where the kernel cannot copy
            monkeypatch.delattr(os, "copy_file_range", raising=False)
        dst = tmp_path / f"dst{kernel}"
        dst.write_bytes(bytes(400_000))
        s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR)
        try:
            irpa_writer.copy_range(s, 7, d, 1000, 250_000)
            with pytest.raises(OSError, match="ended"):
                irpa_writer.copy_range(s, 300_000, d, 390_000, 10)
        finally:
            os.close(s), os.close(d)
        out = dst.read_bytes()
        assert out[1000:251_000] == payload[7:250_007]
        assert out[:1000] == bytes(1000)
