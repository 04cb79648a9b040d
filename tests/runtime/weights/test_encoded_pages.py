"""runtime/weights/pages.py: encoded archives keep each distinct page once, and load as the
original entries.

Synthetic archives check the format (a repeated entry stored once, a splat kept, a hash
collision caught by the byte comparison); the compiled tiny cpu artifact checks that its
encoded archives are paged, smaller than the encoder's output, and give the same image.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime.device_select import choose_device
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
from sdiree.runtime.session import Session
from sdiree.runtime.weights import pages
from sdiree.runtime.weights.pages import entry_views, paged_layout, write_paged


def _raw_archive(path, entries: dict, splat=None):
    import iree.runtime as rt

    index = rt.ParameterIndex()
    for key, data in entries.items():
        index.add_buffer(key, data)
    if splat:
        index.add_splat(splat, np.array([7, 0, 0, 0], np.uint8), 64)
    index.create_archive_file(str(path))


def _data(seed, n):
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def test_repeated_pages_are_stored_once_and_read_back_exactly(tmp_path):
    a, b = _data(1, 5 * pages.PAGE + 100), _data(2, 3 * pages.PAGE)
    # entry x holds a, b, a again (page-aligned) and a tail; y repeats b at another phase
    x = np.concatenate([a[: 5 * pages.PAGE], b, a[: 5 * pages.PAGE], a[-100:]])
    y = np.concatenate([np.zeros(pages.PAGE, np.uint8), b])
    raw, out = tmp_path / "raw.irpa", tmp_path / "paged.irpa"
    _raw_archive(raw, {"x": x, "y": y}, splat="s")
    stats = write_paged(raw, out)
    assert stats.shared_runs >= 2
    assert stats.bytes_out <= (5 + 3 + 1 + 1) * pages.PAGE  # a, b, the tail, the zero page
    views = entry_views(out)
    np.testing.assert_array_equal(views["x"], x)
    np.testing.assert_array_equal(views["y"], y)
    assert not views["x"].flags.writeable
    assert [k for k, _, _ in pages.splat_entries(out)] == ["s"]
    # what the encoder writes (learning a layout's temp disk): the data entries, not the pages
    assert pages.raw_size(out) == pages.raw_size(raw) == len(x) + len(y) > out.stat().st_size
    private = entry_views(out, private=True)["x"]
    private[:4] = 0  # copy-on-write: the file keeps its bytes
    np.testing.assert_array_equal(entry_views(out)["x"], x)


def test_a_hash_collision_is_caught_by_the_byte_comparison(tmp_path, monkeypatch):
    x = np.concatenate([_data(3, 4 * pages.PAGE), _data(4, 4 * pages.PAGE)])
    raw, out = tmp_path / "raw.irpa", tmp_path / "paged.irpa"
    _raw_archive(raw, {"x": x})
    # every page hashes alike: each candidate run must fail its comparison
    monkeypatch.setattr(
        pages, "_page_hashes", lambda p, i, w: np.zeros(p.first[i + 1] - p.first[i], np.uint64)
    )
    stats = write_paged(raw, out)
    assert stats.shared_runs == 0 and stats.bytes_out == len(x)
    np.testing.assert_array_equal(entry_views(out)["x"], x)


def _image(art):
    m = load_manifest(art)
    info, _ = choose_device(m, None)
    req = resolve_request(m, GenerationRequest(prompt="a red boat", steps=3, seed=11))
    session = Session(m, info, Text2Image.SUBMODULES)
    return Text2Image(m, session).generate(req, progress=None).images


def test_the_artifact_keeps_one_packed_copy_and_makes_the_same_image(compiled, tmp_path):
    import iree.runtime as rt

    art = compiled.get("cpu", "host", "fp32")
    data = json.loads((art / "manifest.json").read_text())
    assert data["schema_version"] >= 4
    unet = data["submodules"]["unet"]
    enc = [e for e in unet["extra_parameters"] if e["scope"] == "unet_encoded"]
    assert enc and enc[0].get("layout") == "pages"
    index = rt.ParameterIndex()
    index.load(str(art / "unet.encoded.irpa"))
    assert paged_layout(index) is not None
    # the same entries written out whole (both packed copies), in a copy of the artifact
    raw_art = tmp_path / "raw"
    shutil.copytree(art, raw_art)
    raw = raw_art / "unet.encoded.irpa"
    raw.unlink()
    views_paged = entry_views(art / "unet.encoded.irpa")
    whole = rt.ParameterIndex()
    for key, view in views_paged.items():
        whole.add_buffer(key, np.array(view))
    whole.create_archive_file(str(raw))
    assert (art / "unet.encoded.irpa").stat().st_size < 0.75 * raw.stat().st_size
    from sdiree.runtime.fileutil import sha256_file

    data["files"]["unet.encoded.irpa"] = sha256_file(raw)
    (raw_art / "manifest.json").write_text(json.dumps(data))
    np.testing.assert_array_equal(_image(art), _image(raw_art))


@pytest.mark.parametrize("page", [4096])
def test_a_layout_from_another_format_is_refused(tmp_path, page):
    import iree.runtime as rt

    index = rt.ParameterIndex()
    meta = pages.META_PREFIX + json.dumps({"version": 99, "page": page, "entries": {}})
    index.add_buffer(pages.PAGES_KEY, np.zeros(page, np.uint8), metadata=meta)
    index.create_archive_file(str(tmp_path / "a.irpa"))
    with pytest.raises(ValueError, match="format"):
        pages.load_archive(rt.ParameterIndex(), tmp_path / "a.irpa")


def test_released_file_pages_leave_rss_and_read_back_and_memory_is_never_dropped(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r")

    def rss_file_kb():
        status = Path("/proc/self/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("RssFile:")).split()[1])

    assert int(mapped[::4096].astype(np.int64).sum()) >= 0  # touch every page
    before = rss_file_kb()
    pages.release_pages(mapped[4096:])  # a view's pages: the first page stays
    assert before - rss_file_kb() > 48 << 10  # most of the 64 MiB left this process
    np.testing.assert_array_equal(mapped, data)  # and reads back the same
    memory = data.copy()
    pages.release_pages(memory)  # not a file mapping: nothing may be dropped
    np.testing.assert_array_equal(memory, data)
