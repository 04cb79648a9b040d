"""The cpu target's bf16 tuning spec (tools/make_cpu_tuning_spec.py): it is its generator's output,
the registry gives it to `--dtype bf16` only, it matches the producers of bf16 matmul operands
it was written for (iree-compile's own configuration dump shows its marker and its K tiles on
them, where iree alone gives them 2-wide tiles, 1-wide on AVX2), it changes the compiled
module and not the results, and it touches no fp32 build. Checked on small hand-written
dispatches of each form (a softmax's max + exp, an elementwise product) and on the tiny SD 1.x
model's bf16 UNet. The tiny bf16 artifact's images against diffusers are
tests/runtime/test_run_parity.py's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from configured import configurations  # noqa: E402
from make_cpu_tuning_spec import SPEC, generate  # noqa: E402
from test_tuning_specs import MARKER  # noqa: E402

SPEC_REL = "tuning/cpu_bf16_packs.mlir"
PANELS_SPEC_REL = "tuning/cpu_avx2_linear_panels.mlir"
SUBMODULES = ("text_encoder", "unet", "vae_decoder", "vae_encoder")

MAPS = """
#map = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
"""
# exp(s - m) over rows, then (that) @ v: the tail of both forms below.
EXP_THEN_MATMUL = """
  %zero = arith.constant 0.0 : f32
  %e0 = tensor.empty() : tensor<256x512xf32>
  %e = linalg.generic {indexing_maps = [#map, #row, #map], iterator_types = ["parallel", "parallel"]}
      ins(%s, %m : tensor<256x512xf32>, tensor<256xf32>) outs(%e0 : tensor<256x512xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %x = math.exp %d : f32
    linalg.yield %x : f32
  } -> tensor<256x512xf32>
  %r0 = tensor.empty() : tensor<256x48xf32>
  %z = linalg.fill ins(%zero : f32) outs(%r0 : tensor<256x48xf32>) -> tensor<256x48xf32>
  %r = linalg.matmul ins(%e, %v : tensor<256x512xf32>, tensor<512x48xf32>)
      outs(%z : tensor<256x48xf32>) -> tensor<256x48xf32>
  return %r : tensor<256x48xf32>
}
"""
# The softmax of attention's scores, then P.V: iree fuses the max, the exp and the bf16
# conversion of P and its pack into one dispatch rooted at the max.
SOFTMAX = (
    MAPS
    + """
func.func @main(%s: tensor<256x512xf32>, %v: tensor<512x48xf32>) -> tensor<256x48xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %m0 = tensor.empty() : tensor<256xf32>
  %mi = linalg.fill ins(%ninf : f32) outs(%m0 : tensor<256xf32>) -> tensor<256xf32>
  %m = linalg.generic {indexing_maps = [#map, #row], iterator_types = ["parallel", "reduction"]}
      ins(%s : tensor<256x512xf32>) outs(%mi : tensor<256xf32>) {
  ^bb0(%a: f32, %o: f32):
    %x = arith.maximumf %a, %o : f32
    linalg.yield %x : f32
  } -> tensor<256xf32>"""
    + EXP_THEN_MATMUL
)
# An elementwise root that packs a bf16 operand (as GEGLU's product feeding the next linear):
# the rows' shift given as an input keeps it 2-D (iree flattens a plain elementwise op to 1-D).
ELEMENTWISE = (
    MAPS
    + """
func.func @main(%s: tensor<256x512xf32>, %m: tensor<256xf32>, %v: tensor<512x48xf32>)
    -> tensor<256x48xf32> {"""
    + EXP_THEN_MATMUL
)


def reference(s: np.ndarray, v: np.ndarray) -> np.ndarray:
    s64 = s.astype(np.float64)
    return np.exp(s64 - s64.max(axis=1, keepdims=True)) @ v.astype(np.float64)


def test_shipped_spec_is_the_generators_output():
    assert SPEC.read_text() == generate()


def test_registry_gives_the_spec_to_cpu_bf16_only():
    """bf16 gets this spec on every arch; fp32 gets none, except the UNet on a chip without
    avx512f, whose linears are panels with their own spec (tests/specs/test_cpu_avx2_panels.py)."""
    from sdiree.compile.plan import tuning_spec
    from sdiree.runtime.targets import load_registry

    registry = load_registry()
    cpu = registry.target("cpu")
    # embedded in the module: iree's spec-flag loader can deadlock a compile (compile/NOTES.md)
    assert cpu.tuning_spec_via == "module-attribute"
    for dtype in cpu.dtypes:
        for arch in cpu.arches:
            plan = SimpleNamespace(target=cpu, arch=arch, dtype=dtype, registry=registry)
            avx2_panels = dtype == "fp32" and "avx512f" not in cpu.arch(arch).features()
            for sub in SUBMODULES:
                found = tuning_spec(plan, sub)
                if dtype == "bf16":
                    assert found is not None, (dtype, arch, sub)
                    assert found[0] == SPEC_REL and found[1].read_bytes() == SPEC.read_bytes()
                elif avx2_panels and sub == "unet":
                    assert found is not None and found[0] == PANELS_SPEC_REL, (dtype, arch, sub)
                else:
                    assert found is None, (dtype, arch, sub, found)


def cpu_flags(dtype: str) -> list[str]:
    from sdiree.runtime.targets import load_registry

    return load_registry().target("cpu").compile_flags("host", dtype, "unet")


def iree_compile(src: Path, out: Path, flags: list[str], *more: str, spec: bool) -> None:
    """iree-compile src, with the spec attached to a copy of it as cpu's compiles attach it
    (`tuning_spec_via: module-attribute`; the flag's loader can deadlock, compile/NOTES.md)."""
    from sdiree.compile.iree_compile import iree_compile_tool
    from sdiree.compile.tuning_embed import attach

    if spec:
        attach(src, SPEC, out.with_suffix(".spec.mlirbc"))
        src = out.with_suffix(".spec.mlirbc")
    cmd = [iree_compile_tool(), str(src), "-o", str(out), *flags, *more]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def producer_k_tiles(text: str) -> set[int]:
    """The K (last) vector tiles of a dispatch's ops that write bf16: an elementwise root's last
    `vector_common_parallel` entry, or a reduction's consumer's `vector_inner_parallel` one."""
    tiles = set()
    for line in text.splitlines():
        if "linalg.generic" not in line or "xbf16>)" not in line:
            continue
        m = re.search(r"vector_inner_parallel = \[[0, ]*(\d+)\]", line) or re.search(
            r"vector_common_parallel = \[(?:\d+, )*(\d+)\]", line
        )
        if m:
            tiles.add(int(m.group(1)))
    return tiles


@pytest.mark.parametrize("form,root", [("softmax", "reduction"), ("elementwise", "elementwise")])
def test_spec_tiles_bf16_producers_along_k_and_keeps_results(tmp_path, form, root):
    pytest.importorskip("iree.compiler")
    import iree.runtime as rt

    src = tmp_path / f"{form}.mlir"
    src.write_text(SOFTMAX if form == "softmax" else ELEMENTWISE)
    bf16 = cpu_flags("bf16")
    builds = {}
    for name in ("plain", "spec"):
        dump = tmp_path / f"cfg-{name}"
        vmfb = tmp_path / f"{name}.vmfb"
        dumped = f"--iree-hal-dump-executable-configurations-to={dump}"
        iree_compile(src, vmfb, bf16, dumped, spec=name == "spec")
        builds[name] = (vmfb, configurations(dump))

    # the dispatch that produces the bf16 operand: iree alone tiles it 2 (AVX-512) or 1 (AVX2)
    # wide along K; the spec gives it 16 and marks it and its root
    (plain_fn,) = [f for f in builds["plain"][1] if f"_{root}_256x512_" in f]
    assert producer_k_tiles(builds["plain"][1][plain_fn]) <= {1, 2}
    tuned = builds["spec"][1][plain_fn]
    assert producer_k_tiles(tuned) == {16}
    assert tuned.count(MARKER) == (2 if root == "reduction" else 1)
    assert not any(MARKER in t for f, t in builds["spec"][1].items() if f != plain_fn)
    assert builds["spec"][0].read_bytes() != builds["plain"][0].read_bytes()

    rng = np.random.default_rng(0)
    s = (rng.standard_normal((256, 512)) * 3).astype(np.float32)
    v = rng.standard_normal((512, 48)).astype(np.float32)
    outs = {}
    for name, (vmfb, _) in builds.items():
        ctx = rt.SystemContext(config=rt.Config("local-task"))
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
        args = (s, v) if form == "softmax" else (s, s.max(axis=1), v)
        outs[name] = np.asarray(ctx.modules.module.main(*args))
    scale = np.abs(outs["plain"]).max()
    assert np.abs(outs["spec"] - outs["plain"]).max() <= 1e-6 * scale
    ref = reference(s, v)
    assert np.abs(outs["spec"] - ref).max() / np.abs(ref).max() < 2e-2  # bf16 operands


def test_spec_touches_no_fp32_build(tmp_path):
    pytest.importorskip("iree.compiler")
    src = tmp_path / "softmax.mlir"
    src.write_text(SOFTMAX)
    dump = tmp_path / "cfg"
    dumped = f"--iree-hal-dump-executable-configurations-to={dump}"
    iree_compile(src, tmp_path / "m.vmfb", cpu_flags("fp32"), dumped, spec=True)
    configs = configurations(dump)
    assert configs and not any(MARKER in t for t in configs.values())


def test_spec_applies_to_the_tiny_unet(compiled, compile_cache, tmp_path):
    """The tiny model's bf16 UNet, as the fixture compiled it (its manifest names the spec):
    its exported MLIR configured again with and without the spec."""
    from sdiree.runtime.manifest import load_manifest

    manifest = load_manifest(compiled.get("cpu", "host", "bf16")).data
    for sub in SUBMODULES:
        assert SPEC_REL in str(manifest["submodules"][sub]["tuning_specs"]), sub
    unet = manifest["submodules"]["unet"]
    (mlir,) = list(compile_cache.rglob(unet["mlir"]))[:1]
    configs = {}
    for name in ("plain", "spec"):
        dump = tmp_path / f"cfg-{name}"
        iree_compile(
            mlir, tmp_path / f"{name}.mlir", unet["flags"], "--compile-to=executable-configurations",
            f"--iree-hal-dump-executable-configurations-to={dump}", spec=name == "spec",
        )  # fmt: skip
        configs[name] = configurations(dump)
    marked = {f for f, t in configs["spec"].items() if MARKER in t}
    # the softmaxes and layer norms (reductions) and the GEGLU products (elementwise)
    assert any("_reduction_" in f for f in marked) and any("_elementwise_" in f for f in marked)
    for f in marked:
        assert producer_k_tiles(configs["spec"][f]) <= {8, 16}, f
    # what iree alone does to them: pack-wide K tiles (a producer that reads its input
    # transposed may already run 16 wide along K; the spec gives it 16 rows too)
    narrow = {f for f in marked if producer_k_tiles(configs["plain"][f]) <= {1, 2}}
    assert any("_reduction_" in f for f in narrow) and any("_elementwise_" in f for f in narrow)
    assert not any(MARKER in t for t in configs["plain"].values())
