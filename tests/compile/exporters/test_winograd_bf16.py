"""Why cpu bf16 exports F(2x2,3x3) Winograd and not F(4x4,3x3): the error of bf16 operands.

iree-compile's `--iree-global-opt-demote-contraction-inputs-type=bf16` rounds a contraction's
operands to bf16 and accumulates in fp32. For a Winograd convolution those operands are the
transformed tiles and weights, whose rounding F(4x4)'s output transform (entries up to 8)
amplifies. Emulated here on one UNet-sized convolution against a float64 reference; the registry
choice (specs/targets.json, cpu `dtype_options.bf16.submodule_export`) rests on these ratios.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.winograd import conv2d_winograd  # noqa: E402
from sdiree.runtime.targets import load_registry  # noqa: E402


def _bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _errors(channels: int = 128, side: int = 32) -> dict[str, float]:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
    x = torch.nn.functional.silu(torch.randn(1, channels, side, side))
    ref = torch.nn.functional.conv2d(
        x.double(), conv.weight.double(), conv.bias.double(), padding=1
    )
    rounded = torch.nn.Conv2d(channels, channels, 3, padding=1)
    rounded.weight.data, rounded.bias.data = _bf16(conv.weight.data), conv.bias.data
    errors = {"im2col": _rel(rounded(_bf16(x)), ref)}
    mm, bmm = torch.mm, torch.bmm
    try:  # the Winograd contraction (one torch.bmm, or split: a torch.mm per tile element):
        # round its operands as iree does, and check that each form ran
        calls = []
        torch.mm = lambda a, b: calls.append("mm") or mm(_bf16(a), _bf16(b))
        torch.bmm = lambda a, b: calls.append("bmm") or bmm(_bf16(a), _bf16(b))
        with torch.no_grad():
            for m in (2, 4):
                errors[f"F{m}"] = _rel(conv2d_winograd(conv, x, m), ref)
                split = _rel(conv2d_winograd(conv, x, m, split_min_side=side), ref)
                assert split == pytest.approx(errors[f"F{m}"], rel=1e-3), (m, split)
    finally:
        torch.mm, torch.bmm = mm, bmm
    assert calls.count("mm") == 16 + 36 and calls.count("bmm") == 2, calls
    return errors


def test_bf16_operands_cost_f4x4_far_more_than_f2x2():
    e = _errors()
    assert e["im2col"] < 5e-3
    assert e["F4"] > 5 * e["im2col"], e  # ~10x measured
    assert e["F2"] < 2.5 * e["im2col"], e  # ~1.6x measured


def test_cpu_bf16_exports_no_f4x4():
    cpu = load_registry().target("cpu")
    for sub in ("unet", "vae_decoder", "vae_encoder"):
        fp32, bf16 = cpu.export_for(sub), cpu.export_for(sub, "bf16")
        assert "winograd4_min_side" not in bf16 and bf16.get("conv") != "winograd4", sub
        assert fp32.get("conv") == "winograd4" or "winograd4_min_side" in fp32, sub
