"""The Winograd export as one matmul per tile element: what iree-compile makes of it.

Exported as a batched matmul, the transformed tiles were stacked (whole-tensor copies) and their
bf16 conversion flattened to 1-D and packed element by element; split, each tile element's
input transform is one dispatch that also converts and packs its matmul's operand. Checked on one
small convolution compiled with the cpu target's own flags (and bf16's spec), for each inverse
transform (`winograd_output`), from the compiler's dispatch names, and its result against a
float64 convolution. Below `winograd_split_min_side` a conv keeps the one batched matmul.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("iree.compiler")
pytest.importorskip("iree.turbine")

from sdiree.compile.exporters.winograd import add_winograd_weights, conv2d_winograd  # noqa: E402

N, C, SIDE = 2, 32, 16


class _Conv(torch.nn.Module):
    def __init__(self, conv: torch.nn.Conv2d, m: int, output: str, split_min_side=SIDE):
        super().__init__()
        self.conv, self.m, self.output, self.split = conv, m, output, split_min_side

    def forward(self, x):
        return conv2d_winograd(self.conv, x, self.m, self.output, self.split)


def _traced_ops(m: int, output: str, split_min_side=SIDE) -> list[str]:
    conv = torch.nn.Conv2d(C, C, 3, padding=1)
    add_winograd_weights(conv, m)
    module = _Conv(conv, m, output, split_min_side)
    ep = torch.export.export(module, (torch.randn(N, C, SIDE, SIDE),))
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("m,output", [(2, "interleaved"), (2, "batched"), (4, "batched")])
def test_one_matmul_per_tile_element(m, output):
    ops = _traced_ops(m, output)
    assert sum("aten.mm" in t for t in ops) == (m + 2) ** 2 and not any("bmm" in t for t in ops)


@pytest.mark.parametrize("split_min_side", [SIDE + 1, None])
@pytest.mark.parametrize("m", [2, 4])
def test_below_the_split_side_one_batched_matmul(m, split_min_side):
    ops = _traced_ops(m, "interleaved", split_min_side)
    assert sum("aten.bmm" in t for t in ops) == 1 and not any("aten.mm" in t for t in ops)


def test_interleaved_inverse_is_f2x2_only():
    """F(4x4) takes the batched inverse whatever is asked (its interleaved one overran
    llvm-cpu's stack limit), F(2x2) the one asked."""
    assert _traced_ops(4, "interleaved") == _traced_ops(4, "batched")
    assert _traced_ops(2, "interleaved") != _traced_ops(2, "batched")


def _compile(
    tmp_path: Path, dtype: str, m: int, output: str
) -> tuple[Path, list[str], np.ndarray, np.ndarray]:
    from iree.turbine import aot

    from sdiree.compile.iree_compile import iree_compile_tool
    from sdiree.compile.plan import tuning_spec
    from sdiree.compile.tuning_embed import attach
    from sdiree.runtime.targets import load_registry

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(C, C, 3, padding=1)
    add_winograd_weights(conv, m)
    x = torch.randn(N, C, SIDE, SIDE)
    ref = torch.nn.functional.conv2d(
        x.double(), conv.weight.double(), conv.bias.double(), padding=1
    )
    src = tmp_path / "conv.mlir"
    aot.export(_Conv(conv, m, output), x).save_mlir(src)
    registry = load_registry()
    cpu = registry.target("cpu")
    plan = SimpleNamespace(target=cpu, arch="host", dtype=dtype, registry=registry)
    spec = tuning_spec(plan, "unet")  # as the shipped build has it (bf16's)
    if spec:
        attach(src, spec[1], tmp_path / "conv.mlirbc")
        src = tmp_path / "conv.mlirbc"
    dump, vmfb = tmp_path / "sources", tmp_path / "conv.vmfb"
    cmd = [
        iree_compile_tool(),
        str(src),
        "-o",
        str(vmfb),
        *cpu.compile_flags("host", dtype, "unet"),
    ]
    cmd.append(f"--iree-hal-dump-executable-sources-to={dump}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = re.findall(r"func\.func @(\S+?)\(", "".join(p.read_text() for p in dump.iterdir()))
    return vmfb, names, x.numpy(), ref.detach().numpy()


def _run(vmfb: Path, x: np.ndarray) -> np.ndarray:
    import iree.runtime as rt

    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
    return np.asarray(ctx.modules.module.main(x))


@pytest.mark.parametrize(
    "dtype,m,output,tol",
    [
        ("bf16", 2, "interleaved", 2e-2),  # the cpu UNet's
        ("bf16", 2, "batched", 2e-2),  # the cpu bf16 VAE's
        ("fp32", 2, "interleaved", 1e-5),
        ("fp32", 4, "batched", 1e-5),  # the cpu fp32 VAE's, and the UNet's largest convs
    ],
)
def test_split_winograd_fuses_transform_conversion_and_pack(tmp_path, dtype, m, output, tol):
    vmfb, names, x, ref = _compile(tmp_path, dtype, m, output)
    th = SIDE // m
    matmuls = [n for n in names if re.search(r"_matmul_\d+x", n)]
    assert matmuls and not any("batch_matmul" in n for n in names), names
    if dtype == "bf16":
        # each tile element's transform converts its own operand: [N, th, tw, C] f32 -> bf16
        fused = [n for n in names if n.endswith(f"_elementwise_{N}x{th}x{th}x{C}_f32xf32xbf16")]
        assert fused, names
        # and no conversion is left on its own (1-D, or of a stacked, transposed tensor)
        alone = [n for n in names if re.search(r"_elementwise_(transpose_)?[\dx]+_f32xbf16$", n)]
        assert not alone, alone
    out = _run(vmfb, x)
    assert np.abs(out - ref).max() / np.abs(ref).max() < tol
