"""The manifest as the runtime reads it: its shape, paths that stay inside the artifact, missing
files, and the sha256 cache (keyed by ctime and inode too; in the user cache where the artifact
is read-only). Built by hand here: no compile needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sdiree.runtime import fileutil, manifest
from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import sha256_file
from sdiree.runtime.manifest import HASH_CACHE, check_files, load_manifest


def make_artifact(root: Path, edit=None) -> Path:
    """A small artifact: three files and a manifest naming them with their sha256."""
    files = {
        "unet.vmfb": os.urandom(4096),
        "unet.irpa": os.urandom(8192),
        "tokenizer/vocab.json": b"{}",
        "scheduler/scheduler_config.json": b"{}",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    data = {
        "schema_version": 2,
        "model": {"name": "m"},
        "target": {"name": "cpu", "arch": "host", "driver": "local-task"},
        "dtype": "fp32",
        "image": {
            "height": 64,
            "width": 64,
            "batch_size": 1,
            "latent_channels": 4,
            "latent_height": 8,
            "latent_width": 8,
        },
        "scheduler": {"config": "scheduler/scheduler_config.json"},
        "text_encoders": [{"submodule": "text_encoder", "tokenizer": "tokenizer"}],
        "submodules": {
            "unet": {
                "vmfb": "unet.vmfb",
                "parameters": "unet.irpa",
                "scope": "unet",
                "extra_parameters": [],
                "functions": {},
            }
        },
        "files": {rel: sha256_file(root / rel) for rel in files},
    }
    if edit:
        data = edit(data)
    (root / "manifest.json").write_text(json.dumps(data))
    return root


def test_well_formed_artifact_loads_and_checks(tmp_path):
    m = load_manifest(make_artifact(tmp_path))
    check_files(m, tmp_path / HASH_CACHE)
    assert m.submodules["unet"].archives() == [("unet.irpa", "unet")]


def test_a_json_list_is_not_a_manifest(tmp_path):
    make_artifact(tmp_path, edit=lambda d: [d])
    with pytest.raises(UserError, match="not a valid sdiree manifest: a JSON list"):
        load_manifest(tmp_path)


def _drop(*keys):
    def edit(d):
        node = d
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
        return d

    return edit


@pytest.mark.parametrize(
    "keys,named",
    [
        (("model",), "'model'"),
        (("scheduler",), "'scheduler'"),
        (("target", "driver"), "'target.driver'"),
        (("image", "latent_height"), "'image.latent_height'"),
        (("submodules", "unet", "vmfb"), "'vmfb'"),
        (("text_encoders", 0, "tokenizer"), "'tokenizer'"),
    ],
    ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_missing_key_is_one_clear_line(tmp_path, keys, named):
    make_artifact(tmp_path, edit=_drop(*keys))
    with pytest.raises(UserError) as e:
        load_manifest(tmp_path)
    msg = str(e.value)
    assert "not a valid sdiree manifest: missing" in msg and named in msg, msg
    assert "copy the whole artifact" in msg and "\n" not in msg


def test_wrong_type_is_refused(tmp_path):
    def edit(d):
        d["image"]["height"] = "64"
        return d

    make_artifact(tmp_path, edit=edit)
    with pytest.raises(UserError, match="'image.height' is not an integer"):
        load_manifest(tmp_path)


OUTSIDE = ["../params/abc-fp32/unet.irpa", "/etc/passwd", "tokenizer/../../x", "C:\\x\\unet.irpa"]


@pytest.mark.parametrize("path", OUTSIDE)
@pytest.mark.parametrize("where", ["parameters", "vmfb", "extra", "files", "scheduler"])
def test_paths_outside_the_artifact_are_refused(tmp_path, path, where):
    def edit(d):
        unet = d["submodules"]["unet"]
        if where in ("parameters", "vmfb"):
            unet[where] = path
        elif where == "extra":
            unet["extra_parameters"] = [{"path": path, "scope": "unet"}]
        elif where == "files":
            d["files"][path] = "0" * 64
        else:
            d["scheduler"]["config"] = path
        return d

    make_artifact(tmp_path, edit=edit)
    with pytest.raises(UserError, match="outside the artifact directory"):
        load_manifest(tmp_path)


def test_missing_file_says_the_artifact_is_incomplete(tmp_path):
    m = load_manifest(make_artifact(tmp_path))
    (tmp_path / "unet.irpa").unlink()
    with pytest.raises(UserError) as e:
        check_files(m, tmp_path / HASH_CACHE)
    msg = str(e.value)
    assert "is incomplete: unet.irpa is missing" in msg and "copy" in msg
    assert "recompile" not in msg


def test_corrupt_byte_with_restored_mtime_is_caught(tmp_path):
    m = load_manifest(make_artifact(tmp_path))
    check_files(m, tmp_path / HASH_CACHE)  # verified and cached
    vmfb = tmp_path / "unet.vmfb"
    st = vmfb.stat()
    data = bytearray(vmfb.read_bytes())
    data[100] ^= 0xFF
    vmfb.write_bytes(bytes(data))
    os.utime(vmfb, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert (vmfb.stat().st_size, vmfb.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(UserError, match="does not match its sha256"):
        check_files(m, tmp_path / HASH_CACHE)


def test_cache_spares_rehashing_unchanged_files(tmp_path, monkeypatch):
    m = load_manifest(make_artifact(tmp_path))
    check_files(m, tmp_path / HASH_CACHE)
    monkeypatch.setattr(fileutil, "sha256_file", _no_hashing)
    check_files(m, tmp_path / HASH_CACHE)


def _no_hashing(path, *a):
    raise AssertionError(f"{path} was hashed again")


def test_read_only_artifact_keeps_its_cache_in_the_user_cache(tmp_path, monkeypatch):
    art = make_artifact(tmp_path / "art")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "user-cache"))
    real_write = manifest.atomic_write_json

    def read_only_artifact(path, obj):
        if Path(path).parent == art:
            raise PermissionError(30, "Read-only file system", str(path))
        real_write(path, obj)

    monkeypatch.setattr(manifest, "atomic_write_json", read_only_artifact)
    m = load_manifest(art)
    check_files(m, art / HASH_CACHE)  # no error, though the artifact cannot be written
    assert not (art / HASH_CACHE).exists()
    assert list((tmp_path / "user-cache" / ".verified").glob("*.json"))
    monkeypatch.setattr(fileutil, "sha256_file", _no_hashing)
    check_files(m, art / HASH_CACHE)  # served from the user cache
