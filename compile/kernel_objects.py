"""Hand-written CPU kernels (specs/kernels/*.c) built into objects for iree's embedded ELF.

iree links a `#hal.executable.object` into an llvm-cpu executable when an export dispatches to
a function it does not generate (compile/exporters/amx_matmul.py). The object must be
freestanding: no libc, no TLS, no unwind tables, position independent. It is built here with the
system's C compiler (`$CC`, else cc, gcc or clang) and kept in the user cache under the sha256 of
the source, the flags and the compiler's version, so a compile builds it once. The exported MLIR
names the object by that path (iree 3.13 drops an object's inline `data`: it links an empty
temporary file instead), so the compile stage builds it again where the cache lost it
(`ensure_objects`).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import atomic_path, user_cache_dir
from sdiree.runtime.targets import default_specs_dir

from .params_stage import DISK_FULL

FREESTANDING = (
    "-O2",
    "-std=c11",
    "-ffreestanding",
    "-fPIC",
    "-fno-stack-protector",
    "-fno-asynchronous-unwind-tables",
    "-fno-exceptions",
    "-fvisibility=hidden",
)


def kernel_source(name: str) -> Path:
    return default_specs_dir() / "kernels" / f"{name}.c"


def source_hash(name: str) -> str:
    """sha256 of a kernel's source and of the headers beside it, which kernels include (part of
    the export's cache key)."""
    source = kernel_source(name)
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()


def c_compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


@functools.cache
def _compiler_version(cc: str) -> str:
    """cc's version banner, asked once a process (an export looks the object up once per
    custom-op shape)."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


def build_object(name: str, isa_flags: tuple[str, ...]) -> Path:
    """The x86-64 ELF object of specs/kernels/<name>.c built with isa_flags (e.g. -mamx-tile):
    its path in the user cache."""
    cc = c_compiler()
    if cc is None:
        raise UserError(
            f"this compile links the kernel specs/kernels/{name}.c and needs a C compiler to build "
            "it: install gcc or clang (or set $CC), or compile with another --dtype"
        )
    flags = (*FREESTANDING, *isa_flags)
    version = _compiler_version(cc)
    key = hashlib.sha256("\0".join([source_hash(name), *flags, version]).encode()).hexdigest()[:24]
    out = user_cache_dir() / ".kernels" / f"{name}-{key}.o"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        got = subprocess.run(
            [cc, *flags, "-c", str(kernel_source(name)), "-o", str(tmp)],
            capture_output=True,
            text=True,
        )
        if got.returncode != 0:
            if DISK_FULL.search(got.stderr):  # the driver names where, as for its own writes
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            first = (got.stderr.strip().splitlines() or ["(no message)"])[0]
            raise UserError(
                f"{cc} could not build specs/kernels/{name}.c ({first}): a compiler that knows "
                f"{' '.join(isa_flags)} is needed (gcc 11 or newer, clang 12 or newer)"
            )
    return out
