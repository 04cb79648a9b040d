"""An artifact directory is self-contained: copied elsewhere on its own, with the compile cache
gone, it makes the same image; `compile --out DIR` writes nothing outside DIR but the compile
cache; the shared archives cost no disk (hardlinks) where they can."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdiree.runtime import fileutil
from sdiree.runtime.fileutil import link_or_copy


def test_link_or_copy_links_where_it_can(tmp_path):
    src = tmp_path / "a.irpa"
    src.write_bytes(b"weights")
    link_or_copy(src, tmp_path / "b.irpa")
    assert (tmp_path / "b.irpa").stat().st_ino == src.stat().st_ino
    link_or_copy(src, tmp_path / "b.irpa")  # already there: nothing to do
    assert src.stat().st_nlink == 2


def test_link_or_copy_copies_across_filesystems(tmp_path, monkeypatch):
    def cross_device(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(fileutil.os, "link", cross_device)
    src = tmp_path / "a.irpa"
    src.write_bytes(b"weights")
    (tmp_path / "b.irpa").write_bytes(b"old")
    link_or_copy(src, tmp_path / "b.irpa")
    assert (tmp_path / "b.irpa").read_bytes() == b"weights"
    assert (tmp_path / "b.irpa").stat().st_ino != src.stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.irpa", "b.irpa"]


def test_stamp_changes_when_bytes_do_though_size_and_mtime_do_not(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"0123456789")
    cache: dict = {}
    first = fileutil.cached_sha256(p, "f", cache)
    st = p.stat()
    p.write_bytes(b"0123456780")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fileutil.cached_sha256(p, "f", cache) != first


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def sdiree(*args, env, cwd):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", *map(str, args)],
        capture_output=True, text=True, timeout=900, env=env, cwd=cwd,
    )  # fmt: skip


def make_image(art: Path, png: Path, env, cwd) -> np.ndarray:
    proc = sdiree("run", art, "--prompt", "a red cube", "--steps", 2, "--seed", 7, "-o", png,
                  env=env, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return np.asarray(Image.open(png))


# The one submodule whose module the test's compile builds (iree-compile runs, under the
# test's cwd and HOME); the others' come from the seeded build cache.
COMPILED_AGAIN = "text_encoder"


def seed_modules(build_cache: Path, art: Path, dest: Path, skip: str) -> list[str]:
    """Copy into dest/.modules the build cache's entries of art's modules (the artifact's vmfbs
    are hardlinks of them, or equal copies), but skip's; returns the submodules seeded."""
    seeded = set()
    by_bytes = {  # each file read once
        m.read_bytes(): m.stem
        for m in art.glob("*.vmfb")
        if m.stem != skip and not m.stem.endswith(".encoder")
    }
    for record in (build_cache / ".modules").glob("*.record.json"):
        stem = record.name.removesuffix(".record.json")
        vmfb = record.with_name(f"{stem}.vmfb")
        module = by_bytes.get(vmfb.read_bytes()) if vmfb.is_file() else None
        if module is not None:
            (dest / ".modules").mkdir(parents=True, exist_ok=True)
            for part in build_cache.joinpath(".modules").glob(f"{stem}.*"):
                shutil.copy2(part, dest / ".modules" / part.name)
            seeded.add(module)
    return sorted(seeded)


@pytest.mark.slow
def test_copied_artifact_runs_without_the_original_or_the_cache(compiled, compile_cache, tmp_path):
    # The default cache (no $SDIREE_CACHE), under a private HOME; seeded with the session's
    # exports (the model's cache) and with its modules but one, so that only that one compiles
    # again (the build cache is the user cache's, compile/build_cache.py).
    art = compiled.get("cpu", "host", "fp32")
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cache = home / ".cache" / "sdiree"
    shutil.copytree(compile_cache / "tiny-sd", cache / "tiny-sd")
    others = sorted(p.stem for p in art.glob("*.vmfb") if not p.stem.endswith(".encoder"))
    others.remove(COMPILED_AGAIN)
    assert seed_modules(compile_cache, art, cache, COMPILED_AGAIN) == others
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("SDIREE_CACHE", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    model_before = files_under(compiled.model)
    home_before = files_under(home)

    a = tmp_path / "first" / "A"
    proc = sdiree("compile", compiled.model, "--target", "cpu", "--arch", "host",
                  "--dtype", "fp32", "--out", a, env=env, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stderr

    # nothing written outside --out but the documented cache
    assert list(a.parent.iterdir()) == [a]
    assert list(cwd.iterdir()) == []
    assert files_under(compiled.model) == model_before
    home_after = files_under(home)
    written = {f for f, v in home_after.items() if home_before.get(f) != v}
    documented = (
        ".cache/sdiree/tiny-sd/",
        ".cache/sdiree/.modules/",
        ".cache/sdiree/.exports/",
        ".cache/sdiree/.kernels/",  # sdiree's kernels' objects, where an export links them
    )
    assert all(f.startswith(documented) for f in written), sorted(written)
    assert any(f.startswith(".cache/sdiree/.modules/") for f in written)  # modules compiled

    # every path in the manifest is inside the artifact; the shared archives are hardlinks,
    # except those the compile pruned to what the encoded archives lack (compile/prune.py)
    manifest = json.loads((a / "manifest.json").read_text())
    for rel in manifest["files"]:
        assert not Path(rel).is_absolute() and ".." not in Path(rel).parts
        assert (a / rel).resolve().is_relative_to(a)
    params = next((cache / "tiny-sd" / "params").glob("*-fp32"))
    shared = [rel for rel in manifest["files"] if (params / rel).is_file()]
    linked = [rel for rel in shared if f"{rel}.pruned.json" not in manifest["files"]]
    # the text encoder's is pruned on any CPU (on an AMX one the UNet's is kept whole: its
    # encoded weights are bf16x3 parts, not a layout of it)
    assert "unet.irpa" in shared and "text_encoder.irpa" in shared
    assert "text_encoder.irpa" not in linked
    for rel in linked:
        assert (a / rel).stat().st_ino == (params / rel).stat().st_ino

    image_a = make_image(a, tmp_path / "a.png", env, cwd)
    b = tmp_path / "elsewhere" / "B"
    shutil.copytree(a, b)
    shutil.rmtree(a)
    shutil.rmtree(cache)
    image_b = make_image(b, tmp_path / "b.png", env, cwd)
    np.testing.assert_array_equal(image_a, image_b)

    # an incomplete copy names what is missing and says to copy the whole directory
    (b / "unet.irpa").unlink()
    proc = sdiree("run", b, "--prompt", "a", "-o", tmp_path / "c.png", env=env, cwd=cwd)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "unet.irpa" in line and "incomplete" in line, line
    assert "copy" in line and "recompile" not in line
