"""A read-only artifact (a shared model, a read-only mount) runs: loading opens nothing of it for
writing. (iree's VmModule.mmap opens the .vmfb "r+b", which failed with `OSError: Read-only file
system` on text_encoder.vmfb.)"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime import session
from sdiree.runtime.device import list_devices
from sdiree.runtime.manifest import load_manifest

# Runs "$@" with $1 bind-mounted read-only onto itself, in a mount namespace of its own so that
# nothing outside the test sees the mount; exits 97 if the mount turned out writable.
READ_ONLY = (
    'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" || exit 96; '
    'if touch "$1/.probe" 2>/dev/null; then exit 97; fi; shift; exec "$@"'
)
# root (or CAP_SYS_ADMIN) needs only a mount namespace; others need a user namespace too.
UNSHARE = (["unshare", "--mount", "--propagation", "private"], ["unshare", "-r", "--mount"])


def _read_only_runner(root: Path) -> list[str]:
    """The command prefix that runs a command with root read-only; skips where none can."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to make a read-only mount")
    for prefix in UNSHARE:
        cmd = [*prefix, "sh", "-c", READ_ONLY, "sh", str(root)]
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    pytest.skip("cannot make a read-only bind mount here (no mount or user namespaces)")


@pytest.fixture(scope="module")
def cpu_art(compiled):
    return compiled.get("cpu", "host", "fp32")


def _copy_artifact(src: Path, root: Path) -> Path:
    """The artifact and the shared folders its manifest may point into, without its hash
    cache (so the run verifies every file on the read-only copy)."""
    art = root / src.name
    shutil.copytree(src, art)
    for shared in ("params", "mlir"):
        if (src.parent / shared).is_dir():
            shutil.copytree(src.parent / shared, root / shared)
    (art / ".verified.json").unlink(missing_ok=True)
    return art


def test_run_from_a_read_only_mount(cpu_art, tmp_path):
    root = tmp_path / "shared"
    art = _copy_artifact(cpu_art, root)
    runner = _read_only_runner(root)
    out = tmp_path / "img.png"
    proc = subprocess.run(
        [*runner, sys.executable, "-m", "sdiree.runtime.cli", "run", str(art)]
        + ["--prompt", "a cat", "--steps", "2", "--seed", "1", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SDIREE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and out.is_file()


def test_loading_opens_no_artifact_file_for_writing(cpu_art, tmp_path, monkeypatch):
    """Without mounts: every open of an artifact file goes through io.open / os.open with a
    read-only mode, here made to fail like a read-only file system if it does not."""
    art = _copy_artifact(cpu_art, tmp_path / "shared")
    root = str(tmp_path / "shared")
    writes = []
    real_open, real_os_open = io.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if str(file).startswith(root) and any(c in mode for c in "wax+"):
            writes.append((str(file), mode))
            raise OSError(30, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if str(path).startswith(root) and flags & (os.O_WRONLY | os.O_RDWR):
            writes.append((str(path), flags))
            raise OSError(30, "Read-only file system", str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr("builtins.open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    manifest = load_manifest(art)
    s = session.Session(manifest, list_devices("local-task")[0], list(manifest.submodules))
    args = [np.zeros(d.shape, d.dtype) for d in s.decl("text_encoder", "encode").inputs]
    assert all(np.isfinite(o).all() for o in s.call("text_encoder", "encode", *args))
    assert writes == []
