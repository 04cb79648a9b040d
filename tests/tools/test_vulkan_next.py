"""tools/vulkan_next.py without the network: which packages it takes from which suite, and the
command it builds (the fetch itself and a run under it: compile/NOTES.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import vulkan_next  # noqa: E402


def index(*blocks: str) -> dict:
    return vulkan_next.parse_index("\n\n".join(blocks))


MAIN = index(
    "Package: mesa-vulkan-drivers\nVersion: 25.0.7\nDepends: libc6 (>= 2.39), libllvm19 | libllvm18"
    "\nFilename: pool/mesa-25.deb",
    "Package: libc6\nVersion: 2.41\nPre-Depends: libgcc-s1\nFilename: pool/libc6.deb",
    "Package: libgcc-s1\nVersion: 14\nDepends: libc6\nFilename: pool/libgcc.deb",
    "Package: libllvm19\nVersion: 19\nDepends: libvulkan1, libffi8\nFilename: pool/llvm.deb",
    "Package: libffi8-real\nVersion: 3\nProvides: libffi8\nFilename: pool/ffi.deb",
    "Package: vulkan-validationlayers\nVersion: 1.4\nDepends: libc6\nFilename: pool/vvl.deb",
)
BACKPORTS = index(
    "Package: mesa-vulkan-drivers\nVersion: 26.1.6\nDepends: libc6, libllvm19 | libllvm18, libdisplay-info2"
    "\nFilename: pool/mesa-26.deb",
    "Package: libdisplay-info2\nVersion: 0.2\nFilename: pool/di.deb",
    "Package: libc6\nVersion: 9.99\nFilename: pool/not-this-libc.deb",
)


def test_closure_takes_mesa_from_backports_and_the_rest_from_trixie():
    got = vulkan_next.closure({"trixie": MAIN, "trixie-backports": BACKPORTS})
    files = {p["Package"]: p["Filename"] for p in got}
    assert files["mesa-vulkan-drivers"] == "pool/mesa-26.deb"
    assert files["libc6"] == "pool/libc6.deb"  # the suite's own, not a backport
    assert files["libdisplay-info2"] == "pool/di.deb"  # only backports has it
    assert "libffi8-real" in files and "libvulkan1" not in files  # a Provides; the host's loader
    assert "libllvm19" in files and "libllvm18" not in files  # first alternatives only
    assert len(got) == len(files)  # each once, though several depend on libc6


def test_run_command_uses_the_unpacked_loader_and_lavapipe(tmp_path):
    argv, env = vulkan_next.command(tmp_path, "sdiree.runtime.vulkan_caps", ["-x"], validate=True)
    lib = tmp_path / "root" / vulkan_next.LIBDIR
    assert argv[0] == str(lib / "ld-linux-x86-64.so.2")
    assert argv[2].split(":")[0] == str(lib) and argv[4] == "-c"
    assert "run_module('sdiree.runtime.vulkan_caps'" in argv[5] and "['-x']" in argv[5]
    assert env["VK_ICD_FILENAMES"] == str(tmp_path / "lvp_icd.json")
    assert env["VK_INSTANCE_LAYERS"] == "VK_LAYER_KHRONOS_validation"
    assert env["PYTHONHOME"] == sys.base_prefix
    argv, env = vulkan_next.command(tmp_path, "check.py", [], validate=False)
    assert "run_path('check.py'" in argv[5]
    assert env.get("VK_INSTANCE_LAYERS") == os.environ.get("VK_INSTANCE_LAYERS")
