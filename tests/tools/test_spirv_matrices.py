"""tools/spirv_matrices.py reads cooperative-matrix types from SPIR-V words written here by hand
(the iree-written modules: tests/specs/test_vulkan_cooperative_matrix.py)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from spirv_matrices import census, cooperative_matrix_types, main  # noqa: E402


def inst(opcode: int, *operands: int) -> list[int]:
    return [(len(operands) + 1) << 16 | opcode, *operands]


def module(*insts: list[int]) -> bytes:
    words = [0x07230203, 0x00010600, 0, 100, 0]
    for i in insts:
        words += i
    return struct.pack(f"<{len(words)}I", *words)


# ids: 1 f32, 2 f16, 3 u32, 4..8 constants (scope 3, 16, 8, use A=0, B=1), 9.. matrices
TYPES = [
    inst(22, 1, 32), inst(22, 2, 16), inst(21, 3, 32, 0),
    inst(43, 3, 4, 3), inst(43, 3, 5, 16), inst(43, 3, 6, 8), inst(43, 3, 7, 0), inst(43, 3, 8, 1),
]  # fmt: skip


def test_reads_type_rows_columns_and_use():
    blob = module(*TYPES, inst(4456, 9, 1, 4, 5, 6, 7), inst(4456, 10, 2, 4, 6, 5, 8))
    assert cooperative_matrix_types(blob) == {("f32", 16, 8, "A"), ("f16", 8, 16, "B")}


def test_a_module_without_them_and_bad_input(tmp_path, capsys):
    plain = tmp_path / "plain.spv"
    plain.write_bytes(module(*TYPES))
    assert not census([plain]) and main([str(plain)]) == 0
    assert "no cooperative matrices in 1 modules" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not a SPIR-V module"):
        cooperative_matrix_types(b"\0" * 32)
    with pytest.raises(ValueError, match="zero-length instruction"):
        cooperative_matrix_types(module([0]))
