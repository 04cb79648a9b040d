"""compile/spirv_f16_operands.py: on SPIR-V words written here by hand, and on iree's own rdna3
shaders, substituted back into a module by iree-compile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sdiree.compile.spirv_f16_operands import executable_name, main, rewrite

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests" / "specs"))
sys.path.insert(0, str(ROOT / "tests" / "tools"))
from spirv_matrices import census, cooperative_matrix_types  # noqa: E402
from test_spirv_matrices import inst, module  # noqa: E402

# ids: 1 f32, 2 f16, 3 u32; 4 scope, 5 sixteen, 6..8 uses A, B, accumulator
HEAD = [
    inst(22, 1, 32), inst(22, 2, 16), inst(21, 3, 32, 0), inst(43, 3, 4, 3), inst(43, 3, 5, 16),
    inst(43, 3, 6, 0), inst(43, 3, 7, 1), inst(43, 3, 8, 2),
    inst(4456, 10, 2, 4, 5, 5, 6), inst(4456, 11, 2, 4, 5, 5, 7),  # f16 A, B
    inst(4456, 12, 1, 4, 5, 5, 6), inst(4456, 13, 1, 4, 5, 5, 7),  # f32 A, B
    inst(4456, 14, 1, 4, 5, 5, 8),  # f32 accumulator
    inst(5, 30, 0),  # OpName of the A conversion (a literal name word)
]  # fmt: skip
BODY = [
    inst(4457, 10, 20, 99, 6), inst(4457, 11, 21, 99, 7),  # loads (pointer id 99, layout)
    inst(115, 12, 30, 20), inst(115, 13, 31, 21),  # OpFConvert to f32 A and B
    inst(4457, 14, 22, 99, 6),  # the accumulator
    inst(4459, 14, 40, 30, 31, 22),  # OpCooperativeMatrixMulAddKHR
]  # fmt: skip


def test_multiply_add_takes_the_f16_matrices_and_the_f32_copies_go():
    done = rewrite(module(*HEAD, *BODY))
    assert done is not None and done[1] == 2
    assert cooperative_matrix_types(done[0]) == {
        ("f16", 16, 16, "A"), ("f16", 16, 16, "B"), ("f32", 16, 16, "accumulator"),
    }  # fmt: skip
    words = done[0]
    assert module(inst(4459, 14, 40, 20, 21, 22))[20:] in words  # A and B are the loads now
    assert (
        module(inst(115, 12, 30, 20))[20:] not in words and module(inst(5, 30, 0))[20:] not in words
    )


def test_a_conversion_used_elsewhere_stays_and_nothing_to_do_is_none():
    kept = rewrite(module(*HEAD, *BODY, inst(4458, 98, 30, 6)))  # the f32 A is also stored
    assert kept is not None
    assert ("f32", 16, 16, "A") in cooperative_matrix_types(kept[0])
    assert ("f32", 16, 16, "B") not in cooperative_matrix_types(kept[0])
    assert rewrite(module(*HEAD)) is None
    with pytest.raises(ValueError, match="not a SPIR-V module"):
        rewrite(b"\0" * 32)


def test_executable_names_from_iree_dump_names():
    assert executable_name("unet_denoise_cfg$async_dispatch_57_denoise_cfg$async_dispatch_57_"
                           "matmul_128x256x32_f16xf16xf32.spv") == "denoise_cfg$async_dispatch_57"  # fmt: skip
    assert (
        executable_name("text_encoder_encode$async_dispatch_0_encode$async_dispatch_0_x.spv")
        == "encode$async_dispatch_0"
    )


def test_iree_substitutes_the_rewritten_rdna3_shaders(tmp_path):
    from test_vulkan_cooperative_matrix import MATMUL

    from sdiree.compile.iree_compile import iree_compile_tool

    src = tmp_path / "linear.mlir"
    src.write_text(MATMUL)
    flags = ["--iree-hal-target-device=vulkan", "--iree-vulkan-target=rdna3"]

    def compile_(*extra: str) -> subprocess.CompletedProcess:
        cmd = [iree_compile_tool(), str(src), *flags, *extra, "-o", str(tmp_path / "m.vmfb")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    compile_(f"--iree-hal-dump-executable-binaries-to={tmp_path / 'dump'}")
    assert ("f32", 16, 16, "A") in census((tmp_path / "dump").glob("*.spv"))
    assert main([str(tmp_path / "dump"), str(tmp_path / "subst")]) == 0
    (subst,) = (tmp_path / "subst").glob("*.spv")
    done = compile_(f"--iree-hal-substitute-executable-objects-from={tmp_path / 'subst'}")
    assert f"substituted with object file at `{subst}`" in done.stderr
    assert subst.read_bytes() in (tmp_path / "m.vmfb").read_bytes()
    assert {(c, u) for c, _, _, u in census([subst])} == {
        ("f16", "A"), ("f16", "B"), ("f32", "accumulator"),
    }  # fmt: skip
