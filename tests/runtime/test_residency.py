"""residency and Session.release: a finished phase's weight pages leave RSS, bytes unchanged."""

from __future__ import annotations

import mmap
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime import residency

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/maps")

MiB = 1 << 20


def _file(tmp_path: Path, n: int = 16 * MiB) -> tuple[Path, bytes]:
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    return path, data


def test_read_only_mapping_leaves_rss_and_reads_back(tmp_path):
    path, data = _file(tmp_path)
    ident = residency.file_identity(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(m, np.uint8)
        assert int(view[:: mmap.PAGESIZE].sum()) >= 0  # touch every page
        before = residency.resident_bytes([ident])
        assert before >= len(data) * 9 // 10
        assert residency.release_mapped_files([path]) >= len(data)
        assert residency.resident_bytes([ident]) < len(data) // 10
        assert view.tobytes() == data  # faulted back in from the page cache, unchanged
        del view
    finally:
        m.close()


def test_writable_mapping_is_left_alone(tmp_path):
    path, data = _file(tmp_path, 4 * MiB)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, writable
    try:
        m[:4] = b"\0\1\2\3"  # a copy-on-write page that madvise would throw away
        m[len(data) - 1 :] = b"\7"
        assert residency.release_mapped_files([path]) == 0
        assert m[:4] == b"\0\1\2\3" and m[len(data) - 1 :] == b"\7"
        assert m[4 : len(data) - 1] == data[4:-1]
    finally:
        m.close()


def test_keep_turns_it_off(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, MiB)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        monkeypatch.setenv(residency.KEEP_ENV, "keep")
        assert residency.release_mapped_files([path]) == 0
    finally:
        m.close()


def test_unknown_or_missing_files_release_nothing(tmp_path):
    assert residency.release_mapped_files([tmp_path / "gone.irpa"]) == 0
    assert residency.release_mapped([]) == 0


# -- on the tiny artifact: each phase's pages go when it ends, outputs unchanged ----------------
PHASES = """
import json, sys
from pathlib import Path
import numpy as np
from sdiree.runtime import residency
from sdiree.runtime.device import list_devices
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, pipeline_submodules
from sdiree.runtime.pipeline import resolve_request
from sdiree.runtime.session import Session

m = load_manifest(Path(sys.argv[1]))
subs = pipeline_submodules(m, Text2Image)
s = Session(m, list_devices("local-task")[0], subs)
files = {n: {i for p, _ in m.submodules[n].archives()
             if (i := residency.file_identity(m.path(p))) is not None} for n in subs}
def resident():
    return {n: residency.resident_bytes(ids) for n, ids in files.items()}
seen = []  # (call, resident bytes per module when it starts)
call = s.call
def recording(sub, fn, *a):
    seen.append([f"{sub}.{fn}", resident()])
    return call(sub, fn, *a)
s.call = recording
t2i = Text2Image(m, s)
req = resolve_request(m, GenerationRequest(prompt="a cat", steps=2, seed=1))
image = t2i.generate(req, progress=None).images
after = resident()
lat = np.zeros(m.submodules["vae_decoder"].functions["decode"].inputs[0].shape, np.float32)
first = call("vae_decoder", "decode", lat)[0]
touched = residency.resident_bytes(files["vae_decoder"])
released = s.release(["vae_decoder"])
again = call("vae_decoder", "decode", lat)[0]
np.save(sys.argv[2], image)
print(json.dumps({"seen": seen, "after": after, "touched": touched, "released": released,
                  "same": bool(np.array_equal(first, again))}))
"""


def _phases(art: Path, out: Path, **env) -> dict:
    import json

    run = subprocess.run(
        [sys.executable, "-c", PHASES, str(art), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_each_phase_starts_without_the_previous_ones_pages(compiled, tmp_path):
    art = compiled.get("cpu", "host", "fp32")
    got = _phases(art, tmp_path / "released.npy")
    kept = _phases(art, tmp_path / "kept.npy", SDIREE_PHASE_MEMORY="keep")
    calls = [c for c, _ in got["seen"]]
    assert calls[0].startswith("text_encoder.") and calls[-1] == "vae_decoder.decode"
    first_unet = next(r for c, r in got["seen"] if c.startswith("unet."))
    later_unet = [r for c, r in got["seen"] if c.startswith("unet.")][1:]
    decode = got["seen"][-1][1]
    # kept: everything a phase touched is still resident when the next one starts
    kept_decode = kept["seen"][-1][1]
    assert kept_decode["text_encoder"] > 0 and kept_decode["unet"] > 0
    # released: the text encoder's pages are gone before the UNet runs, the UNet's before
    # the decode, and the UNet's stay between its own calls (no refault within the loop)
    assert first_unet["text_encoder"] == 0
    assert all(r["unet"] > 0 for r in later_unet)
    assert decode["unet"] == 0 and decode["text_encoder"] == 0
    assert got["after"] == {n: 0 for n in got["after"]}
    assert got["touched"] > 0 and got["released"] > 0 and got["same"]
    # the image does not change
    np.testing.assert_array_equal(
        np.load(tmp_path / "released.npy"), np.load(tmp_path / "kept.npy")
    )


def test_replaced_weights_encoded_in_the_cache_are_released_too(compiled, monkeypatch, tmp_path):
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
    from sdiree.runtime.session import Session
    from sdiree.runtime.weights.archive import Archive
    from sdiree.runtime.weights.overrides import WeightOverrides

    art = compiled.get("cpu", "host", "fp32")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    m = load_manifest(art)
    a = Archive(art / "unet.irpa")
    scaled = {
        k: (np.array(a.array(k)) * np.float32(1.02)).astype(e.dtype) for k, e in a.entries.items()
    }
    overrides = WeightOverrides({"unet": scaled}, digest="unet-1.02")
    session = Session(m, choose_device(m, None)[0], Text2Image.SUBMODULES, overrides)
    (cached,) = (tmp_path / "cache").rglob("unet.encoded.irpa")
    ident = residency.file_identity(cached)
    assert ident in session.weights.file_ids[m.submodules["unet"].encoder.scope]
    during = []
    call = session.call

    def recording(sub, fn, *args):
        out = call(sub, fn, *args)
        if sub == "unet":
            during.append(residency.resident_bytes([ident]))
        return out

    session.call = recording
    req = resolve_request(m, GenerationRequest(prompt="a red boat", steps=2, seed=11))
    Text2Image(m, session).generate(req, progress=None)
    assert during and min(during) > 0  # the UNet read the cached archive in place
    assert residency.resident_bytes([ident]) == 0  # and gave its pages back after the loop
