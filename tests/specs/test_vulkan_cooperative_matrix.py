"""Why no vulkan-spirv preset uses cooperative matrices, and a check that none does.

iree 3.13's SPIR-V cooperative-matrix pipeline writes every f16 x f16 -> f32 contraction (all
of the UNet's: torch-mlir accumulates f16 products in f32) as f16 loads converted to f32 A and
B matrices and an f32 x f32 multiply-add. Vulkan allows only the matrix types a device lists:
RADV lists f16, bf16 and 8-bit integer operands for RDNA3, no f32 ones, NVIDIA's driver refused
every such shader on an H200, and the Khronos validation layer rejects them
(VUID-RuntimeSpirv-OpTypeCooperativeMatrixKHR-10163; compile/NOTES.md). So rdna3, the last preset
with iree's WMMA list, is SIMT like the others. The first test pins iree's behaviour: when a
later iree writes f16 operand matrices it fails, and rdna3's cooperative matrices are worth
another look.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
from compile_queue import Queued  # noqa: E402
from spirv_matrices import census  # noqa: E402

# The UNet's linears after export: f16 activations times transposed f16 weights, f32 sums.
MATMUL = """
func.func @linear(%a: tensor<128x64xf16>, %b: tensor<256x64xf16>) -> tensor<128x256xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<128x256xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<128x256xf32>) -> tensor<128x256xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(m, n, k) -> (m, k)>,
      affine_map<(m, n, k) -> (n, k)>, affine_map<(m, n, k) -> (m, n)>],
      iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%a, %b : tensor<128x64xf16>, tensor<256x64xf16>) outs(%f : tensor<128x256xf32>) {
  ^bb0(%x: f16, %y: f16, %acc: f32):
    %xf = arith.extf %x : f16 to f32
    %yf = arith.extf %y : f16 to f32
    %p = arith.mulf %xf, %yf : f32
    %s = arith.addf %acc, %p : f32
    linalg.yield %s : f32
  } -> tensor<128x256xf32>
  return %r : tensor<128x256xf32>
}
"""


def spirv_of(flags: list[str], tmp_path: Path) -> list[Path]:
    """The SPIR-V modules iree-compile writes for MATMUL with flags."""
    from sdiree.compile.iree_compile import iree_compile_tool

    src = tmp_path / "linear.mlir"
    src.write_text(MATMUL)
    out = tmp_path / "bin"
    cmd = [
        iree_compile_tool(), str(src), *flags, f"--iree-hal-dump-executable-binaries-to={out}",
        "-o", str(tmp_path / "linear.vmfb"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    spv = sorted(out.glob("*.spv"))
    assert spv, "iree-compile wrote no SPIR-V"
    return spv


def test_iree_writes_f32_operand_cooperative_matrices(tmp_path):
    counts = census(spirv_of(["--iree-hal-target-device=vulkan", "--iree-vulkan-target=rdna3"],
                             tmp_path))  # fmt: skip
    assert counts, "iree's rdna3 target no longer uses cooperative matrices for this matmul"
    operands = {(ctype, use) for ctype, _, _, use in counts if use in ("A", "B")}
    assert ("f32", "A") in operands and ("f32", "B") in operands, (
        f"iree now declares {sorted(operands)} operand matrices: if only f16 ones, rdna3 (and "
        "NVIDIA's Vulkan presets) may use cooperative matrices again (specs/README.md)"
    )


def vulkan_fp16_presets():
    from sdiree.runtime.targets import load_registry

    vk = load_registry().target("vulkan-spirv")
    return [name for name in vk.arches if "fp16" not in vk.refusals(name)]


@pytest.mark.parametrize("arch", vulkan_fp16_presets())
def test_no_vulkan_preset_declares_cooperative_matrices(arch, tmp_path):
    from sdiree.runtime.targets import load_registry

    preset = load_registry().target("vulkan-spirv").arch(arch)
    assert not preset.device.get("cooperative_matrix"), arch
    assert not census(spirv_of(list(preset.flags), tmp_path)), arch


def test_fallback_spec_is_its_generators_output():
    """The spec iree 3.13 needs to compile a UNet on cooperative matrices at all (the
    transposed-output and attention contractions to SIMT), kept for the f16-operand route."""
    from make_vulkan_tuning_spec import CLASSES, SPEC, render

    assert SPEC.read_text() == render()
    for name in CLASSES:
        assert f"@match_{name}_64_k32" in SPEC.read_text()


def _wmma_rdna3_options(root: Path, model: Path) -> dict:
    """The tiny UNet for rdna3 fp16 as a GPU session would try the route back to tensor cores:
    iree's own WMMA target, the fallback spec, `f16_matrix_operands`; configurations dumped."""
    import json
    import shutil

    specs, dump = root / "specs", root / "dump"
    shutil.copytree(ROOT / "specs", specs)
    data = json.loads((specs / "targets.json").read_text())
    preset = data["targets"]["vulkan-spirv"]["arches"]["rdna3"]
    preset["flags"] = [
        "--iree-hal-target-device=vulkan", "--iree-vulkan-target=rdna3",
        f"--iree-hal-dump-executable-configurations-to={dump}",
    ]  # fmt: skip
    preset["tuning_specs"] = {"*": "tuning/vulkan_coopmatrix_fallback.mlir"}
    preset["f16_matrix_operands"] = True
    (specs / "targets.json").write_text(json.dumps(data))
    return dict(
        model_dir=model, target="vulkan-spirv", arch="rdna3", dtype="fp16", out=root / "art",
        specs_dir=specs, submodules=("unet",),
    )  # fmt: skip


WMMA_RDNA3 = Queued("wmma-rdna3-fp16", _wmma_rdna3_options)  # compiled in the background


def test_f16_matrix_operands_rewrites_every_cooperative_matrix_shader(tiny_model, tmp_path_factory):
    """The route back to tensor cores, as a GPU session would try it: rdna3 given iree's own
    WMMA target, the fallback spec and `f16_matrix_operands`. The tiny UNet compiles; as many
    of its shaders take their f16 matrices as iree configured on cooperative matrices."""
    import re

    root, said = WMMA_RDNA3.result(tiny_model, tmp_path_factory)
    dump = root / "dump"
    coop = [f for f in dump.glob("*.mlir") if "CooperativeMatrixVectorize" in f.read_text()]
    found = re.search(r"unet: (\d+) cooperative-matrix shaders take their f16 matrices", said)
    assert coop and found and int(found.group(1)) == len(coop), said[-2000:]
