"""lavapipe stops a shader invocation's loops after 65,535 iterations in all (llvmpipe's loop
limiter, LP_MAX_TGSI_LOOP_ITERATIONS, shared by every loop of a shader) and returns what the
truncated loops computed, without an error. A kernel that loops longer computes the wrong thing
on lavapipe only: this is why lavapipe given ampere's code path returns NaN for SD 1.5's UNet
at 128² (specs/README.md, "Their fp16 numerics on lavapipe"), not a fault of that path.

The product here is that UNet's mid-block projection (1280 channels, 4 tokens): ampere's SIMT
configuration gives it one workgroup per 256 output channels, each active thread looping over
64 rows and all of K (~2,400 iterations per 32 of K), lavapipe's own one short loops.

lavapipe's own preset meets the limit in GroupNorm: without subgroup operations iree sums each
group in one thread, 4 values per iteration, so a group of more than 262,140 values (SD 1.5's
VAE decoder from 256²) was summed in part; the preset's export choice `norm_sums: chunked`
(compile/exporters/norm_precision.py) sums it in chunks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

PRODUCT = """
func.func @mm(%a: tensor<{k}x4xf16>, %w: tensor<1280x{k}xf16>) -> tensor<4x1280xf16> {{
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<1280x4xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<1280x4xf32>) -> tensor<1280x4xf32>
  %p = linalg.generic {{indexing_maps = [affine_map<(m, n, k) -> (k, n)>,
      affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (m, n)>],
      iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%a, %w : tensor<{k}x4xf16>, tensor<1280x{k}xf16>) outs(%acc : tensor<1280x4xf32>) {{
  ^bb0(%x: f16, %y: f16, %s: f32):
    %xf = arith.extf %x : f16 to f32
    %yf = arith.extf %y : f16 to f32
    %m = arith.mulf %xf, %yf : f32
    %r = arith.addf %s, %m : f32
    linalg.yield %r : f32
  }} -> tensor<1280x4xf32>
  %o = tensor.empty() : tensor<4x1280xf16>
  %t = linalg.generic {{indexing_maps = [affine_map<(m, n) -> (m, n)>,
      affine_map<(m, n) -> (n, m)>], iterator_types = ["parallel", "parallel"]}}
      ins(%p : tensor<1280x4xf32>) outs(%o : tensor<4x1280xf16>) {{
  ^bb0(%x: f32, %y: f16):
    %h = arith.truncf %x : f32 to f16
    linalg.yield %h : f16
  }} -> tensor<4x1280xf16>
  return %t : tensor<4x1280xf16>
}}
"""


def target_flag(arch: str) -> str:
    """The vulkan-spirv preset's target description; ampere's with its subgroup ops off, as
    lavapipe has none (the form tests/specs/test_tuning_specs.py runs the whole model in)."""
    presets = json.loads((ROOT / "specs" / "targets.json").read_text())["targets"]
    (flag,) = presets["vulkan-spirv"]["arches"][arch]["flags"]
    return flag.replace("subgroup = shuffle|arithmetic", "subgroup = none")


def run_on_lavapipe(vmfb: bytes, function: str, *args: np.ndarray) -> np.ndarray:
    import iree.runtime as rt

    from sdiree.runtime.device import create_device, list_devices, to_host
    from sdiree.runtime.device_pollers import in_use

    lavapipe = next(d for d in list_devices("vulkan") if d.is_cpu_emulation)
    device = create_device(lavapipe)
    instance = rt.VmInstance()
    module = rt.VmModule.copy_buffer(instance, vmfb)
    context = rt.VmContext(instance, modules=[rt.create_hal_module(instance, device), module])
    fn = rt.FunctionInvoker(context, device, module.lookup_function(function))
    with in_use(device):
        return to_host(device, fn(*args))


def rel_error(arch: str, k: int) -> float:
    from iree.compiler import compile_str

    vmfb = compile_str(PRODUCT.format(k=k), extra_args=[target_flag(arch)])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, 4)).astype(np.float16)
    w = (rng.standard_normal((1280, k)) * 0.02).astype(np.float16)
    ref = (w.astype(np.float32) @ a.astype(np.float32)).T
    out = run_on_lavapipe(vmfb, "mm", a, w)
    return float(np.abs(out.astype(np.float32) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize(
    ("arch", "k", "right"),
    [
        ("ampere", 768, True),  # ~58,000 iterations per invocation
        ("ampere", 1280, False),  # ~97,000: truncated
        ("lavapipe", 1280, True),  # lavapipe's own configuration of the same product
    ],
)
def test_lavapipe_truncates_long_loops(arch, k, right):
    rel = rel_error(arch, k)
    if right:
        assert rel < 2e-3, rel
    else:  # the truncated loops leave it far off, or NaN (seen once in a CI run)
        assert np.isnan(rel) or rel > 0.5, (
            f"lavapipe ran {k} of K right: its loop limit moved? {rel}"
        )


@pytest.mark.parametrize("sums", ["whole", "chunked"])
def test_lavapipe_sums_a_large_group_only_in_chunks(sums):
    """A GroupNorm of 8 channels x 256 x 256 = 524,288 values per group (as SD 1.5's VAE
    decoder's 256-channel norms at 256²), compiled for the lavapipe preset: summed whole, the
    loop limiter cuts each group's sums short and the output is far off; with the preset's
    `norm_sums: chunked` it is group_norm's."""
    torch = pytest.importorskip("torch")
    from iree.compiler import compile_str
    from iree.turbine import aot

    from sdiree.compile.exporters.norm_precision import set_norm_sums
    from sdiree.runtime.targets import load_registry

    assert (
        load_registry()
        .target("vulkan-spirv")
        .export_for("vae_decoder", "fp16", "lavapipe")["norm_sums"]
        == "chunked"
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.GroupNorm(8, 64)).eval()
    x = torch.randn(1, 64, 256, 256) * 2 + 1
    with torch.no_grad():
        ref = model(x).numpy()
    set_norm_sums(model, sums)
    mlir = str(aot.export(model, args=(x,)).mlir_module)
    vmfb = compile_str(mlir, extra_args=[target_flag("lavapipe")])
    err = float(np.abs(run_on_lavapipe(vmfb, "main", x.numpy()) - ref).max())
    if sums == "chunked":
        assert err < 1e-3, err
    else:
        assert err > 0.1, f"lavapipe summed 524,288 values whole: its loop limit moved? {err}"
