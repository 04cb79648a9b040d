"""Rewrite iree 3.13's cooperative-matrix shaders to multiply their f16 matrices, not f32 copies.

iree 3.13 writes an f16 x f16 -> f32 contraction on cooperative matrices as f16 loads, an
OpFConvert of each A and B matrix to f32 and an f32 x f32 OpCooperativeMatrixMulAddKHR: a type
no GPU lists, so no preset uses cooperative matrices (specs/README.md). The multiply-add may take
the f16 matrices themselves with the f32 accumulator (f16 A and B, f32 C: what RDNA3 and NVIDIA
list at 16x16x16), and the result is the same: f16 to f32 is exact, and so is the product of two
f16 values in f32. This points each multiply-add at the f16 matrix its operand was converted
from, then drops the conversions and matrix types nothing uses any more.

An arch preset's `f16_matrix_operands` has compile_mlir (compile/iree_compile.py) compile
twice: once dumping the executables' SPIR-V (`--iree-hal-dump-executable-binaries-to`), then,
with the rewritten ones, again (`--iree-hal-substitute-executable-objects-from`, which takes
<executable>.spv; iree dumps <module>_<executable>_<export>.spv). No preset sets it: it is
untried on a GPU, and lavapipe, which lists only 8x8x8 matrices, cannot judge these 16x16 ones
(compile/NOTES.md). By hand: `python -m sdiree.compile.spirv_f16_operands DUMP SUBST`.
"""

from __future__ import annotations

import argparse
import re
import struct
from pathlib import Path

_NAME, _DECORATE, _FCONVERT = 5, 71, 115
_TYPE_FLOAT, _CONSTANT = 22, 43
_COOP_TYPE, _COOP_LOAD, _COOP_MULADD = 4456, 4457, 4459
# opcodes that carry literals where an id could be mistaken (only whole-id operands are searched)
_LITERAL_OPS = {3, 4, 5, 6, 7, 8, 10, 11, 14, 15, 16, 17, 21, 22, 43, 71, 72, 330}


def instructions(blob: bytes) -> tuple[list[int], list[list[int]]]:
    """(the 5 header words, [[opcode, *operands] per instruction]) of a SPIR-V module."""
    words = list(struct.unpack(f"<{len(blob) // 4}I", blob[: len(blob) // 4 * 4]))
    if not words or words[0] != 0x07230203:
        raise ValueError("not a SPIR-V module (no magic number)")
    out, i = [], 5
    while i < len(words):
        count = words[i] >> 16
        if count == 0:
            raise ValueError(f"malformed SPIR-V: a zero-length instruction at word {i}")
        out.append([words[i] & 0xFFFF, *words[i + 1 : i + count]])
        i += count
    return words[:5], out


def _module(header: list[int], insts: list[list[int]]) -> bytes:
    words = list(header)
    for ins in insts:
        words += [len(ins) << 16 | ins[0], *ins[1:]]
    return struct.pack(f"<{len(words)}I", *words)


def _ids(ins: list[int]) -> list[int]:
    """The operands of ins that can be ids (conservative: a literal may pass for one)."""
    if ins[0] in _LITERAL_OPS:
        return []
    if ins[0] == 81:  # OpCompositeExtract: type, result, composite, literal indexes
        return ins[1:4]
    if ins[0] == 79:  # OpVectorShuffle: type, result, vector, vector, literal components
        return ins[1:5]
    return ins[1:]


def rewrite(blob: bytes) -> tuple[bytes, int] | None:
    """(the rewritten module, how many operands now take the f16 matrix), or None if no
    multiply-add has an operand converted from an f16 matrix of its use."""
    header, insts = instructions(blob)
    widths = {i[1]: i[2] for i in insts if i[0] == _TYPE_FLOAT}
    constants = {i[2]: i[3] for i in insts if i[0] == _CONSTANT}
    # matrix type id -> (float width, rows, columns, use)
    matrices = {
        i[1]: (widths.get(i[2]), constants.get(i[4]), constants.get(i[5]), constants.get(i[6]))
        for i in insts
        if i[0] == _COOP_TYPE
    }
    type_of = {i[2]: i[1] for i in insts if i[0] in (_FCONVERT, _COOP_LOAD, _COOP_MULADD)}
    converted = {i[2]: i[3] for i in insts if i[0] == _FCONVERT and i[1] in matrices}
    changed = 0
    for ins in insts:
        if ins[0] != _COOP_MULADD:
            continue
        for pos in (3, 4):  # A, B
            src = converted.get(ins[pos])
            if src is None:
                continue
            wide, narrow = matrices[type_of[ins[pos]]], matrices.get(type_of.get(src))
            if narrow and narrow[0] == 16 and wide[0] == 32 and narrow[1:] == wide[1:]:
                ins[pos] = src
                changed += 1
    if not changed:
        return None

    def unused(x: int, definer: list[int]) -> bool:
        return not any(x in _ids(i) for i in insts if i is not definer)

    for kind, at in ((_FCONVERT, 2), (_COOP_TYPE, 1)):  # conversions first, then their types
        dead = {
            i[at]
            for i in insts
            if i[0] == kind and (kind != _FCONVERT or i[1] in matrices) and unused(i[at], i)
        }
        insts = [
            i
            for i in insts
            if not (
                (i[0] == kind and i[at] in dead) or (i[0] in (_NAME, _DECORATE) and i[1] in dead)
            )
        ]
    return _module(header, insts), changed


def executable_name(dump_name: str) -> str:
    """The hal.executable a dumped binary (<module>_<executable>_<export>.spv) belongs to."""
    m = re.match(r"(.+?)_(.+?_dispatch_\d+)_\2_", dump_name)  # iree names exports <executable>_...
    if not m:
        raise ValueError(f"{dump_name}: not <module>_<executable>_<export>.spv")
    return m.group(2)


def rewrite_dump(dump: Path, out: Path) -> int:
    """Rewrite each module in dump that has something to rewrite into out/<executable>.spv;
    how many were."""
    count = 0
    for f in sorted(dump.glob("*.spv")):
        done = rewrite(f.read_bytes())
        if done:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{executable_name(f.name)}.spv").write_bytes(done[0])
            count += 1
    return count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", type=Path, help="--iree-hal-dump-executable-binaries-to folder")
    ap.add_argument(
        "out", type=Path, help="folder for --iree-hal-substitute-executable-objects-from"
    )
    a = ap.parse_args(argv)
    count = rewrite_dump(a.dump, a.out)
    print(f"rewrote {count} of {len(list(a.dump.glob('*.spv')))} modules into {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
