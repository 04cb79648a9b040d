"""`winograd_matmul: "amx"` (compile/exporters/winograd.py `_product`): a split Winograd conv's
products that fit sdiree's AMX kernel take it, with bf16 operands (the transformed weight's
slices packed for the kernel); the conv stays the convolution within bf16's rounding, and where
this CPU has AMX the compiled module gives the eager result."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.conv_matmul import set_conv_lowering  # noqa: E402
from sdiree.runtime.cpu_features import host_cpu_features  # noqa: E402

HAS_AMX = {"amx_tile", "amx_bf16"} <= host_cpu_features()


def _conv(c=64, o=96):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(c, o, 3, padding=1), torch.nn.Conv2d(o, 8, 3, padding=1)
    )


def _lowered(matmul):
    model = _conv()
    set_conv_lowering(model, "winograd", None, "interleaved", 16, matmul)
    return model


def test_amx_products_are_the_conv_in_bf16_and_odd_channels_stay_fp32():
    x = torch.randn(2, 64, 16, 16)
    want = torch.nn.functional.conv2d(
        x.double(), _conv()[0].weight.double(), _conv()[0].bias.double(), padding=1
    )
    iree_way, amx_way = _lowered("iree"), _lowered("amx")
    a, b = iree_way[0](x).double(), amx_way[0](x).double()
    rel_iree = ((a - want).abs().max() / want.abs().max()).item()
    rel_amx = ((b - want).abs().max() / want.abs().max()).item()
    assert rel_iree < 1e-5 and 1e-5 < rel_amx < 1e-2  # bf16 operands: rounded, not far
    # 8 output channels: no product fits, so the second conv is fp32's exactly
    y = a.float()
    torch.testing.assert_close(amx_way[1](y), iree_way[1](y), rtol=0, atol=0)


def test_exported_split_conv_dispatches_its_products_to_the_kernel(tmp_path):
    iree_aot = pytest.importorskip("iree.turbine.aot")
    model = _lowered("amx")
    x = torch.randn(2, 64, 16, 16)
    want = model(x).detach().numpy()
    mlir = tmp_path / "conv.mlir"
    iree_aot.export(model, args=(x,)).save_mlir(str(mlir))
    text = mlir.read_text()
    assert text.count("util.call @sdiree_amx_matmul_128x64x96(") == 16  # 4x4 elements
    vmfb = tmp_path / "conv.vmfb"
    cpu = "host" if HAS_AMX else "sapphirerapids"
    got = subprocess.run(
        [
            "iree-compile",
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            "--iree-opt-data-tiling",
            "--iree-llvmcpu-enable-ukernels=all",
            f"--iree-llvmcpu-target-cpu={cpu}",
            str(mlir),
            "-o",
            str(vmfb),
        ],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    if not HAS_AMX:
        return
    import iree.runtime as rt

    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    out = ctx.modules.module["main"](x.numpy()).to_host()
    assert np.abs(out - want).max() / np.abs(want).max() < 2e-3
