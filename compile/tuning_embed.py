"""Attach a tuning spec to an MLIR module, for targets whose spec flag is unusable.

iree 3.13's SPIR-V pipeline does not read `--iree-codegen-tuning-spec-path`. It reads
`--iree-codegen-transform-dialect-library`, but loading that library deadlocks a multithreaded
compile now and then: the loader holds a lock while it parses, the parser's parallel verifier
lets the same worker thread pick up another executable's configuration pass, which waits for
the lock forever (seen on the tiny UNet for ampere; compile/NOTES.md). The pipeline also reads a
spec serialized into the module as `iree_codegen.tuning_spec_mlirbc`, on the executable's module
or any parent, and parses it without that lock: this writes a copy of the module with the spec
attached to its top level, which then holds for every executable. llvm-cpu reads
`--iree-codegen-tuning-spec-path` through the same loader and hung the same way (the tiny
model's bf16 text encoder), so the cpu target embeds its spec too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

ATTRIBUTE = "iree_codegen.tuning_spec_mlirbc"


def attach(mlir: Path, spec: Path, out: Path) -> None:
    """Write mlir (text or bytecode) with spec's text attached as ATTRIBUTE to out (bytecode)."""
    import numpy as np
    from iree.compiler import ir

    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(mlir.read_bytes())
        data = np.frombuffer(spec.read_bytes(), dtype=np.int8)
        module.operation.attributes[ATTRIBUTE] = ir.DenseElementsAttr.get(data)
        with open(out, "wb") as f:
            module.operation.write_bytecode(f)


@contextlib.contextmanager
def with_spec(mlir: Path, spec: Path | None, workdir: Path) -> Iterator[Path]:
    """mlir itself without a spec; else a temporary copy in workdir with spec attached."""
    if spec is None:
        yield mlir
        return
    tmp = workdir / f".{mlir.stem}+tuning.{os.getpid()}.mlirbc"
    try:
        attach(mlir, spec, tmp)
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)
