"""A newer Vulkan stack on this Debian 12 machine, for checks its own lavapipe cannot make.

Debian 12's lavapipe (Mesa 22.3.6) has no cooperative matrices and its validation layers
(1.3.239) do not know them. Mesa 26's lavapipe has VK_KHR_cooperative_matrix and the 1.4 layers
check each shader's matrices against the device's list. Both need a newer glibc than Debian 12
has, so this unpacks Debian 13 (trixie, and trixie-backports for Mesa) packages into a folder,
with their own glibc, and runs python through that glibc's loader: nothing is installed
system-wide, and nothing but Debian's package archive is fetched (each .deb checked against the
SHA256 the archive's signed index lists). compile/NOTES.md, "iree 3.13's Vulkan cooperative
matrices are f32 x f32", is what it found.

    python tools/vulkan_next.py fetch                 # ~300 MB into ~/.cache/sdiree-vulkan-next
    python tools/vulkan_next.py run -- sdiree.runtime.vulkan_caps
    python tools/vulkan_next.py run --validate -- sdiree.runtime.cli run ART --prompt x

`run` takes a python module or script and its arguments (runpy), with this interpreter's site
folders.
Results copied back to the host must be staged (runtime/device.py's to_host does): Mesa 26
offers external host memory, and iree's import of a host pointer fails on its alignment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import site
import subprocess
import sys
import urllib.request
from pathlib import Path

MIRROR = "http://deb.debian.org/debian"
SUITES = ("trixie", "trixie-backports")  # the second wins where it has the package
FROM_BACKPORTS = {"mesa-vulkan-drivers"}  # Mesa 26: trixie's own 25.0 has no cooperative matrices
WANTED = ("mesa-vulkan-drivers", "libc6", "vulkan-validationlayers")
# provided by the host (its loader finds the ICD we name) or not needed to load the libraries
SKIP = {"libvulkan1", "debconf", "perl-base", "libcrypt1"}
DEFAULT_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sdiree-vulkan-next"
LIBDIR = "usr/lib/x86_64-linux-gnu"


def parse_index(text: str) -> dict[str, dict[str, str]]:
    """A Debian Packages index: {package: {field: value}} (continuation lines dropped)."""
    out = {}
    for block in text.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
        if "Package" in fields:
            out[fields["Package"]] = fields
    return out


def closure(indexes: dict[str, dict], wanted=WANTED) -> list[dict[str, str]]:
    """The packages `wanted` needs, dependencies first-alternative only, versions unchecked (one
    suite's current packages are consistent with each other)."""
    main, backports = indexes[SUITES[0]], indexes[SUITES[1]]
    provides = {}
    for name, fields in main.items():
        for p in fields.get("Provides", "").split(","):
            if p.strip():
                provides.setdefault(p.strip().split(" ")[0], name)
    seen, out, todo = set(), [], list(wanted)
    while todo:
        name = todo.pop(0)
        name = name if name in main or name in backports else provides.get(name, name)
        if name in seen or name in SKIP:
            continue
        fields = backports.get(name) if name in FROM_BACKPORTS else main.get(name)
        fields = fields or backports.get(name)
        if fields is None:
            raise SystemExit(f"error: {name} is in neither {SUITES[0]} nor {SUITES[1]}")
        seen.add(name)
        out.append(fields)
        for dep in ",".join(fields.get(k, "") for k in ("Pre-Depends", "Depends")).split(","):
            first = dep.split("|")[0].strip().split(" ")[0].split(":")[0]
            if first:
                todo.append(first)
    return out


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as r:
        return r.read()


def fetch(root: Path) -> None:
    indexes = {
        s: parse_index(lzma.decompress(_get(f"{MIRROR}/dists/{s}/main/binary-amd64/Packages.xz")).decode())
        for s in SUITES
    }  # fmt: skip
    packages = closure(indexes)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "debs").mkdir(parents=True)
    for fields in packages:
        data = _get(f"{MIRROR}/{fields['Filename']}")
        if hashlib.sha256(data).hexdigest() != fields["SHA256"]:
            raise SystemExit(f"error: {fields['Filename']} does not match the index's SHA256")
        deb = tmp / "debs" / Path(fields["Filename"]).name
        deb.write_bytes(data)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
        print(f"{fields['Package']} {fields['Version']}")
    lvp = tmp / "root" / LIBDIR / "libvulkan_lvp.so"
    icd = {"file_format_version": "1.0.0", "ICD": {"library_path": str(root / "root" / LIBDIR / lvp.name), "api_version": "1.4.0"}}  # fmt: skip
    (tmp / "lvp_icd.json").write_text(json.dumps(icd))
    shutil.rmtree(tmp / "debs")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    print(f"wrote {root}")


def command(root: Path, module: str, args: list[str], validate: bool) -> tuple[list[str], dict]:
    """argv and environment that run `python -m module args` (or a script, module ending in
    .py) under root's glibc and lavapipe."""
    lib = root / "root" / LIBDIR
    host_libs = [sysconfig_libdir(), "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"]
    dirs = [
        *site.getsitepackages(),
        *([site.getusersitepackages()] if site.ENABLE_USER_SITE else []),
    ]
    code = (
        "import runpy, site, sys\n"
        f"for d in {dirs!r}: site.addsitedir(d)\n"
        f"sys.argv = [{module!r}, *{args!r}]\n"
        + (
            f"runpy.run_path({module!r}, run_name='__main__')\n"
            if module.endswith(".py")
            else f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        )
    )
    argv = [
        str(lib / "ld-linux-x86-64.so.2"), "--library-path", ":".join([str(lib), *host_libs]),
        os.path.realpath(sys.executable), "-c", code,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONHOME=sys.base_prefix)
    env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"] = str(root / "lvp_icd.json")
    if validate:
        env["VK_LAYER_PATH"] = str(root / "root/usr/share/vulkan/explicit_layer.d")
        env["VK_INSTANCE_LAYERS"] = "VK_LAYER_KHRONOS_validation"
    return argv, env


def sysconfig_libdir() -> str:
    import sysconfig

    return sysconfig.get_config_var("LIBDIR") or "/usr/lib"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and unpack the packages")
    run = sub.add_parser("run", help="run a python module under them")
    run.add_argument("--validate", action="store_true", help="with the Khronos validation layer")
    run.add_argument("module")
    run.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.cmd == "fetch":
        fetch(a.root)
        return 0
    if not (a.root / "lvp_icd.json").exists():
        print(f"error: nothing fetched at {a.root}; run `python {sys.argv[0]} fetch` first",
              file=sys.stderr)  # fmt: skip
        return 2
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    cmd, env = command(a.root, a.module, args, a.validate)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
