"""`sdiree compile` against bad sizes and places, a full disk, damaged shared archives and the
temp files of a killed compile: one clear line or a repaired build, never a traceback."""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sdiree.compile import driver
from sdiree.compile.driver import MAX_SIDE, CompileOptions, compile_model
from sdiree.compile.report import Reporter
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import check_files, load_manifest
from sdiree.runtime.weights.recover import sidecar_path


def compile_quietly(model, out, **kw):
    rep = Reporter(stream=io.StringIO())
    opts = dict(model_dir=model, target="cpu", arch="host", dtype="fp32", out=out)
    compile_model(CompileOptions(**{**opts, **kw}), rep)
    ran = {(r.stage, r.item) for r in rep.records if r.status == "done"}
    return ran, rep.stream.getvalue()


BAD_SIZES = [
    ({"height": 0}, "--height 0 is not a positive multiple of 8"),
    ({"width": 0}, "--width 0 is not a positive multiple of 8"),
    ({"height": -64}, "--height -64 is not a positive"),
    ({"width": 12}, "--width 12 is not a positive multiple of 8"),
    ({"height": MAX_SIDE + 8}, f"({MAX_SIDE} at most)"),
    ({"width": 1 << 20}, f"({MAX_SIDE} at most)"),
]


@pytest.mark.parametrize("size,must_say", BAD_SIZES, ids=[str(b[0]) for b in BAD_SIZES])
def test_bad_sizes_refused_before_writing(tiny_model, tmp_path, size, must_say):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=must_say.replace("(", r"\(").replace(")", r"\)")):
        compile_quietly(tiny_model, out, **size)
    assert not out.exists()


def test_height_zero_exits_non_zero_from_the_cli(tiny_model, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(tiny_model), "--target",
         "cpu", "--height", "0", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --height 0 is not")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", [".", "artifact", "unet/artifact"])
def test_out_inside_the_model_folder_refused(tiny_model, tmp_path, where):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    before = sorted(p.relative_to(model) for p in model.rglob("*"))
    with pytest.raises(UserError, match="inside the model folder"):
        compile_quietly(model, model / where)
    assert sorted(p.relative_to(model) for p in model.rglob("*")) == before


def test_full_disk_is_one_line(tiny_model, tmp_path, monkeypatch):
    """However the write fails (here: the first export), a full disk is a UserError."""

    def full(self, submodule):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.mlir_path(submodule)))

    monkeypatch.setattr(driver.Builder, "ensure_mlir", full)
    with pytest.raises(UserError, match=r"^no space left on device writing to .*/mlir \(") as e:
        compile_quietly(tiny_model, tmp_path / "out")
    assert f"set {driver.CACHE_ENV} elsewhere" in str(e.value)


def test_full_disk_while_writing_weights_names_the_cache(tiny_model, tmp_path, monkeypatch):
    """An archive's write fails as a plain OSError naming no file (a pwrite): the message
    still names the cache's params folder, where it was writing, and what to do about it."""
    from sdiree.compile.exporters import base

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(base, "save_parameters", full)
    with pytest.raises(UserError, match=r"^no space left on device writing to .*/params/") as e:
        compile_quietly(tiny_model, tmp_path / "out")
    assert f"set {driver.CACHE_ENV} elsewhere" in str(e.value)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs, where this process may mount one (root in most sandboxes)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
        )
    except OSError:
        pytest.skip("no mount command")
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("full", ["cache", "out"])
def test_really_full_disk_is_one_line_and_leaves_no_temps(tiny_model, tmp_path, tiny_fs, full):
    env = dict(os.environ)
    out = tiny_fs / "art" if full == "out" else tmp_path / "art"
    if full == "cache":
        env["SDIREE_CACHE"] = str(tiny_fs)
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(tiny_model), "--target",
         "cpu", "--arch", "host", "--dtype", "fp32", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no space left on device writing to {tiny_fs}"), last
    assert ("choose another --out" if full == "out" else "set SDIREE_CACHE elsewhere") in last
    assert not [p for p in tiny_fs.rglob("*") if ".tmp" in p.name]
    assert not (out / "manifest.json").exists()


# A target whose artifacts link the cache's archives whole (cpu keeps pruned copies of its own,
# compile/prune.py)
LINKED = {"target": "vulkan-spirv", "arch": "lavapipe"}


def _private_copy(compiled, compile_cache: Path, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A copy of the lavapipe fp32 artifact and of the compile cache, linked as a compile leaves
    them (the artifact's shared archives are hardlinks into the cache): (artifact, params)."""
    base = compiled.get(LINKED["target"], LINKED["arch"], "fp32")
    cache = tmp_path / "cache"
    shutil.copytree(compile_cache, cache)
    monkeypatch.setenv("SDIREE_CACHE", str(cache))
    out = tmp_path / "art"
    shutil.copytree(base, out)
    params = next((cache / "tiny-sd" / "params").glob("*-fp32"))
    for p in out.glob("*.irpa"):
        if (params / p.name).is_file() and not sidecar_path(p).exists():  # pruned: a copy
            p.unlink()
            os.link(params / p.name, p)
    return out, params


def test_truncated_shared_archive_is_rewritten(compiled, compile_cache, tmp_path, monkeypatch):
    out, params = _private_copy(compiled, compile_cache, tmp_path, monkeypatch)
    ran, log = compile_quietly(compiled.model, out, **LINKED)
    assert "up to date" in log
    archive = params / "unet.irpa"
    with open(archive, "r+b") as f:
        f.truncate(archive.stat().st_size // 2)

    ran, log = compile_quietly(compiled.model, out, **LINKED)
    assert "up to date" not in log
    assert "truncated or changed" in log
    assert ("parameters", "unet") in ran
    assert ("export", "unet") not in ran
    check_files(load_manifest(out))  # what run checks: the artifact is whole again
    assert (out / "unet.irpa").stat().st_ino == archive.stat().st_ino


def test_changed_shared_archive_of_same_size_and_mtime_is_rewritten(
    compiled, compile_cache, tmp_path, monkeypatch
):
    out, params = _private_copy(compiled, compile_cache, tmp_path, monkeypatch)
    compile_quietly(compiled.model, out, **LINKED)  # records the archives' stamps
    archive = params / "unet.irpa"  # linked (the others are pruned copies)
    st = archive.stat()
    data = bytearray(archive.read_bytes())
    data[-16] ^= 0xFF
    archive.write_bytes(bytes(data))
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))

    ran, log = compile_quietly(compiled.model, out, **LINKED)
    assert ("parameters", "unet") in ran
    check_files(load_manifest(out))


def test_temps_of_a_killed_compile_are_removed(compiled, compile_cache):
    out = compiled.get("cpu", "host", "fp32")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(dead.stdout)  # a process that has ended
    cache = compile_cache / "tiny-sd"
    params = next((cache / "params").glob("*-fp32"))
    tag = uuid.uuid4().hex[:8]
    temps = [
        params / f".unet-{tag}.irpa.{pid}.tmp.irpa",
        params / f".unet-{tag}.irpa.sha256.{pid}.tmp.sha256",
        cache / "mlir" / f".unet-{tag}.mlirbc.{pid}.tmp.mlirbc",
        cache / f"..model-hashes-{tag}.json.{pid}.tmp.json",
        out / f".unet-{tag}.vmfb.{pid}.tmp.vmfb",
        out / "tokenizer" / f".vocab-{tag}.json.{pid}.tmp.json",
        out / "scheduler" / f".scheduler_config-{tag}.json.{pid}.tmp.json",
        # named with this process's pid, as when a container gives a new process an old pid
        out / f".unet-{tag}.encoded.irpa.{os.getpid()}.tmp.irpa",
    ]
    for t in temps:
        t.write_bytes(b"partial")
    _, log = compile_quietly(compiled.model, out)
    assert "up to date" in log
    assert [t for t in temps if t.exists()] == []
