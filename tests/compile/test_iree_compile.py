"""compile/iree_compile: a failed compile leaves its log and no vmfb; a later success clears it."""

from __future__ import annotations

import pytest

from sdiree.compile.iree_compile import compile_mlir
from sdiree.runtime.errors import UserError
from sdiree.runtime.targets import load_registry

GOOD = """
func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = arith.addf %a, %a : tensor<4xf32>
  return %r : tensor<4xf32>
}
"""


def test_failure_log_then_success_removes_it(tmp_path):
    flags = load_registry().target("cpu").compile_flags("x86-64-v3", "fp32")
    src, vmfb, log = tmp_path / "m.mlir", tmp_path / "m.vmfb", tmp_path / "m.compile.log"
    src.write_text(GOOD.replace("arith.addf", "arith.nosuchop"))
    with pytest.raises(UserError, match=r"iree-compile failed for m\.mlir: .*full log"):
        compile_mlir(src, vmfb, flags, log)
    assert log.is_file() and "nosuchop" in log.read_text() and not vmfb.exists()
    src.write_text(GOOD)
    compile_mlir(src, vmfb, flags, log)
    assert vmfb.stat().st_size > 0 and not log.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
