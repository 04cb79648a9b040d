"""Export choice `linear: "panels"`: every nn.Linear whose output features are a multiple of 16
traced as a contraction over its weight stored as panels of 16 output features.

On a CPU without AVX-512, iree 3.13 data-tiles every f32 matmul into an 8x8 tile whose ukernel
does eight broadcasts and one load per eight FMAs, ~55 % of a core's FMA rate; a 6x16 register
tile (six broadcasts, two loads, twelve FMAs) reaches ~85 % (compile/NOTES.md, "The AVX2 f32
matmul tile"). No flag changes that tile, and an untiled matmul reads its right operand K rows
apart, which loses at the UNet's sizes. Here the weight is a parameter of its own,
`<linear>.weight_panels` of shape [N / 16, K, 16] (runtime/weights/derived.py), and the trace
is `sum_k x[m, k] * panels[j, k, n]`, written as a broadcast product and a sum: iree fuses the
two into one `linalg.generic` contraction over (m, j, n, k) whose right operand is read 16
contiguous floats per k, with the bias and what follows fused behind it. That generic is no
`linalg.matmul` when data tiling is decided, so it is not data-tiled, and the tuning spec
`specs/tuning/cpu_avx2_linear_panels.mlir` gives it the 6x16 tile.

The broadcast product is only ever traced (on fake tensors, as torch.export and the compile's
shape probes run it); run eagerly, the same contraction is an einsum.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

from sdiree.runtime.weights.derived import PANEL_WIDTH, PANELS_PARAM

from ..placeholders import is_placeholder, mark, placeholder

DERIVED_TAG = "panels"  # joined to the submodule's other derived tag: <scope>.<tag>.irpa


def panel_contraction(x2: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] times the weight panels [J, K, 16] make: [M, J * 16]."""
    m = x2.shape[0]
    j, _, p = panels.shape
    if detect_fake_mode(x2) is None:
        return torch.einsum("mk,jkn->mjn", x2, panels).reshape(m, j * p)
    return (x2[:, None, :, None] * panels[None]).sum(2).reshape(m, j * p)


def _panels_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = panel_contraction(x.reshape(-1, x.shape[-1]), getattr(self, PANELS_PARAM))
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def has_panels(linear: torch.nn.Linear) -> bool:
    return linear.out_features % PANEL_WIDTH == 0


def heads_merged_inputs(model: torch.nn.Module) -> set[int]:
    """ids of the Linears that take attention's heads merged (an attention's `to_out[0]`),
    which keep their own forward under `panels`: their input is the attention output
    transposed and collapsed ([B, H, S, D] -> [B, S, H * D]), and iree propagates that collapse
    into the panels' broadcast product, splitting K into (H, D) there but not in the sum, so
    the two stay apart, the product materialized (SD 1.5's UNet call 2x slower; NOTES.md)."""
    return {
        id(m.to_out[0])
        for m in model.modules()
        if isinstance(getattr(m, "to_out", None), torch.nn.ModuleList)
        and isinstance(m.to_out[0], torch.nn.Linear)
    }


def _as_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16] (runtime/weights/derived.py's panels_weight, in torch)."""
    n, k = w.shape
    return w.reshape(n // PANEL_WIDTH, PANEL_WIDTH, k).transpose(1, 2).contiguous()


def add_panels(linear: torch.nn.Linear) -> torch.nn.Parameter:
    """Give linear its weight as panels (a parameter of its own; a placeholder of that shape
    when its weight is one: the archive computes it from the model's files)."""
    w = linear.weight
    n, k = w.shape
    shape = (n // PANEL_WIDTH, k, PANEL_WIDTH)
    if getattr(linear, PANELS_PARAM, None) is None:
        if is_placeholder(w):
            panels = mark(torch.nn.Parameter(placeholder(shape, w.dtype), requires_grad=False))
        else:
            with torch.no_grad():
                panels = torch.nn.Parameter(_as_panels(w.detach()), requires_grad=False)
        linear.register_parameter(PANELS_PARAM, panels)
    return getattr(linear, PANELS_PARAM)


def panels_forward(linear: torch.nn.Linear):
    """The forward to bind to linear under `panels` (its weight's panels added)."""
    add_panels(linear)
    return _panels_forward


def derived_weight_maker(name: str, shape: tuple[int, ...], dtype: torch.dtype, source):
    """A function computing parameter name (`<linear>.weight_panels`) from the Linear's weight as
    the model's files hold it, in dtype."""
    weight = name[: -len(PANELS_PARAM)] + "weight"

    def make() -> torch.Tensor:
        got = _as_panels(source.tensor(weight).to(dtype))
        if tuple(got.shape) != tuple(shape):
            raise ValueError(f"{name}: {weight} gives {tuple(got.shape)}, not {tuple(shape)}")
        return got

    return make
