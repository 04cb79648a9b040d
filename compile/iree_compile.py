"""Run iree-compile on one MLIR module with a target's flags; the vmfb appears atomically."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import atomic_path


def iree_compile_tool() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


def compiler_version() -> str:
    from importlib.metadata import version

    return version("iree-base-compiler")


def compile_mlir(mlir: Path, vmfb: Path, flags: list[str], log_path: Path) -> None:
    """Compile mlir to vmfb; on failure write the compiler output to log_path and raise. A log
    left by an earlier failure is removed once the module compiles."""
    with atomic_path(vmfb) as tmp:
        proc = subprocess.run(
            [iree_compile_tool(), str(mlir), "-o", str(tmp), *flags],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not tmp.exists():
            log_path.write_text(proc.stderr + proc.stdout)
            first = next(
                (ln for ln in proc.stderr.splitlines() if "error:" in ln),
                proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else "no output",
            )
            raise UserError(
                f"iree-compile failed for {mlir.name}: {first.strip()[:300]} (full log: {log_path})"
            )
    log_path.unlink(missing_ok=True)
