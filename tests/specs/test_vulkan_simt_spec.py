"""The SIMT Vulkan presets' UNet spec (tools/make_vulkan_simt_spec.py) at SD 1.5's sizes: it
is its generator's output and every SIMT GPU preset's, takes SD 1.5's 64x64-level P.V off the
per-output reduction iree 3.13 gives it there, leaves the P.V shapes iree tiles itself alone,
and the tile it gives computes P.V right when lavapipe runs it. (The tiny model's UNet: tests/specs/
test_tuning_specs.py, test_nvidia_simt_spec_takes_exactly_attentions_pv.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from make_vulkan_simt_spec import SPEC, render  # noqa: E402

MARKER = "__tuning_spec_applied__"


def test_shipped_spec_is_the_generators_output():
    text = SPEC.read_text()
    assert text == render()
    assert "@match_pv_head_dim_16" in text and "@match_pv_n8_m256_k32" in text


def pv_mlir(b: int, m: int, n: int, k: int) -> str:
    """Attention's P.V as the decomposed export leaves it: f16 operands, f32 result."""
    p, v, o = f"tensor<{b}x{m}x{k}xf16>", f"tensor<{b}x{k}x{n}xf16>", f"tensor<{b}x{m}x{n}xf32>"
    return f"""func.func @pv(%p: {p}, %v: {v}) -> {o} {{
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : {o}
  %f = linalg.fill ins(%z : f32) outs(%e : {o}) -> {o}
  %r = linalg.batch_matmul ins(%p, %v : {p}, {v}) outs(%f : {o}) -> {o}
  return %r : {o}
}}
"""


def compile_pv(tmp_path: Path, shape, arch: str, spec: bool, full: bool = False):
    """(configured source, vmfb path) of one P.V compiled with the preset's flags."""
    from sdiree.compile.iree_compile import iree_compile_tool
    from sdiree.compile.tuning_embed import attach
    from sdiree.runtime.targets import load_registry

    name = "x".join(map(str, shape)) + f"-{arch}-{spec}"
    src = tmp_path / f"{name}.mlir"
    src.write_text(pv_mlir(*shape))
    if spec:
        attach(src, SPEC, tmp_path / f"{name}.mlirbc")
        src = tmp_path / f"{name}.mlirbc"
    dump, out = tmp_path / f"{name}.dump", tmp_path / f"{name}.vmfb"
    flags = load_registry().target("vulkan-spirv").compile_flags(arch, "fp16", "unet")
    cmd = [iree_compile_tool(), str(src), *flags, "-o", str(out)]
    cmd.append(f"--iree-hal-dump-executable-configurations-to={dump}")
    if not full:
        cmd.append("--compile-to=executable-configurations")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (text,) = [p.read_text() for p in dump.glob("*.mlir")]
    return text, out


def config(text: str) -> tuple[str, str, str]:
    return (
        re.search(r"spirv_pipeline<(\w+)>", text).group(1),
        re.search(r"workgroup_size = (\[[^\]]*\])", text).group(1),
        re.search(r"tile_sizes = (\[\[[^>]*\]\])", text).group(1),
    )


SIMT_GPUS = (
    "rdna3",
    "rdna2",
    "gcn",
    "ampere",
    "ada",
    "arc",
)  # fp16 GPU presets without cooperative matrices


def test_every_simt_gpu_preset_gives_its_unet_the_spec():
    from sdiree.runtime.targets import load_registry

    vk = load_registry().target("vulkan-spirv")
    for name, arch in vk.arches.items():
        gpu_fp16 = name != "lavapipe" and "fp16" not in arch.refused_dtypes
        simt_gpu = gpu_fp16 and not arch.device.get("cooperative_matrix")
        assert (arch.tuning_specs == {"unet": "tuning/vulkan_simt_attention.mlir"}) == simt_gpu
        assert simt_gpu == (name in SIMT_GPUS), name


def test_sd15_self_attention_pv_leaves_the_reduction_pipeline(tmp_path):
    """SD 1.5's guided 64x64 P.V at 512² (16 heads x 4096 queries, head dim 40, 4096 keys):
    iree 3.13's config on every SIMT GPU preset is a reduction per output; with the spec, the
    tiled SIMT matmul pipeline, 256 queries by 8 columns per workgroup on 2x32 threads."""
    shape = (16, 4096, 40, 4096)
    for arch in SIMT_GPUS:
        plain, _ = compile_pv(tmp_path, shape, arch, False)
        assert config(plain)[0] == "SubgroupReduce" and MARKER not in plain, arch
        text, _ = compile_pv(tmp_path, shape, arch, True)
        assert MARKER in text, arch
        assert config(text) == ("MatmulPromoteVectorize", "[2, 32, 1]", "[[1, 256, 8, 32]]"), arch


@pytest.mark.parametrize(
    "shape",
    [(16, 4096, 40, 77), (16, 4096, 64, 4096), (16, 1024, 80, 1024), (16, 64, 4, 64)],
    ids=["cross-attention", "head-dim-64", "sd15-32x32", "head-dim-4"],
)
def test_pv_shapes_iree_tiles_itself_keep_its_choice(tmp_path, shape):
    text, _ = compile_pv(tmp_path, shape, "ampere", True)
    plain, _ = compile_pv(tmp_path, shape, "ampere", False)
    assert MARKER not in text and config(text) == config(plain)


def test_the_specs_tile_computes_pv_on_lavapipe(tmp_path):
    """The spec's SD 1.5 tile (256 queries x 8 columns, K step 32, 2x32 threads) run for real
    on lavapipe at head dim 40 and 1024 keys, against numpy in float64."""
    import iree.runtime as rt

    from sdiree.runtime.device import to_host

    shape = b, m, n, k = (2, 1024, 40, 1024)
    text, vmfb = compile_pv(tmp_path, shape, "lavapipe", True, full=True)
    assert config(text) == ("MatmulPromoteVectorize", "[2, 32, 1]", "[[1, 256, 8, 32]]")
    rng = np.random.default_rng(0)
    p = rng.random((b, m, k))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float16)
    v = rng.standard_normal((b, k, n)).astype(np.float16)
    device = rt.get_driver("vulkan").create_default_device()
    ctx = rt.SystemContext(config=rt.Config(device=device))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
    out = to_host(device, ctx.modules.module["pv"](p, v))
    ref = np.einsum("bmk,bkn->bmn", p.astype(np.float64), v.astype(np.float64))
    assert np.abs(out - ref).max() <= 1e-3 * np.abs(ref).max()
