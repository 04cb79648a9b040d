"""`linear: "panels"` (compile/exporters/linear_panels.py): a Linear whose output features are a
multiple of 16 computes the same values over its weight as panels, the panels are the
runtime's (runtime/weights/derived.py), and iree turns the trace into one contraction over
(m, j, n, k) that the AVX2 tuning spec gives its 6x16 tile, with torch's results."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.linear_flat import set_linear_lowering  # noqa: E402
from sdiree.runtime.weights.derived import (  # noqa: E402
    PANELS_PARAM,
    base_key,
    derived_weight,
    panels_weight,
    unpanel,
)

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "specs" / "tuning" / "cpu_avx2_linear_panels.mlir"
TILE = "vector_common_parallel = [6, 1, 16, 0]"


def test_panels_linear_equals_native_and_keeps_the_others():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 8),  # 8: no panels
    )
    x = torch.randn(2, 5, 24)
    want = model(x)
    assert set_linear_lowering(model, "panels") == 1
    assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__
    panels = getattr(model[0], PANELS_PARAM)
    assert tuple(panels.shape) == (2, 24, 16) and not hasattr(model[2], PANELS_PARAM)
    w = model[0].weight.detach().numpy()
    np.testing.assert_array_equal(panels.detach().numpy(), panels_weight(w))
    torch.testing.assert_close(model(x), want, rtol=0, atol=1e-6)
    # a second lowering adds nothing; native gives every class forward back
    assert set_linear_lowering(model, "panels") == 1
    assert set_linear_lowering(model, "native") == 2
    assert "forward" not in model[0].__dict__


def test_panels_are_the_runtimes_and_read_back_exactly():
    w = np.random.default_rng(0).standard_normal((48, 20)).astype(np.float32)
    p = panels_weight(w)
    assert p.shape == (3, 20, 16)
    np.testing.assert_array_equal(p[1, 7], w[16:32, 7])  # panel 1, input feature 7
    np.testing.assert_array_equal(unpanel(p), w)
    key = "mid_block.attentions.0.proj_in." + PANELS_PARAM
    assert base_key(key) == "mid_block.attentions.0.proj_in.weight"
    np.testing.assert_array_equal(derived_weight(key, w, p.shape), p)
    with pytest.raises(ValueError, match="multiple of 16"):
        panels_weight(w[:40])


class _Block(torch.nn.Module):
    """A GEGLU-like pair: a panels Linear with a fused bias and GELU behind it, then one that
    stays a data-tiled matmul (6 outputs)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 6)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_panels_compile_to_the_6x16_tile_with_torchs_results(tmp_path):
    pytest.importorskip("iree.compiler")
    import iree.runtime as rt
    import iree.turbine.aot as aot

    from sdiree.compile.iree_compile import UNTHREADED, iree_compile_tool
    from sdiree.runtime.targets import load_registry

    torch.manual_seed(1)
    block = _Block().eval()
    x = torch.randn(2, 45, 64)  # M = 90: a remainder of 6-row tiles
    with torch.no_grad():
        want = block(x).numpy()
    set_linear_lowering(block, "panels")
    src = tmp_path / "m.mlir"
    src.write_text(str(aot.export(block, args=(x,), strict_export=False).mlir_module))
    flags = load_registry().target("cpu").compile_flags("x86-64-v3", "fp32", "unet")
    outs, dumps = {}, {}
    # the spec flag can deadlock a threaded compile (compile/iree_compile.py): one thread
    spec = [f"--iree-codegen-tuning-spec-path={SPEC}", *UNTHREADED]
    for name, extra in (("spec", spec), ("plain", [])):
        dump = tmp_path / f"cfg-{name}"
        vmfb = tmp_path / f"{name}.vmfb"
        cmd = [iree_compile_tool(), str(src), "-o", str(vmfb), *flags, *extra,
               f"--iree-hal-dump-executable-configurations-to={dump}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        dumps[name] = [f.read_text() for f in dump.glob("*.mlir")]
        ctx = rt.SystemContext(config=rt.Config("local-task"))
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
        outs[name] = np.asarray(ctx.modules.module.main(x.numpy()))

    tiled = [t for t in dumps["spec"] if TILE in t]
    assert len(tiled) == 1  # the panels contraction, with its bias and GELU fused
    assert "mmt4d" not in tiled[0] and "matmul_like" in tiled[0]
    assert any("mmt4d" in t for t in dumps["spec"])  # the 6-output Linear stays data-tiled
    assert not any(TILE in t for t in dumps["plain"])
    scale = np.abs(want).max()
    for name, got in outs.items():
        assert np.abs(got - want).max() <= 1e-5 * scale, name
    # the spec changes the tile, not the sums: K in order, one FMA each
    assert np.abs(outs["spec"] - outs["plain"]).max() <= 1e-6 * scale


def test_attention_output_projection_keeps_its_forward():
    """`to_out[0]` takes attention's heads merged (a transposed, collapsed tensor): iree would
    split its K in the panels' product and not in the sum, so it stays a plain Linear."""
    from diffusers.models.attention_processor import Attention

    attn = Attention(query_dim=32, heads=2, dim_head=16)
    assert set_linear_lowering(attn, "panels") == 3  # to_q, to_k, to_v
    assert "forward" not in attn.to_out[0].__dict__
    assert not hasattr(attn.to_out[0], PANELS_PARAM)
