"""The rocm tuning specs (tools/make_rocm_tuning_spec.py): each is what its generator writes, is
needed, matches the convolutions it was written for (iree-compile's own configuration dump
shows its marker on them and its tile in their configuration) and nothing else, and changes
what the compiler would have chosen.

rocm fp16 compiles its convolutions channels-last as implicit GEMMs on the matrix cores. Where
a conv's output width is not a multiple of 16 (SD 1.5's 8x8 level at 512², SD 2.1's 24x24 and
12x12 at 768²) iree 3.13's own tile needs 80 KiB of shared memory when the conv also writes a
transposed copy of its output, and the UNet does not compile on any AMD chip (64 KiB); the
spec's 64x64 tile fits. Checked on a single dispatch of that kind (seconds) and on the tiny
UNet's own configuration, compiled only as far as the configurations.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from make_rocm_tuning_spec import FAMILIES, TUNING, render  # noqa: E402

# With the spec flag iree 3.13 can deadlock a threaded compile; sdiree's compile retries such
# a compile (compile/iree_compile.py), a test's own compile runs single-threaded instead.
from sdiree.compile.iree_compile import UNTHREADED  # noqa: E402

MARKER = "__tuning_spec_applied__"
SPECS = {"gfx90a": "rocm_cdna_convs", "gfx942": "rocm_cdna_convs", "gfx1100": "rocm_rdna3_convs"}
CONV_SUBMODULES = ("unet", "vae_decoder", "vae_encoder")
INTRINSIC = {"gfx942": "MFMA_F32_16x16x16_F16", "gfx1100": "WMMAR3_F32_16x16x16_F16"}

# A stride-2 conv of SD 2.1's 768² UNet (48x48 -> 24x24, 640 channels, guided batch) that also
# writes its output transposed, as in the UNet; and a 16x16 one, whose width is aligned.
DISPATCHES = """
func.func @down(%x: tensor<2x50x50x640xf16>, %w: tensor<640x3x3x640xf16>, %b: tensor<640xf16>)
    -> (tensor<2x24x24x640xf16>, tensor<640x2x24x24xf16>) {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<2x24x24x640xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<2x24x24x640xf32>) -> tensor<2x24x24x640xf32>
  %c = linalg.conv_2d_nhwc_fhwc {dilations = dense<1> : tensor<2xi64>, strides = dense<2> : tensor<2xi64>}
    ins(%x, %w : tensor<2x50x50x640xf16>, tensor<640x3x3x640xf16>)
    outs(%f : tensor<2x24x24x640xf32>) -> tensor<2x24x24x640xf32>
  %e1 = tensor.empty() : tensor<2x24x24x640xf16>
  %e2 = tensor.empty() : tensor<640x2x24x24xf16>
  %r:2 = linalg.generic {indexing_maps = [affine_map<(a, b, c, d) -> (a, b, c, d)>,
      affine_map<(a, b, c, d) -> (d)>, affine_map<(a, b, c, d) -> (a, b, c, d)>,
      affine_map<(a, b, c, d) -> (d, a, b, c)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
    ins(%c, %b : tensor<2x24x24x640xf32>, tensor<640xf16>)
    outs(%e1, %e2 : tensor<2x24x24x640xf16>, tensor<640x2x24x24xf16>) {
  ^bb0(%i: f32, %bb: f16, %o: f16, %o2: f16):
    %be = arith.extf %bb : f16 to f32
    %s = arith.addf %i, %be : f32
    %t = arith.truncf %s : f32 to f16
    linalg.yield %t, %t : f16, f16
  } -> (tensor<2x24x24x640xf16>, tensor<640x2x24x24xf16>)
  return %r#0, %r#1 : tensor<2x24x24x640xf16>, tensor<640x2x24x24xf16>
}
func.func @aligned(%x: tensor<2x18x18x640xf16>, %w: tensor<640x3x3x640xf16>) -> tensor<2x16x16x640xf32> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<2x16x16x640xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<2x16x16x640xf32>) -> tensor<2x16x16x640xf32>
  %c = linalg.conv_2d_nhwc_fhwc {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}
    ins(%x, %w : tensor<2x18x18x640xf16>, tensor<640x3x3x640xf16>)
    outs(%f : tensor<2x16x16x640xf32>) -> tensor<2x16x16x640xf32>
  return %c : tensor<2x16x16x640xf32>
}
"""


def iree_compile(args: list, cwd: Path) -> subprocess.CompletedProcess:
    from sdiree.compile.iree_compile import iree_compile_tool

    cmd = [iree_compile_tool(), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def configurations(dump: Path) -> dict[str, str]:
    """{dispatch function name: its configured source} from a configuration dump."""
    out = {}
    for f in dump.glob("*.mlir"):
        for chunk in re.split(r"(?=func\.func @)", f.read_text())[1:]:
            out[re.match(r"func\.func @(\S+?)\(", chunk).group(1)] = chunk
    return out


def workgroup(text: str) -> list[int]:
    return json.loads(re.search(r"workgroup = (\[[^\]]*\])", text).group(1))


def lowering(text: str) -> str:
    return re.search(r"lowering_config = (#iree_gpu\.lowering_config<\{[^}]*\}>)", text).group(1)


def test_shipped_specs_are_the_generators_output():
    for stem in FAMILIES:
        text = (TUNING / f"{stem}.mlir").read_text()
        assert text == render(stem)
        assert "@match_conv_batched_s2_rows4" in text and "@keep_default" in text


def test_registry_gives_each_rocm_arch_its_matrix_core_spec():
    """Each rocm preset takes its family's spec; fp16 compiles the convs channels-last as
    implicit GEMMs (iree's default, no longer turned off) with the UNet's filters exported
    channels-last, as cuda does; fp32 keeps the direct convs it was measured with."""
    from sdiree.runtime.targets import load_registry

    rocm = load_registry().target("rocm")
    assert rocm.tuning_spec_via == "flag"
    for name, arch in rocm.arches.items():
        spec = f"tuning/{SPECS[name]}.mlir"
        assert arch.tuning_specs == dict.fromkeys(CONV_SUBMODULES, spec), name
        fp16 = " ".join(rocm.compile_flags(name, "fp16", "unet"))
        assert "use-igemm=false" not in fp16 and "transpose-convolution" in fp16, name
        assert "use-igemm=false" in " ".join(rocm.compile_flags(name, "fp32", "unet")), name
    fp16 = rocm.dtype_options["fp16"]
    assert fp16.submodule_export["unet"]["conv"] == "pointwise_einsum_fhwc"


@pytest.mark.parametrize("arch", ["gfx942", "gfx1100"])
def test_unaligned_conv_needs_the_spec_and_it_applies(arch, tmp_path):
    src = tmp_path / "convs.mlir"
    src.write_text(DISPATCHES)
    base = [src, "--iree-hal-target-device=hip", f"--iree-rocm-target={arch}", "-o", "out.vmfb"]
    without = iree_compile(base, tmp_path)
    assert without.returncode != 0
    assert "uses 81920 bytes of shared memory; exceeded the limit of 65536" in without.stderr

    spec = TUNING / f"{SPECS[arch]}.mlir"
    dump = tmp_path / "dump"
    done = iree_compile(
        [*base, f"--iree-codegen-tuning-spec-path={spec}", *UNTHREADED,
         f"--iree-hal-dump-executable-configurations-to={dump}"], tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out.vmfb").stat().st_size > 0
    configs = configurations(dump)
    (down,) = [t for n, t in configs.items() if n.startswith("down")]
    (aligned,) = [t for n, t in configs.items() if n.startswith("aligned")]
    assert MARKER in down and workgroup(down) == [1, 4, 16, 64, 0]
    assert INTRINSIC[arch] in down
    assert MARKER not in aligned


def test_tiny_unet_convs_take_the_spec_on_matrix_cores(compiled, tmp_path):
    """The tiny UNet of the suite's rocm gfx942 fp16 artifact, compiled as far as its dispatch
    configurations with the artifact's own flags: with the spec, every channels-last f16 conv
    of a multiple of 64 output channels whose output width is not a multiple of 16 (the tiny UNet's are 8
    and 4 wide) carries the spec's marker and tile, nothing else does, and without the spec the
    compiler picks other tiles for them; every conv of 16 channels or more runs on MFMA."""
    from sdiree.runtime.manifest import load_manifest

    m = load_manifest(compiled.get("rocm", "gfx942", "fp16"))
    sub = m.data["submodules"]["unet"]
    assert list(sub["tuning_specs"]) == ["tuning/rocm_cdna_convs.mlir"]
    (mlir,) = Path(os.environ["SDIREE_CACHE"]).rglob(sub["mlir"])
    flags = [f for f in sub["flags"] if "tuning-spec-path" not in f]
    spec = f"--iree-codegen-tuning-spec-path={TUNING / 'rocm_cdna_convs.mlir'}"
    assert spec in sub["flags"]

    def configured(extra: list[str], name: str) -> dict[str, str]:
        dump = tmp_path / name
        done = iree_compile(
            [mlir, *flags, *extra, "--compile-to=executable-configurations",
             f"--iree-hal-dump-executable-configurations-to={dump}", "-o", f"{name}.mlir"],
            tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return {n: t for n, t in configurations(dump).items() if "_conv_" in n}

    tuned, default = configured([spec, *UNTHREADED], "tuned"), configured([], "default")
    assert set(tuned) == set(default)
    matched = {n for n, t in tuned.items() if MARKER in t}
    assert matched
    for name, text in tuned.items():
        dims = [int(d) for d in re.search(r"_conv_([0-9x]+)_f16", name).group(1).split("x")]
        batched = len(dims) == 7  # [n,] oh, ow, oc, kh, kw, c
        oh, ow, oc = dims[1:4] if batched else dims[0:3]
        if oc >= 16 and dims[-1] >= 16:
            assert "MFMA_F32_16x16x16_F16" in text, name
        assert (name in matched) == (oc % 64 == 0 and ow % 16 != 0), name
        if name in matched:
            want = [1, 4, 16, 64, 0] if batched else [4, 16, 64, 0]
            assert workgroup(text) == want and "f16xf16xf32" in name, name
            assert lowering(default[name]) != lowering(text), name
            assert MARKER not in default[name], name
        else:
            assert lowering(text) == lowering(default[name]), name
