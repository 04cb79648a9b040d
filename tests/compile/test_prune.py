"""compile/prune.py: a cpu artifact keeps of its original weights only what the encoded
archives lack, and runs exactly as it would with all of them.

On the tiny model's cpu artifact: every original archive is pruned (sidecar listed in the
manifest), the keys it dropped read back equal to the compile cache's full archive (bit for
bit, Winograd-only 3x3 weights within float32 rounding), an image is bit-identical to the same
artifact given its full archives back, and a GPU-style artifact (nothing encoded) keeps its
archives whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from llvm_cpu import host_fp32_splits, laid_out_cpu_fp32

from sdiree.compile.prune import ArchiveUse, _prune_key
from sdiree.runtime.device_select import choose_device
from sdiree.runtime.fileutil import sha256_file
from sdiree.runtime.manifest import HASH_CACHE, load_manifest
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
from sdiree.runtime.session import Session
from sdiree.runtime.text_inputs import TOKEN_TABLE
from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.overrides import WeightOverrides
from sdiree.runtime.weights.recover import SIDECAR_SUFFIX, sidecar_path

ORIGINALS = ("text_encoder.irpa", "unet.irpa", "vae.irpa", "vae.winograd4.irpa")


def _full(art: Path, name: str) -> Path:
    """The compile cache's full archive that art's pruned `name` came from (by its digest)."""
    digest = json.loads((art / ".build-state.json").read_text())["pruned"][name]["from"]
    cache = Path(os.environ["SDIREE_CACHE"])
    found = [
        p
        for p in cache.glob(f"*/params/*/{name}")
        if json.loads(p.with_suffix(".irpa.sha256").read_text())["sha256"] == digest
    ]
    assert found, name
    return found[0]


def _image(art, overrides=None):
    m = load_manifest(art)
    info, _ = choose_device(m, None)
    req = resolve_request(m, GenerationRequest(prompt="a red boat", steps=3, seed=11))
    session = Session(m, info, Text2Image.SUBMODULES, overrides)
    return Text2Image(m, session).generate(req).images


def test_the_cpu_artifact_keeps_only_what_its_encoded_archives_lack(compiled):
    art = compiled.get(*laid_out_cpu_fp32())
    files = load_manifest(art).data["files"]
    for name in ORIGINALS:
        sidecar = sidecar_path(art / name)
        assert files.get(sidecar.name) == sha256_file(sidecar), name
        assert files[name] == sha256_file(art / name)
        full, pruned = Archive(_full(art, name)), Archive(art / name)
        assert set(pruned.entries) == set(full.entries)
        dropped = [k for k, e in pruned.entries.items() if e.recovered]
        # the token table is read by the runtime, not by a module: it stays
        kept = [k for k in pruned.entries if k not in dropped and not k.endswith(TOKEN_TABLE)]
        kept_bytes = sum(full.entries[k].length for k in kept)
        assert kept_bytes < 0.2 * sum(e.length for e in full.entries.values()), name
        for key in dropped:
            want, got = full.array(key), pruned.array(key)
            if key.endswith("conv.weight") or want.shape[2:] == (3, 3):
                assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), key
            else:
                np.testing.assert_array_equal(got, want, err_msg=key)
        # a big weight kept is one a module names (or whose name starts another's it names:
        # `conv.weight` in `conv.weight_winograd`, the upper bound prune.py keeps)
        named = b"".join(v.read_bytes() for v in art.glob("*.vmfb"))
        big = [k for k, e in full.entries.items()
               if e.length >= 4096 and k.endswith("weight") and not k.endswith(TOKEN_TABLE)]  # fmt: skip
        assert all(k in dropped or k.encode() in named for k in big), name
        assert len(set(big) & set(dropped)) >= 0.8 * len(big), name


def _pruned(art: Path) -> list[str]:
    return sorted(p.name[: -len(SIDECAR_SUFFIX)] for p in art.glob(f"*{SIDECAR_SUFFIX}"))


def test_a_bf16_artifact_drops_weights_as_its_modules_hold_them(compiled):
    """A bf16 artifact's encoders pack the contractions' weights in bf16: it drops those as
    their bf16 rounding (what its modules compute with; the sidecar says so), and what float32
    packs hold (biases) bit for bit. Its original archives shrink as an fp32 artifact's do."""
    from sdiree.runtime.weights.layout import from_bf16, to_bf16

    art = compiled.get("cpu", "host", "bf16")
    for name in ("text_encoder.irpa", "unet.irpa", "vae.irpa"):
        full, pruned = Archive(_full(art, name)), Archive(art / name)
        listed = json.loads(sidecar_path(art / name).read_text())["keys"]
        dropped = [k for k, e in pruned.entries.items() if e.recovered]
        assert sorted(dropped) == sorted(listed), name
        rounded = [k for k in dropped if listed[k].get("rounded") == "bf16"]
        assert rounded, name
        for key in dropped:
            want, got = full.array(key), pruned.array(key)
            if key not in rounded:
                np.testing.assert_array_equal(got, want, err_msg=key)
            elif want.ndim == 4 and want.shape[2:] == (3, 3):  # through the Winograd inverse
                assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max(), key
            else:
                np.testing.assert_array_equal(got, from_bf16(to_bf16(want)).reshape(want.shape))
        kept = [k for k in pruned.entries if k not in dropped and not k.endswith(TOKEN_TABLE)]
        kept_bytes = sum(full.entries[k].length for k in kept)
        assert kept_bytes < 0.2 * sum(e.length for e in full.entries.values()), name


def test_a_lora_on_a_pruned_bf16_artifact_adds_to_its_bf16_weights(compiled, tmp_path):
    """The same LoRA-like change on the pruned bf16 artifact (added to the bf16-rounded
    weights it reads back) and on the same artifact with its full archives (added to the
    float32 weights) differ by bf16 rounding only."""
    art = compiled.get("cpu", "host", "bf16")
    whole = _with_full_archives(art, tmp_path / "whole")
    a = Archive(art / "unet.irpa")
    keys = [k for k, e in a.entries.items() if e.recovered and k.endswith("to_q.weight")]
    rng = np.random.default_rng(3)
    deltas = {k: 0.05 * rng.standard_normal(a.entries[k].shape).astype(np.float32) for k in keys}
    images = []
    for root in (art, whole):
        arch = Archive(root / "unet.irpa")
        changed = {k: np.array(arch.array(k)) + d for k, d in deltas.items()}
        images.append(_image(root, WeightOverrides({"unet": changed}, digest="")))
    diff = np.abs(images[0].astype(np.float64) - images[1].astype(np.float64)) / 2  # [-1, 1]
    psnr = 10 * np.log10(1.0 / max(float((diff**2).mean()), 1e-20))
    assert keys and psnr >= 30, psnr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_pruned_artifact_makes_the_image_its_full_archives_make(compiled, tmp_path, dtype):
    art = (
        compiled.get(*laid_out_cpu_fp32())
        if dtype == "fp32"
        else compiled.get("cpu", "host", dtype)
    )
    assert set(_pruned(art)) >= {"text_encoder.irpa", "unet.irpa", "vae.irpa"}
    whole = _with_full_archives(art, tmp_path / "whole")
    assert not any(e.recovered for e in Archive(whole / "unet.irpa").entries.values())
    np.testing.assert_array_equal(_image(art), _image(whole))


def _with_full_archives(art: Path, whole: Path) -> Path:
    """A copy of art with its pruned archives whole again."""
    shutil.copytree(art, whole)
    data = json.loads((whole / "manifest.json").read_text())
    for name in _pruned(art):
        shutil.copyfile(_full(art, name), whole / name)
        sidecar_path(whole / name).unlink()
        data["files"].pop(sidecar_path(whole / name).name)
        data["files"][name] = sha256_file(whole / name)
    (whole / "manifest.json").write_text(json.dumps(data))
    (whole / HASH_CACHE).unlink()
    return whole


def test_an_archive_without_encoded_weights_stays_whole(compiled):
    """vulkan's UNet module computes nothing from its weights at load (no encoder): its
    archive stays whole."""
    art = compiled.get("vulkan-spirv", "lavapipe", "fp32")
    assert not (art / "unet.irpa.pruned.json").exists()
    cpu = compiled.get(*laid_out_cpu_fp32())
    full = Archive(_full(cpu, "unet.irpa"))
    assert not any(e.recovered for e in Archive(art / "unet.irpa").entries.values())
    assert Archive(art / "unet.irpa").entries.keys() == full.entries.keys()


def test_a_lora_session_gives_the_module_no_read_back_weights(compiled):
    """The module's own scope, with a weight replaced, holds the replaced weight and what the
    module names; the weights the artifact dropped are not read back for it (SD 1.5: 2 GB)."""
    art = compiled.get(*laid_out_cpu_fp32())
    m = load_manifest(art)
    a = Archive(art / "unet.irpa")
    dropped = [k for k, e in a.entries.items() if e.recovered]
    changed = {dropped[0]: np.array(a.array(dropped[0])) * 1.5}
    session = Session(m, choose_device(m, None)[0], ("unet",), WeightOverrides({"unet": changed}))
    served = {k for k, _ in session.weights.indices["unet"].items()}
    assert dropped[0] in served
    assert not served & set(dropped[1:])
    # what the module names: the kept weights of each archive in its scope (with panels, a CPU
    # without avx512f, its derived archive's panels too)
    own = [Archive(art / p) for p, scope in m.submodules["unet"].archives() if scope == "unet"]
    named = {k for o in own for k, e in o.entries.items() if not e.recovered}
    assert served - {dropped[0]} == named


def test_the_prune_key_follows_its_inputs_and_skips_submodules_without_a_layout():
    def results(vmfb="1", layout_sha="l"):
        return {
            "unet": {"vmfb_sha256": vmfb, "encoded": {
                "sha256": "e", "encoder": {"layout": "unet.layout.json", "layout_sha256": layout_sha}}},
            "vae_decoder": {"vmfb_sha256": "2", "encoded": {"sha256": "f", "encoder": {}}},
        }  # fmt: skip

    use = ArchiveUse(Path("unet.irpa"), Path("cache/unet.irpa"), "d", "unet", ["unet"])
    src = [{"encoded": "unet.encoded.irpa", "layout": "unet.layout.json"}]
    key = _prune_key(use, results(), src)
    assert key == _prune_key(use, results(), src)
    assert key != _prune_key(use, results(vmfb="9"), src)
    assert key != _prune_key(use, results(layout_sha="9"), src)


def test_an_amx_fp32_artifact_keeps_the_archives_of_its_split_weights_whole(compiled):
    """On an AMX CPU, host fp32's UNet and VAE encode each weight as two bf16 parts
    (`amx_operands: bf16x3`): computed from the weight, not laid out, and the weight cannot be
    read back from them, so no layout is learned and their archives stay whole; the text
    encoder's is still pruned."""
    if not host_fp32_splits():
        pytest.skip("this CPU has no AMX: host fp32 is laid out (the tests above)")
    art = compiled.get("cpu", "host", "fp32")
    m = load_manifest(art)
    for sub in ("unet", "vae_decoder", "vae_encoder"):
        assert m.data["submodules"][sub]["export"]["amx_operands"] == "bf16x3", sub
        assert not (art / f"{sub}.layout.json").exists(), sub
    for name in ("unet.irpa", "vae.irpa"):
        assert not sidecar_path(art / name).exists(), name
        assert not any(e.recovered for e in Archive(art / name).entries.values()), name
    assert sidecar_path(art / "text_encoder.irpa").exists()
    assert (art / "text_encoder.layout.json").exists()


def test_the_kept_subset_is_written_as_iree_writes_it(tmp_path):
    """_write_subset copies the kept entries file to file (data, splats, metadata) into the
    same bytes iree's own writer makes of them."""
    import iree.runtime as rt

    from sdiree.compile.prune import _write_subset

    rng = np.random.default_rng(3)
    entries = {
        "a.weight": (rng.integers(0, 256, 1000, dtype=np.uint8), "PYTORCH:{}"),
        "b.bias": (np.full(16, 7, np.uint8), None),  # a splat
        "c.weight": (rng.integers(0, 256, 4099, dtype=np.uint8), None),
        "d.weight": (rng.integers(0, 256, 65, dtype=np.uint8), "m"),
    }

    def archive(keys, path):
        index = rt.ParameterIndex()
        for key in keys:
            data, meta = entries[key]
            if key == "b.bias":
                index.add_splat(key, data[:1].copy(), len(data), metadata=meta)
            else:
                index.add_buffer(key, data, metadata=meta)
        index.create_archive_file(str(path))

    archive(entries, tmp_path / "full.irpa")
    kept = ["d.weight", "b.bias", "a.weight"]
    archive(kept, tmp_path / "want.irpa")
    _write_subset(Archive(tmp_path / "full.irpa"), kept, tmp_path / "got.irpa")
    assert (tmp_path / "got.irpa").read_bytes() == (tmp_path / "want.irpa").read_bytes()


def test_close_decides_in_float32_as_in_float64():
    """_close's float32 path accepts and refuses what a float64 comparison does, with a margin
    on the safe side: never a weight whose exact difference passes the tolerance."""
    from sdiree.compile.prune import WINOGRAD_TOLERANCE, _close

    rng = np.random.default_rng(5)
    want = rng.standard_normal((64, 9)).astype(np.float32)
    limit = WINOGRAD_TOLERANCE * float(np.abs(want).max())
    for factor, expected in ((0.5, True), (0.99, True), (1.01, False), (3.0, False)):
        got = want.copy()
        got[7, 3] += np.float32(factor * limit)
        exact = np.abs(got.astype(np.float64) - want.astype(np.float64)).max()
        assert _close(got, want) is expected == bool(exact <= limit)
    nan = want.copy()
    nan[0, 0] = np.nan
    assert not _close(nan, want)
    assert _close(want.copy(), want)
    assert not _close(want[:, :8].copy(), want)
    rounded = want.copy()
    rounded[1, 1] += np.float32(1e-3)  # exactly bf16-rounded it is not; within 2**-6 it is
    assert _close(rounded, want, rounded=True)
