"""Page-aligned weights a CPU Vulkan device imports (runtime/weights/imported.py)."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from sdiree.compile.verify import make_inputs
from sdiree.runtime.device import list_devices
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.session import Session
from sdiree.runtime.weights import overrides
from sdiree.runtime.weights.imported import add_importable
from sdiree.runtime.weights.pages import load_archive


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_every_entry_is_a_page_aligned_copy_of_the_archives_bytes(compiled):
    import iree.runtime as rt

    manifest = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    path = manifest.path(manifest.submodules["vae_decoder"].archives()[0][0])
    index, keep = rt.ParameterIndex(), []
    copies = add_importable(index, path, keep)
    mapped = rt.ParameterIndex()
    load_archive(mapped, path)
    want = {k: e for k, e in mapped.items()}
    assert len(copies) == sum(not e.is_splat for e in want.values()) > 10
    assert {k for k, _ in index.items()} == set(want)
    data = path.read_bytes()
    for key, (copy, offset, length) in copies.items():
        assert _address(copy) % mmap.PAGESIZE == 0 and len(copy) % mmap.PAGESIZE == 0
        assert length == want[key].length
        assert copy[:length] == data[offset : offset + length]
    assert len(keep) == len(copies)


def test_lavapipe_reads_the_weights_where_they_are_and_computes_the_same(compiled, monkeypatch):
    """The session on lavapipe imports its weights (no copy in the HAL's pools, which lavapipe's
    calls overwrite at SD 1.5 size): writing the host copies changes the next call's result.
    Its results equal those of the weights loaded the old way, bit for bit."""
    manifest = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    info = list_devices("vulkan")[0]
    assert info.is_cpu_emulation
    inputs = make_inputs(manifest, "vae_decoder", "decode", 0)
    s = Session(manifest, info, ["vae_decoder"])
    copies = [k for k in s.weights._keep if isinstance(k, mmap.mmap)]
    assert copies  # the ordinary archive's entries, imported
    got = s.call("vae_decoder", "decode", *inputs)[0]

    monkeypatch.setattr(overrides, "add_importable", lambda index, p, keep: load_archive(index, p))
    pooled = Session(manifest, info, ["vae_decoder"], fresh_device=True)
    assert not [k for k in pooled.weights._keep if isinstance(k, mmap.mmap)]
    np.testing.assert_array_equal(got, pooled.call("vae_decoder", "decode", *inputs)[0])

    for c in copies:  # zeroed in host memory after loading: the device sees it
        np.frombuffer(c, np.uint8)[:] = 0
    zeroed = s.call("vae_decoder", "decode", *inputs)[0]
    assert not np.array_equal(zeroed, got)
    assert float(np.ptp(zeroed)) == 0.0  # every weight and bias 0: one value everywhere
