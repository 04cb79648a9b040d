"""The cooperative-matrix types a SPIR-V module declares, read from its binary.

Vulkan lets a shader use a cooperative matrix only in a (component type, rows, columns, use,
scope) the device lists (vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR; the Khronos
validation layer's VUID-RuntimeSpirv-OpTypeCooperativeMatrixKHR-10163). iree 3.13's SPIR-V
cooperative-matrix pipeline declares f32 A and B matrices for every f16 x f16 -> f32
contraction (it converts the loaded f16 matrices and multiplies in f32), a type no AMD or
NVIDIA driver lists (compile/NOTES.md). This reads what a module declares, without a device:

    iree-compile ... --iree-hal-dump-executable-binaries-to=DIR
    python tools/spirv_matrices.py DIR/*.spv     # count of modules per (type, rows, cols, use)
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from sdiree.compile.spirv_f16_operands import instructions

_OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_CONSTANT = 21, 22, 43
_OP_TYPE_COOPERATIVE_MATRIX_KHR = 4456
USES = ("A", "B", "accumulator")


def cooperative_matrix_types(blob: bytes) -> set[tuple[str, int, int, str]]:
    """{(component type, rows, columns, use)} of the module's OpTypeCooperativeMatrixKHR."""
    _, insts = instructions(blob)
    scalars: dict[int, str] = {}
    constants: dict[int, int] = {}
    found = set()
    for opcode, *ops in insts:
        if opcode == _OP_TYPE_FLOAT:
            scalars[ops[0]] = f"f{ops[1]}"
        elif opcode == _OP_TYPE_INT:
            scalars[ops[0]] = f"{'i' if ops[2] else 'u'}{ops[1]}"
        elif opcode == _OP_CONSTANT:
            constants[ops[1]] = ops[2]
        elif opcode == _OP_TYPE_COOPERATIVE_MATRIX_KHR:
            # result id, component type, scope, rows, columns, use (ids of constants)
            found.add(
                (scalars[ops[1]], constants[ops[3]], constants[ops[4]], USES[constants[ops[5]]])
            )
    return found


def census(paths) -> Counter:
    """How many of the modules at paths declare each cooperative-matrix type."""
    counts: Counter = Counter()
    for p in paths:
        counts.update(cooperative_matrix_types(Path(p).read_bytes()))
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spv", nargs="+", type=Path, help="SPIR-V binaries (.spv)")
    args = ap.parse_args(argv)
    counts = census(args.spv)
    for (ctype, rows, cols, use), n in sorted(counts.items()):
        print(f"{n:5d} modules: {ctype} {rows}x{cols} {use}")
    if not counts:
        print(f"no cooperative matrices in {len(args.spv)} modules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
