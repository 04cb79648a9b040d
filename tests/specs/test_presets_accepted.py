"""Every target × arch × dtype preset in specs/targets.json is accepted by iree-compile 3.13.

Unknown flags stop the compile, so a typo in the registry shows up here on a trivial module
rather than minutes into a real compile.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sdiree.compile.iree_compile import iree_compile_tool
from sdiree.runtime.targets import load_registry

MLIR = """
func.func @main(%a: tensor<4x8xf32>, %b: tensor<8x16xf32>) -> tensor<4x16xf32> {
  %c = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4x16xf32>
  %f = linalg.fill ins(%c : f32) outs(%e : tensor<4x16xf32>) -> tensor<4x16xf32>
  %r = linalg.matmul ins(%a, %b : tensor<4x8xf32>, tensor<8x16xf32>)
                     outs(%f : tensor<4x16xf32>) -> tensor<4x16xf32>
  return %r : tensor<4x16xf32>
}
"""

REGISTRY = load_registry()
PRESETS = [
    (t.name, a, d) for t in REGISTRY.targets.values() for a in t.arches for d in t.usable_dtypes(a)
]


def test_required_presets_exist():
    arches = {t: set(REGISTRY.target(t).arches) for t in REGISTRY.targets}
    assert {"host", "x86-64-v3"} <= arches["cpu"]
    assert {"lavapipe", "baseline", "rdna2", "rdna3", "ampere", "ada", "gcn", "arc"} <= arches[
        "vulkan-spirv"
    ]
    assert {"gfx90a", "gfx942", "gfx1100"} <= arches["rocm"]
    assert {"sm_80", "sm_89"} <= arches["cuda"]
    # cpu: decomposed attention is 2.4x faster and far more precise than fused SDPA at 512x512,
    # and chunked (cache-sized blocks, softmax sums from the second matmul) faster again, with
    # 1.7 GB less peak memory (tools/PERFORMANCE.md); vulkan: fused attention does not compile
    # in iree 3.13.
    assert REGISTRY.target("vulkan-spirv").export["attention"] == "decomposed"
    assert REGISTRY.target("cpu").export["attention"] == "chunked"
    assert all(REGISTRY.target(t).export["attention"] == "sdpa" for t in ("rocm", "cuda"))
    # cpu: convolutions exported as matmuls, which llvm-cpu data-tiles (tools/PERFORMANCE.md)
    assert REGISTRY.target("cpu").export["conv"] in ("matmul", "winograd")
    # ... and the VAE's with F(4x4,3x3): its 512x512 activations outweigh its weights
    cpu = REGISTRY.target("cpu")
    assert cpu.export_for("unet")["conv"] == "winograd"
    # ... with F(4x4,3x3) on the UNet's convs whose input is 64x64 or larger (its top level at
    # 512x512), where the activations outweigh the 4x larger transformed weights; the 32x32
    # level's F(2x2) keeps `sdiree run`'s peak below torch eager's (issue 21)
    assert cpu.export_for("unet")["winograd4_min_side"] == 64
    # ... each Winograd conv one matmul per tile element where its input is large enough to pay
    # for the dispatches (specs/README.md), 16 in the UNet, 128 in the VAE
    assert cpu.export_for("unet")["winograd_split_min_side"] == 16
    # ... and the VAE decoder's activations channels-last between its convs (no transposes
    # around each conv: its 512x512 decode x0.89 fp32, x0.91 bf16 on Zen 5)
    assert cpu.export_for("vae_decoder") == {
        "attention": "chunked", "attention_block_bytes": 4 << 20, "conv": "winograd4",
        "winograd_output": "batched", "winograd_split_min_side": 128, "layout": "channels_last",
    }  # fmt: skip
    assert "layout" not in cpu.export_for("vae_encoder")
    # ... attention's score blocks of 4 MiB (256 of 4096 queries at 512x512, fp32), faster than
    # 16 MiB ones on Zen 5 (compile/NOTES.md)
    assert cpu.export_for("unet")["attention_block_bytes"] == 4 << 20
    assert REGISTRY.target("cpu").export_dtype("bf16") == "fp32"
    # GPU targets: linears as 2-D matmuls (no load-time transposed copies), except in the VAE
    # and on the 48 KiB NVIDIA Vulkan presets, where iree 3.13 then fails to compile some
    vk = REGISTRY.target("vulkan-spirv")
    assert vk.export_for("unet", "fp16", "rdna3")["linear"] == "flat"
    assert vk.export_for("vae_decoder", "fp16", "rdna3")["linear"] == "native"
    assert vk.export_for("unet", "fp16", "ampere")["linear"] == "native"
    assert all(REGISTRY.target(t).export_for("unet")["linear"] == "flat" for t in ("rocm", "cuda"))
    assert "linear" not in cpu.export_for("unet")
    # cuda fp16: 1x1 convs as weight-first einsums and no O3, the two ways iree 3.13 got fp16
    # contractions wrong on an H100 (tools/PERFORMANCE.md, "GPU"); fp32 keeps O3.
    cuda = REGISTRY.target("cuda")
    assert cuda.export["conv"] == "pointwise_einsum" and cuda.pick_dtype("sm_80", None) == "fp16"
    assert not any(
        f.startswith("--iree-opt-level") for f in (*cuda.flags, *cuda.dtype_flags("fp16", "sm_80"))
    )
    assert "--iree-opt-level=O3" in cuda.dtype_flags("fp32", "sm_80")


def test_refused_dtypes_are_refused_with_their_reason_and_defaults_fall_back():
    from sdiree.runtime.errors import UserError

    vk = REGISTRY.target("vulkan-spirv")
    assert "fp16" in vk.refusals("baseline") and "fp16" not in vk.usable_dtypes("baseline")
    assert vk.pick_dtype("baseline", None) == "fp32"
    with pytest.raises(UserError, match=r"refused for vulkan-spirv/baseline: iree 3\.13 cannot"):
        vk.pick_dtype("baseline", "fp16")
    for arch in ("rdna3", "ampere", "ada", "gcn", "arc"):  # fp16 compiles on every GPU arch
        assert vk.pick_dtype(arch, None) == "fp16"
    cuda = REGISTRY.target("cuda")
    with pytest.raises(UserError, match="not available"):
        cuda.pick_dtype("sm_80", "bf16")
    for t in REGISTRY.targets.values():
        for a in t.arches:
            assert t.pick_dtype(a, None) in t.usable_dtypes(a), (t.name, a)
            assert all(d in t.dtypes for d in t.refusals(a)), "a refusal names a known dtype"


def _run_compile(tmp_path, name: str, mlir: str, flags) -> tuple[subprocess.CompletedProcess, Path]:
    src, out = tmp_path / f"{name}.mlir", tmp_path / f"{name}.vmfb"
    src.write_text(mlir)
    cmd = [iree_compile_tool(), str(src), "-o", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True), out


def _compile(tmp_path, name: str, mlir: str, flags) -> bytes:
    proc, out = _run_compile(tmp_path, name, mlir, flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out.read_bytes()


@pytest.mark.parametrize("target,arch,dtype", PRESETS)
def test_preset_flags_compile(tmp_path, target, arch, dtype):
    t = REGISTRY.target(target)
    opt = t.dtype_options.get(dtype)
    subs = {None, *t.submodule_flags, *(opt.submodule_flags if opt else ())}
    for i, flags in enumerate(sorted({tuple(t.compile_flags(arch, dtype, s)) for s in subs})):
        assert len(_compile(tmp_path, f"m{i}", MLIR, flags)) > 0


def test_cpu_submodule_flags_take_effect(tmp_path):
    """A flag iree-compile accepts can still change nothing (compile/NOTES.md lists some): the
    UNet's own cpu flags must change the module of a UNet-sized matmul (the distribution tile
    of a data-tiled matmul, here 128 workgroups -> 8)."""
    t = REGISTRY.target("cpu")
    base = t.compile_flags(t.default_arch, "fp32")
    m, k, n = 2048, 320, 320
    mlir = MLIR.replace("4x8", f"{m}x{k}").replace("8x16", f"{k}x{n}").replace("4x16", f"{m}x{n}")
    assert t.submodule_flags["unet"], "the cpu preset sets UNet-only flags"
    plain = _compile(tmp_path, "plain", mlir, base)
    tuned = _compile(tmp_path, "unet", mlir, [*base, *t.submodule_flags["unet"]])
    assert plain != tuned


def test_submodules_sharing_weights_share_their_export_conv_choice():
    """The VAE's decoder and encoder share one model and one derived-weights archive, so a
    preset giving them different Winograd tiles could not compile (conv_matmul refuses it)."""
    from sdiree.compile.exporters import SCOPES

    for target in REGISTRY.targets.values():
        dtype_subs = (s for o in target.dtype_options.values() for s in o.submodule_flags)
        for sub in (*target.submodule_export, *target.submodule_flags, *dtype_subs):
            assert sub in SCOPES, f"{target.name}: unknown submodule {sub} in its registry entry"
        for scope in set(SCOPES.values()):
            subs = [s for s, sc in SCOPES.items() if sc == scope]
            convs = {target.export_for(s).get("conv", "native") for s in subs}
            assert len(convs) == 1, (target.name, scope, convs)
        # per-conv tiles are chosen by the UNet exporter only (plan_for refuses them elsewhere)
        for sub in SCOPES:
            if sub != "unet":
                assert "winograd4_min_side" not in target.export_for(sub), (target.name, sub)


UKERNELS_OFF = "--iree-llvmcpu-enable-ukernels=none"


def test_cpu_bf16_drops_the_matmul_ukernel_where_the_cpu_lacks_avx512_bf16():
    """iree 3.13 has a bf16 matmul ukernel only for avx512_bf16; elsewhere its generic fallback
    ran a 2048x640x640 bf16 matmul 44x slower than fp32, and the codegen without ukernels 2.2x
    (tools/PERFORMANCE.md). The fallback flag comes last, so it overrides the target's."""
    import dataclasses

    t = REGISTRY.target("cpu")
    v3 = t.compile_flags("x86-64-v3", "bf16")
    assert v3[-1] == UKERNELS_OFF and "--iree-llvmcpu-enable-ukernels=all" in v3
    assert UKERNELS_OFF not in t.compile_flags("x86-64-v3", "fp32")
    with_bf16 = dataclasses.replace(t.arch("x86-64-v3"), cpu_features=("avx2", "avx512_bf16"))
    t2 = dataclasses.replace(t, arches={**t.arches, "x86-64-v3": with_bf16})
    assert UKERNELS_OFF not in t2.compile_flags("x86-64-v3", "bf16")
    assert t.arch("host").cpu_features == "host"  # the compiling machine's, read at compile


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= REGISTRY.target("cpu").arch("host").features(),
    reason="runs x86-64-v3 code: needs an AVX2 CPU",
)
def test_cpu_bf16_fallback_takes_effect_and_stays_right(tmp_path):
    """With and without the fallback the bf16 module differs, and both compute the matmul with
    bf16-rounded inputs and fp32 accumulation."""
    import iree.runtime as ireert
    import numpy as np

    t = REGISTRY.target("cpu")
    m, k, n = 64, 128, 96
    mlir = MLIR.replace("4x8", f"{m}x{k}").replace("8x16", f"{k}x{n}").replace("4x16", f"{m}x{n}")
    flags = t.compile_flags("x86-64-v3", "bf16")
    modules = {
        "fallback": _compile(tmp_path, "fallback", mlir, flags),
        "ukernel": _compile(tmp_path, "ukernel", mlir, flags[:-1]),
    }
    assert modules["fallback"] != modules["ukernel"]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)

    def bf16(x):  # round to nearest even on the top 16 bits
        u = x.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(np.uint32).view(np.float32)

    want = bf16(a).astype(np.float64) @ bf16(b).astype(np.float64)
    for name, vmfb in modules.items():
        config = ireert.Config("local-task")
        ctx = ireert.SystemContext(config=config)
        ctx.add_vm_module(ireert.VmModule.copy_buffer(config.vm_instance, vmfb))
        got = np.asarray(ctx.modules.module["main"](a, b))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(), err_msg=name)


# A conv as an im2col matmul, its bias, and the result both as is and transposed (the next
# layer's layout): one fused dispatch, at the SD 1.5 UNet's stride-2 conv (64² -> 32², 320
# channels, batch 1) and the VAE encoder's 512² conv (128 channels) sizes.
DUAL_OUTPUT_MATMUL = """
func.func @main(%a: tensor<MxKxf32>, %b: tensor<KxNxf32>, %bias: tensor<Nxf32>)
    -> (tensor<MxNxf32>, tensor<NxMxf32>) {
  %c = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<MxNxf32>
  %f = linalg.fill ins(%c : f32) outs(%e : tensor<MxNxf32>) -> tensor<MxNxf32>
  %r = linalg.matmul ins(%a, %b : tensor<MxKxf32>, tensor<KxNxf32>)
                     outs(%f : tensor<MxNxf32>) -> tensor<MxNxf32>
  %et = tensor.empty() : tensor<NxMxf32>
  %o:2 = linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>,
      affine_map<(d0, d1) -> (d1)>, affine_map<(d0, d1) -> (d0, d1)>,
      affine_map<(d0, d1) -> (d1, d0)>], iterator_types = ["parallel", "parallel"]}
      ins(%r, %bias : tensor<MxNxf32>, tensor<Nxf32>)
      outs(%e, %et : tensor<MxNxf32>, tensor<NxMxf32>) {
  ^bb0(%in: f32, %in_0: f32, %out: f32, %out_1: f32):
    %s = arith.addf %in, %in_0 : f32
    linalg.yield %s, %s : f32, f32
  } -> (tensor<MxNxf32>, tensor<NxMxf32>)
  return %o#0, %o#1 : tensor<MxNxf32>, tensor<NxMxf32>
}
"""


@pytest.mark.parametrize(
    "submodule,m,k,n", [("unet", 1024, 2880, 320), ("vae_encoder", 65536, 1152, 128)]
)
def test_cpu_bf16_tile_bytes_compile_the_dual_output_matmul(tmp_path, submodule, m, k, n):
    """In bf16 these dispatches fail ("operations with large vector sizes (16384 bytes)") with
    the fp32 tile bytes (the UNet's 1 MiB, the VAE encoder's default); bf16's own smaller ones,
    applied last, compile them."""
    mlir = DUAL_OUTPUT_MATMUL.replace("M", str(m)).replace("K", str(k)).replace("N", str(n))
    t = REGISTRY.target("cpu")
    flags = t.compile_flags("x86-64-v3", "bf16", submodule)
    assert flags[-1].startswith("--iree-llvmcpu-matmul-tile-bytes=")
    assert len(_compile(tmp_path, "bf16", mlir, flags)) > 0
    fp32_tiles, _ = _run_compile(tmp_path, "fp32_tiles", mlir, flags[:-1])
    assert fp32_tiles.returncode != 0 and "large vector sizes" in fp32_tiles.stderr
